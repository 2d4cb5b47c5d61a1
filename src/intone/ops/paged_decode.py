"""A Triton kernel for one query row over its paged keys (the static decode attention on CUDA).

Each program takes one row and one KV head: the row's G query heads of that group attend to the
row's first `seq_len` keys, gathered from its block table a tile at a time with an online softmax
in fp32; scores and the weighted sum are tensor-core products (weights rounded to the cache dtype
for the second, as flash attention does). It reads only the keys a row owns (not the whole
KV-length bucket), and its grid and loop bounds come from tensors, so it runs the same inside a
CUDA graph. A prefill runs through it
too, one row per prompt token (seq_len = position + 1 gives the causal mask).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path is used
    triton = None

# Keys per loop iteration. The group's query heads are padded to 16 rows so that both products run
# on tensor cores (tl.dot); an fp32 cache multiplies in full fp32 ("ieee"), never TF32.
TILE = {torch.float32: 32}
DEFAULT_TILE = 64
MIN_DOT_ROWS = 16


def available(q: Tensor) -> bool:
    return triton is not None and q.is_cuda


if triton is not None:

    @triton.jit
    def _paged_decode(q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, out_ptr, scale,
                      stride_qb, stride_qh, stride_kblock, stride_kslot, stride_kh, stride_tb, stride_ob, stride_oh,
                      BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                      TILE_K: tl.constexpr, PRECISION: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq_len = tl.load(seq_lens_ptr + row)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        g_ok = g < GROUP
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for t in range(0, tl.cdiv(seq_len, TILE_K)):
            pos = t * TILE_K + tl.arange(0, TILE_K)
            valid = pos < seq_len
            block = tl.load(tables_ptr + row * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0)
            base = block * stride_kblock + (pos % BLOCK_SIZE) * stride_kslot + kv_head * stride_kh
            k = tl.load(k_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G, TILE] fp32
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / l[:, None]
        tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, seq_lens: Tensor) -> Tensor:
    """q [B, H, D]; caches [blocks, block_size, H_kv, D]; tables [B, n_blocks]; seq_lens [B] (>= 1) -> [B, H, D]."""
    b, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    _paged_decode[(b, kv_heads)](
        q, k_cache, v_cache, tables, seq_lens, out, dim**-0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, HEAD_DIM=dim, GROUP=group, GROUP_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        TILE_K=TILE.get(k_cache.dtype, DEFAULT_TILE), PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
    )
    return out
