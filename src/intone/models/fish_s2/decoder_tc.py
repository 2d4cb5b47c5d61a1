"""Fish's carried codec decoder with time-major activations ([B, T, C]: cuDNN's channels-last layout), the same sums.

Why: as in the reference encoder (`encoder_tc`), the decoder's convolutions run at the audio rate with few channels
(768 at 8x the upsampled frame rate down to 96 at 44.1 kHz), and cuDNN computes them channels-last in half
precision, so on [B, C, T] tensors every convolution converts its input and output around itself; session 26 put
layout conversions and copies at ~40% of a served call's CUDA time. Here the activations stay time-major from the
decoder's first convolution to its last:
- each convolution that carries a history reads one buffer per call: the rows' histories, then the Snake before it
  written straight after them (no concatenation), zero-padded to a multiple of its dilation; a dilated one runs
  undilated down the buffer's [B, C, L / d, d] view (`encoder_tc.folded`), an undilated one as a conv2d with no
  padding (the history is its left context), a kernel-1 one as a matrix product;
- a transposed convolution (kernel 2 x stride) is a channels-last conv_transpose2d over [its last input | the chunk],
  its bias left to the first residual unit's kernels (read in place, as the channels-first lean path does);
- each row's new history is gathered from its own valid end, as `codec_stream` does along the other axis.

Histories are time-major too ([h, C] per layer), so a request's state belongs to the layout that made it: one
decoder per process (`fish_s2.decoder_layout`). Not bit-identical to the channels-first decode on a GPU (other cuDNN
kernels, cuBLAS for the kernel-1 convolutions); the same sums in float64 (tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from intone.models.fish_s2.codec_modules import CausalConv, CausalTransConv, ResidualUnit, Snake
from intone.models.fish_s2.encoder_tc import as_nchw, as_time_major, channels_last_kernel, folded
from intone.ops.snake import bias_residual_tc, snake_tc


def decode_tc(decoder: nn.Sequential, z: Tensor, ctx, key: str) -> Tensor:
    """The codec's `Decoder.model` on z [B, D, T] (channels-first, rows valid up to ctx.lengths), each layer after its
    rows' histories in ctx (`codec_stream._Context`): the samples [B, T x hop]."""
    first, *blocks, act, last, tanh = decoder
    if not (isinstance(act, Snake) and isinstance(last, CausalConv) and isinstance(tanh, nn.Tanh)):
        raise ValueError("decode_tc: the decoder does not end Snake, convolution, Tanh")
    x = _conv(first, _input(z.transpose(1, 2), first, ctx, f"{key}.0"), z.shape[2])
    for i, block in enumerate(blocks, start=1):
        x = _decoder_block(block.block, x, ctx, f"{key}.{i}")
    n = len(blocks) + 2
    y = _conv(last, _input(x, last, ctx, f"{key}.{n}", act), x.shape[1])
    return torch.tanh(y.squeeze(2))


def _input(x: Tensor, conv: CausalConv, ctx, key: str, act: Snake | None = None,
           bias: Tensor | None = None) -> Tensor:
    """conv's input buffer: each row's history of (span - 1) samples, then x (act(x + bias) with act), zeros up to a
    multiple of the dilation; the rows' new histories kept."""
    if conv.stride != 1 or conv.conv.groups != 1:
        raise ValueError(f"{key}: decode_tc carries stride-1, ungrouped convolutions only")
    return _buffer(x, conv.span - 1, conv.conv.dilation[0], ctx, key, act, bias)


def _buffer(x: Tensor, h: int, d: int, ctx, key: str, act: Snake | None = None, bias: Tensor | None = None) -> Tensor:
    b, t, c = x.shape
    whole = -(-(h + t) // d) * d
    buffer = x.new_empty(b, whole, c)
    buffer[:, :h] = ctx.history(key, lambda: x.new_zeros(1, h, c))
    if whole > h + t:  # reaches only outputs past the chunk, but must not hold whatever the memory held
        buffer[:, h + t:] = 0
    if act is None:
        buffer[:, h: h + t] = x
    else:
        snake_tc(x, act.alpha, bias, out=buffer[:, h: h + t])
    ctx.keep(key, ctx.tail(buffer, h, dim=1))
    return buffer


def _conv(conv: CausalConv, buffer: Tensor, length: int, bias: bool = True) -> Tensor:
    """conv over a buffer from `_input` (no padding added): its `length` outputs [B, length, C'] (a view)."""
    c = conv.conv
    k, d = c.kernel_size[0], c.dilation[0]
    b = c.bias if bias else None
    if k == 1:
        return F.linear(buffer, c.weight[:, :, 0], b)
    if d == 1:
        return as_time_major(F.conv2d(as_nchw(buffer), channels_last_kernel(c, c.weight, taps_along=3), b))
    y = F.conv2d(folded(buffer, d), channels_last_kernel(c, c.weight, taps_along=2), b)  # [B, C', L / d - k + 1, d]
    return y.permute(0, 2, 3, 1).flatten(1, 2)[:, :length]


def _decoder_block(layers: nn.Sequential, x: Tensor, ctx, key: str) -> Tensor:
    act, up, *units = layers
    if not (isinstance(act, Snake) and isinstance(up, CausalTransConv) and all(isinstance(u, ResidualUnit)
                                                                              for u in units)):
        raise ValueError(f"{key}: decode_tc expects Snake, transposed convolution, residual units")
    c = up.conv
    stride, t = c.stride[0], x.shape[1]
    if up.trim != stride or (c.padding, c.output_padding, c.dilation, c.groups) != ((0,), (0,), (1,), 1):
        raise ValueError(f"{key}: decode_tc carries transposed convolutions of kernel 2 x stride only")
    # the last input's second half-kernel reaches this chunk's first block: one sample of history
    buffer = _buffer(x, 1, 1, ctx, f"{key}.1", act)
    y = F.conv_transpose2d(as_nchw(buffer), channels_last_kernel(c, c.weight, taps_along=3), None, stride=(1, stride))
    y = as_time_major(y)[:, stride: stride * (t + 1)]
    ctx.lengths = ctx.lengths * stride
    pending = c.bias  # added by the first residual unit's kernels, as they read y
    for j, unit in enumerate(units, start=2):
        y, pending = _residual_unit(unit, y, ctx, f"{key}.{j}", pending), None
    return y


def _residual_unit(unit: ResidualUnit, x: Tensor, ctx, key: str, x_bias: Tensor | None) -> Tensor:
    """(x + x_bias) + the unit's block of it, in `ResidualUnit.residual`'s CUDA order."""
    act_in, conv_in, act_mid, conv_out = unit.block
    y = _conv(conv_in, _input(x, conv_in, ctx, f"{key}.1", act_in, x_bias), x.shape[1], bias=False)
    y = snake_tc(y, act_mid.alpha, conv_in.conv.bias)
    return bias_residual_tc(x, _conv(conv_out, y, y.shape[1], bias=False), conv_out.conv.bias, x_bias)
