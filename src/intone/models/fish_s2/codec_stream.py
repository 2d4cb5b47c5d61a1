"""Stateful decode of the Fish codec: a request's frames arrive in chunks, and each chunk is decoded
against the state its earlier chunks left, so the chunks' audio, joined, is the one-pass decode of
all the frames (no re-decoded left context, no seams).

Every layer of the decoder path is causal, and each keeps a bounded history:
- a stride-1 causal convolution: its last (span - 1) input samples (its left padding, zeros at first);
- a transposed convolution with kernel 2 x stride: its last input sample, whose second half-kernel
  overlaps the next chunk's first output block (kernel == stride: nothing);
- each layer of the windowed transformer: the keys (rotated) and values of its last window - 1 frames.
Everything else (lookups, Snake, norms, pointwise layers, residual adds) is per sample.

Rows of a batch are right-padded to one length; a causal layer's outputs at valid positions never
see the padding, and each row's new history is taken at its own end (a gather), so requests of
different chunk lengths and histories decode together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from intone.models.fish_s2.codec import FishCodec
from intone.models.fish_s2.codec_modules import (
    CausalConv, CausalTransConv, ConvNeXtBlock, ResidualUnit, Snake, WindowTransformer,
    masked_attention,
)
from intone.models.fish_s2.decoder_tc import decode_tc
from intone.models.fish_s2.layers import rope_table
from intone.ops.fused import rope_pairs_factors, rotate_pairs
from intone.ops.snake import bias_residual, snake

NO_POSITION = -(2**40)  # the position of a history slot not yet filled: outside every window


@dataclass
class DecoderState:
    """One request's histories: one flat row per dtype of its decoder's `StateLayout` (views of the
    call that left them)."""

    frames: int  # frames decoded so far (the next chunk's first absolute frame)
    rows: tuple[Tensor, ...]


class StateLayout:
    """Where each layer's history sits in a state row: a request's histories are a few flat tensors
    (one per dtype), so a call gathers a batch's states in one stack per dtype and the decode is a
    function of fixed-shape tensors (a CUDA graph replays it). Found by tracing one decode."""

    def __init__(self, blanks: dict[str, Tensor], reach: int = 0):
        """blanks: each layer's history of a request with none yet ([1, ...]), in the decode's order; reach: the
        most frames a layer after the transformer reads behind a chunk (its history over the upsampling before it,
        rounded up: the packed decode's gap)."""
        self.reach = reach
        self.dtypes = list(dict.fromkeys(t.dtype for t in blanks.values()))
        self.entries: dict[str, tuple[int, int, torch.Size]] = {}
        sizes = [0] * len(self.dtypes)
        for key, blank in blanks.items():
            group = self.dtypes.index(blank.dtype)
            self.entries[key] = (group, sizes[group], blank.shape[1:])
            sizes[group] += blank[0].numel()
        self.blanks = [torch.cat([b.reshape(-1) for b in blanks.values() if b.dtype == d]) for d in self.dtypes]


class StreamingDecoder:
    """graphs: CUDA graphs of the decode (`capture`); calls at other shapes run eagerly. fused: the
    decoder's layers through `_run_decoder` (fewer copies, the same values) instead of one by one;
    time_major: through `decoder_tc.decode_tc` (activations and histories time-major; its own state layout)."""

    def __init__(self, codec: FishCodec, fused: bool = False, time_major: bool = False):
        if fused and time_major:
            raise ValueError("the time-major decode has no lean variant (it writes its Snakes into its buffers)")
        self.codec = codec
        self.fused, self.time_major = fused, time_major
        self.graphs = None
        self._layout: StateLayout | None = None

    def layout(self, device: torch.device) -> StateLayout:
        if self._layout is None:
            tracer = _Tracer()
            codes = torch.zeros(1, self.codec.cfg.num_codebooks, 1, dtype=torch.long, device=device)
            one = torch.ones(1, dtype=torch.long, device=device)
            with torch.inference_mode():
                self._forward(codes, one, one - 1, tracer)
            self._layout = StateLayout(tracer.blanks, tracer.reach)
        return self._layout

    @torch.inference_mode()
    def decode(self, codes: Tensor, lengths: list[int], states: list[DecoderState | None]) -> tuple[Tensor, list]:
        """codes [B, K, T] (row i valid up to lengths[i], right-padded), each row's state (None: a
        request's first chunk) -> (audio [B, T * hop], padded like the codes; the rows' new states)."""
        device = codes.device
        layout = self.layout(device)
        n = torch.tensor(lengths, device=device)
        start = torch.tensor([s.frames if s else 0 for s in states], device=device)
        flats = [torch.stack([s.rows[g] if s else blank.to(device) for s in states])
                 for g, blank in enumerate(layout.blanks)]
        inputs = (codes.long(), n, start, *flats)
        if self.graphs is not None:
            audio, *new = self.graphs.run("fish.stream_decode", self._flat, *inputs)
        else:
            audio, *new = self._flat(*inputs)
        rows = list(zip(*(f.unbind(0) for f in new)))
        frames = [(s.frames if s else 0) + length for s, length in zip(states, lengths)]
        return audio, [DecoderState(f, r) for f, r in zip(frames, rows)]

    def capture(self, graphs, rows: int, frames: int, device: torch.device) -> None:
        """A graph of the decode of `rows` chunks of `frames` (start-up only)."""
        layout = self.layout(device)
        codes = torch.zeros(rows, self.codec.cfg.num_codebooks, frames, dtype=torch.long, device=device)
        n = torch.full((rows,), frames, dtype=torch.long, device=device)
        flats = [blank.to(device).expand(rows, -1).contiguous() for blank in layout.blanks]
        with torch.inference_mode():
            graphs.capture("fish.stream_decode", self._flat, codes, n, torch.zeros_like(n), *flats)
        self.graphs = graphs

    def _flat(self, codes: Tensor, n: Tensor, start: Tensor, *flats: Tensor) -> tuple[Tensor, ...]:
        """The decode as a function of tensors: (audio, the new state rows per dtype)."""
        ctx = self._context(flats, n)
        audio = self._forward(codes, n, start, ctx)
        return (audio, *ctx.outputs())

    def _context(self, flats: tuple[Tensor, ...], n: Tensor) -> "_Context":
        return _Context(self._layout, flats, n)

    def _forward(self, codes: Tensor, n: Tensor, start: Tensor, ctx) -> Tensor:
        q = self.codec.quantizer
        ctx.lengths = n
        semantic = codes[:, :1].clamp(max=q.semantic_quantizer.codebook_size - 1)
        residual = codes[:, 1:].clamp(max=q.quantizer.codebook_size - 1)
        z = q.semantic_quantizer.lookup(semantic) + q.quantizer.lookup(residual)
        z = ctx.after_transformer(_transformer(q.post_module, z, start, ctx, "post"))
        z = _run(q.upsample, z, ctx, "up")
        z = z.to(self.codec.dtype)
        if self.time_major:
            return ctx.audio(decode_tc(self.codec.decoder.model, z, ctx, "dec"))
        run = _run_decoder if self.fused else _run
        return ctx.audio(run(self.codec.decoder.model, z, ctx, "dec").squeeze(1))


class _Layers:
    """How a context runs the layers that carry histories: here on right-padded rows."""

    lengths: Tensor | None
    _tails: tuple = (None, None)  # `tail`'s indices: (the lengths they are for, {h: index})

    def tail(self, x: Tensor, h: int, dim: int = 2) -> Tensor:
        """x [B, C, L] (dim 1: time-major [B, L, C]), a layer's input behind its h samples of history: each row's
        h samples from lengths[i] on (the history the row leaves: the last h before its valid end). Each index is
        made once per h and rate (a call reads ~40 histories, of 19 distinct shapes)."""
        lengths, index = self._tails
        if lengths is not self.lengths:
            lengths, index = self.lengths, {}
            self._tails = lengths, index
        if h not in index:
            index[h] = (lengths.view(-1, 1) + torch.arange(h, device=x.device)).unsqueeze(1)
        if dim == 1:
            return torch.gather(x, 1, index[h].transpose(1, 2).expand(-1, -1, x.shape[2]))
        return torch.gather(x, 2, index[h].expand(-1, x.shape[1], -1))

    def conv(self, module: CausalConv, x: Tensor, key: str, bias: bool = True) -> Tensor:
        return _conv(module, x, self, key, bias)

    def trans_conv(self, module: CausalTransConv, x: Tensor, key: str) -> Tensor:
        return _trans_conv(module, x, self, key)

    def after_transformer(self, z: Tensor) -> Tensor:
        return z

    def audio(self, samples: Tensor) -> Tensor:
        return samples


class _Context(_Layers):
    """The batch's old histories (views of the stacked state rows), the new ones as each layer
    leaves them, and each row's valid length at the current rate (it grows through the upsampling)."""

    def __init__(self, layout: StateLayout, flats: tuple[Tensor, ...], lengths: Tensor):
        self.layout, self.flats, self.lengths = layout, flats, lengths
        self.kept: dict[str, Tensor] = {}

    def history(self, key: str, blank) -> Tensor:
        """The rows' histories for this layer ([B, *blank().shape[1:]]; blank is the tracer's, not called here)."""
        group, offset, shape = self.layout.entries[key]
        return self.flats[group][:, offset: offset + shape.numel()].unflatten(1, shape)

    def keep(self, key: str, rows: Tensor) -> None:
        self.kept[key] = rows.reshape(rows.shape[0], -1)

    def outputs(self) -> list[Tensor]:
        keys = list(self.layout.entries)
        return [torch.cat([self.kept[k] for k in keys if self.layout.entries[k][0] == g], dim=1)
                for g in range(len(self.layout.dtypes))]


class _Tracer(_Layers):
    """A context for finding the layout: every history is blank; the order of first use is kept."""

    def __init__(self):
        self.blanks: dict[str, Tensor] = {}
        self.lengths = None
        self.rate, self.reach = 1, 0  # the upsampling so far; `StateLayout.reach`

    def conv(self, module: CausalConv, x: Tensor, key: str, bias: bool = True) -> Tensor:
        self.reach = max(self.reach, -(-(module.span - 1) // self.rate))
        return super().conv(module, x, key, bias)

    def trans_conv(self, module: CausalTransConv, x: Tensor, key: str) -> Tensor:
        self.reach = max(self.reach, -(-min(module.trim, 1) // self.rate))
        self.rate *= module.conv.stride[0]
        return super().trans_conv(module, x, key)

    def history(self, key: str, blank) -> Tensor:
        self.blanks[key] = blank()
        return self.blanks[key]

    def keep(self, key: str, rows: Tensor) -> None:
        pass


def _run(module: nn.Module, x: Tensor, ctx: _Context, key: str) -> Tensor:
    """module(x) with carried histories, for the module kinds on the decoder path."""
    if isinstance(module, nn.Sequential):
        for i, child in enumerate(module):
            x = _run(child, x, ctx, f"{key}.{i}")
        return x
    if isinstance(module, CausalConv):
        return ctx.conv(module, x, key)
    if isinstance(module, CausalTransConv):
        return ctx.trans_conv(module, x, key)
    if isinstance(module, ResidualUnit):
        return module.residual(x, lambda i, y, bias: ctx.conv(module.block[i], y, f"{key}.{i}", bias))
    if isinstance(module, ConvNeXtBlock):
        y = ctx.conv(module.dwconv, x, key).transpose(1, 2)
        y = module.pwconv2(module.act(module.pwconv1(module.norm(y))))
        return x + (module.gamma * y).transpose(1, 2)
    if hasattr(module, "block") or hasattr(module, "model"):  # DecoderBlock, Decoder: a Sequential inside
        return _run(getattr(module, "block", None) or module.model, x, ctx, key)
    return module(x)  # per sample: Snake, Tanh


def _conv(module: CausalConv, x: Tensor, ctx: _Context, key: str, bias: bool = True) -> Tensor:
    if module.stride != 1:
        raise ValueError("a strided convolution cannot be decoded in chunks")
    h = module.span - 1
    if h == 0:
        return module.valid(x, bias)
    xh = torch.cat([ctx.history(key, lambda: x.new_zeros(1, x.shape[1], h)), x], dim=2)
    ctx.keep(key, ctx.tail(xh, h))
    return module.valid(xh, bias)


def _trans_conv(module: CausalTransConv, x: Tensor, ctx: _Context, key: str) -> Tensor:
    stride, trim = module.conv.stride[0], module.trim
    if trim == 0:
        out = module.conv(x)
    elif trim == stride:  # kernel 2 x stride: the last input's second half reaches the next block
        xh = torch.cat([ctx.history(key, lambda: x.new_zeros(1, x.shape[1], 1)), x], dim=2)
        ctx.keep(key, ctx.tail(xh, 1))
        out = module.conv(xh)[..., stride: stride * (x.shape[2] + 1)]
    else:
        raise ValueError(f"transposed conv with kernel {trim + stride} and stride {stride}: not streamable here")
    ctx.lengths = ctx.lengths * stride
    return out


def _transformer(module: WindowTransformer, x: Tensor, start: Tensor, ctx: _Context, key: str) -> Tensor:
    """Channels-first x [B, D, T] at absolute frames start[i] + t; each layer attends over its kept
    keys and values of the last window - 1 frames and the chunk's own, within the window."""
    b, _, t = x.shape
    keep = module.window - 1
    positions = start.view(-1, 1) + torch.arange(t, device=x.device)  # [B, T]
    # the rotation's factors once for every layer (made per layer and per q and k: ~100 torch calls a call)
    rope = rope_pairs_factors(rope_table(positions, module.head_dim, module.rope_base), x.dtype)
    past = ctx.history(f"{key}.pos", lambda: torch.full((1, keep), NO_POSITION, device=x.device, dtype=torch.long))
    key_pos = torch.cat([past, torch.where(torch.arange(t, device=x.device) < ctx.lengths.view(-1, 1),
                                           positions, NO_POSITION)], dim=1)  # [B, keep + T]
    ctx.keep(f"{key}.pos", ctx.tail(key_pos.unsqueeze(1), keep).squeeze(1))
    qp, kp = positions.unsqueeze(2), key_pos.unsqueeze(1)
    mask = (kp <= qp) & (kp > qp - module.window)
    # A padding query row sees its own key, so no row is all -inf (a NaN there would reach valid rows
    # through the attention's 0 x NaN products in the next layer).
    mask |= torch.arange(keep + t, device=x.device) == torch.arange(keep, keep + t, device=x.device).view(-1, 1)
    mask = mask.unsqueeze(1)  # [B, 1, T, keep + T]
    h = x.transpose(1, 2)
    for i, layer in enumerate(module.layers):
        h = _block(layer, h, rope, mask, ctx, f"{key}.{i}", keep)
    return module.norm(h).transpose(1, 2)


def _block(layer, h: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, ctx: _Context, key: str,
           keep: int) -> Tensor:
    """rope: (cos, sin) from `rope_pairs_factors`."""
    attn = layer.attention
    heads, head_dim = attn.n_head, attn.head_dim
    qkv = attn.wqkv(layer.attention_norm(h)).unflatten(-1, (3 * heads, head_dim))
    # queries and keys are adjacent heads of one projection: rotated in one pass, the same values
    q, k = rotate_pairs(qkv[..., : 2 * heads, :], *rope).split(heads, dim=-2)
    v = qkv[..., 2 * heads:, :]
    # [B, keep + T, H, d]; the blank histories are the tracer's
    k = torch.cat([ctx.history(f"{key}.k", lambda: qkv.new_zeros(1, keep, heads, head_dim)), k], dim=1)
    v = torch.cat([ctx.history(f"{key}.v", lambda: qkv.new_zeros(1, keep, heads, head_dim)), v], dim=1)
    ctx.keep(f"{key}.k", ctx.tail(k.flatten(2).transpose(1, 2), keep).transpose(1, 2).unflatten(2, (heads, -1)))
    ctx.keep(f"{key}.v", ctx.tail(v.flatten(2).transpose(1, 2), keep).transpose(1, 2).unflatten(2, (heads, -1)))
    y = masked_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
    h = h + layer.attention_layer_scale(attn.wo(y.transpose(1, 2).flatten(-2)))
    return h + layer.ffn_layer_scale(layer.feed_forward(layer.ffn_norm(h)))


# ---- the decoder with fewer copies ------------------------------------------------------------------
# What `_run` computes, with the copies its layers make one by one left out (on a GPU, where cuDNN adds a
# convolution's bias as a pass of its own and the Triton kernels take strided views):
# - a Snake that feeds a convolution with a history writes straight into that convolution's input buffer,
#   after the rows' histories, instead of into a tensor that is then concatenated to them;
# - a transposed convolution runs without its bias; the kernels after it (the first residual unit's
#   Snake and its residual add) add it as they read its output's slice in place, rounded as the bias
#   pass rounds it, where `_run` copies that slice twice to make it contiguous.
# The same sums in the same order: expected bit-equal on a GPU with cuDNN's deterministic plans (a GPU test,
# written in session 28 and not yet run), float rounding apart on a CPU, whose convolutions add their biases inside.


def _run_decoder(decoder: nn.Sequential, z: Tensor, ctx: _Context, key: str) -> Tensor:
    """`_run` over the decoder (in convolution, decoder blocks, Snake, out convolution, Tanh)."""
    layers = list(decoder)
    x, i = _conv(layers[0], z, ctx, f"{key}.0"), 1
    while i < len(layers):
        layer, after = layers[i], layers[i + 1] if i + 1 < len(layers) else None
        if _doubled_trans_conv(layer):
            x = _decoder_block(layer.block, x, ctx, f"{key}.{i}")
        elif isinstance(layer, Snake) and isinstance(after, CausalConv) and after.span > 1 and after.stride == 1:
            x = after.valid(_snake_into(layer, x, after.span - 1, ctx, f"{key}.{i + 1}"))
            i += 1
        else:
            x = _run(layer, x, ctx, f"{key}.{i}")
        i += 1
    return x


def _doubled_trans_conv(layer: nn.Module) -> bool:
    """A decoder block (Snake, transposed convolution of kernel 2 x stride, residual units)."""
    parts = list(getattr(layer, "block", ()))
    if len(parts) < 3 or not isinstance(parts[0], Snake) or not isinstance(parts[1], CausalTransConv):
        return False
    up = parts[1].conv  # `_decoder_block` passes only its weight and stride
    plain = (up.padding, up.output_padding, up.dilation, up.groups) == ((0,), (0,), (1,), 1)
    return plain and parts[1].trim == up.stride[0] and all(isinstance(p, ResidualUnit) for p in parts[2:])


def _snake_into(act: Snake, x: Tensor, h: int, ctx: _Context, key: str, bias: Tensor | None = None) -> Tensor:
    """The input of the convolution at `key` that follows `act`: its rows' histories of h samples, then
    act(x + bias) written after them (no concatenation); its new histories kept."""
    history = ctx.history(key, lambda: x.new_zeros(1, x.shape[1], h))
    buffer = torch.empty(x.shape[0], x.shape[1], h + x.shape[2], dtype=x.dtype, device=x.device)
    buffer[..., :h] = history
    snake(x, act.alpha, bias, out=buffer[..., h:])
    ctx.keep(key, ctx.tail(buffer, h))
    return buffer


def _decoder_block(layers: nn.Sequential, x: Tensor, ctx: _Context, key: str) -> Tensor:
    act, up, *units = layers
    stride = up.conv.stride[0]
    xh = _snake_into(act, x, 1, ctx, f"{key}.1")  # the last input's second half-kernel reaches this chunk
    y = F.conv_transpose1d(xh, up.conv.weight, None, stride)[..., stride: stride * (x.shape[2] + 1)]
    ctx.lengths = ctx.lengths * stride
    pending = up.conv.bias  # added by the first residual unit's kernels
    for j, unit in enumerate(units, start=2):
        y, pending = _residual_unit(unit, y, ctx, f"{key}.{j}", pending), None
    return y


def _residual_unit(unit: ResidualUnit, x: Tensor, ctx: _Context, key: str, x_bias: Tensor | None) -> Tensor:
    """(x + x_bias) + unit's block of it: `ResidualUnit.residual`'s CUDA order, x read in place."""
    act_in, conv_in, act_mid, conv_out = unit.block
    y = conv_in.valid(_snake_into(act_in, x, conv_in.span - 1, ctx, f"{key}.1", x_bias), False)
    y = snake(y, act_mid.alpha, conv_in.conv.bias)
    return bias_residual(x, conv_out.valid(y, False), conv_out.conv.bias, x_bias)
