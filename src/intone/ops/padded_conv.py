"""A convolution of a zero-padded input, without the padded copy.

The official causal convolutions concatenate zeros before (and after) their input. Where the padding
before is at least the padding after, the convolution's own zero padding, as much on both sides, keeps
the same output grid, and its first outputs are the explicitly padded convolution's (the rest read only
more zeros): the same sums, without a copy of the input per layer.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def padded_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, left: int, right: int = 0, stride: int = 1,
                  dilation: int = 1, groups: int = 1) -> Tensor:
    """F.conv1d(F.pad(x, (left, right)), weight, bias, stride, 0, dilation, groups)."""
    if right > left:
        return F.conv1d(F.pad(x, (left, right)), weight, bias, stride, 0, dilation, groups)
    span = (weight.shape[-1] - 1) * dilation + 1
    frames = (x.shape[-1] + left + right - span) // stride + 1
    return F.conv1d(x, weight, bias, stride, left, dilation, groups)[..., :frames]
