"""CUDA graphs, captured at start-up and only replayed afterwards (invariant 2): the helpers the AR step's
(`step_graphs`) share, and `FunctionGraphs` for a model's fixed-shape functions outside the AR step.

Buckets: a step's rows pad to the next of ROW_BUCKETS and its KV length to the next of KV_BUCKETS, so a
few shapes cover every batch. Every key the engine can meet is captured before it serves, with
nothing else on the GPU; a key without a graph (its capture failed, or it lies beyond the buckets'
bound) runs eagerly over the same padded buffers: the same kernels on the same shapes, the same bits.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from intone.engine.streams import own_stream

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
KV_BUCKETS = (256, 512, 1024, 2048, 4096, 8192)


def bucket(value: int, buckets=ROW_BUCKETS) -> int | None:
    return next((b for b in buckets if b >= value), None)


def head_bound(bounds: tuple, max_top_k: int) -> int | None:
    """The smallest of a head's candidate bounds (None: every token, the last) that holds max_top_k."""
    return next(b for b in bounds if b is None or b >= max_top_k)


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


@dataclass
class CaptureReport:
    graphs: int = 0
    failed: int = 0
    seconds: float = 0.0


def _tensors(tree) -> list[Tensor]:
    return list(tree) if isinstance(tree, (tuple, list)) else [tree]


class _GraphSet:
    """One copy of every captured function: its graphs share a memory pool, so they are replayed
    one at a time (its lock), on whatever stream the replaying thread is on.

    Since no two of its graphs run at once, they share their input and output buffers too: each
    graph's are views of one arena per argument place and dtype, sized by the first capture that
    needs it, so shapes captured largest first share one (a Fish codec graph's state rows are ~4 MB
    a row: one copy of the largest call's, rather than one per captured shape). A graph copies its
    outputs into its views as its last kernels, so the pool keeps none of them."""

    def __init__(self, priority: int):
        self.priority = priority
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[Tensor], list[Tensor]]] = {}
        self.lock = threading.Lock()
        self.last: torch.cuda.Event | None = None
        self.pool = None
        self.capture_stream: torch.cuda.Stream | None = None  # this set's own (see capture_graph)
        self._arenas: dict[tuple, Tensor] = {}

    def _view(self, place: tuple, like: Tensor) -> Tensor:
        """A buffer shaped like `like` at the start of the arena for `place` (grown by a new arena when
        too small: the graphs captured on the old one keep it)."""
        key = (*place, like.dtype, like.device)
        arena = self._arenas.get(key)
        if arena is None or arena.numel() < like.numel():
            arena = self._arenas[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return arena[: like.numel()].view(like.shape)

    def capture(self, key: tuple, fn: Callable, inputs) -> None:
        if self.capture_stream is None:
            self.capture_stream = own_stream(None, "graph set's capture", self.priority)
        # an input of other strides keeps them (a clone of its own): the kernels fn picks may depend on them
        static = [self._view(("in", i), t).copy_(t) if t.is_contiguous() else t.clone() for i, t in enumerate(inputs)]
        outs: list[Tensor] = []

        def run() -> list[Tensor]:
            result = _tensors(fn(*static))
            if not outs:  # the eager run before the capture: the outputs' views, outside the graph's pool
                outs.extend(self._view(("out", i), t) for i, t in enumerate(result))
            for buffer, value in zip(outs, result):
                buffer.copy_(value)
            return outs

        graph, _ = capture_graph(run, self.pool, self.capture_stream)
        self.pool = graph.pool()
        self.graphs[key] = (graph, static, outs)

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
