"""CUDA graphs for the talker's pure decode steps, keyed by (padded rows, KV-length bucket).

An eager talker step is ~1000 small kernels (24 layers), so at any batch size it costs what
launching them costs. A decode step (one new token per request) has static shapes once the
rows are padded to a bucket and the keys to a KV-length bucket, so it is captured once per
key and replayed. Attention in the graph reads each row's blocks up to the bucket and masks
beyond the row's length; padding rows write their keys to the cache's scratch slot and their
logits are dropped. Prefill and mixed steps, and batches beyond the buckets, run eagerly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from intone.engine.attention import AttentionMetadata
from intone.engine.kv_cache import KVCache

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
KV_BUCKETS = (256, 512, 1024, 2048, 4096, 8192)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, seq_lens: Tensor) -> Tensor:
    """q [B, H, D] over each row's first seq_lens cached keys (tables [B, n_blocks]) -> [B, H, D]."""
    keys = k_cache[tables].flatten(1, 2).to(q.dtype)  # [B, S, H_kv, D]
    values = v_cache[tables].flatten(1, 2).to(q.dtype)
    b, s, h_kv, d = keys.shape
    qg = q.view(b, h_kv, -1, d)
    scores = torch.einsum("bhgd,bshd->bhgs", qg, keys) * d**-0.5
    valid = torch.arange(s, device=q.device) < seq_lens.unsqueeze(1)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgs,bshd->bhgd", torch.softmax(scores, dim=-1), values)
    return out.reshape(b, -1, d)


def _bucket(value: int, buckets) -> int | None:
    return next((b for b in buckets if b >= value), None)


class _DecodeGraph:
    def __init__(self, talker, kv: KVCache, rows: int, kv_tokens: int, pool):
        dev, block = kv.k.device, kv.block_size
        self.x = torch.zeros(rows, talker.shape.hidden_size, dtype=kv.k.dtype, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.slots = torch.full((rows,), kv.scratch_slot, dtype=torch.int64, device=dev)
        self.tables = torch.full((rows, kv_tokens // block), kv.num_blocks, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(rows, dtype=torch.int64, device=dev)

        def run():
            return talker.decode_step(self.x, self.positions, self.slots, self.tables, self.seq_lens, kv)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the capture (allocator, lazy init)
            run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = run()
        self.scratch_slot, self.scratch_block = kv.scratch_slot, kv.num_blocks

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
        return self.logits[:r]


class TalkerGraphs:
    """Captures lazily, on the first decode batch of each (rows, KV length) bucket."""

    def __init__(self, talker):
        self.talker = talker
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._pool = None
        self._kv: KVCache | None = None

    def __call__(self, x: Tensor, meta: AttentionMetadata, kv: KVCache) -> Tensor | None:
        """Logits [R, V] from a graph, or None when this step is not a graph-able decode."""
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
        graph = self._graphs.get((rows, kv_tokens))
        if graph is None:
            graph = self._graphs[(rows, kv_tokens)] = _DecodeGraph(self.talker, kv, rows, kv_tokens, self._pool)
            self._pool = graph.graph.pool()
        return graph.replay(x, meta).clone()

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)
