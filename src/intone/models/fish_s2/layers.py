"""Building blocks shared by the slow AR, the fast AR and the codec transformer."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from intone.ops import fused
from intone.ops.joined_linear import JoinedLinear, join_linears


class RMSNorm(nn.Module):
    """Normalises in fp32 (fp64 stays fp64), casts back, then scales: the official order (it matters
    in bf16). fusable: the AR's norms follow `ops.fused`'s switch; the codec's stay eager."""

    def __init__(self, dim: int, eps: float, fusable: bool = False):
        super().__init__()
        self.eps, self.fusable = eps, fusable
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        norm = fused.rms_norm if self.fusable else fused.rms_norm_eager
        return norm(x, self.weight, self.eps, torch.promote_types(x.dtype, torch.float32))

    def add(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """(x + y, this norm of it), in one kernel where the AR's pieces are fused."""
        add_norm = fused.add_rms_norm if self.fusable else fused.add_rms_norm_eager
        return add_norm(x, y, self.weight, self.eps, torch.promote_types(x.dtype, torch.float32))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, fusable: bool = False):
        super().__init__()
        self.fusable = fusable
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w13: JoinedLinear | None = None  # w1 and w3 as one GEMM (`join`)

    def join(self) -> None:
        """w1 and w3 as one GEMM from now on (`ops.joined_linear`; once the weights are where they run)."""
        self.w13 = join_linears(self.w1, self.w3)

    def forward(self, x: Tensor) -> Tensor:
        gate = fused.silu_mul if self.fusable else fused.silu_mul_eager
        return self.w2(gate(*(self.w13(x) if self.w13 is not None else (self.w1(x), self.w3(x)))))


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


# Rotate interleaved pairs (x[2i], x[2i+1]), GPT-J style, not NeoX halves; x [..., T, H, D], table
# [..., T, D/2, 2] gathered at x's positions. The codec's (always eager); the AR calls ops.fused.rope_pairs.
apply_rope = fused.rope_pairs_eager
