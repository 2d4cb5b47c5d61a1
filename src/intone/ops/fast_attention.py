"""Fish's fast-AR attention (a query of one or two positions over at most `num_codebooks` keys) as one Triton
kernel (CUDA): the new keys and values written into the step's cache and the attention over the cache, per
(row, KV head) program.

In torch each layer's call is two cache writes and an SDPA call that cuDNN runs with a kernel made for long
sequences: ~12 us a call at 48 rows on an H100 (~40 us for the two-position first call), 36 calls a step, ~0.56 ms
of a 10.8 ms step for attention over at most ten keys. Both products here are fp32 sums of fp32 products (the
first one's exact: products of two bf16 values), the softmax in fp32 and the probabilities kept in fp32 for the
second product (flash attention rounds them to the inputs' type first): the same sums as SDPA's math on the same
inputs, to float rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: SDPA is used
    triton = None


def available(q: Tensor) -> bool:
    return triton is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.dim() == 4


if triton is not None:

    @triton.jit
    def _attend(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, out_ptr, position, scale,
                q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh, c_sb, c_ss, c_sh, o_sb, o_st, o_sh,
                T: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, SLOTS: tl.constexpr, ROWS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        d = tl.arange(0, D)
        s = tl.arange(0, SLOTS)
        for t in tl.static_range(T):  # this call's keys and values into the cache
            kn = tl.load(k_ptr + b * k_sb + t * k_st + g * k_sh + d)
            vn = tl.load(v_ptr + b * v_sb + t * v_st + g * v_sh + d)
            tl.store(kc_ptr + b * c_sb + (position + t) * c_ss + g * c_sh + d, kn)
            tl.store(vc_ptr + b * c_sb + (position + t) * c_ss + g * c_sh + d, vn)
        # the keys: earlier positions from the cache, this call's from its inputs (no read of what was just stored)
        old = (s < position)[:, None]
        new = ((s >= position) & (s < position + T))[:, None]
        t_of = tl.where(s >= position, s - position, 0)[:, None]
        cache_at = b * c_sb + s[:, None] * c_ss + g * c_sh + d[None, :]
        keys = tl.load(kc_ptr + cache_at, mask=old, other=0.0) + \
            tl.load(k_ptr + b * k_sb + t_of * k_st + g * k_sh + d[None, :], mask=new, other=0.0)
        values = tl.load(vc_ptr + cache_at, mask=old, other=0.0) + \
            tl.load(v_ptr + b * v_sb + t_of * v_st + g * v_sh + d[None, :], mask=new, other=0.0)
        r = tl.arange(0, ROWS)  # (position t, head of the group) per row, padded
        live = r < T * GROUP
        t_q = r // GROUP
        head = g * GROUP + r % GROUP
        q = tl.load(q_ptr + b * q_sb + t_q[:, None] * q_st + head[:, None] * q_sh + d[None, :], mask=live[:, None],
                    other=0.0)
        # fp32 products of the bf16 inputs (exact) summed in fp32, as tensor cores sum them; "ieee": no TF32 rounding
        scores = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee") * scale
        scores = tl.where(s[None, :] <= (position + t_q)[:, None], scores, float("-inf"))
        p = tl.exp(scores - tl.max(scores, axis=1)[:, None])
        out = tl.dot(p, values.to(tl.float32), input_precision="ieee") / tl.sum(p, axis=1)[:, None]
        tl.store(out_ptr + b * o_sb + t_q[:, None] * o_st + head[:, None] * o_sh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def attend(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, position: int) -> Tensor:
    """q [B, T, H, D], k and v [B, T, H_kv, D] at positions position.. (T > 1 only from position 0, causal);
    k_cache and v_cache [B, slots, H_kv, D] take them -> the attention over slots 0.. [B, T, H, D]."""
    b, t, heads, dim = q.shape
    kv_heads, slots = k.shape[2], k_cache.shape[1]
    if position + t > slots or heads % kv_heads or any(x.stride(-1) != 1 for x in (q, k, v, k_cache, v_cache)) \
            or k_cache.stride() != v_cache.stride():
        raise ValueError("fast_attention.attend: positions past the cache, uneven groups or strided heads")
    out = torch.empty(b, t, heads, dim, dtype=q.dtype, device=q.device)
    group = heads // kv_heads
    _attend[(b, kv_heads)](
        q, k, v, k_cache, v_cache, out, position, dim ** -0.5,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *out.stride()[:3],
        T=t, GROUP=group, D=dim, SLOTS=max(16, triton.next_power_of_2(slots)),
        ROWS=max(16, triton.next_power_of_2(t * group)))
    return out
