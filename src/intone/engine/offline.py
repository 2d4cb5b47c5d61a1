"""Synthesis without a server: requests run to completion through an `EngineCore` in this process.

The same admission, AR steps, chunk planning and codec stage as serving (a request that is not
streamed gets its whole audio from one codec pass at its end), so `intone speak` gives what the
server gives for the same request and seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from intone.engine.core import EngineCore
from intone.errors import IntoneError, InvalidRequestError
from intone.protocol import AudioChunk, SynthesisRequest


@dataclass
class Synthesis:
    """One request's result: its audio and how it ended."""

    audio: np.ndarray  # float32 mono at the model's rate
    frames: int
    stop_reason: str | None
    completion_tokens: int


def synthesize(core: EngineCore, requests: list[SynthesisRequest]) -> list[Synthesis]:
    """Each request's audio, in the order given (they run together, batched as the server batches
    them). A refused or failed request raises, naming the field where the engine names one."""
    for request in requests:
        core.add_request(request)
    pieces: dict[str, list[np.ndarray]] = {r.request_id: [] for r in requests}
    ends: dict[str, AudioChunk] = {}
    while len(ends) < len(requests):
        for chunk in core.step():
            if chunk.error:
                for rid in pieces.keys() - ends.keys() - {chunk.request_id}:
                    core.abort(rid)
                if chunk.error_code == "invalid_request" or chunk.error_field:
                    field = chunk.error_field or "request"
                    raise InvalidRequestError(field, chunk.error.removeprefix(f"{field}: "))
                raise IntoneError(chunk.error)
            pieces[chunk.request_id].append(chunk.audio)
            if chunk.finished:
                ends[chunk.request_id] = chunk
    return [Synthesis(np.concatenate(pieces[r.request_id]).astype(np.float32, copy=False),
                      ends[r.request_id].end_frame, ends[r.request_id].stop_reason,
                      ends[r.request_id].completion_tokens) for r in requests]
