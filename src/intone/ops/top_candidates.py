"""`sampling.best_tokens` as one Triton kernel (CUDA): each row's k best logits' ids, in descending order, equal
logits by ascending id.

torch's top-k over [rows, 4096] keys (`gatherTopK`, a radix select made for long rows) took ~52 us a call on an
H100 at 48 rows, and Fish draws ten times a step (0.5 ms of a 10.8 ms step). Here one program per row makes the
row's keys (`fused.order_keys_eager`'s integers: the float's bits made to order above the reversed id, so every
key is distinct) and keeps the largest with Triton's bitonic top-k in registers; the same keys, so the same ids.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch version is used
    triton = None

MAX_WIDTH = 8192  # the widest row one program sorts (Fish's 4097 semantic logits pad to it)
MAX_K = 64


def available(logits: Tensor, k: int) -> bool:
    return (triton is not None and logits.is_cuda and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[-1] <= MAX_WIDTH and 1 <= k <= min(MAX_K, logits.shape[-1]))


if triton is not None:

    @triton.jit
    def _best(logits_ptr, out_ptr, width, stride, k, WIDTH: tl.constexpr, K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, WIDTH)
        ok = cols < width
        x = tl.load(logits_ptr + row * stride + cols, mask=ok, other=0.0) + 0.0  # -0.0 is 0.0
        bits = x.to(tl.int32, bitcast=True).to(tl.int64)
        order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        keys = order * 4294967296 + (width - 1 - cols).to(tl.int64)
        keys = tl.where(ok, keys, -9223372036854775807 - 1)  # padding: below every key
        best = tl.topk(keys, K)  # [K], descending
        ids = (width - 1) - (best & 0xFFFFFFFF)
        ranks = tl.arange(0, K)
        tl.store(out_ptr + row * k + ranks, ids, mask=ranks < k)


def best_tokens_kernel(logits: Tensor, k: int) -> Tensor:
    """`sampling.best_tokens(logits, k)` for float32 logits [R, V] (V <= MAX_WIDTH, k <= MAX_K): [R, k] int64."""
    rows, width = logits.shape
    out = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    if rows:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        wide = triton.next_power_of_2(width)
        _best[(rows,)](logits, out, width, logits.stride(0), k, WIDTH=wide, K=max(2, triton.next_power_of_2(k)),
                       num_warps=8 if wide >= 4096 else 4)
    return out
