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
    sees no Python number that changes from call to call). key_starts: where the rows' keys differ from
    their queries (a row's queries over its earlier frames and its own), row i's keys are key slots
    [key_starts[i], key_starts[i + 1]) (bounded by the key count), or with key_used [R] the first key_used[i]
    from key_starts[i] (rows may then share keys, e.g. the query segments of one row its keys, laid out once,
    and the starts need not increase); key_index [K]: each key slot's place in (earlier frames' keys, then
    the call's own), from which the caller lays them out; past_frames [P]: where each earlier frame's key lies
    in the earlier keys the caller is given (None: given in order; e.g. a pool's blocks, gathered by the
    caller's compiled code with the rest); bound: an empty tensor as long as the longest row (for compiled
    callers, a shape rather than a number)."""

    starts: Tensor
    longest: int | None = None
    key_starts: Tensor | None = None
    key_index: Tensor | None = None
    bound: Tensor | None = None
    key_used: Tensor | None = None
    past_frames: Tensor | None = None

    @property
    def keys(self) -> Tensor:
        return self.starts if self.key_starts is None else self.key_starts


def flash_available(q: Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, spans: RowSpans) -> Tensor:
    """q [S, H, D], k, v [K, H, D] -> [S, H, D]: each row's queries over its own keys (softmax scale
    1/sqrt(D)); K = S unless the spans give the keys' own starts."""
    if flash_available(q):
        longest = spans.longest if spans.longest is not None else \
            spans.bound.shape[0] if spans.bound is not None else q.shape[0]
        longest_key = longest if spans.key_starts is None else k.shape[0]
        return torch.ops.aten._flash_attention_forward(q, k, v, spans.starts, spans.keys, longest, longest_key,
                                                       0.0, False, False, seqused_k=spans.key_used)[0]
    out = torch.zeros_like(q)
    bounds, key_bounds = spans.starts.tolist(), spans.keys.tolist()
    key_ends = key_bounds[1:] if spans.key_used is None else \
        [lo + n for lo, n in zip(key_bounds, spans.key_used.tolist())]
    for lo, hi, k_lo, k_hi in zip(bounds[:-1], bounds[1:], key_bounds[:-1], key_ends):
        if hi > lo:
            rows = (y.transpose(0, 1)[None] for y in (q[lo:hi], k[k_lo:k_hi], v[k_lo:k_hi]))
            out[lo:hi] = F.scaled_dot_product_attention(*rows)[0].transpose(0, 1)
    return out
