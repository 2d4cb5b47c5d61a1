"""Response audio: whole files in five formats, and the streamable framings of PCM16."""

from __future__ import annotations

import io
import struct

import numpy as np
import soundfile as sf
import torch

from intone.audio import resample

CONTENT_TYPES = {
    "wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg",
}
STREAMABLE = ("wav", "pcm")
OPUS_RATE = 48000  # Opus runs at 48 kHz; other rates are resampled to it


def pcm16(audio: np.ndarray) -> bytes:
    """float32 [-1, 1] -> little-endian signed 16-bit samples."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def wav_header(sample_rate: int, num_samples: int | None) -> bytes:
    """The canonical 44-byte PCM16 mono header; unknown length (streaming) writes the maximum."""
    data = 0xFFFFFFFF if num_samples is None else num_samples * 2
    riff = 0xFFFFFFFF if num_samples is None else 36 + data
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE" + b"fmt " +
            struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16) +
            b"data" + struct.pack("<I", data))


def wav_bytes(audio: np.ndarray, sample_rate: int) -> bytes:
    return wav_header(sample_rate, len(audio)) + pcm16(audio)


def encode_file(audio: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    if fmt == "wav":
        return wav_bytes(audio, sample_rate)
    if fmt == "pcm":
        return pcm16(audio)
    buf = io.BytesIO()
    if fmt == "flac":
        sf.write(buf, audio, sample_rate, format="FLAC", subtype="PCM_16")
    elif fmt == "mp3":
        sf.write(buf, audio, sample_rate, format="MP3", subtype="MPEG_LAYER_III")
    elif fmt == "opus":
        at48k = resample(torch.from_numpy(np.ascontiguousarray(audio)), sample_rate, OPUS_RATE).numpy()
        sf.write(buf, at48k, OPUS_RATE, format="OGG", subtype="OPUS")
    else:
        raise ValueError(f"unknown format {fmt!r}")
    return buf.getvalue()


class StreamEncoder:
    """Bytes for a raw audio stream: PCM16, or a WAV header of unknown length then PCM16."""

    def __init__(self, fmt: str, sample_rate: int):
        if fmt not in STREAMABLE:
            raise ValueError(f"{fmt} cannot stream")
        self._header = wav_header(sample_rate, None) if fmt == "wav" else b""

    def encode(self, audio: np.ndarray) -> bytes:
        head, self._header = self._header, b""
        return head + pcm16(audio)
