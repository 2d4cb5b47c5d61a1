"""The codec stage on a worker thread of its own (and its own CUDA stream), beside the AR loop.

The engine loop plans chunks and hands each step's batch of them to this worker; the next AR steps
run while the codec decodes. By default chunks are decoded in the order they were handed over, and
each decode call takes every chunk waiting (so the calls grow with the backlog). With deadlines
(`codec.schedule: deadline`), each chunk carries the moment its listener runs out of audio without
it (its request's first chunk: at once), and each call takes the waiting chunks with the earliest
deadlines, up to `max_call` (so a new stream's first chunk goes ahead of the backlog of running
ones, and the worst-off stream next). With `codec.schedule: first`, a call takes only new streams'
first chunks while any wait; with `preempt`, a call over the backlog also pauses at each of its
stage's pause points (CosyVoice3: every Euler step of the flow) to decode the first chunks that
arrived meanwhile, so a new stream waits for one step, not for the whole call. Either way a
request's chunks come out in order, and their contents do not depend on timing (the windows were
fixed when they were planned). A call that raises is retried chunk by chunk; only a chunk that
fails alone gets its exception as its result.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from intone.engine.activity import Activity
from intone.engine.streams import own_stream, sm_share

log = logging.getLogger(__name__)


@dataclass
class DecodedBatch:
    items: list  # (EngineRequest, Chunk) pairs, as handed over
    audio: list  # per item: the samples (np.ndarray) or the exception its decode raised
    seconds: float  # wall time of the decode calls that carried this batch
    tokens: list[int]  # per item: the request's generated tokens when the chunk was planned
    gpu_seconds: float = 0.0  # their spans on the codec's stream (a stage that times its pieces; else 0)
    flow_seconds: float = 0.0  # CosyVoice3: the flow's part of gpu_seconds
    preempted: bool = False  # decoded at a pause point of a call over the backlog
    dropped: bool = False  # not decoded: their request ended while they waited (`ended_batch`)


def ended_batch(items: list) -> DecodedBatch:
    """Waiting chunks of a request that ended, handed back undecoded so the loop's counts come down."""
    return DecodedBatch(items, [RuntimeError("the request ended")] * len(items), 0.0, [0] * len(items),
                        dropped=True)


def skipped_prepares(items: list) -> DecodedBatch:
    """Waiting `prepare` chunks whose streams' first chunks went to a call first: those solve the reference
    themselves, so these are handed back undone (no audio, no state, no error)."""
    return DecodedBatch(items, [np.zeros(0, np.float32)] * len(items), 0.0, [0] * len(items), dropped=True)


def decode_batch(stage, items: list, pause=None) -> list:
    """The stage's audio for items; on failure, each item alone (failing ones get their exception).
    pause: called at the stage's pause points of the batch's call (not of the retries)."""
    try:
        return stage.run(items, pause) if pause is not None else stage.run(items)
    except Exception:  # noqa: BLE001 - retried one by one, so only the failing chunk's request ends
        log.exception("codec batch failed; retrying its chunks one by one")
    out = []
    for item in items:
        try:
            out.append(stage.run([item])[0])
        except Exception as e:  # noqa: BLE001
            log.exception("codec failed for %s", item[0].request_id)
            out.append(e)
    return out


class ChunkQueue:
    """Chunks waiting for the codec, earliest deadline first (ties: as handed over); `take` hands
    out one decode call's worth: up to max_call (None: all that wait). With `first` (a predicate:
    is this item one a client waits on now, e.g. its request's first chunk?), a call takes only those
    while any wait beside others (and their requests' earlier chunks still waiting, which their
    states need first), so a new stream's first audio does not wait for a call over the whole
    backlog. Not thread-safe."""

    def __init__(self, max_call: int | None = None, first=None):
        self.max_call = max_call
        self.first = first
        self._heap: list = []  # (deadline, order, item, tokens)
        self._order = itertools.count()

    def push(self, item, tokens: int, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._order), item, tokens))

    def take(self, only=None) -> tuple[list, list[int]]:
        """only: a predicate on items; the others stay queued (a call may then take nothing)."""
        candidates = self._heap if only is None else [t for t in self._heap if only(t[2])]
        if self.first is not None:
            firsts = {id(t[2][0]): t[2][1].start for t in candidates if self.first(t[2])}  # request -> its start
            if 0 < len(firsts) < len(candidates):
                candidates = [t for t in candidates if t[2][1].start <= firsts.get(id(t[2][0]), -1)]
        n = len(candidates) if self.max_call is None else min(self.max_call, len(candidates))
        taken = heapq.nsmallest(n, candidates)
        if len(taken) == len(self._heap):
            self._heap = []
        elif taken:
            chosen = {id(t) for t in taken}
            self._heap = [t for t in self._heap if id(t) not in chosen]
            heapq.heapify(self._heap)
        return [t[2] for t in taken], [t[3] for t in taken]

    def drop(self, keep) -> list:
        """Remove the items for which keep(item) is false; returns them."""
        dropped = [t[2] for t in self._heap if not keep(t[2])]
        if dropped:
            self._heap = [t for t in self._heap if keep(t[2])]
            heapq.heapify(self._heap)
        return dropped

    def __len__(self) -> int:
        return len(self._heap)

    def holds(self, predicate) -> bool:
        """Some waiting item satisfies predicate."""
        return any(predicate(t[2]) for t in self._heap)

    def earliest(self, predicate) -> float | None:
        """The earliest deadline among the waiting items that satisfy predicate (None: no such item)."""
        return min((t[0] for t in self._heap if predicate(t[2])), default=None)

    def requests(self) -> int:
        """Requests with a chunk waiting."""
        return len({id(t[2][0]) for t in self._heap})


def codec_stream(device: torch.device, sms: int | None, shared: bool = False, priority: int = 0):
    """(stream, its green context or None) for the codec worker. With `sms`, the stream belongs to a
    green context of that many of the GPU's SMs (`sm_share`). shared: the calling thread's
    current stream (the engine loop's, `codec.stream: loop`). priority: of its own stream (lower is more urgent)."""
    if device.type != "cuda":
        return None, None
    if shared:
        return torch.cuda.current_stream(device), None
    if sms is None:
        return own_stream(device, "codec worker", priority), None
    context = sm_share(device, sms, "codec.sms")
    return context.Stream(), context


def opens_a_stream(item) -> bool:
    """A streamed request's first chunk (a whole response's one chunk is also its last; a `prepare` chunk
    only readies the codec's state ahead of it)."""
    return item[1].start == 0 and not item[1].finished and not item[1].prepare


def is_piece(item) -> bool:
    """A non-streamed request's chunk (nobody listens before its last one)."""
    return item[0].frontier is not None and not item[0].frontier.listened


def is_midstream(item) -> bool:
    """A stream's chunk after its first and before its last: its listener is playing the audio before it."""
    return not is_piece(item) and item[1].start > 0 and not item[1].finished


def is_first_chunk(item) -> bool:
    """A chunk someone waits on first: a new stream's first, or a whole response's only one (a
    non-streamed request's earlier pieces are not: its client waits for the last; nor is a stream's
    `prepare` chunk, work done ahead while the codec has room, which nobody waits on: as a first
    chunk it made calls of its own and preempted the backlog's, session 32)."""
    return item[1].start == 0 and not item[1].prepare and (item[1].finished or not is_piece(item))


def is_awaited(item) -> bool:
    """A chunk a client waits on now: `is_first_chunk`, or a non-streamed request's last piece (its whole
    response waits for it; its earlier pieces only had to be done before it)."""
    return is_first_chunk(item) or (is_piece(item) and item[1].finished)


def alone_predicate(schedule: str):
    """The chunks that `codec.schedule` decodes in calls of their own, ahead of the rest (None: none)."""
    return {"first": is_first_chunk, "preempt": is_first_chunk, "awaited": is_awaited}.get(schedule)


def decode_timed(stage, items: list, tokens: list[int], pause=None, preempted: bool = False) -> DecodedBatch:
    """`decode_batch` with its wall time and the stage's GPU spans; pause: `Preemption` (the calls it
    makes at the pause points are timed by it, and taken out of this call's times)."""
    start, gpu, flow = time.perf_counter(), stage.gpu_seconds, stage.flow_seconds
    audio = decode_batch(stage, items, pause)
    nested = (pause.seconds, pause.gpu_seconds, pause.flow_seconds) if pause is not None else (0.0, 0.0, 0.0)
    return DecodedBatch(items, audio, time.perf_counter() - start - nested[0], tokens,
                        gpu_seconds=stage.gpu_seconds - gpu - nested[1],
                        flow_seconds=stage.flow_seconds - flow - nested[2], preempted=preempted)


def hold_seconds(waiting: ChunkQueue, oldest: float | None, gather_s: float, full: int,
                 lead_s: float | None = None) -> float:
    """Seconds the next call should still wait for more chunks (0: start it now). A call of a few
    rows costs about what one of a few dozen does (launch-bound), so a run of small calls keeps
    the codec busy and a request's last piece queues behind it; gathered, the pieces go in fewer
    calls and the last one waits for one (Fish, session 23: +10%, completion -0.25 s). Pieces are
    due `gather_s` after the oldest chunk waiting was handed over; with `lead_s` a stream's chunk
    between its first and its last is due `lead_s` before its deadline (its listener runs out of
    audio); any other stream's chunk at once (a new listener's first audio, and a stream's end, which
    a client may be waiting for before its next request)."""
    if oldest is None or waiting.requests() >= full or len(waiting) >= full:
        return 0.0  # a full call's worth (the loop's backpressure waits on as many chunks)
    if waiting.holds(lambda item: not is_piece(item) and (lead_s is None or not is_midstream(item))):
        return 0.0  # a listener's audio never waits for company (with a lead: only while it is playing)
    now = time.perf_counter()
    due = [oldest + gather_s if gather_s > 0 else now] if waiting.holds(is_piece) else []
    later = waiting.earliest(is_midstream)
    if later is not None:
        due.append(later - lead_s)
    return max(0.0, min(due) - now)


class Preemption:
    """The pause points of one call over the backlog: at each, the first chunks waiting are decoded
    before the call goes on. On a GPU it also keeps the call's launches at most one pause point ahead
    of its kernels (the stage would otherwise queue its whole call at once), so the first chunks'
    kernels wait behind one step of the call, not behind the rest of it."""

    def __init__(self, worker: "CodecWorker", stream, items: list):
        """items: the call's own; a first chunk of one of their requests waits for the call to end (its
        `prepare` is among them: the first chunk goes on from the state the call commits)."""
        self.worker, self.stream = worker, stream
        self.in_call = {id(req) for req, _ in items}
        self.behind = None  # the stream's mark at the previous pause point
        self.seconds = self.gpu_seconds = self.flow_seconds = 0.0  # of the calls made at the pause points

    def __call__(self) -> None:
        if self.stream is not None:
            mark = torch.cuda.Event()
            mark.record(self.stream)
            if self.behind is not None:
                self.behind.synchronize()
            self.behind = mark
        items, tokens = self.worker.take_first_chunks(self.in_call)
        if items:
            decoded = self.worker._decode(items, tokens, self.stream, preempted=True)
            self.seconds += decoded.seconds
            self.gpu_seconds += decoded.gpu_seconds
            self.flow_seconds += decoded.flow_seconds


class CodecWorker:
    def __init__(self, stage, device: torch.device, max_call: int | None = None, alone=None,
                 sms: int | None = None, preempt: bool = False, gather_s: float = 0.0, full: int = 64,
                 shared_stream: bool = False, lead_s: float | None = None, priority: int = 0):
        """alone: a predicate (`alone_predicate`); while chunks it holds for wait beside others, a call takes only
        those (ChunkQueue); preempt implies `is_first_chunk`.
        sms: the codec's share of the GPU's SMs (`codec_stream`). preempt: calls over the backlog
        decode the first chunks that arrive meanwhile at their pause points (`Preemption`).
        gather_s: a call of non-streamed requests' chunks starts once its oldest has waited this
        long, at once if `full` requests wait or any stream's chunk does (fewer, larger calls: `_hold`).
        shared_stream: decode on the constructing thread's current stream (the loop's) instead of one of
        its own, so the GPU runs the codec's kernels and the AR's one after the other. lead_s: a stream's
        later chunk waits until its deadline is that near (`hold_seconds`). priority: of the worker's own
        stream (`codec.high_priority`)."""
        self.stage = stage
        self._waiting = ChunkQueue(max_call, is_first_chunk if preempt else alone)
        self._gather_s, self._full, self._lead_s = gather_s, full, lead_s
        self._oldest: float | None = None  # when the oldest chunk still waiting was handed over
        self._preempt = preempt
        self._done: list[DecodedBatch] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ready = threading.Event()
        self._stop = False
        self.in_flight = 0  # chunks handed over and not yet collected
        self.activity = Activity()  # its calls (the AR loop's split of its steps' GPU time)
        self.prepares_skipped = 0  # `_skip_prepares`
        stream, self._green_context = codec_stream(device, sms, shared_stream, priority)
        self._thread = threading.Thread(target=self._work, args=(stream,), name="intone-codec", daemon=True)
        self._thread.start()

    def submit(self, items: list, tokens: list[int], deadlines: list[float] | None = None) -> None:
        """deadlines: per item (perf_counter seconds); None: as handed over."""
        self.in_flight += len(items)
        if deadlines is None:
            deadlines = [time.perf_counter()] * len(items)
        with self._wake:
            for item, n, deadline in zip(items, tokens, deadlines):
                self._waiting.push(item, n, deadline)
            if self._oldest is None:
                self._oldest = time.perf_counter()
            self._wake.notify_all()

    def take_first_chunks(self, busy: set[int] = frozenset()) -> tuple[list, list[int]]:
        """The first chunks waiting (up to a call's worth), taken off the queue, but none of the requests
        in `busy` (ids)."""
        with self._wake:
            if not self._waiting:
                return [], []
            taken = self._waiting.take(lambda item: is_first_chunk(item) and id(item[0]) not in busy)
            return self._skip_prepares(*taken)

    @property
    def calls(self) -> int:
        return self.stage.calls

    def release(self, request_id: str) -> None:
        """A request ended: its chunks still waiting are dropped (a held stream's may otherwise wait
        for a deadline long past its end); its state lives on the request object."""
        with self._wake:
            dropped = self._waiting.drop(lambda item: item[0].request_id != request_id)
            if not self._waiting:
                self._oldest = None
            if dropped:
                self._done.append(ended_batch(dropped))
                self._ready.set()

    @property
    def queued(self) -> int:
        """Chunks waiting for the worker (not yet in a decode call)."""
        return len(self._waiting)

    def collect(self) -> list[DecodedBatch]:
        with self._lock:
            done, self._done = self._done, []
            self._ready.clear()
        self.in_flight -= sum(len(d.items) for d in done)
        return done

    def wait(self, timeout: float) -> None:
        self._ready.wait(timeout)

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(timeout=30)

    def _work(self, stream) -> None:
        while True:
            with self._wake:
                while True:
                    if self._stop:
                        return
                    hold = self._hold() if self._waiting else None
                    if hold == 0.0:
                        items, tokens = self._skip_prepares(*self._waiting.take())
                        self._oldest = self._oldest if self._waiting else None  # a capped call's leftovers stay due
                        if items:
                            break
                    self._wake.wait(hold)
            # a call of first chunks is what the pause points would run: it pauses for nothing
            backlog = self._preempt and not all(is_first_chunk(item) for item in items)
            self._decode(items, tokens, stream, Preemption(self, stream, items) if backlog else None)

    def _skip_prepares(self, items: list, tokens: list[int]) -> tuple[list, list[int]]:
        """items and tokens less the `prepare` chunks of streams whose first chunks they hold; those, and such
        prepares still waiting, are handed back undone (under the lock)."""
        opening = {id(req) for req, chunk in items if chunk.start == 0 and not chunk.prepare}
        if not opening:
            return items, tokens

        def stale(item) -> bool:
            return item[1].prepare and id(item[0]) in opening
        skipped = [item for item in items if stale(item)] + self._waiting.drop(lambda item: not stale(item))
        if skipped:
            self.prepares_skipped += len(skipped)
            self._done.append(skipped_prepares(skipped))
            self._ready.set()
            kept = [i for i, item in enumerate(items) if not stale(item)]
            items, tokens = [items[i] for i in kept], [tokens[i] for i in kept]
        return items, tokens

    def _hold(self) -> float:
        return hold_seconds(self._waiting, self._oldest, self._gather_s, self._full, self._lead_s)

    def _decode(self, items: list, tokens: list[int], stream, pause: Preemption | None = None,
                preempted: bool = False) -> DecodedBatch:
        with torch.inference_mode(), self.activity:  # thread-local: the loop's mode does not reach this thread
            if stream is None:
                decoded = decode_timed(self.stage, items, tokens, pause, preempted)
            else:
                with torch.cuda.stream(stream):
                    decoded = decode_timed(self.stage, items, tokens, pause, preempted)
        with self._wake:
            self._done.append(decoded)
            self._ready.set()
        return decoded
