"""Audio files in and out: reading references (checked, as numpy), writing wav. Torch-free: the API
process reads references with it (resampling is `ops.resample`, in the engine)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import soundfile as sf

from intone.errors import InvalidRequestError


def read_audio(source: str | Path | bytes, field: str = "ref_audio",
               max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """A file path or raw bytes -> (mono float32 [N], sample rate). Errors name `field`."""
    label = "data" if isinstance(source, bytes) else str(source)
    if not isinstance(source, bytes) and not Path(source).is_file():
        raise InvalidRequestError(field, f"{label}: no such file")
    if max_seconds is not None:
        _check_declared_length(source, label, field, max_seconds)
    try:
        data, rate = sf.read(io.BytesIO(source) if isinstance(source, bytes) else str(source),
                             dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        reason = re.sub(r"<[^>]* at 0x[0-9a-f]+>", "the data", str(e))  # no object addresses in answers
        raise InvalidRequestError(field, f"{label}: not a readable audio file ({reason})") from None
    if data.shape[0] == 0:
        raise InvalidRequestError(field, f"{label}: audio is empty")
    check_sample_rate(int(rate), field)
    if max_seconds is not None and data.shape[0] / rate > max_seconds:
        raise InvalidRequestError(field, f"{label}: audio is {data.shape[0] / rate:.1f} s, over the {max_seconds:g} s limit")
    if not np.isfinite(data).all():
        raise InvalidRequestError(field, f"{label}: audio contains NaN or infinite samples")
    return data.mean(axis=1), int(rate)


def _check_declared_length(source, label: str, field: str, max_seconds: float) -> None:
    """Refuse by the header's length before decoding anything (two hours of FLAC silence would
    otherwise be decoded whole, seconds of CPU and gigabytes, just to be refused)."""
    try:
        info = sf.info(io.BytesIO(source) if isinstance(source, bytes) else str(source))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
        return  # unreadable: sf.read below says so, naming the field
    if info.samplerate > 0 and info.frames > 0 and info.frames / info.samplerate > max_seconds:
        raise InvalidRequestError(field, f"{label}: audio is {info.frames / info.samplerate:.1f} s, "
                                         f"over the {max_seconds:g} s limit")


def write_wav(path: str | Path, audio, sample_rate: int) -> None:
    """audio: a numpy array or a tensor (on any device)."""
    samples = audio.detach().cpu().numpy() if hasattr(audio, "detach") else audio
    sf.write(str(path), np.asarray(samples, dtype=np.float32).reshape(-1), sample_rate, subtype="PCM_16")


MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 4000, 384000


def check_sample_rate(rate: int, field: str) -> int:
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise InvalidRequestError(field, f"sample rate {rate} Hz is outside {MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz")
    return rate
