"""The exponential race of `sampling.sample` as one Triton kernel (CUDA): per row, the candidate with
the largest p_i / E_i, E_i = -log(U_i), the uniforms hashed on the fly from the row's key, itself hashed
from the row's seed, step and the draw (`sampling.row_keys`).

The torch version builds the keys with ~35 int64 elementwise kernels over [rows] and every uniform
with ~15 more over [rows, candidates] per draw (Fish draws 11 times a step, so ~550 small kernels of
its ~2,490 a step); this reads the seeds, steps, probabilities and token ids once. It does the
same integer and floating-point operations in the same precisions (hash in 64-bit integers masked
to 32 bits, uniform and log in fp64, the race in the probabilities' dtype), so it picks the same
token; a GPU test checks that against the torch version.

`filtered_race` takes the rest of `sampling.sample` after its sort into one kernel too (the running total,
top-p and top-k, the temperature, the race): ~15 kernels fewer per draw.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
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

    @triton.jit
    def _filtered_race(logits_ptr, idx_ptr, lse_ptr, top_p_ptr, top_k_ptr, temp_ptr, seeds_ptr, steps_ptr, salt,
                       scratch_ptr, out_ptr, k, stride_l, stride_i, BLOCK_N: tl.constexpr):
        """`sampling.sample` after its sort, for one row of at most BLOCK_N candidates (see `filtered_race`)."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        ok = cols < k
        ids = tl.load(idx_ptr + row * stride_i + cols, mask=ok, other=0).to(tl.int64)
        z = tl.load(logits_ptr + row * stride_l + ids, mask=ok, other=float("-inf"))
        lse = tl.load(lse_ptr + row)
        probs = scratch_ptr + row * 2 * BLOCK_N
        tl.store(probs + cols, libdevice.exp(z - lse), mask=ok)
        tl.debug_barrier()
        # the running total left to right, one add at a time (the column scan of `sampling.running_total`)
        total = tl.full([], 0.0, tl.float32)
        for j in range(0, BLOCK_N):
            total = total + tl.load(probs + j, mask=j < k, other=0.0)
            tl.store(probs + BLOCK_N + j, total, mask=j < k)
        tl.debug_barrier()
        cum = tl.load(probs + BLOCK_N + cols, mask=ok, other=0.0)
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        top_k = tl.load(top_k_ptr + row).to(tl.int64)
        temp = tl.maximum(tl.load(temp_ptr + row).to(tl.float32), 1e-5)
        keep = (cols == 0) | (~(cum > top_p) & (cols < top_k))
        scaled = tl.where(keep, libdevice.div_rn(z, temp), float("-inf"))
        first = libdevice.div_rn(tl.load(logits_ptr + row * stride_l + tl.load(idx_ptr + row * stride_i)), temp)
        weight = libdevice.exp(scaled - first)
        key = _row_key(tl.load(seeds_ptr + row).to(tl.int64), tl.load(steps_ptr + row).to(tl.int64),
                       salt.to(tl.int64))
        bits = _mix32(_mix32(key ^ ids) + ids)
        u = ((bits >> 8).to(tl.float64) + 0.5) / 16777216.0
        race = tl.where(ok, libdevice.div_rn(weight, (-tl.log(u)).to(tl.float32)), -1.0)
        at = tl.argmax(race, axis=0)  # the first of equal values, as torch.argmax
        tl.store(out_ptr + row, tl.load(idx_ptr + row * stride_i + at))


def filtered_race(logits: Tensor, idx: Tensor, lse: Tensor, params, draw: int) -> Tensor:
    """`sampling.sample`'s work after its sort, as one kernel: logits [R, V] float32, idx [R, K] the sorted
    candidates (K <= 64 as `sample` calls it), lse [R] the rows' logsumexp over V, params a `SamplingBatch`
    -> [R] ids. The same operations in the same order and precisions as the torch ops it replaces (the running
    total one add at a time; IEEE divisions; libdevice's exp, which torch's CUDA exp is); a GPU test checks the
    tokens."""
    rows, k = idx.shape
    block = max(16, triton.next_power_of_2(k))
    idx = idx.contiguous()
    scratch = torch.empty(rows, 2, block, dtype=torch.float32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _filtered_race[(rows,)](logits, idx, lse.contiguous(), params.top_p.contiguous(), params.top_k.contiguous(),
                            params.temperature.contiguous(), params.seeds.contiguous(), params.steps.contiguous(),
                            draw_salt(draw), scratch, out, k, logits.stride(0), idx.stride(0), BLOCK_N=block,
                            num_warps=1)
    return out


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
