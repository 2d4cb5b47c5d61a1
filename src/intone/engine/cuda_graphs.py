"""CUDA graphs of the AR step, owned by the model runner and captured at start-up (invariant 2).

An eager decode step of a deep transformer is hundreds to thousands of small kernels, so at any
batch size it costs what launching them costs. Two pieces of a step have static shapes once
their rows are padded to a bucket:

- the decode forward (`TTSModel.forward_decode`, one token per row: a decode's new token, or
  one token of a prompt), keyed by (rows, KV length): attention reads each row's blocks up to the KV bucket and masks beyond the row's
  length; padding rows write their keys to the cache's scratch slot and their outputs are dropped;
- the head (`TTSModel.head`: sampling, and Fish's fast AR), keyed by rows and by the bound on the
  rows' top_k its draws sort to (`ar.sample_candidates` or every token: the smallest that holds the
  batch's largest top_k; every bound draws the same tokens), for models whose head has static shapes;
  padding rows are copies of row 0 (valid values) and are dropped.

Every key the engine can meet is captured by `capture_all()` before the engine serves, with
nothing else on the GPU; afterwards graphs are only replayed. A key without a graph (its capture
failed, or it lies beyond the buckets' bound) runs eagerly over the same padded buffers: the same
kernels on the same shapes, so the same bits a replay would give.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, fields
from typing import Callable

import torch
from torch import Tensor

from intone.engine.streams import own_stream
from intone.ops.attention import AttentionMetadata
from intone.ops.kv_cache import KVCache
from intone.ops.sampling import SamplingBatch

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
KV_BUCKETS = (256, 512, 1024, 2048, 4096, 8192)


def bucket(value: int, buckets=ROW_BUCKETS) -> int | None:
    return next((b for b in buckets if b >= value), None)


def head_bound(bounds: tuple, max_top_k: int) -> int | None:
    """The smallest of a head's candidate bounds (None: every token, the last) that holds max_top_k."""
    return next(b for b in bounds if b is None or b >= max_top_k)


def pad_rows(t: Tensor, rows: int) -> Tensor:
    """Pad dim 0 to `rows` by repeating row 0."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t[:1].expand(rows - t.shape[0], *t.shape[1:])])


def capture_graph(run: Callable, pool, capture_stream: torch.cuda.Stream):
    """run() once on a side stream (allocator, lazy init, plans), then captured: (graph, its output).

    capture_stream: one per set of graphs that are replayed one after another. cuBLAS keeps its
    workspace per stream, and a graph bakes in the workspace of the stream it was captured on;
    graphs captured on one stream (torch's default capture stream, if none is given) and replayed
    concurrently from two streams share that workspace. On Hopper the split GEMM kernels keep
    semaphores there, and two such replays (the AR step's and the frontend's) hung the GPU."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
        out = run()
    return graph, out


class _Capturable:
    """Static input buffers, a `run()` over them, and optionally a captured graph of `run()`."""

    graph: torch.cuda.CUDAGraph | None = None
    out = None

    def run(self):
        raise NotImplementedError

    def capture(self, pool, capture_stream) -> None:
        self.graph, self.out = capture_graph(self.run, pool, capture_stream)

    def execute(self):
        if self.graph is None:
            return self.run()
        self.graph.replay()
        return self.out


class _DecodeBuffers(_Capturable):
    def __init__(self, fn, kv: KVCache, rows: int, width: int, dtype, kv_tokens: int):
        dev = kv.k.device
        self.fn, self.kv = fn, kv
        self.scratch_slot, self.scratch_block = kv.scratch_slot, kv.num_blocks
        self.x = torch.zeros(rows, width, dtype=dtype, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.slots = torch.full((rows,), kv.scratch_slot, dtype=torch.int64, device=dev)
        self.tables = torch.full((rows, kv_tokens // kv.block_size), kv.num_blocks, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(rows, dtype=torch.int64, device=dev)

    def run(self):
        return self.fn(self.x, self.positions, self.slots, self.tables, self.seq_lens, self.kv)

    def load(self, x: Tensor, meta: AttentionMetadata) -> None:
        r, n_blocks = x.shape[0], meta.block_tables.shape[1]
        self.x[:r].copy_(x)
        self.positions[:r].copy_(meta.positions)
        self.slots[:r].copy_(meta.slot_mapping)
        self.slots[r:] = self.scratch_slot  # rows left from a larger batch must not write its slots
        self.tables[:r, :n_blocks].copy_(meta.block_tables)
        self.tables[:r, n_blocks:] = self.scratch_block
        self.tables[r:] = self.scratch_block
        self.seq_lens[:r].copy_(meta.seq_lens)
        self.seq_lens[r:] = 1


_SAMPLING_TENSORS = [f.name for f in fields(SamplingBatch) if f.name not in (
    "max_top_k", "has_penalty", "modes")]


class _HeadBuffers(_Capturable):
    def __init__(self, fn, rows: int, candidates: int | None, modes: str, out_shape, out_dtype, history_width: int,
                 device):
        self.fn, self.candidates = fn, candidates
        self.hidden = torch.zeros(rows, *out_shape, dtype=out_dtype, device=device)
        self.history = torch.full((rows, history_width), -1, dtype=torch.int64, device=device)
        kinds = dict(temperature=torch.float32, top_p=torch.float32, top_k=torch.int64,
                     repetition_penalty=torch.float32, seeds=torch.int64, steps=torch.int64,
                     ban_stop=torch.bool, below_min=torch.bool, ras=torch.bool)
        values = {name: torch.ones(rows, dtype=kinds[name], device=device) for name in _SAMPLING_TENSORS}
        values["ban_stop"].zero_(), values["below_min"].zero_()
        # max_top_k is a placeholder (a static head never reads it); the graph runs the samplers of `modes`
        self.sampling = SamplingBatch(max_top_k=1, has_penalty=True, modes=modes, **values)

    def run(self):
        return self.fn(self.hidden, self.sampling, self.history, self.candidates)

    def load(self, hidden: Tensor, sampling: SamplingBatch, history: Tensor) -> None:
        rows = self.hidden.shape[0]
        self.hidden.copy_(pad_rows(hidden, rows))
        self.history.copy_(pad_rows(history, rows))
        for name in _SAMPLING_TENSORS:
            value = getattr(sampling, name)
            if value is None:
                raise ValueError(f"a static head needs sampling.{name}")
            getattr(self.sampling, name).copy_(pad_rows(value, rows))


@dataclass
class CaptureReport:
    graphs: int = 0
    failed: int = 0
    seconds: float = 0.0


class StepGraphs:
    """The decode and head graphs of one model runner (CUDA only)."""

    def __init__(self, decode_fn: Callable, head_fn: Callable | None, kv: KVCache, width: int, dtype,
                 out_shape, out_dtype, history_width: int, head_bounds: tuple = (None,), head_modes: tuple = ("both",)):
        """head_modes: the `SamplingBatch.modes` the head has graphs of its own for (the model's
        `head_modes`); any other batch replays the "both" graph."""
        self.decode_fn, self.head_fn, self.kv = decode_fn, head_fn, kv
        self.head_bounds, self.head_modes = head_bounds, head_modes
        self.width, self.dtype = width, dtype
        self.out_shape, self.out_dtype, self.history_width = out_shape, out_dtype, history_width
        self._decode: dict[tuple[int, int], _DecodeBuffers] = {}
        self._head: dict[tuple[int, int | None, str], _HeadBuffers] = {}
        self._pool = None
        self._capture_stream: torch.cuda.Stream | None = None  # this set's own (see capture_graph)
        self.replays = 0  # steps whose decode ran from a graph
        self.eager = 0  # steps whose decode had no graph for its key
        self.report = CaptureReport()

    # ---- keys ---------------------------------------------------------------------------------

    def decode_key(self, rows: int, max_seqlen_k: int) -> tuple[int, int] | None:
        r, kv_tokens = bucket(rows), bucket(max_seqlen_k, KV_BUCKETS)
        if r is None or kv_tokens is None:
            return None
        return r, -(-kv_tokens // self.kv.block_size) * self.kv.block_size

    def _decode_buffers(self, key) -> _DecodeBuffers:
        if key not in self._decode:
            rows, kv_tokens = key
            self._decode[key] = _DecodeBuffers(self.decode_fn, self.kv, rows, self.width, self.dtype, kv_tokens)
        return self._decode[key]

    def _head_buffers(self, rows: int, candidates: int | None, modes: str) -> _HeadBuffers:
        key = rows, candidates, modes
        if key not in self._head:
            self._head[key] = _HeadBuffers(self.head_fn, rows, candidates, modes, self.out_shape, self.out_dtype,
                                           self.history_width, self.kv.k.device)
        return self._head[key]

    # ---- serving ------------------------------------------------------------------------------

    def decode(self, x: Tensor, meta: AttentionMetadata) -> Tensor | None:
        """Output rows for a decode batch, or None when it lies beyond the buckets."""
        key = self.decode_key(x.shape[0], meta.max_seqlen_k)
        if key is None:
            return None
        buffers = self._decode_buffers(key)
        buffers.load(x, meta)
        if buffers.graph is not None:
            self.replays += 1
        else:
            self.eager += 1
        return buffers.execute()[: x.shape[0]].clone()

    def head(self, hidden: Tensor, sampling: SamplingBatch, history: Tensor):
        """(tokens, codes, stopped), or None when the rows lie beyond the buckets."""
        rows = bucket(hidden.shape[0])
        if self.head_fn is None or rows is None:
            return None
        modes = sampling.modes if sampling.modes in self.head_modes else "both"
        buffers = self._head_buffers(rows, head_bound(self.head_bounds, sampling.max_top_k), modes)
        buffers.load(hidden, sampling, history)
        n = hidden.shape[0]
        return tuple(t[:n].clone() for t in buffers.execute())

    # ---- start-up -------------------------------------------------------------------------------

    def capture_all(self, max_rows: int, max_kv_tokens: int, max_tokens: int | None = None) -> CaptureReport:
        """Capture every (token rows, KV) decode key up to max_tokens rows and every head row bucket
        up to max_rows, largest first (the shared memory pool is sized once, by the largest)."""
        start = time.perf_counter()
        row_keys = [r for r in ROW_BUCKETS if r <= (bucket(max_rows) or ROW_BUCKETS[-1])]
        token_keys = [r for r in ROW_BUCKETS if r <= (bucket(max(max_tokens or 0, max_rows)) or ROW_BUCKETS[-1])]
        kv_top = bucket(max_kv_tokens, KV_BUCKETS) or KV_BUCKETS[-1]
        keys = sorted({self.decode_key(r, kv) for r in token_keys for kv in KV_BUCKETS if kv <= kv_top}, reverse=True)
        torch.cuda.synchronize()
        with torch.inference_mode():
            for key in keys:
                self._capture(self._decode_buffers(key), key)
            if self.head_fn is not None:
                for rows in sorted(row_keys, reverse=True):
                    for candidates in self.head_bounds:
                        for modes in self.head_modes:
                            self._capture(self._head_buffers(rows, candidates, modes),
                                          ("head", rows, candidates, modes))
        torch.cuda.synchronize()
        self.report.seconds = time.perf_counter() - start
        return self.report

    def _capture(self, buffers: _Capturable, key) -> None:
        try:
            if self._capture_stream is None:
                self._capture_stream = own_stream(None, "AR graphs' capture")
            buffers.capture(self._pool, self._capture_stream)
            self._pool = buffers.graph.pool()
            self.report.graphs += 1
        except Exception:  # e.g. out of memory: this key runs eagerly instead of failing the engine
            log.exception("cannot capture a CUDA graph for %s; it will run eagerly", key)
            buffers.graph = None
            self.report.failed += 1
            torch.cuda.synchronize()

    @property
    def captured(self) -> list:
        decode = sorted(k for k, b in self._decode.items() if b.graph is not None)
        head = sorted((("head", r, c, m) for (r, c, m), b in self._head.items() if b.graph is not None),
                      key=lambda k: (k[1], k[2] is None, k[2] or 0, k[3]))
        return decode + head


def _tensors(tree) -> list[Tensor]:
    return list(tree) if isinstance(tree, (tuple, list)) else [tree]


class _GraphSet:
    """One copy of every captured function: its graphs share a memory pool, so they are replayed
    one at a time (its lock), on whatever stream the replaying thread is on."""

    def __init__(self, priority: int):
        self.priority = priority
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[Tensor], list[Tensor]]] = {}
        self.lock = threading.Lock()
        self.last: torch.cuda.Event | None = None
        self.pool = None
        self.capture_stream: torch.cuda.Stream | None = None  # this set's own (see capture_graph)

    def capture(self, key: tuple, fn: Callable, inputs) -> None:
        if self.capture_stream is None:
            self.capture_stream = own_stream(None, "graph set's capture", self.priority)
        static = [t.clone() for t in inputs]
        graph, out = capture_graph(lambda: fn(*static), self.pool, self.capture_stream)
        self.pool = graph.pool()
        self.graphs[key] = (graph, static, _tensors(out))

    def replay(self, key: tuple, inputs) -> list[Tensor]:
        graph, static, out = self.graphs[key]
        with self.lock:
            if self.last is not None:  # the previous replay (maybe on another stream) is done with the buffers
                torch.cuda.current_stream().wait_event(self.last)
            for buffer, value in zip(static, inputs):
                buffer.copy_(value)
            graph.replay()
            result = [t.clone() for t in out]
            self.last = torch.cuda.Event()
            self.last.record()
            return result


class FunctionGraphs:
    """CUDA graphs of a model's fixed-shape functions outside the AR step (the reference frontend's
    networks, CosyVoice3's flow solve), keyed by name and input shapes. The engine makes one and hands
    it to the model at start-up; the model captures each shape it will see (`capture`), and later calls `run`, which
    replays the graph for those shapes or, for any other shape, calls the function eagerly.

    With `replicas` > 1 every shape is captured that many times, each copy with its memory pool of
    its own, and each thread that replays takes one copy (round robin at its first call): several
    frontend workers then replay concurrently, each on its own stream. The copies are the same
    kernels on the same shapes, so a clip gets the same bits from any of them."""

    def __init__(self, priority: int = 0, replicas: int = 1):
        """priority: of the streams the graphs are captured on (lower is more urgent, as CUDA counts)."""
        self.priority = priority
        self._sets = [_GraphSet(priority) for _ in range(max(1, replicas))]
        self._assigned = threading.local()
        self._next = 0
        self._assign_lock = threading.Lock()
        self.replays = self.eager = 0
        self.report = CaptureReport()

    @staticmethod
    def key(name: str, inputs) -> tuple:
        return (name, *((tuple(t.shape), t.dtype) for t in inputs))

    def capture(self, name: str, fn: Callable, *inputs: Tensor) -> None:
        """Capture fn(*inputs) for these shapes in every copy (start-up only: nothing else may use the GPU)."""
        key = self.key(name, inputs)
        if key in self._sets[0].graphs or not inputs[0].is_cuda:
            return
        start = time.perf_counter()
        try:
            for graph_set in self._sets:
                graph_set.capture(key, fn, inputs)
            self.report.graphs += 1
        except Exception:  # this shape runs eagerly instead
            log.exception("cannot capture a CUDA graph for %s; it will run eagerly", key)
            for graph_set in self._sets:
                graph_set.graphs.pop(key, None)
            self.report.failed += 1
            torch.cuda.synchronize()
        self.report.seconds += time.perf_counter() - start

    def has(self, name: str, *inputs: Tensor) -> bool:
        """Whether `run` would replay a graph for these inputs' shapes; a caller that then runs its own
        eager path instead counts it (`ran_eagerly`)."""
        return self.key(name, inputs) in self._sets[0].graphs

    def ran_eagerly(self) -> None:
        with self._assign_lock:
            self.eager += 1

    def run(self, name: str, fn: Callable, *inputs: Tensor, eager: Callable | None = None) -> list[Tensor]:
        """fn(*inputs) as a list of tensors: replayed when these shapes were captured, else computed
        eagerly by `eager()` (default: fn(*inputs); e.g. the call before its inputs were padded)."""
        key = self.key(name, inputs)
        captured = key in self._sets[0].graphs
        with self._assign_lock:  # workers count side by side
            self.replays += captured
            self.eager += not captured
        if not captured:
            return _tensors(eager() if eager is not None else fn(*inputs))
        return self._mine().replay(key, inputs)

    def _mine(self) -> _GraphSet:
        index = getattr(self._assigned, "index", None)
        if index is None:
            with self._assign_lock:
                index = self._assigned.index = self._next % len(self._sets)
                self._next += 1
        return self._sets[index]

    def __len__(self) -> int:
        return len(self._sets[0].graphs)
