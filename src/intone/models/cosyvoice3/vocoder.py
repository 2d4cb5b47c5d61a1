"""CosyVoice3's vocoder: speech tokens -> mel (flow) -> audio (HiFT), batched across requests.

Per chunk it does what the official streaming loop (`CosyVoice2Model.tts` with
`CosyVoice3Model.token2wav`) does for one request, with the state the engine keeps per request:
  - flow over the reference tokens plus *all* tokens up to the chunk's end (+3 lookahead
    tokens, read as context) with the chunk-causal mask; the final chunk runs with full
    attention and no lookahead, as officially;
  - the chunk's new mel frames (2 per token) are appended to the request's mel history;
  - officially, HiFT runs over the whole history (finalize only on the last chunk) and the
    samples beyond those already released are the chunk's audio. HiFT is causal with a
    bounded receptive field except for its excitation's running phase, so here it runs over
    a window: the last `stream_context_frames` (40) frames before the first sample wanted,
    plus the new ones, with the phase carried from the request's previous window. The samples
    are the same (float64: to rounding; the window's are computed in another order), and a
    hop's HiFT work no longer grows with the utterance (O(n) instead of O(n^2)).
So the audio a request receives is the official streaming output for the same tokens and
the same hop schedule (the planner's); the test suite checks this against a plain
re-run of that loop, request by request.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from intone.models.cosyvoice3.dit import FLEX_BLOCK
from intone.models.cosyvoice3.flow import GRAPH_FRAME_BUCKET, FlowRequest, graph_rows, graph_shape
from intone.models.cosyvoice3.flow_cache import solve_continued
from intone.models.cosyvoice3.flow_slots import SlotLayout, capture_slots, captured_shapes, slot_layout, solve_slots
from intone.models.cosyvoice3.flow_cache_pool import FlowCache, FlowCachePool
from intone.models.cosyvoice3.hift import HIFT_FRAME_BUCKET
from intone.models.cosyvoice3.hift import graph_shape as hift_graph_shape
from intone.models.cosyvoice3.hift_source import SourceWindow
from intone.models.vocoder import CodecWindow, Vocoder
from intone.ops.batching import group_jobs
from intone.ops.compiling import compile_settings
from intone.ops.host_copy import to_host

log = logging.getLogger(__name__)

MAX_GRAPH_CELLS = 64 * 1024  # rows x mel frames of the largest flow graph (its activations, x2 for CFG)


@dataclass
class StreamState:
    """What a request's next chunk needs from its earlier ones: the mel frames of HiFT's window
    (from absolute frame `start`), the samples already released, and HiFT's phase sum over the
    frames before `phase_at` (None: nothing carried yet)."""

    mel: Tensor  # [80, n]
    start: int = 0
    released: int = 0
    phase: Tensor | None = None
    phase_at: int = 0
    flow: FlowCache | None = None  # cosyvoice3.flow.cache: the flow's state after the stream's last non-final hop


def stretch(mel: Tensor, speed: float) -> Tensor:
    """Official tempo change: linear interpolation of the mel [80, T] to int(T / speed) frames."""
    return F.interpolate(mel.unsqueeze(0), size=int(mel.shape[1] / speed), mode="linear")[0]


def compile_dit(estimator, unit: str, wrapper: str = "python") -> None:
    """torch.compile the DiT's forward ("dit"), or each transformer block's ("block"): the 22 blocks
    are one code object, so the second compiles one block once and reuses it (real size, on a CPU:
    8-15 s against 113 s), and leaves the few kernels around the blocks eager. wrapper: inductor's
    Python or C++ wrapper (`cosyvoice3.flow.compile_wrapper`)."""
    compile_settings()

    def compiled(fn):
        return torch.compile(fn, dynamic=True, options={"cpp_wrapper": wrapper == "cpp"})
    if unit == "dit":
        for name in ("forward", "forward_slots", "forward_continued", "forward_continued_packed"):
            setattr(estimator, name, compiled(getattr(estimator, name)))
        return
    for block in estimator.transformer_blocks:
        block.forward = compiled(block.forward)


def store_for_autocast(estimator, dtype: torch.dtype) -> None:
    """Store the DiT's weights in the autocast dtype it runs under: autocast would cast each one in every
    pass (real size: ~2 GB of traffic and 154 kernels a pass, ten passes a call), and each feeds a matmul
    or convolution that autocast runs in that dtype, so the mel keeps its bits. Its RoPE table stays fp32
    (`RotaryEmbedding`); a float64 DiT, which autocast leaves alone, stays float64."""
    if next(estimator.parameters()).dtype != torch.float64:
        estimator.to(dtype)


def compile_batches(flow, device) -> list[list[FlowRequest]]:
    """The flow calls that compile the DiT at start-up: a whole and a streamed row (the padded solve),
    and with the varlen kernel three whole rows (the packed solve) whose sizes (rows, slots, padded
    frames, the convolutions' layout) all differ: dynamic shapes equate the sizes equal at their first
    compile, and a later call where they differ compiles again (real size: a minute, mid-service)."""
    def row(tokens: int, streaming: bool) -> FlowRequest:
        return FlowRequest(torch.zeros(tokens, dtype=torch.long, device=device),
                           torch.zeros(30, dtype=torch.long, device=device), torch.zeros(60, 80, device=device),
                           torch.ones(192, device=device), streaming=streaming, finalize=not streaming)

    batches = [[row(40, False), row(50, True)]]
    if flow.decoder.estimator.attention_kernel == "varlen":
        batches.append([row(40 + 10 * i, False) for i in range(3)])
    return batches


def whole_row(job: FlowRequest) -> bool:
    """A row solved whole with full attention (a final hop or a full response, with no earlier frames under the
    chunk mask): never continued from a flow cache, so it may run at fixed sizes (`flow_slots`)."""
    return not job.streaming and job.full_from is None


def warm_continued(flow, row: FlowRequest) -> None:
    """Compile the flow cache's two solves (`solve_continued`) at start-up: three streams' first hops (no
    cache; 200 mel frames), then their next (200 solved + 50 new). Sizes that differ from each other
    (rows, frames, past frames, flex blocks), so the compiled code ties none of them (dynamic shapes equate
    the sizes equal at their first compile, and a later call where they differ compiles again: real size,
    a minute each). row: a streamed dummy hop of `compile_batches`."""
    first, second = ([replace(row, tokens=torch.zeros(n, dtype=torch.long, device=row.tokens.device))] * 3
                     for n in (73, 98))
    # its own pool (the served pool is sized after start-up), with room for the three streams' caches
    pool = FlowCachePool(2**62, max_blocks=40)
    kept = solve_continued(flow, first, [None] * 3, [True] * 3, pool=pool)[1]
    solve_continued(flow, second, kept, [True] * 3, pool=pool)


class CosyVocoder(Vocoder):
    def __init__(self, model, max_batch: int, max_padded_frames: int, autocast: str = "none",
                 call_cost: int | None = None, flow_cache: bool = False, graph_frames: int | None = None,
                 hift_graph_frames: int | None = None, hift_call_cost: int | None = None, final_continued: bool = False,
                 cache_bytes: int | None = None, pauses: bool = False):
        """call_cost: the flow's calls split by `group_jobs` at this fixed cost per call (in tokens).
        pauses: the codec pauses its calls between Euler steps (`codec.schedule: preempt`), so a fixed-size
        solve's graphs are its steps', not the whole solve's (`flow_slots`).
        hift_call_cost: the same for HiFT's calls (None: each as full as the bounds allow; a call's cost
        is its graph's shape when HiFT has graphs, as with the flow's).
        flow_cache: a stream's non-final hops keep the flow's state, and the next hop solves only its new
        frames against it (`flow_cache.solve_continued`). final_continued (with flow_cache): a stream's final
        hop goes on from it too (`final_job`), where officially it re-solves the whole utterance with full
        attention. cache_bytes: the most the flow caches' pool takes (`FlowCachePool`; a hop it has no room
        for keeps no cache).
        graph_frames: the longest flow call that
        `capture_graphs` gives a graph (None: no graphs). hift_graph_frames: the longest HiFT window that
        `capture_graphs` gives a graph (None: none)."""
        self.graph_frames, self.hift_graph_frames = graph_frames, hift_graph_frames
        self.model = model
        self.device = model.codec_device
        self.call_cost, self.hift_call_cost = call_cost, hift_call_cost
        self.flow_cache = flow_cache
        self.final_continued = final_continued and flow_cache
        # the streams' flow caches, allocated at the first served flow call (start-up has left what it needs)
        self.pool = FlowCachePool(cache_bytes if cache_bytes is not None else 2**62)
        self.references_ahead = 0  # references solved ahead of their streams' first hops (`prepare` windows)
        self.max_batch = max_batch
        self.max_padded_frames = max_padded_frames
        # Half-precision autocast is for GPUs; on a CPU it is slower and only loses precision.
        gpu = model.codec_device.type == "cuda"
        self.autocast = getattr(torch, autocast) if autocast != "none" and gpu else None
        self.calls = 0  # batched flow calls (each followed by HiFT work), for tests and metrics
        self.padded_tokens = self.useful_tokens = 0  # the flow calls' rows x longest, and their real part
        self.hift_padded_frames = self.hift_useful_frames = 0  # HiFT's calls' computed rows x mel frames, and theirs
        self.flow_seconds = self.vocoder_seconds = 0.0  # the pieces' spans on the codec's stream (`_span`)
        self._counting = threading.Lock()  # the counters are read by the engine loop's thread
        self.graphs = None  # the flow solve's and HiFT's CUDA graphs (`capture_graphs`)
        # whole-response calls laid out at fixed sizes (`flow_slots`): flow graphs with the varlen kernel
        # (with flow_cache: streams' whole final hops; their continued hops run `solve_continued`)
        self.slotted = graph_frames is not None and model.flow.decoder.estimator.attention_kernel == "varlen"
        self.slot_shapes: set[tuple[int, int]] = set()  # the (rows, frames) of the fixed-size solve's graphs
        self.pauses = pauses

    def _autocast(self):
        """The flow's autocast, always without its cast cache: a cast cached by a graph's warm-up run
        would be read, not recomputed, by the captured graph (torch's rule for graphing under
        autocast), and one setting for every call keeps a compiled DiT at one compiled entry (the
        cache flag is part of what its guards check). The DiT's weights are stored cast
        (`store_for_autocast`), so only the flow's few other weights are recast in each call."""
        return torch.autocast(self.model.codec_device.type, self.autocast or torch.float32,
                              enabled=self.autocast is not None, cache_enabled=False)

    @property
    def wants_graphs(self) -> bool:
        return self.graph_frames is not None or self.hift_graph_frames is not None

    def capture_graphs(self, graphs) -> None:
        """Capture (start-up only: nothing else may use the GPU) the flow's ODE solve at every (rows, frames)
        shape a call is padded to (`graph_shape`), up to `graph_frames` conditioned mel frames and
        MAX_GRAPH_CELLS rows x frames, and HiFT's calls up to `hift_graph_frames` mel frames; longer calls
        run eagerly. Largest first: the pool is sized once."""
        self.graphs = graphs
        rows = sorted({graph_rows(n) for n in range(1, self.max_batch + 1)})
        if self.slotted:
            self._capture_slots(graphs)
        elif self.graph_frames:
            self._capture_flow(graphs, rows)
        if self.hift_graph_frames:
            step = HIFT_FRAME_BUCKET
            for r, frames in sorted(((r, f) for r in rows for f in range(step, self.hift_graph_frames + 1, step)),
                                    key=lambda s: s[0] * s[1], reverse=True):
                self.model.hift.capture(r, frames, graphs)

    def _capture_slots(self, graphs) -> None:
        """The fixed-size solve's Euler step at every (rows, frames) bucket of `captured_shapes`, most frames first;
        a shape that does not fit in memory is left to the varlen solve, as are the shapes after it."""
        for rows, slots in captured_shapes(self.max_batch, self.graph_frames, 2 * self.max_padded_frames):
            try:
                with self._autocast():
                    if capture_slots(self.model.flow, rows, slots, self.graph_frames, graphs, whole=not self.pauses):
                        self.slot_shapes.add((rows, slots))
            except torch.OutOfMemoryError:
                log.warning("no memory to capture the flow at %d rows x %d frames: its calls and smaller ones run "
                            "the varlen solve", rows, slots)
                torch.cuda.empty_cache()
                return

    def _capture_flow(self, graphs, rows: list[int]) -> None:
        dev, ratio = self.model.codec_device, self.model.flow.config.token_mel_ratio
        # A flex DiT's one-block shape would compile apart; such calls (under 2.6 s of reference and
        # output) run eagerly, padded to two blocks (`CosyFlow.inference`).
        shortest = 2 * FLEX_BLOCK if self.model.flow.decoder.estimator.attention_kernel == "flex" else GRAPH_FRAME_BUCKET
        shapes = [(r, f) for r in rows for f in range(shortest, self.graph_frames + 1, GRAPH_FRAME_BUCKET)
                  if r * f <= MAX_GRAPH_CELLS]
        for r, frames in sorted(shapes, key=lambda s: s[0] * s[1], reverse=True):
            tokens = frames // ratio  # prompt + output tokens of a finalized row: exactly `frames` mel frames
            dummy = FlowRequest(torch.zeros(tokens - 1, dtype=torch.long, device=dev),
                                torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(ratio, 80, device=dev),
                                torch.ones(192, device=dev), streaming=False, finalize=True)
            with self._autocast():
                self.model.flow.capture_solve([dummy] * r, graphs)

    def _slot_layout(self, jobs: list[FlowRequest]) -> SlotLayout | None:
        """The fixed-size layout of a call of whole rows (None: not slotted, a streamed row or one whose earlier
        frames keep the chunk mask (`full_from`), or beyond the buckets)."""
        if self.graphs is None or not self.slotted or not all(map(whole_row, jobs)):
            return None
        layout = slot_layout(self.model.flow.mel_lengths(jobs), self.graph_frames)
        # on a GPU only a captured shape (another would only add padding); elsewhere every one, eagerly
        if layout is None or (self.device.type == "cuda" and (layout.rows, layout.slots) not in self.slot_shapes):
            return None
        return layout

    def compile_flow(self, unit: str = "dit", wrapper: str = "python") -> None:
        """torch.compile the DiT (dynamic shapes; `compile_dit`) and compile it now, on small dummy
        calls (`compile_batches`), so no request pays for it. Fuses the elementwise work around the GEMMs: 2.3x at 64 rows."""
        compile_dit(self.model.flow.decoder.estimator, unit, wrapper)
        dev = self.model.codec_device
        dummy = compile_batches(self.model.flow, dev)
        with self._autocast():
            if not self.flow_cache:  # with the cache every call is a continued solve
                for batch in dummy:
                    self.model.flow.inference(batch)
            else:
                warm_continued(self.model.flow, dummy[0][1])

    @property
    def gpu_seconds(self) -> float:
        """The calls' spans on the codec's stream so far (flow and HiFT)."""
        with self._counting:
            return self.flow_seconds + self.vocoder_seconds

    def _mark(self):
        """A point on the stage's stream: a CUDA event (the GPU's own clock, so a span includes the
        kernels' waits for SMs the AR holds) or, on a CPU, the wall clock."""
        device = self.model.codec_device
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    @staticmethod
    def _span(start, end) -> float:
        """Seconds between two marks (for events, once the stream has passed the second)."""
        return end - start if isinstance(start, float) else start.elapsed_time(end) / 1000

    def decode(self, windows: list[CodecWindow], states: dict, pause=None) -> tuple[list, dict]:
        """pause: called after each Euler step of an eager flow solve and before HiFT; it may run whole
        calls of its own (on other requests), whose spans are not counted again in this call's."""
        nested = [0.0]  # the spans of the calls run at the pause points

        def paused():
            before = self.gpu_seconds
            pause()
            nested[0] += self.gpu_seconds - before
        marks = [self._mark()]
        new_mel, flows = self._flow(windows, states, paused if pause is not None else None)
        if pause is not None:
            paused()
        marks.append(self._mark())
        # Every chunk's HiFT window starts where its request's committed state does (a request may
        # have two chunks here: regular + terminal; the second's history holds the first's mel).
        hift = self.model.hift
        context, held_back, hop = hift.cfg.stream_context_frames, hift.cfg.held_back_frames, hift.cfg.hop
        latest: dict[int, Tensor] = {}
        mels, finals, starts, spans = [], [], [], []
        for w, mel in zip(windows, new_mel):
            state = states.get(w.key) or StreamState(mel.new_zeros(mel.shape[0], 0))
            history = latest[w.key] = torch.cat([latest.get(w.key, state.mel), mel], dim=1)
            if w.speed != 1.0:  # one whole-utterance chunk (checked at admission): stretch as officially
                history = stretch(history, w.speed)
            end = state.start + (history.shape[1] if w.finished else max(history.shape[1] - held_back, 0))
            after = max(0, end - context)  # where the next window starts
            mels.append(history)
            finals.append(w.finished)
            starts.append(after)
            # The next window's phase is carried from the first frame whose F0 it computes correctly.
            record_at = max(state.phase_at, after + hift.cfg.f0_history_frames if after else 0)
            spans.append((state.start, state.phase_at, state.phase, record_at))
        audio, phases = self._hift(mels, finals, spans)
        marks.append(self._mark())
        pieces, released, after_call = [], {}, dict(states)
        for w, history, wav, after, phase, (first, _, _, record_at), flow in zip(
                windows, mels, audio, starts, phases, spans, flows):
            state = states.get(w.key)
            done = released.get(w.key, state.released if state is not None else 0)
            pieces.append(wav[done - first * hop :].float())
            released[w.key] = max(done, first * hop + wav.shape[0])
            after_call[w.key] = StreamState(history[:, after - first :], after, released[w.key], phase, record_at, flow)
        # One device-to-host copy for the whole call (each copy waits for the stream, and its thread then
        # waits for the interpreter again), split into the windows' views.
        host = to_host(torch.cat(pieces))[0].numpy() if pieces else np.zeros(0, np.float32)
        out = np.split(host, np.cumsum([p.shape[0] for p in pieces])[:-1])
        if not isinstance(marks[-1], float):
            marks[-1].synchronize()  # with no pieces, nothing above waited for the stream
        with self._counting:
            self.flow_seconds += self._span(marks[0], marks[1]) - nested[0]
            self.vocoder_seconds += self._span(marks[1], marks[2])
        return out, after_call

    def _flow(self, windows: list[CodecWindow], states: dict, pause=None) -> tuple[list[Tensor], list[FlowCache | None]]:
        """The new mel frames [80, 2 * (end - start)] of each chunk, and (flow_cache) its stream's flow state after it."""
        model = self.model
        jobs = [self.final_job(w, job) for w, job in zip(windows, model.flow_requests(windows))]
        # a stream's chunks in one call all continue from its committed state (a later one solves more frames)
        committed = [states.get(w.key) for w in windows]
        given = [s.flow if self.flow_cache and s is not None and job is not None
                 and (not w.finished or job.full_from is not None) else None
                 for w, s, job in zip(windows, committed, jobs)]
        empty = model.mel_zeros()
        out: list[Tensor] = [empty] * len(windows)
        flows: list[FlowCache | None] = [None] * len(windows)
        live = [i for i, job in enumerate(jobs) if job is not None]
        keep = [self.flow_cache and not w.finished for w in windows]
        ratio = model.flow.config.token_mel_ratio
        # in tokens, as max_padded_frames counts them, but only those that make mel (no lookahead) and
        # (flow_cache) are not solved already
        lengths = [(n - (given[i].frames if given[i] is not None else 0)) // ratio
                   for i, n in zip(live, model.flow.mel_lengths([jobs[i] for i in live]))]
        for group in self._flow_groups(lengths, [jobs[i] for i in live]):
            idx = [live[g] for g in group]
            batch = [jobs[i] for i in idx]
            # no padding computed (not with graphs; with the cache, only by the varlen kernel)
            packed = model.flow.runs_packed(batch) if not self.flow_cache else \
                model.flow.decoder.estimator.attention_kernel == "varlen"
            layout = self._slot_layout(batch)
            with self._autocast():
                if layout is not None:
                    # where the codec pauses, the steps' graphs are captured: a call it runs unpaused replays them too
                    mels = solve_slots(model.flow, batch, layout, self.graphs, pause, stepped=self.pauses)
                    kept = [None] * len(idx)
                elif self.flow_cache:
                    mels, kept = solve_continued(model.flow, batch, [given[i] for i in idx],
                                                 [keep[i] for i in idx], pause, self.pool)
                else:
                    flow_graphs = self.graphs if self.graph_frames and not self.slotted else None  # slotted: varlen
                    mels, kept = model.flow.inference(batch, flow_graphs, pause), [None] * len(idx)
            with self._counting:
                self.calls += 1
                if layout is not None:  # its slots bucket (its empty rows hold nothing)
                    self.padded_tokens += layout.slots // ratio
                else:
                    self.padded_tokens += sum(lengths[g] for g in group) if packed else \
                        len(group) * max(lengths[g] for g in group)
                self.useful_tokens += sum(lengths[g] for g in group)
                self.references_ahead += sum(windows[i].prepare and flow is not None for i, flow in zip(idx, kept))
            for i, mel, flow in zip(idx, mels, kept):
                # mel starts at the prompt's end or (continued) the cache's, whichever is later
                solved = given[i].frames if given[i] is not None else 0
                skip = max(jobs[i].prompt_mel.shape[0], solved) - jobs[i].prompt_mel.shape[0]
                out[i], flows[i] = mel[:, ratio * windows[i].start - skip:], flow
        return out, flows

    def _flow_groups(self, lengths: list[int], jobs: list[FlowRequest]) -> list[list[int]]:
        """The flow calls of these jobs (`group_jobs`; indices into them). With the flow cache and slotted calls,
        the whole rows (streams' final hops, full responses) are grouped apart from the continued hops, so
        their calls can run at fixed sizes (`_slot_layout`)."""
        whole = [i for i, job in enumerate(jobs) if whole_row(job)] if self.flow_cache and self.slotted else []
        parts = [whole, sorted(set(range(len(jobs))) - set(whole))] if whole else [list(range(len(jobs)))]
        groups = []
        for part in parts:
            for group in group_jobs([lengths[i] for i in part], self.max_batch, self.max_padded_frames,
                                    self.call_cost, self._graph_cost):
                groups.append([part[g] for g in group])
        return groups

    @property
    def flow_cache_bytes(self) -> int:
        """What the streams' kept flow caches hold now (their pool blocks)."""
        return self.pool.used_bytes

    @property
    def flow_cache_pool_bytes(self) -> int:
        """The flow caches' pool (0 until its first use sizes it)."""
        return self.pool.blocks * self.pool.block_bytes

    @property
    def flow_cache_refused(self) -> int:
        """Hops that kept no flow cache for want of pool room."""
        return self.pool.refused

    def final_job(self, window: CodecWindow, job: FlowRequest | None) -> FlowRequest | None:
        """A stream's final hop under final_continued: its frames from its first token on attend to every
        frame, the earlier ones keep the chunk mask (`full_from`), so the hop goes on from the stream's flow
        state. Fixed by the hop schedule, not by what is cached when the hop runs: a stream whose last
        non-final hop is in the same call solves those frames again, with the same values. A whole response,
        or a hop schedule off the chunk grid, stays the official whole solve."""
        if not (self.final_continued and job is not None and window.finished and window.start > 0):
            return job
        full_from = self.model.flow.config.token_mel_ratio * (len(job.prompt_tokens) + window.start)
        chunk = self.model.flow.decoder.estimator.config.static_chunk_size
        return replace(job, full_from=full_from) if chunk <= 0 or full_from % chunk == 0 else job

    def _graph_cost(self, rows: int, tokens: int) -> int:
        """A flow call's padded work in tokens (`group_jobs` with `call_cost`): its graph's shape when one
        replays it (`graph_shape`; mel frames, two a token), else rows x longest."""
        ratio = self.model.flow.config.token_mel_ratio
        if not self.graph_frames or self.slotted or tokens * ratio > self.graph_frames:
            return rows * tokens
        padded_rows, frames = graph_shape(rows, tokens * ratio)
        return padded_rows * frames // ratio

    def _hift_cost(self, rows: int, tokens: int) -> int:
        """A HiFT call's computed work in tokens (`group_jobs` with `hift_call_cost`): its graph's shape
        when HiFT has graphs (every call is then padded to one: `hift.graph_shape`), else rows x longest."""
        ratio = self.model.flow.config.token_mel_ratio
        if not self._hift_graphed:
            return rows * tokens
        padded_rows, frames = hift_graph_shape(rows, tokens * ratio)
        return padded_rows * frames // ratio

    @property
    def _hift_graphed(self) -> bool:
        """HiFT's calls are padded to graph shapes (and replayed where captured)."""
        return self.graphs is not None and bool(self.hift_graph_frames)

    def _count_hift(self, frames: list[int], finalize: list[bool]) -> None:
        """A HiFT call's computed rows x mel frames (its graph's shape when graphed) and their real part, over
        the rows `vocode_batch` computes (those that give samples)."""
        computed = [n for n, fin in zip(frames, finalize) if self.model.hift.cfg.output_samples(n, fin)]
        if not computed:
            return
        rows, longest = hift_graph_shape(len(computed), max(computed)) if self._hift_graphed \
            else (len(computed), max(computed))
        with self._counting:
            self.hift_padded_frames += rows * longest
            self.hift_useful_frames += sum(computed)

    def _hift(self, mels: list[Tensor], finalize: list[bool], spans: list[tuple]) -> tuple[list, list]:
        """HiFT over each chunk's window: (first frame, phase_at, phase or None, record_at) ->
        the window's audio and the phase to carry, per chunk."""
        out: list[Tensor] = [mels[0].new_zeros(0)] * len(mels)
        phases: list[Tensor | None] = [w[2] for w in spans]
        live = [i for i, m in enumerate(mels) if m.shape[1] > 0]
        lengths = [mels[i].shape[1] // self.model.flow.config.token_mel_ratio for i in live]
        harmonics = self.model.hift.cfg.nb_harmonics + 1
        for group in group_jobs(lengths, self.max_batch, self.max_padded_frames, self.hift_call_cost, self._hift_cost):
            idx = [live[g] for g in group]
            self._count_hift([mels[i].shape[1] for i in idx], [finalize[i] for i in idx])
            zero = mels[idx[0]].new_zeros(harmonics, dtype=torch.float64)
            window = SourceWindow([spans[i][0] for i in idx], [spans[i][1] for i in idx],
                                  torch.stack([zero if spans[i][2] is None else spans[i][2].to(zero) for i in idx]),
                                  [spans[i][3] for i in idx])
            audio = self.model.hift.vocode_batch([mels[i] for i in idx], [finalize[i] for i in idx], window,
                                                 self.graphs if self._hift_graphed else None)
            for j, (i, wav) in enumerate(zip(idx, audio)):
                out[i], phases[i] = wav, window.recorded[j]
        return out, phases
