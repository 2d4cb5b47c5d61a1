"""Which frames go to the codec, and when (design invariant 1).

Each request keeps an absolute frontier `emitted` (its `Frontier`, a field of the request object):
frames [0, emitted) have been released.
A chunk is always the next contiguous span [emitted, end) plus up to `left_context` frames
before it as codec context only. The chunk-size policy (initial chunk, steady size, backlog
size under load, growth) only decides *when* a chunk is due and how long it may be; it never
decides which frames it holds, so switching sizes can neither skip nor repeat a frame.
Finishing flushes the whole pending tail, and the terminal chunk is produced exactly once.

CosyVoice3's schedule is expressed with the same frontier: a chunk is due only once
`lookahead_frames` more frames exist beyond its end (the flow reads them as context), hops
grow by `growth_factor` up to `max_chunk_frames`, and the first hop is padded so that the
codec's prompt plus the first hop ends on a multiple of `align_first_chunk` frames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class ChunkPolicy:
    initial_chunk_frames: int = 0  # 0: no special first chunk
    steady_chunk_frames: int = 25
    backlog_chunk_frames: int = 0  # 0 or <= steady: no backlog mode
    backlog_load_threshold: float = 0.75
    backlog_min_ready: int = 2
    left_context_frames: int = 25
    lookahead_frames: int = 0  # frames that must exist beyond a non-final chunk's end
    ramp_factor: float = 0.0  # after the first chunk, hops of initial x ramp^k until they reach the steady size (0: off)
    growth_factor: int = 1  # each chunk's hop is the previous one's times this ...
    max_chunk_frames: int = 0  # ... up to this (0: no cap)
    align_first_chunk: int = 0  # pad the first hop so codec prompt + hop is a multiple of this
    whole_chunk_frames: int = 0  # a non-streamed request's hop (0: its terminal chunk alone)
    listener_margin_s: float = 0.0  # a stream's pending frames are also due once its listener is this close to silence
    frame_seconds: float = 0.0  # audio per frame (the model's; needed with listener_margin_s)

    def __post_init__(self):
        if self.steady_chunk_frames < 1 or self.growth_factor < 1:
            raise ValueError("steady_chunk_frames and growth_factor must be >= 1")
        sizes = (self.initial_chunk_frames, self.left_context_frames, self.backlog_chunk_frames,
                 self.lookahead_frames, self.max_chunk_frames, self.align_first_chunk, self.whole_chunk_frames)
        if min(sizes) < 0:
            raise ValueError("chunk sizes, context and lookahead must be >= 0")
        if self.listener_margin_s < 0 or (self.listener_margin_s > 0 and self.frame_seconds <= 0):
            raise ValueError("listener_margin_s must be >= 0, and needs frame_seconds > 0")

    def longest_chunk(self) -> int | None:
        """The most new frames a chunk other than a request's only one can hold, when frames come at most one
        a step and `plan` runs every step (None: hops grow without a cap). A request's only chunk (a
        whole response, or a stream that ends within its first hop) reaches its utterance's length."""
        if self.growth_factor > 1 and not self.max_chunk_frames:
            return None
        first = self.steady_chunk_frames + max(self.align_first_chunk - 1, 0)
        hops = (first, self.backlog_chunk_frames, self.whole_chunk_frames, self.max_chunk_frames)
        # a finished request's tail: short of a hop, plus the lookahead it held back
        return max(hops) + self.lookahead_frames


@dataclass(frozen=True)
class Chunk:
    request_id: str
    start: int  # first new frame
    end: int  # one past the last new frame
    context: int  # frames before `start` given to the codec as context only
    finished: bool  # the terminal chunk of the request (may hold no frames)
    # no frames: the codec prepares the request's state from its reference alone, ahead of its first
    # chunk (`TTSModel.prepares_codec`), and releases no audio
    prepare: bool = False

    @property
    def window(self) -> tuple[int, int]:
        return self.start - self.context, self.end


@dataclass
class Frontier:
    """One request's chunking state (owned by the request; made by `ChunkPlanner.frontier`)."""

    initial: int  # this request's first-chunk size (0: none)
    whole: bool = False  # no chunk before the terminal one (a non-streamed request)
    hop: int = 0  # every non-final chunk this long, whatever the load (a non-streamed request in pieces; 0: the policy's)
    emitted: int = 0
    chunks: int = 0  # non-final chunks released so far (for hop growth)
    terminated: bool = False
    first_released: float | None = None  # when its first chunk was released (the earliest its listener can start)

    @property
    def listened(self) -> bool:
        """A stream's: its chunks are played as they come (a non-streamed request's wait for its last)."""
        return not (self.whole or self.hop)


class ChunkPlanner:
    """The chunk policy applied to the live requests' frontiers. `plan()` is called once per engine step."""

    def __init__(self, policy: ChunkPolicy, capacity: int):
        self.policy = policy
        self.capacity = capacity
        self.backlog_active = False  # the mode chosen at the last plan(), for tracing

    def frontier(self, initial_chunk_frames: int | None = None, prompt_frames: int = 0,
                 whole: bool = False, one_chunk: bool = False) -> Frontier:
        """A new request's frontier. initial_chunk_frames overrides the policy's for this request (capped
        at the steady size); prompt_frames: the codec prompt's length, for `align_first_chunk`; whole:
        a non-streamed request, its audio in `whole_chunk_frames` pieces, or its terminal chunk alone
        (that also when one_chunk: a prompt whose audio must be decoded in one piece)."""
        p = self.policy
        if whole:
            pieces = p.whole_chunk_frames if not one_chunk else 0
            return Frontier(0, whole=not pieces, hop=pieces)
        initial = p.initial_chunk_frames if initial_chunk_frames is None else initial_chunk_frames
        initial = max(0, min(initial, p.steady_chunk_frames))
        if p.align_first_chunk:
            # the official pad is (-prompt) % hop with align == hop; this equals it then, and keeps
            # prompt + hop on a multiple of align for any other pair too
            initial = p.steady_chunk_frames + (-(prompt_frames + p.steady_chunk_frames)) % p.align_first_chunk
        return Frontier(initial, whole)

    def steady_size(self, pending: dict[str, int]) -> int:
        """Backlog size when enough requests wait with enough frames; re-decided every step."""
        p = self.policy
        if p.backlog_chunk_frames <= p.steady_chunk_frames:
            self.backlog_active = False
            return p.steady_chunk_frames
        waiting = sum(1 for n in pending.values() if n > 0)
        ready = sum(1 for n in pending.values() if n >= p.steady_chunk_frames)
        load = waiting / max(self.capacity, 1)
        self.backlog_active = load >= p.backlog_load_threshold and ready >= p.backlog_min_ready
        return p.backlog_chunk_frames if self.backlog_active else p.steady_chunk_frames

    def _hop(self, front: Frontier, steady: int) -> int:
        if front.hop:
            return front.hop
        if front.chunks == 0 and front.initial > 0:
            return front.initial
        p = self.policy
        if p.ramp_factor and front.initial > 0:
            # A stream's hop k may be at most initial + (frames before it) x (its speed over real
            # time - 1) for chunk k to arrive before its listener runs out, whatever the codec's steady
            # latency; geometric hops from the first chunk stay under that bound while the ramp is at
            # most that speed (Fish at C64: a frame of 46 ms audio per ~20 ms step, speed ~2.3).
            return min(steady, math.ceil(front.initial * p.ramp_factor ** front.chunks))
        hop = steady * p.growth_factor ** front.chunks
        return min(hop, p.max_chunk_frames) if p.max_chunk_frames else hop

    def plan(self, streams: Mapping[str, tuple[Frontier, int]], finished: Sequence[str] = (),
             now: float = 0.0) -> list[Chunk]:
        """streams: each live request's frontier and the frames it has generated so far; finished:
        requests that stopped; now: the clock `listener_margin_s` reads (seconds).

        With `listener_margin_s`, a stream's pending frames (at least one) are also due, short of its hop,
        once its listener, counted as playing from its first chunk's release, would run out of audio
        within the margin: a chunk released then reaches the listener in time whenever the codec and the
        transport take less than the margin minus one step. Its chunks' boundaries then depend on timing,
        which only a codec that carries its state can allow (the audio does not depend on them).

        Returns the chunks due now: per request at most one regular chunk and, for a finished
        request, then one terminal chunk with the whole pending tail (possibly empty), once;
        repeated finish calls return nothing more. A chunk that is due is released as such even
        if its request finished in the same step, so the chunk boundaries never depend on
        when a request stops.
        """
        done = set(finished)
        pending = {rid: n - front.emitted for rid, (front, n) in streams.items()}
        steady = self.steady_size(pending)
        chunks = []
        for rid, (front, n) in streams.items():
            if front.terminated:
                continue
            if n < front.emitted:
                raise ValueError(f"{rid}: frame count went backwards ({n} < {front.emitted})")
            if not front.whole:
                ready, target = n - self.policy.lookahead_frames, self._hop(front, steady)  # ready: a chunk's last end
                if ready - front.emitted >= target:
                    chunks.append(self._release(rid, front, front.emitted + target, False, now))
                elif ready > front.emitted and self._listener_short(front, now):
                    chunks.append(self._release(rid, front, ready, False, now))
            if rid in done:
                chunks.append(self._release(rid, front, n, True, now))
        return chunks

    def _listener_short(self, front: Frontier, now: float) -> bool:
        p = self.policy
        if not p.listener_margin_s or not front.listened or front.first_released is None:
            return False  # off, a non-streamed request, or no first chunk yet (its own size decides it)
        return now + p.listener_margin_s >= front.first_released + front.emitted * p.frame_seconds

    def _release(self, rid: str, front: Frontier, end: int, final: bool, now: float) -> Chunk:
        # The first chunk never takes context: there is nothing before it.
        chunk = Chunk(rid, front.emitted, end, min(front.emitted, self.policy.left_context_frames), final)
        if front.first_released is None:
            front.first_released = now
        front.emitted, front.terminated = end, final
        front.chunks += not final
        return chunk

    def one_chunk(self, initial_chunk_frames: int | None, max_frames: int, whole: bool = False) -> bool:
        """Whether a request of at most max_frames always gets its audio as the terminal chunk alone."""
        if whole:
            return True
        p = self.policy
        initial = p.initial_chunk_frames if initial_chunk_frames is None else initial_chunk_frames
        return not (initial or p.align_first_chunk) and p.steady_chunk_frames + p.lookahead_frames > max_frames

