"""Layers of the modded-DAC codec. All convolutions are causal, so T frames in give exactly
T * 2048 samples out, and a sample never depends on later frames."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from intone.ops.dilated_conv import dilated_conv1d
from intone.ops.padded_conv import padded_conv1d
from intone.ops.snake import bias_residual, snake
from intone.models.fish_s2.layers import RMSNorm, SwiGLU, apply_rope, rope_table

# With a mask, SDPA would pick cuDNN on CUDA, which builds a new plan for every new window
# length (milliseconds of host time per layer call); the memory-efficient kernel does not.
_CODEC_SDPA = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CODEC_HEAD_DIM = 64  # the official codec config's; heads = dim // head_dim
CODEC_ROPE_BASE = 10000.0
CODEC_NORM_EPS = 1e-5


class CausalConv(nn.Module):
    """Left-pads by (effective kernel - stride); right-pads only to complete the last stride."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride=stride, dilation=dilation, groups=groups)
        self.stride = stride
        self.span = (kernel - 1) * dilation + 1

    def forward(self, x: Tensor, bias: bool = True) -> Tensor:
        pad = self.span - self.stride
        length = x.shape[-1]
        frames = math.ceil((length - self.span + pad) / self.stride + 1)
        extra = (frames - 1) * self.stride + (self.span - pad) - length
        c = self.conv
        b = c.bias if bias else None
        if not self._folds(x):
            return padded_conv1d(x, c.weight, b, pad, extra, c.stride[0], c.dilation[0], c.groups)
        if extra == 0 and pad % c.dilation[0] == 0:
            return dilated_conv1d(x, c.weight, b, c.dilation[0], left=pad)  # the padding is the fold's first places
        return self.valid(F.pad(x, (pad, extra)), bias)

    def _folds(self, x: Tensor) -> bool:
        """Whether `valid` runs this convolution through `dilated_conv1d` (on CUDA, dilated, stride 1, groups 1)."""
        c = self.conv
        return x.is_cuda and c.dilation[0] > 1 and c.groups == 1 and self.stride == 1

    def valid(self, x: Tensor, bias: bool = True) -> Tensor:
        """The convolution of an input already padded (no padding added); bias False: without its bias."""
        c = self.conv
        b = c.bias if bias else None
        # On CUDA a dilated convolution runs undilated over its input's interleaved subsequences (the same
        # sums; cuDNN's plans for some dilated shapes are 10x slower: ops/dilated_conv.py)
        if self._folds(x):
            return dilated_conv1d(x, c.weight, b, c.dilation[0])
        return F.conv1d(x, c.weight, b, c.stride, 0, c.dilation, c.groups)


class CausalTransConv(nn.Module):
    """Transposed conv whose right overhang (kernel - stride samples) is cut: L in, L*stride out."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel, stride=stride)
        self.trim = kernel - stride

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv(x)
        return y[..., : y.shape[-1] - self.trim]


class Snake(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: Tensor) -> Tensor:
        return snake(x, self.alpha)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.block = nn.Sequential(
            Snake(dim), CausalConv(dim, dim, 7, dilation=dilation), Snake(dim), CausalConv(dim, dim, 1)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.residual(x, lambda i, y, bias: self.block[i](y, bias))

    def residual(self, x: Tensor, conv) -> Tensor:
        """x + block(x); conv(i, y, bias) applies block[i], a CausalConv, to y (bias False: without its bias).
        On CUDA each convolution's bias is added inside the elementwise kernel after it (cuDNN adds a bias
        as a pass of its own over the output; the CPU kernels add it inside the convolution)."""
        snake_in, conv_in, snake_mid, conv_out = self.block
        if not x.is_cuda:
            return x + conv(3, snake_mid(conv(1, snake_in(x), True)), True)
        y = snake(conv(1, snake_in(x), False), snake_mid.alpha, conv_in.conv.bias)
        return bias_residual(x, conv(3, y, False), conv_out.conv.bias)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor) -> Tensor:
        y = self.dwconv(x).transpose(1, 2)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).transpose(1, 2)


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 1e-2))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class CodecAttention(nn.Module):
    def __init__(self, dim: int, head_dim: int = CODEC_HEAD_DIM):
        super().__init__()
        self.head_dim = head_dim
        self.n_head = dim // head_dim
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor) -> Tensor:
        q, k, v = (t.unflatten(-1, (self.n_head, self.head_dim)) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        y = masked_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(y.transpose(1, 2).flatten(-2))


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with sdpa_kernel(_CODEC_SDPA):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class CodecBlock(nn.Module):
    def __init__(self, dim: int, ffn: int, head_dim: int = CODEC_HEAD_DIM, norm_eps: float = CODEC_NORM_EPS):
        super().__init__()
        self.attention = CodecAttention(dim, head_dim)
        self.feed_forward = SwiGLU(dim, ffn)
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.attention_layer_scale = LayerScale(dim)
        self.ffn_layer_scale = LayerScale(dim)

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor) -> Tensor:
        h = x + self.attention_layer_scale(self.attention(self.attention_norm(x), rope, mask))
        return h + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(h)))


class WindowTransformer(nn.Module):
    """Causal transformer whose attention sees at most `window` frames (itself included).

    Channels-first in and out. `position_offset` is the absolute index of the first frame:
    the bf16-rounded RoPE table is not exactly shift-invariant, so a window decoded on its
    own must use the positions it has in the whole utterance to match the one-pass decode.
    """

    def __init__(self, dim: int, n_layer: int, window: int, ffn: int | None = None, head_dim: int = CODEC_HEAD_DIM,
                 rope_base: float = CODEC_ROPE_BASE, norm_eps: float = CODEC_NORM_EPS):
        super().__init__()
        self.window, self.head_dim, self.rope_base = window, head_dim, rope_base
        self.layers = nn.ModuleList(CodecBlock(dim, ffn or 3 * dim, head_dim, norm_eps) for _ in range(n_layer))
        self.norm = RMSNorm(dim, norm_eps)

    def forward(self, x: Tensor, position_offset: int | Tensor = 0) -> Tensor:
        """position_offset: one int for the batch, or a [B] tensor (one window per row)."""
        length = x.shape[-1]
        pos = torch.arange(length, device=x.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.window)
        if isinstance(position_offset, Tensor):
            positions = position_offset.to(x.device).view(-1, 1) + pos  # [B, T]
        else:
            positions = pos + position_offset
        rope = rope_table(positions, self.head_dim, self.rope_base)
        h = x.transpose(1, 2)
        for layer in self.layers:
            h = layer(h, rope, mask)
        return self.norm(h).transpose(1, 2)


class VectorQuantizer(nn.Module):
    """DAC's factorised VQ: project to `codebook_dim`, nearest unit-norm code, project back."""

    def __init__(self, dim: int, codebook_size: int, codebook_dim: int):
        super().__init__()
        self.in_proj = nn.Conv1d(dim, codebook_dim, 1)
        self.out_proj = nn.Conv1d(codebook_dim, dim, 1)
        self.codebook = nn.Embedding(codebook_size, codebook_dim)

    def quantize(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """z [B, D, T] -> (out_proj of the chosen codes [B, D, T], codes [B, T])."""
        z_e = self.in_proj(z)
        enc = F.normalize(z_e.transpose(1, 2).flatten(0, 1))
        book = F.normalize(self.codebook.weight)
        dist = enc.pow(2).sum(1, keepdim=True) - 2 * enc @ book.t() + book.pow(2).sum(1, keepdim=True).t()
        codes = (-dist).max(1)[1].view(z.shape[0], -1)
        z_q = self.codebook(codes).transpose(1, 2)
        # The official straight-through expression, kept for its exact rounding.
        z_q = z_e + (z_q - z_e)
        return self.out_proj(z_q), codes

    def lookup(self, codes: Tensor) -> Tensor:
        return self.out_proj(self.codebook(codes).transpose(1, 2))


class ResidualQuantizer(nn.Module):
    def __init__(self, dim: int, n_codebooks: int, codebook_size: int, codebook_dim: int):
        super().__init__()
        self.quantizers = nn.ModuleList(
            VectorQuantizer(dim, codebook_size, codebook_dim) for _ in range(n_codebooks)
        )

    @property
    def codebook_size(self) -> int:
        return self.quantizers[0].codebook.num_embeddings

    def quantize(self, z: Tensor) -> tuple[Tensor, Tensor]:
        residual, z_q, codes = z, 0, []
        for q in self.quantizers:
            z_i, c_i = q.quantize(residual)
            z_q = z_q + z_i
            residual = residual - z_i
            codes.append(c_i)
        return z_q, torch.stack(codes, dim=1)

    def lookup(self, codes: Tensor) -> Tensor:
        z = 0.0
        for i, q in enumerate(self.quantizers):
            z = z + q.lookup(codes[:, i])
        return z
