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
    def _snake(x_ptr, alpha_ptr, bias_ptr, out_ptr, length, channels, x_batch, x_row, out_batch, out_row,
               HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr):
        row = tl.program_id(0)  # one (batch, channel) row of T samples per program column
        batch, channel = (row // channels).to(tl.int64), row % channels
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = t < length
        x = tl.load(x_ptr + batch * x_batch + channel * x_row + t, mask=ok, other=0.0)
        dt = x.dtype
        if HAS_BIAS:  # rounded as torch rounds the bias add before the activation
            x = (x.to(tl.float32) + tl.load(bias_ptr + channel).to(tl.float32)).to(dt)
        a = tl.load(alpha_ptr + channel)
        ax = (a.to(tl.float32) * x.to(tl.float32)).to(dt)
        s = libdevice.sin(ax.to(tl.float32)).to(dt)
        sq = (s.to(tl.float32) * s.to(tl.float32)).to(dt)
        inv = libdevice.div_rn(1.0, (a.to(tl.float32) + 1e-9).to(dt).to(tl.float32)).to(dt)  # IEEE, as torch
        y = (x.to(tl.float32) + (inv.to(tl.float32) * sq.to(tl.float32)).to(dt).to(tl.float32)).to(dt)
        tl.store(out_ptr + batch * out_batch + channel * out_row + t, y, mask=ok)


    @triton.jit
    def _bias_residual(x_ptr, y_ptr, bias_ptr, x_bias_ptr, out_ptr, length, channels, x_batch, x_row,
                       HAS_X_BIAS: tl.constexpr, BLOCK_T: tl.constexpr):
        row = tl.program_id(0)
        batch, channel = (row // channels).to(tl.int64), row % channels
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = t < length
        x = tl.load(x_ptr + batch * x_batch + channel * x_row + t, mask=ok, other=0.0)
        y = tl.load(y_ptr + row.to(tl.int64) * length + t, mask=ok, other=0.0)
        dt = x.dtype
        if HAS_X_BIAS:  # x's own bias first, rounded as torch rounds that add
            x = (x.to(tl.float32) + tl.load(x_bias_ptr + channel).to(tl.float32)).to(dt)
        y = (y.to(tl.float32) + tl.load(bias_ptr + channel).to(tl.float32)).to(dt)
        tl.store(out_ptr + row.to(tl.int64) * length + t, (x.to(tl.float32) + y.to(tl.float32)).to(dt), mask=ok)


def _unit_time_stride(x: Tensor) -> Tensor:
    """x itself when its samples are adjacent (any batch and channel strides: a slice of a longer
    tensor), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def snake(x: Tensor, alpha: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """Snake of x [B, C, T] (plus bias [C] first, when given) with alpha [1, C, 1]. x may be a view with
    adjacent samples (e.g. a slice of a longer output: read in place, no copy). out: a [B, C, T] view to
    write into (e.g. a convolution's input buffer after its history), returned; None: a new tensor."""
    if out is not None and out.shape != x.shape:
        raise ValueError(f"out {tuple(out.shape)} for x {tuple(x.shape)}")
    if not available(x) or alpha.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        y = snake_reference(x if bias is None else x + bias.view(1, -1, 1), alpha)
        return y if out is None else out.copy_(y)
    if out is not None and (out.stride(-1) != 1 or out.dtype != x.dtype or out.device != x.device):
        # the torch expression would differ from the kernel in the last bit of ~15% of values
        raise ValueError("snake's out must be a view of x's dtype and device with adjacent samples")
    x = _unit_time_stride(x)
    batch, channels, length = x.shape
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    b = alpha if bias is None else bias.contiguous()  # any pointer when there is no bias
    _snake[(batch * channels, triton.cdiv(length, BLOCK))](
        x, alpha.contiguous(), b, out, length, channels, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_T=BLOCK)
    return out


def bias_residual(x: Tensor, y: Tensor, bias: Tensor, x_bias: Tensor | None = None) -> Tensor:
    """x + (y + bias) for x, y [B, C, T] and bias [C] (with x_bias [C]: (x + x_bias) + (y + bias)),
    rounded as torch rounds each add. x may be a view with adjacent samples (read in place)."""
    if not available(x) or not (x.dtype == y.dtype == bias.dtype) or x.shape != y.shape or \
            (x_bias is not None and x_bias.dtype != x.dtype):
        if x_bias is not None:
            x = x + x_bias.view(1, -1, 1)
        return x + (y + bias.view(1, -1, 1))
    x, y = _unit_time_stride(x), y.contiguous()
    batch, channels, length = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xb = bias if x_bias is None else x_bias.contiguous()  # any pointer when there is none
    _bias_residual[(batch * channels, triton.cdiv(length, BLOCK))](
        x, y, bias.contiguous(), xb, out, length, channels, x.stride(0), x.stride(1),
        HAS_X_BIAS=x_bias is not None, BLOCK_T=BLOCK)
    return out


# ---- time-major ("channels-last") tensors: [B, T, C] with adjacent channels ---------------------------------------
# The same two kernels over [B, T, C], a tile of samples x channels per program (loads along the channels are
# adjacent), with the same roundings: a codec whose convolutions run channels-last (cuDNN's tensor-core layout)
# keeps its activations so, with no layout conversion around each convolution.

if triton is not None:

    @triton.jit
    def _snake_tc(x_ptr, alpha_ptr, bias_ptr, out_ptr, length, channels, x_batch, x_time, out_batch, out_time,
                  HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        batch = tl.program_id(1).to(tl.int64)  # time tiles on the grid's first axis: no 65535 bound on a clip
        t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]
        c = (tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
        ok = (t < length) & (c < channels)
        x = tl.load(x_ptr + batch * x_batch + t.to(tl.int64) * x_time + c, mask=ok, other=0.0)
        dt = x.dtype
        if HAS_BIAS:
            x = (x.to(tl.float32) + tl.load(bias_ptr + c, mask=c < channels, other=0.0).to(tl.float32)).to(dt)
        a = tl.load(alpha_ptr + c, mask=c < channels, other=1.0)
        ax = (a.to(tl.float32) * x.to(tl.float32)).to(dt)
        s = libdevice.sin(ax.to(tl.float32)).to(dt)
        sq = (s.to(tl.float32) * s.to(tl.float32)).to(dt)
        inv = libdevice.div_rn(1.0, (a.to(tl.float32) + 1e-9).to(dt).to(tl.float32)).to(dt)
        y = (x.to(tl.float32) + (inv.to(tl.float32) * sq.to(tl.float32)).to(dt).to(tl.float32)).to(dt)
        tl.store(out_ptr + batch * out_batch + t.to(tl.int64) * out_time + c, y, mask=ok)

    @triton.jit
    def _bias_residual_tc(x_ptr, y_ptr, bias_ptr, x_bias_ptr, out_ptr, length, channels, x_batch, x_time, y_batch,
                          y_time, HAS_X_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        batch = tl.program_id(1).to(tl.int64)  # time tiles on the grid's first axis: no 65535 bound on a clip
        t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]
        c = (tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
        ok = (t < length) & (c < channels)
        x = tl.load(x_ptr + batch * x_batch + t.to(tl.int64) * x_time + c, mask=ok, other=0.0)
        y = tl.load(y_ptr + batch * y_batch + t.to(tl.int64) * y_time + c, mask=ok, other=0.0)
        dt = x.dtype
        if HAS_X_BIAS:
            x = (x.to(tl.float32) + tl.load(x_bias_ptr + c, mask=c < channels, other=0.0).to(tl.float32)).to(dt)
        y = (y.to(tl.float32) + tl.load(bias_ptr + c, mask=c < channels, other=0.0).to(tl.float32)).to(dt)
        out = (x.to(tl.float32) + y.to(tl.float32)).to(dt)
        tl.store(out_ptr + batch * length * channels + t.to(tl.int64) * channels + c, out, mask=ok)


def _tiles(channels: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_C): up to 128 channels a tile, ~4096 values a program."""
    block_c = min(128, triton.next_power_of_2(channels))
    return max(16, 4096 // block_c), block_c


def _adjacent_channels(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def snake_tc(x: Tensor, alpha: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """Snake of a time-major x [B, T, C] (plus bias [C] first) with alpha of C values: `snake` on x.transpose(1, 2),
    the same values. x may have any batch and time strides (e.g. a convolution's output cut to its length); out: a
    [B, T, C] view with adjacent channels to write into (e.g. a buffer longer than x), returned."""
    alpha = alpha.reshape(-1)
    if not available(x) or alpha.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        y = snake_reference(x if bias is None else x + bias, alpha)
        return y if out is None else out.copy_(y)
    if out is not None and (out.shape != x.shape or out.stride(-1) != 1 or out.dtype != x.dtype):
        raise ValueError("snake_tc's out must be a view of x's shape and dtype with adjacent channels")
    x = _adjacent_channels(x)
    batch, length, channels = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    block_t, block_c = _tiles(channels)
    b = alpha if bias is None else bias.contiguous()
    _snake_tc[(triton.cdiv(length, block_t), batch, triton.cdiv(channels, block_c))](
        x, alpha.contiguous(), b, out, length, channels, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_C=block_c)
    return out


def bias_residual_tc(x: Tensor, y: Tensor, bias: Tensor, x_bias: Tensor | None = None) -> Tensor:
    """x + (y + bias) for time-major x, y [B, T, C] and bias [C] (with x_bias [C]: (x + x_bias) + (y + bias)),
    rounded as torch rounds each add; a new contiguous [B, T, C]. x and y may have any batch and time strides."""
    if not available(x) or not (x.dtype == y.dtype == bias.dtype) or x.shape != y.shape or \
            (x_bias is not None and x_bias.dtype != x.dtype):
        return (x if x_bias is None else x + x_bias) + (y + bias)
    x, y = _adjacent_channels(x), _adjacent_channels(y)
    batch, length, channels = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_t, block_c = _tiles(channels)
    xb = bias if x_bias is None else x_bias.contiguous()  # any pointer when there is none
    _bias_residual_tc[(triton.cdiv(length, block_t), batch, triton.cdiv(channels, block_c))](
        x, y, bias.contiguous(), xb, out, length, channels, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
        HAS_X_BIAS=x_bias is not None, BLOCK_T=block_t, BLOCK_C=block_c)
    return out
