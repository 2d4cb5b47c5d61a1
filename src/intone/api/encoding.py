"""Response audio: whole files in six formats, and the same formats encoded as chunks arrive."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import soundfile as sf

CONTENT_TYPES = {
    "wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg",
    "aac": "audio/aac",
}
OPUS_RATE = 48000  # Opus runs at 48 kHz; FFmpeg's encoder resamples other rates to it
# Streamed by FFmpeg (PyAV): format -> (container, encoder, encoder rate; None keeps the model's rate)
CODECS = {
    "mp3": ("mp3", "libmp3lame", None),
    "opus": ("ogg", "libopus", OPUS_RATE),
    "aac": ("adts", "aac", None),
    "flac": ("flac", "flac", None),
}
# Ogg holds packets back until a page is full (1 s by default); short pages let each chunk leave
# with its own audio, at most this much of it waiting for the next chunk.
OGG_PAGE_MICROSECONDS = 100_000


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
    elif fmt in ("opus", "aac"):  # the streamed encoder, whole (libsndfile has no AAC and no resampler)
        encoder = CodecStreamEncoder(fmt, sample_rate)
        return encoder.encode(audio) + encoder.finish()
    else:
        raise ValueError(f"unknown format {fmt!r}")
    return buf.getvalue()


def pcm_headers(sample_rate: int) -> dict[str, str]:
    """What a raw PCM answer is, so a client need not guess (Fish is 44.1 kHz, CosyVoice3 24 kHz)."""
    return {"X-Sample-Rate": str(sample_rate), "X-Channels": "1", "X-Bit-Depth": "16"}


def stream_encoder(fmt: str, sample_rate: int) -> "StreamEncoder | CodecStreamEncoder":
    return CodecStreamEncoder(fmt, sample_rate) if fmt in CODECS else StreamEncoder(fmt, sample_rate)


class StreamEncoder:
    """Bytes for a raw audio stream: PCM16, or a WAV header of unknown length then PCM16."""

    cheap = True  # fast enough for the event loop

    def __init__(self, fmt: str, sample_rate: int):
        if fmt not in ("wav", "pcm"):
            raise ValueError(f"{fmt} is not PCM")
        self._header = wav_header(sample_rate, None) if fmt == "wav" else b""

    def encode(self, audio: np.ndarray) -> bytes:
        head, self._header = self._header, b""
        return head + pcm16(audio)

    def finish(self) -> bytes:
        return self._header  # the header alone when no audio came


class _Sink:
    """Where the muxer writes. It cannot seek, so no header is rewritten after its bytes have left."""

    def __init__(self):
        self._parts: list[bytes] = []

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self._parts = b"".join(self._parts), []
        return out


class CodecStreamEncoder:
    """mp3, opus, aac or flac encoded as chunks arrive: each call returns the bytes that are ready.
    Codecs hold back a frame or so of audio (and Ogg a part page) until more comes or `finish`."""

    cheap = False

    def __init__(self, fmt: str, sample_rate: int):
        container, codec, rate = CODECS[fmt]
        self._sink = _Sink()
        options = {"page_duration": str(OGG_PAGE_MICROSECONDS)} if container == "ogg" else {}
        self._out = av.open(self._sink, "w", format=container, options=options)
        self._stream = self._out.add_stream(codec, rate=rate or sample_rate, layout="mono")
        self._rate = sample_rate
        self._samples = 0

    def encode(self, audio: np.ndarray) -> bytes:
        if len(audio):
            samples = np.clip(audio, -1.0, 1.0).astype(np.float32, copy=False)[None, :]
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="flt", layout="mono")
            frame.sample_rate, frame.pts = self._rate, self._samples  # the encoder resamples and reframes
            self._samples += len(audio)
            self._mux(frame)
        return self._sink.take()

    def finish(self) -> bytes:
        self._mux(None)  # flushes what the encoder held back
        self._out.close()
        return self._sink.take()

    def _mux(self, frame: av.AudioFrame | None) -> None:
        for packet in self._stream.encode(frame):
            self._out.mux(packet)
