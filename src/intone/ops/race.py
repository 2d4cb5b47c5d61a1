"""The exponential race of `sampling.sample` as one Triton kernel (CUDA): per row, the candidate with
the largest p_i / E_i, E_i = -log(U_i), the uniforms hashed on the fly from the row's key, itself hashed
from the row's seed, step and the draw (`sampling.row_keys`).

The torch version builds the keys with ~35 int64 elementwise kernels over [rows] and every uniform
with ~15 more over [rows, candidates] per draw (Fish draws 11 times a step, so ~550 small kernels of
its ~2,490 a step); this reads the seeds, steps, probabilities and token ids once. It does the
same integer and floating-point operations in the same precisions (hash in 64-bit integers masked
to 32 bits, uniform and log in fp64, the race in the probabilities' dtype), so it picks the same
token; a GPU test checks that against the torch version.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch version is used
    triton = None

BLOCK = 1024


def available(probs: Tensor) -> bool:
    return triton is not None and probs.is_cuda


if triton is not None:

    @triton.jit
    def _mix32(x):
        x = x & 0xFFFFFFFF
        x = ((x ^ (x >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
        x = ((x ^ (x >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def _row_key(seed, step, salt):
        """`sampling.row_keys` for one row (salt: the draw's term, made on the host)."""
        key = _mix32(_mix32(seed & 0xFFFFFFFF) ^ ((seed >> 32) & 0xFFFFFFFF) ^ 0x9E3779B9)
        key = _mix32(key ^ ((step * 0x27D4EB2F) & 0xFFFFFFFF))
        return _mix32(key ^ salt)

    @triton.jit
    def _race(probs_ptr, idx_ptr, seeds_ptr, steps_ptr, salt, out_ptr, n, stride_p, stride_i,
              BLOCK_N: tl.constexpr):
        row = tl.program_id(0)
        key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), tl.load(steps_ptr + row).to(tl.int64),
                       salt.to(tl.int64))
        best = tl.full([], -1.0, tl.float32)
        best_id = tl.full([], 0, tl.int64)
        for start in range(0, n, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            ok = cols < n
            p = tl.load(probs_ptr + row * stride_p + cols, mask=ok, other=0.0)
            ids = tl.load(idx_ptr + row * stride_i + cols, mask=ok, other=0).to(tl.int64)
            bits = _mix32(_mix32(key ^ ids) + ids)
            u = ((bits >> 8).to(tl.float64) + 0.5) / 16777216.0
            race = p / (-tl.log(u)).to(p.dtype)
            race = tl.where(ok, race, -1.0)
            top = tl.max(race, axis=0)
            at = tl.argmax(race, axis=0)  # the first of equal values, as torch.argmax
            # masked: where a block's valid entries are all NaN, argmax may land on a padding column
            top_id = tl.load(idx_ptr + row * stride_i + start + at, mask=start + at < n, other=0)
            take = top > best  # strict: an earlier block keeps a tie
            best_id = tl.where(take, top_id, best_id)
            best = tl.where(take, top, best)
        tl.store(out_ptr + row, best_id)


def race_argmax(probs: Tensor, idx: Tensor, seeds: Tensor, steps: Tensor, draw: int) -> Tensor:
    """probs [R, N] (float32: probabilities, or any non-negative weights proportional to them), idx [R, N]
    token ids (int64), seeds and steps [R] (integers), the draw's index -> [R] ids."""
    rows, n = probs.shape
    probs, idx = probs.contiguous(), idx.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    # no wider than the candidates (64 for Fish's usual draws): masked lanes would hash and log for nothing
    block = min(BLOCK, max(16, triton.next_power_of_2(n)))
    _race[(rows,)](probs, idx, seeds.contiguous(), steps.contiguous(), draw_salt(draw), out, n, probs.stride(0),
                   idx.stride(0), BLOCK_N=block)
    return out


def draw_salt(draw: int) -> int:
    """The draw's term of a row's key (`sampling.row_keys`); below 2**63 for any draw a model makes."""
    return draw * 0x165667B1 + 0x61C88647
