"""Attention over rows packed end to end, each row attending only to itself (no mask, no padding).

On a GPU in half precision this is FlashAttention's variable-length kernel as torch ships it
(`aten._flash_attention_forward` with cumulative row starts, what nested-tensor SDPA calls): no work on
padding and no per-element mask. Elsewhere each row runs SDPA alone, the exact reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class RowSpans:
    """Packed rows: row i holds slots [starts[i], starts[i + 1]) (int32 [R + 1], from 0 to the slot
    count); longest: no row is longer (the kernel's bound; a shape of the caller's, so compiled code
    sees no Python number that changes from call to call)."""

    starts: Tensor
    longest: int | None = None


def flash_available(q: Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, spans: RowSpans) -> Tensor:
    """q, k, v [S, H, D] -> [S, H, D]: each row's queries over its own keys (softmax scale 1/sqrt(D))."""
    if flash_available(q):
        longest = spans.longest if spans.longest is not None else q.shape[0]
        return torch.ops.aten._flash_attention_forward(q, k, v, spans.starts, spans.starts, longest, longest,
                                                       0.0, False, False)[0]
    out = torch.zeros_like(q)
    bounds = spans.starts.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        rows = (y[lo:hi].transpose(0, 1)[None] for y in (q, k, v))
        out[lo:hi] = F.scaled_dot_product_attention(*rows)[0].transpose(0, 1)
    return out
