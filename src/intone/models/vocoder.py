"""The codec boundary: what a model's vocoder is given, and the default vocoder over a plain `decode`.

The engine decides which chunks go into a call (its queue, schedule and preemption), makes a
`CodecWindow` of each, hands the call to the model's `Vocoder` with each request's committed state,
and commits the states the vocoder returns only when the whole call succeeded (so a failed call is
retried chunk by chunk from the same states). A vocoder packs the call's windows into device
batches under its bounds (`ops.batching.group_jobs`) and never touches an engine request.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from intone.ops.batching import bucket_frames, bucket_rows, group_jobs, row_buckets, with_buckets
from intone.ops.host_copy import to_device, to_host


@dataclass
class CodecWindow:
    """One chunk of one request, as a vocoder reads it."""

    key: int  # the request's identity: its windows in one call come in order, each continuing from the one before
    request_id: str
    codes: Tensor  # [K, >= end] the request's frames (valid to `end`, plus the model's lookahead unless finished)
    prompt: object  # the request's Prompt (its codec conditioning)
    start: int  # first new frame
    end: int  # one past the last new frame
    context: int  # frames before `start` a stateless decode re-reads as context only
    finished: bool  # the request's terminal chunk
    speed: float = 1.0
    prepare: bool = False  # no frames: the request's state from its reference alone (`TTSModel.prepares_codec`)

    @property
    def window(self) -> tuple[int, int]:
        return self.start - self.context, self.end


class Vocoder(abc.ABC):
    """A model's frames -> audio, over one call's windows of several requests."""

    calls = 0  # device calls made (for tests and metrics)
    gpu_seconds = 0.0  # their spans on the codec's stream (a vocoder that times its pieces; else 0)
    graph_frames: int | None = None  # the longest call `capture_graphs` gives a graph (None: no graphs)
    device: torch.device

    @abc.abstractmethod
    def decode(self, windows: list[CodecWindow], states: dict[int, object], pause=None) -> tuple[list, dict]:
        """(the audio each window releases (float32 numpy), each request's state after its last window).

        states: each request's committed state (None before its first chunk); the vocoder leaves them
        as they are. pause: called at the call's pause points; it may run whole calls of its own."""

    def warm_up(self, max_window_frames: int, longest_chunk: int | None = None) -> int:
        """Run every shape the calls can reach up to this window length (start-up); returns the count.
        longest_chunk: the most new frames a chunk other than a request's only one holds
        (`ChunkPolicy.longest_chunk`; None: max_window_frames)."""
        return 0

    @property
    def wants_graphs(self) -> bool:
        """Whether `capture_graphs` has any call to capture."""
        return self.graph_frames is not None

    @property
    def captures_graphs(self) -> bool:
        """Whether start-up captures them (`loading.warm_up_codec`): they are wanted and the device is a GPU."""
        return self.wants_graphs and self.device.type == "cuda"

    def capture_graphs(self, graphs) -> None:
        """Capture CUDA graphs of the vocoder's calls (start-up, when `wants_graphs`)."""


@dataclass
class CodecJob:
    codes: Tensor  # [K, context + new] window codes
    context: int  # leading frames that are context only
    first_frame: int  # absolute index of codes[:, 0]

    @property
    def length(self) -> int:
        return self.codes.shape[1]


class WindowVocoder(Vocoder):
    """The default vocoder, over the model's `decode` (codes [B, K, T] at absolute frame offsets).

    Windows are sorted by length and grouped so that a group holds at most `max_batch` windows and
    `max_batch * longest <= max_padded_frames` (at least one window per group). Shorter windows are
    right-padded with code 0: the codec is causal, so padding after a window cannot change its
    samples, and each row is decoded at its own absolute frame positions. Each call's shape is padded
    further, frames to a bucket and rows to a power of two (above `row_granule`, when set, to a
    multiple of it; padding rows are zeros and dropped), so the codec meets few distinct shapes: its
    kernels choose their plans once per shape, and a new shape costs more than the decode. exact_rows:
    calls of at most this many windows keep their own row count (no blank rows): the carried decode's calls, or
    with carry_state off every call (with it on, the plain decode's calls, a request's whole utterance beyond the
    graphs, are rare, and exact rows would multiply the shapes start-up decodes for them); frame_buckets: more
    lengths a call's frames may be padded to (the chunk sizes a schedule makes, e.g. 25 and 4 + 25).
    Every shape a call can reach is decoded once at start-up (`warm_up`).

    split_cost: a call's windows split into calls of similar lengths where that saves more padded
    frame-rows than this per extra call (None: every call as full as the bounds allow).

    carry_state: a streamed chunk's new frames are decoded against its request's state (the model's
    `stream_decoder`, which it must have) instead of a window that re-decodes its left context.
    graph_frames: with carry_state, those calls are replayed from CUDA graphs (`capture_graphs`) up
    to this many frames a chunk. lean_decode: the stream decoder's fewer-copies path (`codec.lean_decode`).
    """

    def __init__(self, model, max_batch: int, max_padded_frames: int, carry_state: bool = False,
                 graph_frames: int | None = None, row_granule: int = 0, split_cost: int | None = None,
                 exact_rows: int = 0, frame_buckets=(), lean_decode: bool = False, packed_decode: bool = False):
        self.model = model
        self.row_granule, self.split_cost, self.exact_rows = row_granule, split_cost, exact_rows
        self.frame_buckets = with_buckets(frame_buckets)
        self.device = model.device
        self.max_batch = max_batch
        self.max_padded_frames = max_padded_frames
        self.stream = model.stream_decoder(lean_decode, packed_decode) if carry_state else None
        self.packed = packed_decode and self.stream is not None  # its calls' rows neither padded nor bucketed
        self.graph_frames = graph_frames if self.stream is not None else None
        self.graphs = None
        self.calls = 0
        self.padded_tokens = self.useful_tokens = 0  # the calls' frames, padding included, and their real part
        self._counting = threading.Lock()  # the counters are read by the engine loop's thread

    def warm_up(self, max_window_frames: int, longest_chunk: int | None = None) -> int:
        k = self.model.num_codebooks
        # start-up captures the carried graphs right after, each after a decode of its own: a shape with a graph
        # needs no warm-up here
        carried = set(self.carried_shapes(max_window_frames, longest_chunk)) \
            if self.stream is not None and not self.packed else set()
        carried -= set(self.graph_shapes()) if self.captures_graphs else set()
        plain = set(self.plain_shapes(max_window_frames, self.captures_graphs))
        for rows, t in sorted(carried | plain):
            codes = torch.zeros(rows, k, t, dtype=torch.long)
            if (rows, t) in carried:
                self.stream.decode(codes.to(self.device), [t] * rows, [None] * rows)
            if (rows, t) in plain:
                self.model.decode(codes, torch.zeros(rows, dtype=torch.long))
        packed = self.packed_lengths(carried) if self.packed else []
        for total in packed:  # one chunk filling each packed length: every length a call can reach
            n = total - self.stream.gap
            self.stream.decode(torch.zeros(1, k, n, dtype=torch.long, device=self.device), [n], [None])
        return len(carried | plain) + len(packed)

    def packed_lengths(self, carried: int) -> list[int]:
        """The packed lengths (`codec.packed_decode`) of every call whose rows hold chunks of up to `carried`
        frames, within the call bounds."""
        most = max(carried, min(self.max_padded_frames, self.max_batch * carried))  # a call's frames (or one alone)
        top = self.stream.packed_length([most] + [0] * (self.max_batch - 1))
        lengths, n = [], 1
        while not lengths or lengths[-1] < top:
            lengths.append(self.stream.packed_length([n]))
            n = lengths[-1] - self.stream.gap + 1
        return lengths

    def plain_shapes(self, max_window_frames: int, graphed: bool) -> list[tuple[int, int]]:
        """The shapes of `warm_shapes` the plain decode can meet: all of them, but with the carried decode's graphs
        (`graphed`) only those longer than the graphs reach, since a whole utterance within them goes carried
        (`decode`; Fish's shipped profile: 61 of 96 shapes, the 35 within 50 frames left out)."""
        bound = self.graph_bound if graphed else 0
        return [(rows, t) for rows, t in self.warm_shapes(max_window_frames) if t > bound]

    def carried_shapes(self, max_window_frames: int, longest_chunk: int | None) -> list[tuple[int, int]]:
        """The shapes of `warm_shapes` a carried call can reach: its rounds' spans stay within the built-in
        bucket of their longest chunk (`carried_rounds`), and only a request's only chunk, which takes the
        plain decode, is longer than the policy's longest (Fish's shipped profile: 50 frames against windows
        of up to 512; the carried decode's warm-up was ~90% of its frame-rows on shapes no call reaches)."""
        bound = _carried_bound(max_window_frames, longest_chunk)
        return [(rows, t) for rows, t in self.warm_shapes(max_window_frames, carried=True) if t <= bound]

    def warm_shapes(self, max_window_frames: int, carried: bool = False) -> list[tuple[int, int]]:
        """(rows, frames) of every call of windows up to max_window_frames long, the plain decode's (or the carried
        decode's, whose rows may differ: `exact_rows`): what `warm_up` decodes of them."""
        # a carried call's span may reach its longest chunk's built-in bucket; each length pads to _frames(n)
        shortest: dict[int, int] = {}  # each padded length -> the shortest length that pads to it
        for n in range(1, bucket_frames(max_window_frames) + 1):
            shortest.setdefault(self._frames(n), n)
        shapes = []
        for t, least in sorted(shortest.items()):
            # a group of n windows (n x its longest within max_padded_frames, or alone) is padded to
            # _rows(n) rows and its longest's bucket: every pair a group can reach
            for rows, fewest in self._row_buckets(carried):
                if fewest > 1 and fewest * least > self.max_padded_frames:
                    break
                shapes.append((rows, t))
        return shapes

    def _rows(self, n: int, carried: bool = False) -> int:
        return bucket_rows(n, self.row_granule, self._exact(carried))

    def _row_buckets(self, carried: bool = False) -> list[tuple[int, int]]:
        return row_buckets(self.max_batch, self.row_granule, self._exact(carried))

    def _exact(self, carried: bool) -> int:
        """`exact_rows` for the carried decode's calls, or for every call with carry_state off; else 0."""
        return self.exact_rows if carried or self.stream is None else 0

    def _frames(self, n: int) -> int:
        return bucket_frames(n, self.frame_buckets)

    def _groups(self, lengths: list[int], carried: bool = False) -> list[list[int]]:
        """The calls a round's windows go in: as full as the bounds allow, or with `split_cost` the
        cheapest split, a call costing that many frame-rows plus its padded shape's (so a few long
        rows do not pad many short ones to their length)."""
        return group_jobs(lengths, self.max_batch, self.max_padded_frames, self.split_cost,
                          lambda rows, longest: self._rows(rows, carried) * self._frames(longest))

    @property
    def graph_bound(self) -> int:
        """The longest padded chunk `capture_graphs` gives a graph (0: none)."""
        return self._frames(self.graph_frames) if self.graph_frames else 0

    def graph_shapes(self) -> list[tuple[int, int]]:
        """The (rows, frames) shapes `capture_graphs` captures: every one a call reaches up to `graph_frames`."""
        if not self.graph_frames:
            return []
        return [(r, t) for r, t in self.warm_shapes(self.graph_frames, carried=True) if t <= self.graph_bound]

    def capture_graphs(self, graphs) -> None:
        """The carried decode at every shape of `graph_shapes`; largest first (the graphs share one memory
        pool and their buffers, sized once)."""
        for r, t in sorted(self.graph_shapes(), key=lambda s: s[0] * s[1], reverse=True):
            self.stream.capture(graphs, r, t, self.device)
        self.graphs = graphs

    def decode(self, windows: list[CodecWindow], states: dict, pause=None) -> tuple[list, dict]:
        states = dict(states)
        if self.stream is None:
            return self._decode_windows(windows, pause), states
        # A window that is its request's whole utterance (a full response) is the one-pass decode
        # either way, and the plain decode is cheaper eagerly (H200, Fish C64 full responses: 64.8
        # audio-s/s plain in session 7, 59.8 carried in session 8); one a graph covers goes carried,
        # one replay beside the call's other chunks rather than a call of its own.
        graphed = self.graph_bound if self.graphs is not None else 0
        whole = [w.start == 0 and w.finished and states.get(w.key) is None and w.end > graphed for w in windows]
        out: list = [None] * len(windows)
        for wanted in (True, False):
            idx = [i for i, w in enumerate(whole) if w is wanted]
            if not idx:
                continue
            part = [windows[i] for i in idx]
            audio = self._decode_windows(part, pause) if wanted else self._decode_carried(part, states, pause)
            for i, samples in zip(idx, audio):
                out[i] = samples
        return out, states

    def _decode_windows(self, windows: list[CodecWindow], pause=None) -> list[np.ndarray]:
        jobs = [CodecJob(w.codes[:, w.window[0] : w.end], w.context, w.window[0]) for w in windows]
        return self.decode_jobs(jobs, pause)

    def decode_jobs(self, jobs: list[CodecJob], pause=None) -> list[np.ndarray]:
        """Audio of each job's new frames (float32), in the order of `jobs`; pause: called after each decode."""
        spf = self.model.samples_per_frame
        out: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(jobs)
        live = [i for i, j in enumerate(jobs) if j.length > j.context]
        lengths = [jobs[i].length for i in live]
        for group in self._groups(lengths):
            idx = [live[g] for g in group]
            longest = self._frames(max(jobs[i].length for i in idx))
            codes = torch.zeros(self._rows(len(idx)), jobs[idx[0]].codes.shape[0], longest, dtype=torch.long)
            offsets = torch.zeros(codes.shape[0], dtype=torch.long)
            for row, i in enumerate(idx):
                codes[row, :, : jobs[i].length] = jobs[i].codes
                offsets[row] = jobs[i].first_frame
            audio = to_host(self.model.decode(to_device(codes, self.device), to_device(offsets, self.device)))[0].numpy()
            self._count(codes.shape[0] * longest, sum(jobs[i].length for i in idx))
            for row, i in enumerate(idx):
                job = jobs[i]
                out[i] = np.ascontiguousarray(audio[row, job.context * spf : job.length * spf], dtype=np.float32)
            if pause is not None:
                pause()
        return out

    def _decode_carried(self, windows: list[CodecWindow], states: dict, pause=None) -> list[np.ndarray]:
        """Each window's new frames against its request's state, updated in `states`, in the rounds
        `carried_rounds` plans, each round's spans split back into their chunks."""
        out: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(windows)
        spf = self.model.samples_per_frame
        for round_ in self.carried_rounds(windows):
            lengths = [w.end - w.start for _, w in round_]
            for group in self._groups(lengths, carried=True):
                for g, samples in zip(group, self._decode_round([round_[g][1] for g in group], states)):
                    at = 0
                    for i in round_[g][0]:
                        n = (windows[i].end - windows[i].start) * spf
                        out[i], at = samples[at: at + n], at + n
                if pause is not None:
                    pause()
        return out

    def carried_rounds(self, windows: list[CodecWindow]) -> list[list[tuple[list[int], CodecWindow]]]:
        """The rounds a carried call decodes its windows in: a request's windows that continue one another
        decode as one span (the carried decode does not depend on where chunks begin) while the span fits
        the call's padded length; any others go in successive rounds (each needs the state the one before
        leaves). Each span: (its windows' indices, one window over them)."""
        order = [i for i, w in enumerate(windows) if w.end > w.start]
        # A longer span would pad every row of its round to it: session 23 measured uncapped spans
        # of a backlog's pieces at 55% padding and -20% throughput (Fish, non-streamed pieces of 50).
        # The cap is the built-in bucket (extra buckets pad a round less, but merge the same spans: a
        # stream's 4-frame first chunk and its next 25 stay one row of 29, not two rounds).
        fits = bucket_frames(max((windows[i].end - windows[i].start for i in order), default=1))
        spans, rounds = _contiguous_spans(windows, order, fits), []
        while spans:
            round_, later, seen = [], [], set()
            for span in spans:
                (later if span[1].key in seen else round_).append(span)
                seen.add(span[1].key)
            rounds.append(round_)
            spans = later
        return rounds

    def _count(self, padded: int, useful: int) -> None:
        with self._counting:
            self.calls += 1
            self.padded_tokens += padded
            self.useful_tokens += useful

    def _decode_round(self, windows: list[CodecWindow], states: dict) -> list[np.ndarray]:
        lengths = [w.end - w.start for w in windows]
        for w in windows:
            state = states.get(w.key)
            at = state.frames if state is not None else 0
            if at != w.start:
                raise RuntimeError(f"{w.request_id}: chunk from frame {w.start}, but the codec state is at {at}")
        rows = len(windows) if self.packed else self._rows(len(windows), carried=True)
        frames = max(lengths) if self.packed else self._frames(max(lengths))
        codes = torch.zeros(rows, windows[0].codes.shape[0], frames, dtype=torch.long)
        for row, w in enumerate(windows):
            codes[row, :, : w.end - w.start] = w.codes[:, w.start : w.end]
        pad = rows - len(windows)
        audio, new = self.stream.decode(to_device(codes, self.device), lengths + [0] * pad,
                                        [states.get(w.key) for w in windows] + [None] * pad)
        # the decoder's frames: the packed row (gaps and its bucket's tail), else every row padded to the longest
        self._count(self.stream.packed_length(lengths) if self.packed else rows * codes.shape[2], sum(lengths))
        audio = to_host(audio.float())[0].numpy()
        spf = self.model.samples_per_frame
        out = []
        for row, (w, n) in enumerate(zip(windows, lengths)):
            out.append(np.ascontiguousarray(audio[row, : n * spf], dtype=np.float32))
            states[w.key] = new[row]
        return out


def _carried_bound(max_window_frames: int, longest_chunk: int | None) -> int:
    """The longest padded span a carried call can reach: the built-in bucket of the longest chunk."""
    return bucket_frames(min(longest_chunk or max_window_frames, max_window_frames))


def _contiguous_spans(windows: list[CodecWindow], order: list[int], longest: int) -> list[tuple[list[int], CodecWindow]]:
    """Runs of one request's windows in which each starts where the one before ends, in order, each
    run at most `longest` frames: (their indices, one window over the run, reading the last one's codes)."""
    spans: list[tuple[list[int], CodecWindow]] = []
    last: dict[int, int] = {}  # key -> its latest span
    for i in order:
        w = windows[i]
        k = last.get(w.key)
        if k is not None and spans[k][1].end == w.start and w.end - spans[k][1].start <= longest:
            spans[k] = (spans[k][0] + [i], replace(w, start=spans[k][1].start, context=0))
        else:
            last[w.key] = len(spans)
            spans.append(([i], w))
    return spans
