"""The Snake activation, x + sin(alpha * x)^2 / (alpha + 1e-9) per channel, as one Triton kernel.

In torch it is six elementwise kernels over the codec's largest tensors (its sample-rate
activations), each a full read and write. The kernel reads x once and writes once, and rounds
after every operation to the input's dtype as torch does for half types (each op computes in fp32
and stores its result in the tensor dtype), so it returns the values of the torch expression up to
the last bit (measured on the H200: ~85% of values bit-equal, the rest one unit in the last place
apart, from fused multiply-adds and sin's implementation).

A convolution's bias can be added inside the kernel (snake(conv(x) + bias)), and a residual add with
the next convolution's bias is one kernel too (x + (conv(y) + bias)): cuDNN adds a bias as a pass of
its own over the convolution's whole output, a read and a write of the codec's largest tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: the torch expression is used
    triton = None

BLOCK = 1024


def snake_reference(x: Tensor, alpha: Tensor) -> Tensor:
    """x [B, C, T], alpha [1, C, 1]: the official expression."""
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def available(x: Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32)


if triton is not None:

    @triton.jit
    def _snake(x_ptr, alpha_ptr, bias_ptr, out_ptr, length, channels, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr):
        row = tl.program_id(0)  # one (batch, channel) row of T samples per program column
        channel = row % channels
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = t < length
        x = tl.load(x_ptr + row * length + t, mask=ok, other=0.0)
        dt = x.dtype
        if HAS_BIAS:  # rounded as torch rounds the bias add before the activation
            x = (x.to(tl.float32) + tl.load(bias_ptr + channel).to(tl.float32)).to(dt)
        a = tl.load(alpha_ptr + channel)
        ax = (a.to(tl.float32) * x.to(tl.float32)).to(dt)
        s = libdevice.sin(ax.to(tl.float32)).to(dt)
        sq = (s.to(tl.float32) * s.to(tl.float32)).to(dt)
        inv = libdevice.div_rn(1.0, (a.to(tl.float32) + 1e-9).to(dt).to(tl.float32)).to(dt)  # IEEE, as torch
        y = (x.to(tl.float32) + (inv.to(tl.float32) * sq.to(tl.float32)).to(dt).to(tl.float32)).to(dt)
        tl.store(out_ptr + row * length + t, y, mask=ok)


    @triton.jit
    def _bias_residual(x_ptr, y_ptr, bias_ptr, out_ptr, length, channels, BLOCK_T: tl.constexpr):
        row = tl.program_id(0)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = t < length
        x = tl.load(x_ptr + row * length + t, mask=ok, other=0.0)
        y = tl.load(y_ptr + row * length + t, mask=ok, other=0.0)
        dt = x.dtype
        y = (y.to(tl.float32) + tl.load(bias_ptr + row % channels).to(tl.float32)).to(dt)
        tl.store(out_ptr + row * length + t, (x.to(tl.float32) + y.to(tl.float32)).to(dt), mask=ok)


def snake(x: Tensor, alpha: Tensor, bias: Tensor | None = None) -> Tensor:
    """Snake of x [B, C, T] (plus bias [C] first, when given) with alpha [1, C, 1]."""
    if not available(x) or alpha.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return snake_reference(x if bias is None else x + bias.view(1, -1, 1), alpha)
    x = x.contiguous()
    batch, channels, length = x.shape
    out = torch.empty_like(x)
    b = alpha if bias is None else bias.contiguous()  # any pointer when there is no bias
    _snake[(batch * channels, triton.cdiv(length, BLOCK))](x, alpha.contiguous(), b, out, length, channels,
                                                           HAS_BIAS=bias is not None, BLOCK_T=BLOCK)
    return out


def bias_residual(x: Tensor, y: Tensor, bias: Tensor) -> Tensor:
    """x + (y + bias) for x, y [B, C, T] and bias [C], rounded as torch rounds the two adds."""
    if not available(x) or not (x.dtype == y.dtype == bias.dtype) or x.shape != y.shape:
        return x + (y + bias.view(1, -1, 1))
    x, y = x.contiguous(), y.contiguous()
    batch, channels, length = x.shape
    out = torch.empty_like(x)
    _bias_residual[(batch * channels, triton.cdiv(length, BLOCK))](x, y, bias.contiguous(), out, length, channels,
                                                                   BLOCK_T=BLOCK)
    return out
