"""CUDA graphs for pure decode steps, keyed by (padded rows, KV-length bucket) (design invariant 2).

An eager decode step of a deep transformer is hundreds to thousands of small kernels, so at any
batch size it costs what launching them costs. A decode step (one new token per request) has
static shapes once the rows are padded to a bucket and the keys to a KV-length bucket, so it is
captured once per key and replayed. Attention in the graph reads each row's blocks up to the
bucket and masks beyond the row's length; padding rows (and rows left from a larger batch) write
their keys to the cache's scratch slot, and their outputs are dropped. Prefill and mixed steps,
and batches beyond the buckets, run eagerly.

`decode_fn(x [B, D], positions [B], slots [B], tables [B, n_blocks], seq_lens [B], kv) -> [B, ...]`
is the model's static-shape decode step.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import Tensor

from intone.engine.attention import AttentionMetadata
from intone.engine.kv_cache import KVCache

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
KV_BUCKETS = (256, 512, 1024, 2048, 4096, 8192)

DecodeFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, KVCache], Tensor]


def _bucket(value: int, buckets) -> int | None:
    return next((b for b in buckets if b >= value), None)


class _DecodeGraph:
    def __init__(self, fn: DecodeFn, kv: KVCache, rows: int, width: int, dtype, kv_tokens: int, pool):
        dev, block = kv.k.device, kv.block_size
        self.scratch_slot, self.scratch_block = kv.scratch_slot, kv.num_blocks
        self.x = torch.zeros(rows, width, dtype=dtype, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.slots = torch.full((rows,), kv.scratch_slot, dtype=torch.int64, device=dev)
        self.tables = torch.full((rows, kv_tokens // block), kv.num_blocks, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(rows, dtype=torch.int64, device=dev)

        def run():
            return fn(self.x, self.positions, self.slots, self.tables, self.seq_lens, kv)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture (allocator, lazy init)
            run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = run()

    def replay(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
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
        self.graph.replay()
        return self.out[:r]


class DecodeGraphs:
    """Captures lazily, on the first decode batch of each (rows, KV length) bucket."""

    def __init__(self, fn: DecodeFn):
        self.fn = fn
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._pool = None
        self._kv: KVCache | None = None

    def __call__(self, x: Tensor, meta: AttentionMetadata, kv: KVCache) -> Tensor | None:
        """The step's output for each row, or None when this step is not a graph-able decode."""
        if meta.max_seqlen_q != 1 or not x.is_cuda:
            return None
        if kv is not self._kv:  # graphs read and write the cache they were captured with
            self._graphs.clear()
            self._pool, self._kv = None, kv
        rows = _bucket(x.shape[0], ROW_BUCKETS)
        kv_tokens = _bucket(meta.max_seqlen_k, KV_BUCKETS)
        if rows is None or kv_tokens is None:
            return None
        kv_tokens = -(-kv_tokens // kv.block_size) * kv.block_size
        key = (rows, kv_tokens)
        if key not in self._graphs:
            try:
                graph = _DecodeGraph(self.fn, kv, rows, x.shape[1], x.dtype, kv_tokens, self._pool)
                self._pool = graph.graph.pool()
            except Exception:  # e.g. out of memory: this shape runs eagerly instead of failing the batch
                log.exception("cannot capture a decode graph for %s; running it eagerly", key)
                graph = None
            self._graphs[key] = graph
        graph = self._graphs[key]
        return graph.replay(x, meta).clone() if graph is not None else None

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(k for k, g in self._graphs.items() if g is not None)
