"""Audio in and out: reading references, resampling, writing wav."""

from __future__ import annotations

import io
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from torch import Tensor

from intone.errors import InvalidRequestError


def read_audio(source: str | Path | bytes, field: str = "ref_audio", max_seconds: float | None = None) -> tuple[Tensor, int]:
    """A file path or raw bytes -> (mono float32 [N], sample rate). Errors name `field`."""
    label = "data" if isinstance(source, bytes) else str(source)
    if not isinstance(source, bytes) and not Path(source).is_file():
        raise InvalidRequestError(field, f"{label}: no such file")
    try:
        data, rate = sf.read(io.BytesIO(source) if isinstance(source, bytes) else str(source),
                             dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise InvalidRequestError(field, f"{label}: not a readable audio file ({e})") from None
    if data.shape[0] == 0:
        raise InvalidRequestError(field, f"{label}: audio is empty")
    if max_seconds is not None and data.shape[0] / rate > max_seconds:
        raise InvalidRequestError(field, f"{label}: audio is {data.shape[0] / rate:.1f} s, over the {max_seconds:g} s limit")
    if not np.isfinite(data).all():
        raise InvalidRequestError(field, f"{label}: audio contains NaN or infinite samples")
    return torch.from_numpy(data.mean(axis=1)), int(rate)


def write_wav(path: str | Path, audio: Tensor | np.ndarray, sample_rate: int) -> None:
    samples = audio.detach().cpu().numpy() if isinstance(audio, Tensor) else audio
    sf.write(str(path), np.asarray(samples, dtype=np.float32).reshape(-1), sample_rate, subtype="PCM_16")


@lru_cache(maxsize=16)
def _sinc_kernel(orig: int, new: int, dtype: torch.dtype, zeros: int = 6, rolloff: float = 0.99) -> tuple[Tensor, int]:
    """Hann-windowed sinc filter bank, one row per output phase (torchaudio's default method)."""
    base = min(orig, new) * rolloff
    width = math.ceil(zeros * orig / base)
    idx = torch.arange(-width, width + orig, dtype=dtype)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=dtype)[:, None, None] / new + idx
    t = (t * base).clamp(-zeros, zeros)
    window = torch.cos(t * math.pi / zeros / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.tensor(1.0, dtype=dtype), t.sin() / t)
    return kernel * (window * (base / orig)), width  # torchaudio's association, for equal bits


def resample(audio: Tensor, orig_rate: int, new_rate: int) -> Tensor:
    """[..., N] -> [..., ceil(N * new / orig)]; band-limited sinc interpolation.

    The same filter torchaudio.functional.resample uses by default (the official reference
    loader resamples with it), so reference codes match the official ones.
    """
    if orig_rate == new_rate:
        return audio
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    kernel, width = _sinc_kernel(orig, new, audio.dtype)
    shape = audio.shape
    x = torch.nn.functional.pad(audio.reshape(-1, shape[-1]), (width, width + orig))
    y = torch.nn.functional.conv1d(x[:, None], kernel.to(audio.device), stride=orig)
    y = y.transpose(1, 2).reshape(x.shape[0], -1)
    target = math.ceil(new * shape[-1] / orig)
    return y[..., :target].reshape(*shape[:-1], -1)
