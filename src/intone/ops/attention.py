"""Attention over a paged KV cache, driven by an explicit batch descriptor.

Tokens of all scheduled requests are packed along one axis (no padding rows):
request r owns tokens `cu_seqlens_q[r]:cu_seqlens_q[r+1]`. `cu_seqlens_q` has exactly
`num_reqs + 1` strictly increasing entries (design invariant 2).

`paged_attention` here is the reference implementation (gather, pad, SDPA). It is exact
and runs anywhere; faster kernels must match it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from intone.ops import paged_decode


@dataclass
class AttentionMetadata:
    cu_seqlens_q: Tensor  # [R+1] int64, strictly increasing, starts at 0
    seq_lens: Tensor  # [R] int64: KV length of each request after this step
    block_tables: Tensor  # [R, max_blocks] int64 (unused slots are 0)
    slot_mapping: Tensor  # [T] int64: cache slot (block * block_size + offset) per token
    positions: Tensor  # [T] int64: absolute position per token
    token_request: Tensor  # [T] int64: request row of each token
    token_index: Tensor  # [T] int64: index of each token within its request's query
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def last_token_rows(self) -> Tensor:
        return self.cu_seqlens_q[1:] - 1

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """From the real scheduled batch: per request, new tokens and tokens already cached."""
        arrays, max_q, max_k = cls.host_arrays(query_lens, context_lens, block_tables, block_size)
        return cls.of({k: torch.as_tensor(v, device=device) for k, v in arrays.items()}, max_q, max_k)

    @staticmethod
    def host_arrays(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                    block_size: int) -> tuple[dict[str, np.ndarray], int, int]:
        """The descriptor's fields as host arrays (int64), with max_seqlen_q and max_seqlen_k."""
        q = np.asarray(query_lens, dtype=np.int64)
        ctx = np.asarray(context_lens, dtype=np.int64)
        if not len(q) or q.min() < 1:
            raise ValueError("every scheduled request needs at least one query token")
        cu = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        token_request = np.repeat(np.arange(len(q), dtype=np.int64), q)
        token_index = np.arange(cu[-1], dtype=np.int64) - cu[token_request]
        positions = ctx[token_request] + token_index
        tables = np.zeros((len(q), max(len(t) for t in block_tables)), dtype=np.int64)
        for row, table in enumerate(block_tables):
            tables[row, : len(table)] = table
        seq_lens = q + ctx
        short = np.flatnonzero(seq_lens > np.array([len(t) for t in block_tables]) * block_size)
        if short.size:
            r = int(short[0])
            raise ValueError(f"request row {r}: {len(block_tables[r])} KV blocks cannot hold {seq_lens[r]} tokens")
        slots = tables[token_request, positions // block_size] * block_size + positions % block_size
        arrays = dict(cu_seqlens_q=cu, seq_lens=seq_lens, block_tables=tables, slot_mapping=slots,
                      positions=positions, token_request=token_request, token_index=token_index)
        return arrays, int(q.max()), int(seq_lens.max())

    @classmethod
    def of(cls, tensors: dict[str, Tensor], max_seqlen_q: int, max_seqlen_k: int) -> "AttentionMetadata":
        """From `host_arrays`' fields made tensors (e.g. by `ops.staging`)."""
        return cls(**tensors, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def store_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """k_cache: [num_blocks, block_size, H_kv, D]; k: [T, H_kv, D]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> Tensor:
    """Causal attention of packed queries q [T, H, D] over each request's cached keys."""
    num_reqs, block_size = meta.num_reqs, k_cache.shape[1]
    n_blocks = -(-meta.max_seqlen_k // block_size)
    tables = meta.block_tables[:, :n_blocks]
    # [R, n_blocks * block_size, H_kv, D] -> [R, H_kv, S, D]
    keys = k_cache[tables].flatten(1, 2)[:, : meta.max_seqlen_k].transpose(1, 2)
    values = v_cache[tables].flatten(1, 2)[:, : meta.max_seqlen_k].transpose(1, 2)

    heads, dim = q.shape[1], q.shape[2]
    q_pad = q.new_zeros(num_reqs, meta.max_seqlen_q, heads, dim)
    q_pad[meta.token_request, meta.token_index] = q
    # Padded query rows attend to key 0 only; their output is dropped below.
    q_pos = torch.zeros(num_reqs, meta.max_seqlen_q, dtype=torch.int64, device=q.device)
    q_pos[meta.token_request, meta.token_index] = meta.positions
    key_pos = torch.arange(meta.max_seqlen_k, device=q.device)
    mask = key_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)  # [R, Q, S]

    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if q.is_cuda:
        # With a mask, SDPA would pick cuDNN, which builds a new plan whenever the KV length
        # changes (every step): ~2 ms of host time per layer call. The memory-efficient kernel
        # has no such cost; it takes no GQA flag, so the KV heads are repeated first.
        group = heads // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), keys, values, attn_mask=mask.unsqueeze(1))
    else:
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), keys, values, attn_mask=mask.unsqueeze(1), enable_gqa=heads != keys.shape[1],
        )
    return out.transpose(1, 2)[meta.token_request, meta.token_index]


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, seq_lens: Tensor) -> Tensor:
    """One query per row, static shapes (for CUDA-graph capture): q [B, H, D] over each row's first
    seq_lens keys in its blocks `tables` [B, n_blocks] (n_blocks may exceed what the row uses) -> [B, H, D].

    On CUDA this is the Triton kernel of `paged_decode` (it reads only the keys each row owns);
    elsewhere the reference below.
    """
    if paged_decode.available(q):
        return paged_decode.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens)
    return decode_attention_reference(q, k_cache, v_cache, tables, seq_lens)


def decode_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor,
                               seq_lens: Tensor) -> Tensor:
    """The exact reference of decode_attention: gather every block of the table, mask, fp32.

    Grouped heads are handled by the einsum itself: repeating the KV heads for SDPA (as the eager
    path does) made a 64-row CosyVoice3 decode step 2.1x slower (18.5 vs 8.75 ms, H200). Scores and
    softmax run in fp32 whatever the cache dtype, and never in TF32 (the eager kernel does not use
    it), so a profile's TF32 setting cannot make graphed and eager steps disagree.
    """
    keys = k_cache[tables].flatten(1, 2)  # [B, S, H_kv, D]
    values = v_cache[tables].flatten(1, 2)
    b, s, h_kv, d = keys.shape
    compute = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(compute).view(b, h_kv, -1, d)
    valid = torch.arange(s, device=q.device) < seq_lens.unsqueeze(1)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        scores = torch.einsum("bhgd,bshd->bhgs", qg, keys.to(compute)) * d**-0.5
        weights = torch.softmax(scores.masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1)
        out = torch.einsum("bhgs,bshd->bhgd", weights, values.to(compute))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out.reshape(b, -1, d).to(q.dtype)
