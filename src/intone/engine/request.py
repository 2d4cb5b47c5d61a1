"""The engine's own per-request state (what crosses the process boundary is in `intone.protocol`)."""

from __future__ import annotations

import dataclasses
import enum
import secrets
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from intone.engine.chunk_planner import Frontier
from intone.errors import InvalidRequestError
from intone.models.base import Prompt
from intone.protocol import SamplingParams


def resolve_params(params: SamplingParams, prompt: Prompt, max_seq_len: int) -> SamplingParams:
    """Validated params with a seed drawn if none was given and max_new_tokens cut to the
    model's length and to the prompt's own limit."""
    params = params.validate()
    budget = max_seq_len - len(prompt)
    if budget < 1:
        raise InvalidRequestError("input", f"prompt is {len(prompt)} tokens; the model allows {max_seq_len} in all")
    if prompt.max_new_tokens is not None:
        budget = min(budget, max(1, prompt.max_new_tokens))
    seed = secrets.randbits(63) if params.seed is None else params.seed
    max_new = min(params.max_new_tokens, budget)
    min_new = min(max(params.min_new_tokens, prompt.min_new_tokens), max_new)
    return dataclasses.replace(params, seed=seed, max_new_tokens=max_new, min_new_tokens=min_new)


@dataclass
class RequestTimes:
    """perf_counter instants and durations of one request in the engine core."""

    arrived: float = 0.0
    received_at: float | None = None  # Unix seconds: the API parsed it (`SynthesisRequest.received_at`)
    frontend_s: float = 0.0  # reference encoding (0 without reference audio)
    ready: float = 0.0  # prompt built, queued for the scheduler
    scheduled: float | None = None  # start of the step that ran its prefill
    prefill_s: float | None = None  # that step's wall time
    last_frame: float | None = None
    codec_s: float = 0.0  # wall time of the codec calls that carried its chunks
    first_planned: float | None = None  # when its first chunk went to the codec (playback can start)
    first_delivered: float | None = None  # when its first chunk's audio was sent

    def summary(self, now: float) -> dict[str, float]:
        """Seconds per stage (`intone.protocol.ENGINE_STAGES`): frontend, queue (ready -> scheduled),
        prefill, first_hop (prefill step end -> first chunk to the codec), first_codec (-> its audio
        sent), decode (prefill step end -> last frame), codec, total (arrival -> now). A stage the
        request never reached counts 0."""
        scheduled = self.scheduled if self.scheduled is not None else now
        prefill = self.prefill_s or 0.0
        last = self.last_frame if self.last_frame is not None else now
        planned = self.first_planned if self.first_planned is not None else now
        first_hop = max(0.0, planned - scheduled - prefill) if self.scheduled is not None else 0.0
        first_codec = max(0.0, (self.first_delivered or now) - planned) if self.first_planned is not None else 0.0
        return dict(frontend_s=self.frontend_s, queue_s=max(0.0, scheduled - self.ready), prefill_s=prefill,
                    first_hop_s=first_hop, first_codec_s=first_codec,
                    decode_s=max(0.0, last - scheduled - prefill) if self.scheduled is not None else 0.0,
                    codec_s=self.codec_s, total_s=now - self.arrived if self.arrived else 0.0)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class EngineRequest:
    """All state of one request, owned here and dropped by EngineCore._release (invariant 4)."""

    request_id: str
    prompt: Prompt
    params: SamplingParams  # seed resolved, max_new_tokens clamped to the model's length
    initial_chunk_frames: int | None = None
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)  # main token of each generated frame
    last_codes: np.ndarray | None = None  # [K] codes of the last generated frame (the next step's input)
    codes: Tensor | None = None  # [K, max_new_tokens] codec frames; [0, num_frames) are valid
    num_frames: int = 0  # generated frames forwarded to the codec (a model may trim some)
    codec_state: object = None  # the codec stage's per-request state (dropped with the request)
    block_table: list[int] = field(default_factory=list)  # its KV blocks (grown by the scheduler)
    frontier: Frontier | None = None  # its chunking state (from the chunk planner, at admission)
    prefix_hashes: list[bytes] = field(default_factory=list)  # ar.prefix_caching: digests of its prompt's blocks
    cached_tokens: int = 0  # prompt tokens whose KV it took from an earlier prompt (at admission)
    speed: float = 1.0
    stop_reason: str | None = None
    seq: int = 0  # chunks sent so far
    delivered: int = 0  # frames whose audio has been sent (the frontier a terminal chunk reports)
    codec_in_flight: int = 0  # chunks handed to the codec and not yet delivered
    steps_in_flight: int = 0  # AR steps launched with it whose tokens the host has not read (ar.async_steps)
    times: RequestTimes = field(default_factory=RequestTimes)

    @property
    def kv_tokens_needed(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def generated(self) -> int:
        """Tokens generated, counting those of its steps in flight."""
        return len(self.tokens) + self.steps_in_flight

    def append_frame(self, token: int, frame: np.ndarray, forwards=lambda generated: True) -> None:
        """frame: [K] codes (numpy, from StepOutput.to_host). forwards(tokens generated so far) says
        whether this frame goes to the codec."""
        self.tokens.append(token)
        self.last_codes = frame
        if forwards(self.tokens):
            self._codes_np[:, self.num_frames] = frame  # the tensor's memory, written without a torch call
            self.num_frames += 1

    def allocate_codes(self, num_codebooks: int) -> None:
        """On the CPU: frames arrive there once per step, and the codec stage moves windows over."""
        self.codes = torch.zeros(num_codebooks, self.params.max_new_tokens, dtype=torch.long)
        self._codes_np = self.codes.numpy()
