"""The DiT velocity estimator of the CosyVoice3 flow decoder (`decoder.estimator.*` in flow.pt).

Submodule and parameter names follow the official checkpoint. Activations are laid out
[batch, time, channels] throughout (the official code works channels-first and transposes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from intone.ops.varlen_attention import RowSpans, varlen_attention

# Not cuDNN's attention (torch's first choice on Hopper since 2.11). Streamed CosyVoice3 on the H200
# twice lost the engine to an illegal memory access (2026-12-01 with deadline scheduling; 2026-12-02 at
# start, first seen in the codec thread's next cuDNN call after a flow call); full responses never did.
# Not yet isolated; cuDNN attention under the chunk masks, whose shapes change with every batch of
# hops, is the suspect. The memory-efficient kernel takes the same boolean masks (the Fish codec's
# masked attention runs on it).
_DIT_SDPA = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class DiTConfig:
    """Defaults are the `estimator:` block of the official cosyvoice3.yaml."""

    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: int = 2
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    out_channels: int = 80
    static_chunk_size: int = 50  # mel frames; <= 0 disables the chunk mask
    time_freq_dim: int = 256
    conv_pos_kernel: int = 31
    conv_pos_groups: int = 16
    rope_base: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.out_channels != self.mel_dim:  # the output is a velocity in mel space
            raise ValueError("out_channels must equal mel_dim")


def per_frame(v: Tensor, rows: Tensor | None) -> Tensor:
    """A row's vector [R, C] broadcast over its frames: [R, 1, C] for padded rows, or (rows: each packed
    slot's row, `packing.Packing`) [1, S, C]."""
    return v[:, None] if rows is None else v[rows][None]


def modulate(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """scale, shift: `per_frame`."""
    return x * (1 + scale) + shift


def time_features(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal features of t * 1000; the frequency table is always fp32, as officially."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    angles = (1000 * t[:, None]) * freqs[None]
    return torch.cat((angles.sin(), angles.cos()), dim=-1).to(t.dtype)


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, freq_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        return self.time_mlp(time_features(t, self.freq_dim))


class CausalConvPositionEmbedding(nn.Module):
    def __init__(self, dim: int, kernel: int, groups: int):
        super().__init__()
        self.pad = kernel - 1
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel, groups=groups), nn.Mish())

    def forward(self, x: Tensor) -> Tensor:
        y = x.transpose(1, 2)
        for conv in (self.conv1, self.conv2):
            y = conv(F.pad(y, (self.pad, 0)))
        return y.transpose(1, 2)

    def packed(self, x: Tensor, gapped: Tensor, kept: Tensor, context: Tensor | None = None,
               tails: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, list[Tensor]]:
        """`forward` over packed rows [1, S, dim]: each convolution runs on a layout with `pad` slots before
        every row (slot i at `gapped[i]`; `kept` [1, G, 1] marks the slots) holding zeros, as each row's own
        zero padding, or (`continued`) the row's earlier frames' inputs to that convolution: tails [R, pad,
        dim] each, placed at `context` [R, pad]. -> (output, each convolution's input layout [1, G, dim])."""
        y = x.new_zeros(1, kept.shape[1], x.shape[2]).index_copy(1, gapped, x)
        layouts = []
        for conv, tail in zip((self.conv1, self.conv2), tails or (None, None)):
            if tail is not None:
                y = y.index_copy(1, context.reshape(-1), tail.reshape(1, -1, y.shape[2]).to(y.dtype))
            layouts.append(y)
            y = conv(F.pad(y.transpose(1, 2), (self.pad, 0))).transpose(1, 2) * kept
        return y[:, gapped], layouts

    def continued(self, x: Tensor, tails: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """`forward` with each convolution's `pad` frames of context given (earlier frames' inputs to it,
        [B, pad, dim] each) instead of zeros -> (output, each convolution's input [B, pad + T, dim])."""
        seqs, y = [], x
        for conv, tail in zip((self.conv1, self.conv2), tails):
            seqs.append(torch.cat((tail.to(y.dtype), y), dim=1))
            y = conv(seqs[-1].transpose(1, 2)).transpose(1, 2)
        return y, (seqs[0], seqs[1])


class InputEmbedding(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.proj = nn.Linear(2 * cfg.mel_dim + cfg.mu_dim + cfg.spk_dim, cfg.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(cfg.dim, cfg.conv_pos_kernel, cfg.conv_pos_groups)

    def forward(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor) -> Tensor:
        h = self._project(x, cond, mu, spks)
        return self.conv_pos_embed(h) + h

    def continued_packed(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor, packing,
                         tails: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, list[Tensor]]:
        """`forward` of packed inputs [1, S, mel] (spks: per row), after each row's earlier frames (tails:
        `CausalConvPositionEmbedding.packed`; None: zeros) -> ([1, S, dim], the convolutions' input layouts)."""
        h = self.proj(torch.cat((x, cond, mu, spks[packing.rows][None]), dim=-1))
        y, layouts = self.conv_pos_embed.packed(h, packing.gapped, packing.kept, packing.context, tails)
        return y + h, layouts

    def continued(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor, tails) -> tuple[Tensor, tuple]:
        """`forward` after earlier frames (`CausalConvPositionEmbedding.continued`; tails None: none)."""
        h = self._project(x, cond, mu, spks)
        if tails is None:
            zeros = h.new_zeros(h.shape[0], self.conv_pos_embed.pad, h.shape[2])
            tails = (zeros, zeros)
        y, seqs = self.conv_pos_embed.continued(h, tails)
        return y + h, seqs

    def _project(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor) -> Tensor:
        spks = spks[:, None].expand(-1, x.shape[1], -1)
        return self.proj(torch.cat((x, cond, mu, spks), dim=-1))


class RotaryEmbedding(nn.Module):
    """x-transformers 2.11.24 rotary tables: interleaved pairs, positions cast to the buffer dtype.

    The buffer never goes below fp32: a half-precision DiT keeps exact positions and
    frequencies (as the official fp16 autocast path does) instead of rounding them.
    """

    def __init__(self, dim: int, base: float):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))  # a flow.pt key

    def _apply(self, fn, recurse=True):
        def at_least_fp32(t):
            out = fn(t)
            if t.is_floating_point() and out.dtype in (torch.float16, torch.bfloat16):
                out = t.to(device=out.device)
            return out

        return super()._apply(at_least_fp32, recurse)

    def forward(self, seq_len: int) -> tuple[Tensor, Tensor]:
        return self.at(torch.arange(seq_len, device=self.inv_freq.device))

    def at(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The tables at these positions (any shape [...]) -> cos, sin [..., dim]."""
        angles = (positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq).repeat_interleave(2, dim=-1)
        return angles.cos(), angles.sin()


def apply_rope(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """Rotate the first rot_dim channels of the *flattened* projection, i.e. head 0 only, as officially."""
    cos, sin = rope
    head, rest = x[..., : cos.shape[-1]], x[..., cos.shape[-1]:]
    pairs = head.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return torch.cat(((head * cos + turned * sin).to(x.dtype), rest), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])  # official slot 1 is a parameterless dropout

    def forward(self, x: Tensor, mask: Tensor, valid: Tensor, rope: tuple[Tensor, Tensor],
                past: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """past: earlier frames' (keys, values) [B, H, C, D], placed before this call's frames (the mask's
        key axis covers both). -> (output, this call's frames' keys and values)."""
        b, n, _ = x.shape
        q = apply_rope(self.to_q(x), rope)
        k = apply_rope(self.to_k(x), rope)
        v = self.to_v(x)
        if isinstance(mask, RowSpans):  # packed rows [1, S, C], each attending to itself (and its past [P, H, D])
            q, k, v = (y.view(n, self.heads, -1) for y in (q, k, v))
            keys, values, spans = k, v, mask
            if mask.key_index is not None:
                keys, values = (_laid_out(y, p, mask) for y, p in zip((k, v), past or (None, None)))
                # bounds from shapes (the longest segment's as an empty tensor's length): compiled code then
                # sees no number that changes from call to call
                spans = RowSpans(mask.starts, mask.bound.shape[0], mask.key_starts, key_used=mask.key_used)
            out = varlen_attention(q, keys, values, spans)
            return self.to_out[0](out.reshape(b, n, -1)).masked_fill(~valid[..., None], 0.0), (k, v)
        q, k, v = (y.view(b, n, self.heads, -1).transpose(1, 2) for y in (q, k, v))
        keys, values = (k, v) if past is None else (torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2))
        if isinstance(mask, BlockMask):
            # Contiguous [B, H, T, D]: inductor's flex lowering takes no head-split views (torch 2.13)
            out = flex_attention(q.contiguous(), keys.contiguous(), values.contiguous(), block_mask=mask)
        else:
            with sdpa_kernel(_DIT_SDPA):
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        out = self.to_out[0](out.transpose(1, 2).reshape(b, n, -1))
        return out.masked_fill(~valid[..., None], 0.0), (k, v)


def _laid_out(new: Tensor, past: Tensor | None, spans: RowSpans) -> Tensor:
    """The keys (or values) of `spans.key_index`'s layout from the earlier frames' (`past`, at `past_frames`
    where given: compiled, the pool's blocks are read once, straight into the layout) and this call's."""
    if past is None:
        return new[spans.key_index]
    if spans.past_frames is not None:
        past = past[spans.past_frames]
    return torch.cat((past.to(new.dtype), new))[spans.key_index]


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: float):
        super().__init__()
        inner = int(dim * mult)
        # indices mirror the checkpoint: ff.0.0 in, ff.1 dropout slot, ff.2 out
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")), nn.Identity(), nn.Linear(inner, dim)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.ff(x)


class AdaLayerNormZero(nn.Module):
    """SiLU -> Linear on the time embedding, split into `parts` modulation vectors."""

    def __init__(self, dim: int, parts: int):
        super().__init__()
        self.parts = parts
        self.linear = nn.Linear(dim, dim * parts)

    def forward(self, t: Tensor) -> tuple[Tensor, ...]:
        return self.linear(F.silu(t)).chunk(self.parts, dim=1)


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.eps = cfg.norm_eps
        self.attn_norm = AdaLayerNormZero(cfg.dim, 6)
        self.attn = Attention(cfg.dim, cfg.heads, cfg.dim_head)
        self.ff = FeedForward(cfg.dim, cfg.ff_mult)

    def forward(self, x: Tensor, t: Tensor, mask: Tensor, valid: Tensor, rope: tuple[Tensor, Tensor],
                past: tuple[Tensor, Tensor] | None = None,
                rows: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """rows: packed slots' rows (`per_frame`). -> (output, the attention's keys and values of these
        frames; `Attention.forward`)."""
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = (per_frame(v, rows) for v in self.attn_norm(t))
        h = modulate(F.layer_norm(x, x.shape[-1:], eps=self.eps), scale_a, shift_a)
        attended, kv = self.attn(h, mask, valid, rope, past)
        x = x + gate_a * attended
        h = modulate(F.layer_norm(x, x.shape[-1:], eps=self.eps), scale_f, shift_f)
        return x + gate_f * self.ff(h), kv


FLEX_BLOCK = 128  # flex attention's block of queries and of keys


def block_lists(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """[B, q blocks, kv blocks] bool -> (count [B, 1, q], kv block indices [B, 1, q, kv], the set ones first)."""
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)
    return blocks.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]


class DiT(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.config = cfg
        # "sdpa": a dense boolean mask; "flex": a block mask for flex attention, whose kernel skips
        # the key blocks that a row's padding or its chunk mask hides (fast only compiled); "varlen":
        # calls without chunk masks packed, each row attending to itself (`ops.varlen_attention`),
        # others as "sdpa", unless continued from their flow caches (`forward_continued_packed`).
        self.attention_kernel = "sdpa"
        self.time_embed = TimestepEmbedding(cfg.dim, cfg.time_freq_dim)
        self.input_embed = InputEmbedding(cfg)
        self.rotary_embed = RotaryEmbedding(cfg.dim_head, cfg.rope_base)
        self.transformer_blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.depth))
        self.norm_out = AdaLayerNormZero(cfg.dim, 2)
        self.proj_out = nn.Linear(cfg.dim, cfg.out_channels)

    def attention_mask(self, lengths: Tensor, streaming: Tensor, total: int) -> tuple[Tensor | BlockMask, Tensor]:
        """Boolean SDPA mask [B, 1, T, T] (a BlockMask of the same pattern with the flex kernel) and
        frame validity [B, T] for right-padded rows.

        Streaming rows let frame i see every frame before the end of its chunk, (i // chunk + 1) * chunk,
        with chunks counted from frame 0 (the first prompt frame); other rows see all valid frames.
        """
        pos = torch.arange(total, device=lengths.device)
        valid = pos[None] < lengths[:, None]
        if self.attention_kernel == "flex":
            return self._block_mask(lengths, streaming, total), valid
        visible = valid[:, None, :].expand(-1, total, -1)
        chunk = self.config.static_chunk_size
        if chunk > 0:
            in_chunk = pos[None, :] < ((pos // chunk + 1) * chunk)[:, None]
            visible = visible & (in_chunk[None] | ~streaming[:, None, None])
        return visible[:, None], valid

    def _block_mask(self, lengths: Tensor, streaming: Tensor, total: int) -> BlockMask:
        """The flex block mask of `attention_mask`'s pattern, built from the rows' lengths block by
        block (B x blocks^2 cells, where create_block_mask would evaluate all B x T^2 pairs)."""
        chunk = self.config.static_chunk_size

        def visible(b, h, q, k):  # padded queries see nothing: flex skips their blocks (their output is zeroed)
            seen = (k < lengths[b]) & (q < lengths[b])
            if chunk > 0:
                seen = seen & ((k < (q // chunk + 1) * chunk) | ~streaming[b])
            return seen

        size = FLEX_BLOCK
        start = torch.arange(-(-total // size), device=lengths.device) * size
        length = lengths[:, None, None]
        q0, k0 = start[None, :, None], start[None, None, :]
        some = (q0 < length) & (k0 < length)  # a block with any visible pair, and one with all visible
        every = (q0 + size <= length) & (k0 + size <= length)
        if chunk > 0:  # a query's chunk end grows with it: the block's last valid query sees the most
            whole_rows = ~streaming[:, None, None]
            last_q = torch.minimum(q0 + size - 1, length - 1)
            some = some & (whole_rows | (k0 < (last_q // chunk + 1) * chunk))
            every = every & (whole_rows | (k0 + size <= (q0 // chunk + 1) * chunk))
        return BlockMask.from_kv_blocks(*block_lists(some & ~every), *block_lists(every), BLOCK_SIZE=size,
                                        mask_mod=visible, seq_lengths=(total, total))

    def forward(self, x: Tensor, mu: Tensor, cond: Tensor, spks: Tensor, t: Tensor, mask: Tensor, valid: Tensor) -> Tensor:
        """x, mu, cond: [B, T, mel]; spks: [B, spk]; t: [B]; mask, valid: from `attention_mask`."""
        temb = self.time_embed(t)
        h = self.input_embed(x, cond, mu, spks)
        rope = self.rotary_embed(h.shape[1])
        for block in self.transformer_blocks:
            h, _ = block(h, temb, mask, valid, rope)
        return self._out(h, temb)

    def forward_continued(self, x: Tensor, mu: Tensor, cond: Tensor, spks: Tensor, t: Tensor, mask, valid: Tensor,
                          rope: tuple[Tensor, Tensor], past: list | None, tails) -> tuple[Tensor, list, tuple]:
        """`forward` for frames that follow earlier ones (`flow_cache`): rope at their positions, each layer's
        past (keys, values) before them (None: none), the input embedding's tails (None: zeros).
        -> (velocity, each layer's keys and values of these frames, the embedding's convolution inputs)."""
        temb = self.time_embed(t)
        h, seqs = self.input_embed.continued(x, cond, mu, spks, tails)
        kvs = []
        for i, block in enumerate(self.transformer_blocks):
            h, kv = block(h, temb, mask, valid, rope, None if past is None else past[i])
            kvs.append(kv)
        return self._out(h, temb), kvs, seqs

    def forward_packed(self, x: Tensor, mu: Tensor, cond: Tensor, spks: Tensor, t: Tensor, packing) -> Tensor:
        """`forward` with the rows' valid frames packed end to end (`packing.Packing`): the same velocity
        at every valid frame, zeros elsewhere."""
        if isinstance(packing.mask, RowSpans):  # no row is longer than the padded rows
            packing = replace(packing, mask=RowSpans(packing.mask.starts, bound=x.new_empty(x.shape[1], 0)))
        v = self.forward_slots(packing.pack(x), packing.pack(mu), packing.pack(cond), spks, t, packing)
        return packing.unpack(v, x.shape[0], x.shape[1])

    def forward_slots(self, x: Tensor, mu: Tensor, cond: Tensor, spks: Tensor, t: Tensor, packing) -> Tensor:
        """`forward` of frames already packed [1, S, mel] (spks [R, spk], t [R]: per row of `packing`, whose
        `frames` it does not read) -> velocity [1, S, mel], zeros where `packing.valid` is not set."""
        temb = self.time_embed(t)
        h = self.input_embed.continued_packed(x, cond, mu, spks, packing)[0]
        rope = self.rotary_embed.at(packing.positions)
        for block in self.transformer_blocks:
            h, _ = block(h, temb, packing.mask, packing.valid, rope, rows=packing.rows)
        return self._out(h, temb, packing.rows)

    def forward_continued_packed(self, x: Tensor, mu: Tensor, cond: Tensor, spks: Tensor, t: Tensor, packing,
                                 past: list | None, tails) -> tuple[Tensor, list, list]:
        """`forward_continued` of packed new frames (a `Packing` by `continued_packing`): x, mu, cond [1, S, mel];
        spks [R, spk], t [R] per row; past: each layer's earlier (keys, values) [P, H, D] packed by row, or
        those of every frame they are read from at the mask's `past_frames`
        (None: none); tails: the input embedding's context per row (None: zeros). -> (velocity [1, S, mel],
        each layer's keys and values of these frames [S, H, D], the convolutions' input layouts)."""
        temb = self.time_embed(t)
        h, layouts = self.input_embed.continued_packed(x, cond, mu, spks, packing, tails)
        rope = self.rotary_embed.at(packing.positions)
        kvs = []
        for i, block in enumerate(self.transformer_blocks):
            h, kv = block(h, temb, packing.mask, packing.valid, rope, None if past is None else past[i],
                          rows=packing.rows)
            kvs.append(kv)
        return self._out(h, temb, packing.rows), kvs, layouts

    def _out(self, h: Tensor, temb: Tensor, rows: Tensor | None = None) -> Tensor:
        scale, shift = (per_frame(v, rows) for v in self.norm_out(temb))
        h = modulate(F.layer_norm(h, h.shape[-1:], eps=self.config.norm_eps), scale, shift)
        return self.proj_out(h)
