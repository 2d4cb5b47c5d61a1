"""A Triton kernel for one query row over its paged keys (the static decode attention on CUDA).

Each program takes one row and one KV head: the row's G query heads of that group attend to the
row's first `seq_len` keys, gathered from its block table a tile at a time with an online softmax
in fp32; scores and the weighted sum are tensor-core products (weights rounded to the cache dtype
for the second, as flash attention does). It reads only the keys a row owns (not the whole
KV-length bucket), and its grid and loop bounds come from tensors, so it runs the same inside a
CUDA graph. A prefill runs through it too, one row per prompt token (seq_len = position + 1 gives
the causal mask). The products have at least 16 rows (tensor cores); a row's G query heads fill
G of them, so a run of 16 / G rows of one prompt (G = 4: 4 rows) shares one program and reads its
keys once (`use_prompt_runs`): a prompt's attention reads a quarter of the keys.

With `use_splits(n)` (the profile's `ar.decode_splits`, n > 1) each (row, KV head) is split into n
programs over consecutive spans of the row's keys, each keeping its own running max, sum and
weighted values, and a second kernel merges them (flash-decoding): a step of ~50 rows over 2 KV heads
is ~100 programs for 132 SMs otherwise. The split count is fixed per process, never per batch, so a
row gets the same bits whatever shares its step.
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


_splits = 1
_prompt_runs = True


def use_prompt_runs(on: bool) -> None:
    """Whether a run of a prompt's rows shares one program (the product rows its query heads leave
    as padding, filled by its next rows); off: one program per row (diagnostics: the same bits)."""
    global _prompt_runs
    _prompt_runs = on


def use_splits(n: int) -> None:
    """Key spans per (row, KV head) for every decode attention in this process (1: one program each;
    a power of two up to 16, as the merge kernel's arange needs)."""
    global _splits
    if n not in (1, 2, 4, 8, 16):
        raise ValueError(f"decode splits must be 1, 2, 4, 8 or 16, not {n}")
    _splits = n


def available(q: Tensor) -> bool:
    return triton is not None and q.is_cuda


if triton is not None:

    @triton.jit
    def _paged_decode(q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, out_ptr, scale, n_rows,
                      stride_qb, stride_qh, stride_kblock, stride_kslot, stride_kh, stride_tb, stride_ob, stride_oh,
                      BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                      QROWS: tl.constexpr, ROWS: tl.constexpr, TILE_K: tl.constexpr, PRECISION: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq_len = tl.load(seq_lens_ptr + row)
        # A run of ROWS rows of one prompt (consecutive positions, the same block holding the run's last key)
        # is taken by its first row's program, whose product rows are then its rows' query heads rather than
        # padding; the run's other programs have nothing to do. A row's bits are the same either way: its
        # product row sees the same keys, and the tiles past its own keys add exactly nothing.
        lead = row - row % ROWS
        last = tl.minimum(lead + ROWS - 1, n_rows - 1)
        last_len = tl.load(seq_lens_ptr + last)
        blk = (last_len - 1) // BLOCK_SIZE
        same_block = tl.load(tables_ptr + lead * stride_tb + blk) == tl.load(tables_ptr + last * stride_tb + blk)
        consecutive = last_len == tl.load(seq_lens_ptr + lead) + ROWS - 1
        run = (ROWS > 1) & (last == lead + ROWS - 1) & same_block & consecutive
        first = tl.where(run, lead, row)
        n_here = tl.where(run, ROWS, 1)
        keys = tl.where(run, tl.where(row == lead, last_len, 0), seq_len)  # the program's key span (0: none)
        table_row = tl.where(run, last, row)
        j = tl.arange(0, QROWS)
        r, g = j // GROUP_P2, j % GROUP_P2
        d = tl.arange(0, HEAD_DIM)
        q_ok = (g < GROUP) & (r < n_here) & (keys > 0)
        q_rows = first + r
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + q_rows[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=q_ok[:, None], other=0.0)
        # each product row's own keys (a padding row: the program's, as a lone row's padding always had)
        q_len = tl.load(seq_lens_ptr + q_rows, mask=r < n_here, other=0)
        q_len = tl.where(r < n_here, q_len, keys)
        m = tl.full([QROWS], float("-inf"), tl.float32)
        l = tl.zeros([QROWS], tl.float32)
        acc = tl.zeros([QROWS, HEAD_DIM], tl.float32)
        for t in range(0, tl.cdiv(keys, TILE_K)):
            pos = t * TILE_K + tl.arange(0, TILE_K)
            valid = pos < keys
            block = tl.load(tables_ptr + table_row * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0)
            base = block * stride_kblock + (pos % BLOCK_SIZE) * stride_kslot + kv_head * stride_kh
            k = tl.load(k_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [ROWS * G, TILE] fp32
            s = tl.where(pos[None, :] < q_len[:, None], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / l[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_ok[:, None])

    @triton.jit
    def _paged_decode_split(q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, acc_ptr, ml_ptr, scale,
                            stride_qb, stride_qh, stride_kblock, stride_kslot, stride_kh, stride_tb,
                            BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                            GROUP_PAD: tl.constexpr, TILE_K: tl.constexpr, PRECISION: tl.constexpr,
                            SPLITS: tl.constexpr):
        """One span of a row's keys: unnormalised weighted values acc [H, SPLITS, D] and (max, sum)
        ml [H, SPLITS, 2] per query head, fp32 (a span past the row's keys leaves max -inf, sum 0).
        Its tile loop is `_paged_decode`'s for one row; they become one jit helper once a GPU run can
        check that the default kernel keeps its bits through that change."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + row)
        span = tl.cdiv(tl.cdiv(seq_len, SPLITS), TILE_K) * TILE_K  # whole tiles, so spans never overlap
        start = split * span
        end = tl.minimum(start + span, seq_len)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        g_ok = g < GROUP
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for t in range(0, tl.cdiv(tl.maximum(end - start, 0), TILE_K)):
            pos = start + t * TILE_K + tl.arange(0, TILE_K)
            valid = pos < end
            block = tl.load(tables_ptr + row * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0)
            base = block * stride_kblock + (pos % BLOCK_SIZE) * stride_kslot + kv_head * stride_kh
            k = tl.load(k_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        n_heads = tl.num_programs(1) * GROUP
        slot = (row * n_heads + heads) * SPLITS + split  # [G]
        # An empty span (past the row's keys) writes only its (max -inf, sum 0): a prefill's rows are
        # mostly short, and their accumulators would otherwise be most of the traffic.
        tl.store(acc_ptr + slot[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & (start < seq_len))
        tl.store(ml_ptr + slot * 2, m, mask=g_ok)
        tl.store(ml_ptr + slot * 2 + 1, l, mask=g_ok)

    @triton.jit
    def _merge_splits(acc_ptr, ml_ptr, out_ptr, stride_ob, stride_oh,
                      HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
        """One (row, query head): the spans' partial softmaxes merged into the attention output."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        slot = (row * tl.num_programs(1) + head) * SPLITS + tl.arange(0, SPLITS)
        m = tl.load(ml_ptr + slot * 2)
        l = tl.load(ml_ptr + slot * 2 + 1)
        d = tl.arange(0, HEAD_DIM)
        has_keys = m > float("-inf")
        acc = tl.load(acc_ptr + slot[:, None] * HEAD_DIM + d[None, :], mask=has_keys[:, None], other=0.0)
        top = tl.max(m, axis=0)  # finite: a row has at least one key, so some span has one
        w = tl.where(has_keys, tl.exp(m - top), 0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
        tl.store(out_ptr + row * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, seq_lens: Tensor) -> Tensor:
    """q [B, H, D]; caches [blocks, block_size, H_kv, D]; tables [B, n_blocks]; seq_lens [B] (>= 1) -> [B, H, D]."""
    b, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    if _splits > 1:
        return _split_decode(q, k_cache, v_cache, tables, seq_lens, out, group)
    group_p2 = triton.next_power_of_2(group)
    _paged_decode[(b, kv_heads)](
        q, k_cache, v_cache, tables, seq_lens, out, dim**-0.5, b,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, HEAD_DIM=dim, GROUP=group, GROUP_P2=group_p2,
        QROWS=max(MIN_DOT_ROWS, group_p2), ROWS=max(1, MIN_DOT_ROWS // group_p2) if _prompt_runs else 1,
        TILE_K=TILE.get(k_cache.dtype, DEFAULT_TILE), PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
    )
    return out


def _split_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, seq_lens: Tensor, out: Tensor,
                  group: int) -> Tensor:
    """`paged_decode_attention` over `_splits` key spans per (row, KV head), merged by a second kernel."""
    b, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    acc = torch.empty(b, heads, _splits, dim, device=q.device, dtype=torch.float32)
    ml = torch.empty(b, heads, _splits, 2, device=q.device, dtype=torch.float32)
    _paged_decode_split[(b, kv_heads, _splits)](
        q, k_cache, v_cache, tables, seq_lens, acc, ml, dim**-0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        BLOCK_SIZE=block_size, HEAD_DIM=dim, GROUP=group, GROUP_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        TILE_K=TILE.get(k_cache.dtype, DEFAULT_TILE), PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        SPLITS=_splits,
    )
    _merge_splits[(b, heads)](acc, ml, out, out.stride(0), out.stride(1), HEAD_DIM=dim, SPLITS=_splits)
    return out
