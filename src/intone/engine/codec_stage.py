"""The engine's side of the codec boundary (`models.vocoder`): a call's chunks -> the model's vocoder.

Each (request, chunk) of a call becomes a `CodecWindow`; the vocoder gets the call's windows with
each request's committed codec state and returns the audio and the states after the call. They are
committed to the requests only when the whole call succeeded, so a failed call is retried chunk
by chunk (`codec_worker.decode_batch`) from the same states. Full responses and streams take this
one path; a full response is a request whose only chunk is its terminal one.
"""

from __future__ import annotations

import numpy as np

from intone.models.vocoder import CodecWindow, Vocoder


def window_of(req, chunk) -> CodecWindow:
    """The window of a chunk of a request (an EngineRequest, or the codec process's copy of one). Keyed
    by the request object, not its id: an aborted request's chunks may still be decoded after a new
    request took its id, and the two must not share a state."""
    return CodecWindow(id(req), req.request_id, req.codes, req.prompt, chunk.start, chunk.end, chunk.context,
                       chunk.finished, req.speed, chunk.prepare)


class CodecStage:
    def __init__(self, vocoder: Vocoder):
        self.vocoder = vocoder

    @property
    def calls(self) -> int:
        return self.vocoder.calls

    @property
    def gpu_seconds(self) -> float:
        return self.vocoder.gpu_seconds

    @property
    def flow_seconds(self) -> float:
        """CosyVoice3: the flow's part of `gpu_seconds` (0 for a vocoder without that piece)."""
        return getattr(self.vocoder, "flow_seconds", 0.0)

    def run(self, items: list, pause=None) -> list[np.ndarray]:
        """items: (request, Chunk) pairs -> the audio each chunk releases, in order. pause: called at
        the vocoder's pause points; it may run whole calls of its own, on other requests."""
        states = {id(req): req.codec_state for req, _ in items}
        audio, after = self.vocoder.decode([window_of(req, chunk) for req, chunk in items], states, pause)
        for req, _ in items:
            req.codec_state = after[id(req)]
        return audio
