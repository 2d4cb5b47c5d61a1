"""Fish's reference encoder with time-major activations ([B, T, C]: cuDNN's channels-last layout), the same sums.

Why: the encoder's convolutions run at the audio rate with few channels (64 at 44.1 kHz, 128 at 22 kHz, ...). On a
GPU in half precision cuDNN computes them in the channels-last layout, so each call on a [B, C, T] tensor converts
its input and its output around the convolution: two more passes over the codec's largest tensors per
convolution, beside the Snakes' and the residuals' own. Kept time-major from the first convolution on, the encoder
converts nothing until its last block. Every causal convolution becomes a conv2d on a [B, C, 1, T] view with its
padding as the convolution's own (the first outputs are the causal ones); a dilated one runs undilated over the
[B, C, T / d, d] view of its input (each column one residue class, as `ops.dilated_conv` folds them, here with no
copy: the snake before it writes into a buffer padded to a multiple of d); a kernel-1 one is a matrix product.
The Snakes and the residual adds are `ops.snake`'s time-major kernels, with the same roundings.

Not bit-identical to the channels-first encoder on a GPU (other cuDNN kernels, cuBLAS for the kernel-1
convolutions), so a code may differ where a latent sits at a boundary between two codebook entries; the same sums
in float64 (tests). `FishCodec.encode` uses it with `fish_s2.encoder_layout: time_major`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from intone.models.fish_s2.codec_modules import CausalConv, ResidualUnit, Snake
from intone.ops.snake import bias_residual_tc, snake_tc


def as_nchw(x: Tensor) -> Tensor:
    """[B, T, C] (adjacent channels) -> the [B, C, 1, T] channels-last view of the same memory."""
    return x.unsqueeze(1).permute(0, 3, 1, 2)


def as_time_major(y: Tensor) -> Tensor:
    """A [B, C, 1, T] channels-last conv2d output -> its [B, T, C] view."""
    return y.permute(0, 2, 3, 1).squeeze(1)


def channels_last_kernel(module: nn.Module, weight: Tensor, taps_along: int) -> Tensor:
    """A 1-d convolution's weight [O, I, k] (or a transposed one's [I, O, k]) as a channels-last 4-d kernel with its
    taps along H (taps_along 2: [O, I, k, 1]) or W (3: [O, I, 1, k]). Laid out once per weight, dtype and device and
    kept on the module (laid out on every call, it was ~35 MB of copies in each encoder call); an entry is never
    replaced, so a captured graph's kernel stays alive."""
    kept = module.__dict__.setdefault("_channels_last_kernels", {})
    key = (taps_along, weight.data_ptr(), weight.dtype, weight.device)
    if key not in kept:
        kept.setdefault(key, weight.unsqueeze(5 - taps_along).contiguous(memory_format=torch.channels_last))
    return kept[key]


def conv_tc(x: Tensor, conv: CausalConv, bias: bool = True) -> Tensor:
    """`conv(x)` (a causal convolution, groups 1) on a time-major x [B, T, C]: [B, T', C'] (a view)."""
    c = conv.conv
    k, d, s = c.kernel_size[0], c.dilation[0], conv.stride
    b = c.bias if bias else None
    length = x.shape[1]
    if k == 1 and s == 1:
        return F.linear(x, c.weight[:, :, 0], b)
    if d > 1:
        return _dilated_tc(x, channels_last_kernel(c, c.weight, taps_along=2), b, d)
    left = conv.span - s  # the causal padding; the convolution pads both sides, its first outputs are the causal ones
    frames = -(-length // s)
    w = channels_last_kernel(c, c.weight, taps_along=3)
    y = F.conv2d(as_nchw(x.contiguous()), w, b, stride=(1, s), padding=(0, left))
    return as_time_major(y)[:, :frames]


def _dilated_tc(x: Tensor, kernel: Tensor, bias: Tensor | None, d: int) -> Tensor:
    """A causal dilation-d convolution (stride 1) on x [B, T, C] whose T is a multiple of d (`padded_for`): an
    undilated (k, 1) convolution (kernel [O, I, k, 1], channels-last) down the [B, C, T / d, d] view, padded by
    k - 1 rows in front."""
    b, length, c = x.shape
    if length % d:
        raise ValueError(f"a dilation-{d} convolution's input of {length} samples is not a multiple of {d}")
    y = F.conv2d(folded(x.contiguous(), d), kernel, bias, padding=(kernel.shape[2] - 1, 0))[:, :, : length // d]
    return y.permute(0, 2, 3, 1).reshape(b, length, -1)


def folded(x: Tensor, d: int) -> Tensor:
    """A contiguous time-major x [B, T, C] (T a multiple of d) as the channels-last [B, C, T / d, d] view: each
    column one residue class of the samples mod d, so a dilation-d convolution runs undilated down the columns."""
    b, length, c = x.shape
    return x.view(b, length // d, d, c).permute(0, 3, 1, 2)


def padded_for(x: Tensor, d: int) -> Tensor:
    """A [B, ceil(T / d) * d, C] buffer whose first T samples are left for the caller to write and the rest are
    zeros (they reach only outputs past T, but an algorithm that mixes positions, as an FFT does, must not meet
    whatever the memory held)."""
    b, length, c = x.shape
    whole = -(-length // d) * d
    out = x.new_empty(b, whole, c)
    if whole > length:
        out[:, length:] = 0
    return out


def residual_unit_tc(unit: ResidualUnit, x: Tensor) -> Tensor:
    """`unit(x)` on a time-major x: x + conv_out(snake(conv_in(snake(x)))), the biases added as on CUDA."""
    snake_in, conv_in, snake_mid, conv_out = unit.block
    d = conv_in.conv.dilation[0]
    length = x.shape[1]
    y = padded_for(x, d)
    snake_tc(x, snake_in.alpha, out=y[:, :length])
    y = conv_tc(y, conv_in, bias=False)[:, :length]
    y = snake_tc(y, snake_mid.alpha, conv_in.conv.bias)
    return bias_residual_tc(x, conv_tc(y, conv_out, bias=False), conv_out.conv.bias)


def encode_tc(encoder: nn.Module, audio: Tensor) -> Tensor:
    """The encoder's latent [B, C, T'] (a channels-first view) of audio [B, 1, N], time-major inside."""
    first, *blocks, last_snake, last_conv = encoder.block
    x = _first_conv(first, audio[:, 0])
    for block in blocks:
        for module in block.block:
            if isinstance(module, ResidualUnit):
                x = residual_unit_tc(module, x)
            elif isinstance(module, Snake):
                x = snake_tc(x, module.alpha)
            elif isinstance(module, CausalConv):
                x = conv_tc(x, module)
            elif not isinstance(module, nn.Identity):  # the windowed transformer: channels-first in and out
                x = module(x.transpose(1, 2)).transpose(1, 2)
    x = conv_tc(snake_tc(x, last_snake.alpha), last_conv)
    return x.transpose(1, 2)


def _first_conv(conv: CausalConv, audio: Tensor) -> Tensor:
    """The one-channel input convolution as a product over each sample's k-sample window: [B, N] -> [B, N, C]."""
    c = conv.conv
    k = c.kernel_size[0]
    windows = F.pad(audio, (k - 1, 0)).unfold(-1, k, 1)  # [B, N, k]
    return F.linear(windows, c.weight[:, 0], c.bias)
