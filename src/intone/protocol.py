"""What crosses the process boundary between the API and the engine core: a request, its sampling
parameters, its voice references, and the audio chunks that answer it.

Plain dataclasses and numpy, pickled over ZeroMQ as they are; no torch, so the API process never
loads it (the engine turns arrays into tensors where its models need them).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from intone.errors import InvalidRequestError
from intone.sampling_bounds import SAMPLING_BOUNDS, describe, within

SAMPLING_MODES = ("ras", "standard")

# Where a finished request's time went, in pipeline order. The engine core's stages travel as the
# terminal chunk's `timings` (keys: these names + "_s"); the API adds its own two. first_hop: end of
# the prefill step -> the first chunk handed to the codec; first_codec: that -> its audio delivered
# (with api_in, frontend, queue and prefill: a stream's first audio, stage by stage).
ENGINE_STAGES = ("frontend", "queue", "prefill", "first_hop", "first_codec", "decode", "codec", "total")
REQUEST_STAGES = ("api_in", *ENGINE_STAGES[:-1], "api_out", "total")
# An AR step's company on the GPU, one of these (exclusive; their steps add up to all the timed ones): it carried
# a prefill, else it ran beside the codec's work and the frontend's, beside one of them, or beside neither. The
# engine splits its steps' GPU time by it (`engine.activity`).
STEP_COMPANY = ("prefill", "codec+frontend", "codec", "frontend", "alone")
StopReason = Literal["stop", "length", "abort", "error"]
# The engine's refusals and failures; "aborted" and "engine_dead" are the API's own (its engine
# shutting down, or gone).
ErrorCode = Literal["invalid_request", "queue_full", "too_large", "internal", "aborted", "engine_dead"]


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_p: float = 0.8
    top_k: int = 30
    repetition_penalty: float = 1.0
    max_new_tokens: int = 2048
    min_new_tokens: int = 0  # the stop token is not sampled before this many frames
    seed: int | None = None
    ignore_eos: bool = False  # never sample the stop token: exactly max_new_tokens frames (benchmarks)
    mode: str | None = None  # the model's sampling mode ("ras" or "standard"); None: the model's default

    def validate(self) -> "SamplingParams":
        checks = [(name, getattr(self, name) is None or within(name, getattr(self, name)), describe(name))
                  for name in SAMPLING_BOUNDS]
        checks.append(("mode", self.mode in (None, *SAMPLING_MODES), "must be 'ras' or 'standard'"))
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequestError(name, f"{why}, got {getattr(self, name)!r}")
        return self


@dataclass
class VoiceReference:
    """Reference audio (mono float32, any rate) with its transcript, or its stored encoding."""

    text: str
    audio: np.ndarray | None = None  # [N] float32
    sample_rate: int | None = None
    codes: np.ndarray | None = None  # [K, T]
    features: dict[str, np.ndarray] | None = None  # what `TTSModel.reference_features` returned


def clip_key(audio, sample_rate: int) -> bytes:
    """A reference clip's identity (its samples and rate): the engine caches its features under it,
    and the API routes a request to the engine that holds them."""
    samples = np.ascontiguousarray(np.asarray(audio, dtype=np.float32))
    h = hashlib.blake2b(samples.tobytes(), digest_size=16)
    h.update(int(sample_rate).to_bytes(8, "little"))
    return h.digest()


@dataclass
class SynthesisRequest:
    """A client's request."""

    request_id: str
    text: str
    references: list[VoiceReference] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)
    initial_chunk_frames: int | None = None  # per-request override of the profile's first chunk
    speed: float = 1.0  # tempo, for models that support it in a single (full-response) chunk
    instructions: str | None = None  # a style instruction, for models that take one
    # False: the client takes the whole audio at once, so the codec decodes the utterance in one pass
    # when it ends (the official non-streamed decode, and the cheapest) instead of in chunks.
    stream: bool = True
    received_at: float | None = None  # Unix seconds: the API had parsed it (diagnostics: the frame trace)


@dataclass
class AudioChunk:
    """The engine's answer, in order per request: audio for frames [start_frame, end_frame)."""

    request_id: str
    seq: int
    start_frame: int
    end_frame: int
    # float32 mono. A codec without look-ahead releases (end_frame - start_frame) * samples_per_frame
    # samples; one that looks ahead (CosyVoice3's HiFT) holds the audio of the last few frames
    # back until a later chunk. Over a whole request the total is always frames * samples_per_frame.
    audio: np.ndarray
    sample_rate: int
    finished: bool = False
    stop_reason: StopReason | None = None  # on the terminal chunk
    error: str | None = None
    error_code: ErrorCode | None = None
    error_field: str | None = None  # the request field an invalid_request error is about
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # On the terminal chunk: where the request's time went in the engine (RequestTimes.summary).
    timings: dict[str, float] | None = None
