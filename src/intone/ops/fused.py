"""The AR models' per-layer elementwise pieces (RMSNorm, a residual add with the RMSNorm after it, RoPE, the
per-head norms of queries and keys with their RoPE, SwiGLU's gate, the sampler's sort keys) behind one switch.

By default they run as plain PyTorch in the official op order (several kernels each). With
`use_compiled(True)` (the profile's `ar.fuse_elementwise`, GPU only) the same functions run through
torch.compile, which fuses each into one kernel: the runner captures those kernels in its graphs like
any other, so a decode step launches far fewer of them. The maths is the same, rounded where the eager
code casts (inductor would otherwise keep fp32 between ops: `emulate_precision_casts`); a fused
reduction may sum in another order, so results can differ in the last bit. Only the AR models call these; codecs
keep the eager functions (they run on other threads, where compiling at run time would race).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from intone.ops.compiling import compile_settings


def rms_norm_eager(x: Tensor, weight: Tensor, eps: float, compute: torch.dtype) -> Tensor:
    """Normalised in `compute`, cast back to x's dtype, then scaled."""
    xf = x.to(compute)
    normed = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


def add_rms_norm_eager(x: Tensor, y: Tensor, weight: Tensor, eps: float, compute: torch.dtype) -> tuple[Tensor, Tensor]:
    """(x + y, its RMSNorm): a residual add and the norm that reads it, one kernel when compiled."""
    s = x + y
    return s, rms_norm_eager(s, weight, eps, compute)


def rope_pairs_eager(x: Tensor, table: Tensor) -> Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]), GPT-J style, in fp32 (fp64 for fp64 models).

    x: [..., T, H, D]; table: [..., T, D/2, 2] (cos, sin at x's positions)."""
    return rotate_pairs(x, *rope_pairs_factors(table, x.dtype))


def rope_pairs_factors(table: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`rope_pairs_eager`'s (cos, sin) [..., T, 1, D/2] for inputs of `dtype`: made once, they serve every layer."""
    compute = torch.promote_types(dtype, torch.float32)
    return table[..., 0].unsqueeze(-2).to(compute), table[..., 1].unsqueeze(-2).to(compute)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`rope_pairs_eager` with its factors made (`rope_pairs_factors`)."""
    xs = x.to(cos.dtype).reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xs[..., 0], xs[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1)
    return out.flatten(-2).type_as(x)


def qk_norm_rope_eager(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                       table: Tensor) -> tuple[Tensor, Tensor]:
    """Queries and keys [..., T, H, D] each RMS-normed per head (torch's `rms_norm`, as `nn.RMSNorm`), then
    rotated (`rope_pairs_eager`): four pieces eager, one compiled."""
    q = F.rms_norm(q, q.shape[-1:], q_weight, eps)
    k = F.rms_norm(k, k.shape[-1:], k_weight, eps)
    return rope_pairs_eager(q, table), rope_pairs_eager(k, table)


def rope_halves_eager(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NeoX/Qwen2 halves in x's dtype. x [T, H, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def silu_mul_eager(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def order_keys_eager(logits: Tensor) -> Tensor:
    """float32 [..., V] -> int64 keys in the logits' order, equal logits by ascending id (`sampling.best_tokens`):
    the float's bits made to order as a signed integer (negative floats: larger magnitude, smaller key) above
    the reversed id. Exact integer work, so compiled and eager give the same keys."""
    bits = (logits + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 is 0.0, whose bits differ
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ids = torch.arange(logits.shape[-1] - 1, -1, -1, device=logits.device)
    return order * (1 << 32) + ids


_EAGER = {"rms_norm": rms_norm_eager, "add_rms_norm": add_rms_norm_eager, "rope_pairs": rope_pairs_eager,
          "qk_norm_rope": qk_norm_rope_eager, "rope_halves": rope_halves_eager, "silu_mul": silu_mul_eager,
          "order_keys": order_keys_eager}
_active = dict(_EAGER)


def use_compiled(on: bool) -> None:
    """Switch every AR model in this process to the compiled (on) or eager (off) functions."""
    if on:
        compile_settings()
    for name, fn in _EAGER.items():
        _active[name] = torch.compile(
            fn, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True}) if on else fn


def compiled() -> bool:
    return _active["rms_norm"] is not rms_norm_eager


def rms_norm(x: Tensor, weight: Tensor, eps: float, compute: torch.dtype) -> Tensor:
    return _active["rms_norm"](x, weight, eps, compute)


def add_rms_norm(x: Tensor, y: Tensor, weight: Tensor, eps: float, compute: torch.dtype) -> tuple[Tensor, Tensor]:
    return _active["add_rms_norm"](x, y, weight, eps, compute)


def rope_pairs(x: Tensor, table: Tensor) -> Tensor:
    return _active["rope_pairs"](x, table)


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                 table: Tensor) -> tuple[Tensor, Tensor]:
    return _active["qk_norm_rope"](q, k, q_weight, k_weight, eps, table)


def rope_halves(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _active["rope_halves"](x, cos, sin)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return _active["silu_mul"](gate, up)


def order_keys(logits: Tensor) -> Tensor:
    return _active["order_keys"](logits)
