"""Building blocks shared by the slow AR, the fast AR and the codec transformer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """Normalises in fp32, casts back, then scales: the official order (it matters in bf16)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 (fp64 stays fp64)
        normed = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def rope_table(positions: int | Tensor, head_dim: int, base: float) -> Tensor:
    """cos/sin per (position, pair) as [..., P, head_dim/2, 2], for positions 0..P-1 or the given ones.

    The values are rounded to bf16 even for fp32 models, as the official code does; the
    rounded values are kept in fp32 so the rotation itself runs in fp32. Skipping the
    rounding moves the logits by ~3e-2 and was seen to cause early or missing EOS.
    """
    if isinstance(positions, int):
        positions = torch.arange(positions)
    exponents = torch.arange(0, head_dim, 2, device=positions.device)[: head_dim // 2].float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    angles = positions.float().unsqueeze(-1) * inv_freq  # == torch.outer for 1-D positions
    # polar, not cos/sin: their fp32 results can differ by an ulp, which can flip a bf16 rounding.
    cis = torch.polar(torch.ones_like(angles), angles)
    table = torch.stack([cis.real, cis.imag], dim=-1)
    return table.to(torch.bfloat16).float()


def apply_rope(x: Tensor, table: Tensor) -> Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) — GPT-J style, not NeoX halves.

    x: [..., T, H, D]; table: [..., T, D/2, 2] (already gathered at x's positions).
    """
    compute = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 models
    xs = x.to(compute).reshape(*x.shape[:-1], -1, 2)
    cos = table[..., 0].unsqueeze(-2).to(compute)  # [T, 1, D/2]
    sin = table[..., 1].unsqueeze(-2).to(compute)
    x0, x1 = xs[..., 0], xs[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1)
    return out.flatten(-2).type_as(x)
