"""The codec stage in the engine loop (`codec.overlap: false`): the AR and the codec take turns on the GPU.

Beside the AR (`codec_worker`, a thread and a CUDA stream of its own) the two share the GPU's SMs and
one interpreter, and each slows the other: Fish's AR graphs ran ~60% slower beside the codec, whose
calls took ~5x their time alone (session 23); CosyVoice3's flow 1.4x and HiFT 3.3x (session 24). Here
the loop decodes between its steps, so each runs alone. With `codec.gather_ms` the non-streamed
pieces (and, with `codec.stream_lead_ms`, streams' later chunks) wait for company exactly as the
worker's do (`codec_worker.hold_seconds`), so the calls that stop the AR are few and large; a chunk
that is due takes every waiting one along.
Same interface as `CodecWorker` (submit, collect, wait, queued, in_flight), so the core drives either.
"""

from __future__ import annotations

import time

import torch

from intone.engine.codec_worker import ChunkQueue, DecodedBatch, decode_timed, ended_batch, hold_seconds


class LoopCodec:
    def __init__(self, stage, max_call: int | None = None, gather_s: float = 0.0, full: int = 64,
                 lead_s: float | None = None):
        """max_call: chunks per call at most (None: every waiting chunk); gather_s, full, lead_s: `hold_seconds`."""
        self.stage = stage
        self._waiting = ChunkQueue(max_call)
        self._gather_s, self._full, self._lead_s = gather_s, full, lead_s
        self._oldest: float | None = None  # when the oldest chunk still waiting was handed over
        self._done: list[DecodedBatch] = []
        self.in_flight = 0  # chunks handed over and not yet collected

    def submit(self, items: list, tokens: list[int], deadlines: list[float] | None = None) -> None:
        """deadlines: per item (perf_counter seconds): the order calls take them in, and with a lead
        when a playing stream's chunk is due (None: as handed over)."""
        self.in_flight += len(items)
        now = time.perf_counter()
        for item, n, deadline in zip(items, tokens, deadlines or [now] * len(items)):
            self._waiting.push(item, n, deadline)
        if self._oldest is None:
            self._oldest = now

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def calls(self) -> int:
        return self.stage.calls

    def collect(self) -> list[DecodedBatch]:
        """Decode what is due (`hold_seconds`: then every waiting chunk, up to max_call a call), then
        hand over every decoded batch."""
        self._decode_due(force=False)
        done, self._done = self._done, []
        self.in_flight -= sum(len(d.items) for d in done)
        return done

    def wait(self, timeout: float) -> None:
        """The loop has nothing else to run (or a call's worth waits): decode everything waiting now."""
        self._decode_due(force=True)

    def release(self, request_id: str) -> None:
        """A request ended: its chunks still waiting are dropped (handed back undecoded at the next
        collect); its codec state lives on the request object."""
        dropped = self._waiting.drop(lambda item: item[0].request_id != request_id)
        if not self._waiting:
            self._oldest = None
        if dropped:
            self._done.append(ended_batch(dropped))

    def close(self) -> None:
        """Nothing runs beside the loop."""

    def _decode_due(self, force: bool) -> None:
        while self._waiting and (force or hold_seconds(self._waiting, self._oldest, self._gather_s, self._full,
                                                       self._lead_s) == 0):
            items, tokens = self._waiting.take()
            self._oldest = self._oldest if self._waiting else None  # a capped call's leftovers stay due
            with torch.inference_mode():
                self._done.append(decode_timed(self.stage, items, tokens))
