"""CUDA graphs for the fast AR: one graph per (padded batch size, top-k bound).

A frame's fast-AR pass is ~400 small kernels (10 positions x 4 layers, 9 draws) whose shapes
depend only on the batch size, so it is captured once per batch bucket and replayed. Real rows
are copied into the leading rows of static buffers; padding rows repeat row 0 and their
outputs are dropped (they are never request rows). Replay gives the same bits as an eager
pass over the same padded batch.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from intone.engine.sampling import SamplingBatch

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)

FastFn = Callable[[Tensor, Tensor, SamplingBatch], Tensor]


def bucket_for(rows: int) -> int | None:
    return next((b for b in BUCKETS if b >= rows), None)


def pad_rows(t: Tensor, rows: int) -> Tensor:
    """Pad dim 0 to `rows` by repeating row 0 (valid values, so padding can never fault)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t[:1].expand(rows - t.shape[0], *t.shape[1:])])


class _Graph:
    def __init__(self, fn: FastFn, hidden: Tensor, tokens: Tensor, params: SamplingBatch, pool):
        self.hidden, self.tokens = hidden.clone(), tokens.clone()
        self.params = SamplingBatch(
            params.temperature.clone(), params.top_p.clone(), params.top_k.clone(),
            params.repetition_penalty.clone(), params.seeds.clone(), params.steps.clone(), params.max_top_k,
        )
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside the capture (allocator, lazy init)
            fn(self.hidden, self.tokens, self.params)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn(self.hidden, self.tokens, self.params)

    def replay(self, hidden: Tensor, tokens: Tensor, params: SamplingBatch) -> Tensor:
        rows, size = hidden.shape[0], self.hidden.shape[0]
        self.hidden.copy_(pad_rows(hidden, size))
        self.tokens.copy_(pad_rows(tokens, size))
        for name in ("temperature", "top_p", "top_k", "seeds", "steps"):
            getattr(self.params, name).copy_(pad_rows(getattr(params, name), size))
        self.graph.replay()
        return self.out[:rows].clone()


class FastARGraphs:
    """Captures lazily, on the first batch of each bucket; falls back to eager beyond the buckets."""

    def __init__(self, fn: FastFn):
        self.fn = fn
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None

    def __call__(self, hidden: Tensor, tokens: Tensor, params: SamplingBatch) -> Tensor:
        size = bucket_for(hidden.shape[0])
        if size is None or not hidden.is_cuda:
            return self.fn(hidden, tokens, params)
        key = (size, params.max_top_k)
        graph = self._graphs.get(key)
        if graph is None:
            padded = SamplingBatch(*(pad_rows(getattr(params, n), size) for n in (
                "temperature", "top_p", "top_k", "repetition_penalty", "seeds", "steps")), params.max_top_k)
            graph = _Graph(self.fn, pad_rows(hidden, size), pad_rows(tokens, size), padded, self._pool)
            self._pool = graph.graph.pool()
            self._graphs[key] = graph
        return graph.replay(hidden, tokens, params)

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)
