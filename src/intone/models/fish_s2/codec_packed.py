"""The carried decode with its convolutional part on packed rows (`codec.packed_decode`).

The padded decode (codec_stream.py) right-pads a call's chunks to its longest, and every convolution of the
decoder then computes the padding too: 42-54% of the Fish codec's decoder frames in served calls (sessions 23,
32, 40). Here the windowed transformer still runs on the padded rows (frame rate, cheap), and everything after
it (the quantizer's upsampling and the decoder, where the samples multiply by 2048) runs on one row that holds
each chunk's samples after a gap of its own:

    [gap | chunk 0 | gap | chunk 1 | ... | gap | chunk B-1 | tail up to the bucketed length]

Before each convolution that carries a history of h samples, each chunk's history is written into the last h
places of its gap and its new history read from the last h places it leaves (a chunk shorter than h reads part of
the history back, as the padded decode does), and the convolution runs over the whole row with its causal
left padding: a chunk's outputs read only its own samples and its history. The gap, in frames, is the most any
layer needs at its rate (h over the upsampling so far, rounded up; 3 frames at full size; found by the
layout's trace), and every layer's output in the gaps and the tail is never read by a chunk. So each chunk gets the padded decode's sums, and a
request's state moves between packed and padded calls unchanged.

The packed length is rounded up to `packed_frames` (one of a few shapes for cuDNN's plans and the warm-up,
whatever the call's rows); no CUDA graphs yet.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from intone.models.fish_s2.codec_modules import CausalConv, CausalTransConv
from intone.models.fish_s2.codec_stream import StateLayout, StreamingDecoder, _Context


def packed_frames(frames: int) -> int:
    """The packed length a call of `frames` frames (gaps included) runs at: eight steps per doubling above 256
    frames (at most 12.5% more), multiples of 32 below."""
    unit = max(32, 1 << max(0, frames.bit_length() - 4))
    return -(-frames // unit) * unit


class _Packed(_Context):
    """The padded context's histories and lengths, with the layers after the transformer run on one packed row."""

    def __init__(self, layout: StateLayout, flats: tuple[Tensor, ...], lengths: Tensor, gap: int, total: int):
        super().__init__(layout, flats, lengths)
        self.gap, self.total = gap, total  # at the current rate, samples
        self.rows = lengths.shape[0]
        self.starts = torch.cumsum(lengths + gap, 0) - lengths  # each chunk's first place
        self.frame_starts, self.frames, self.frame_total = self.starts, lengths, total  # at the frame rate
        self.width = 0  # the padded rows' frames (the transformer's)
        self.places: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}

    def after_transformer(self, z: Tensor) -> Tensor:
        """z [B, D, T] right-padded -> [1, D, total], each chunk after its gap (zeros elsewhere)."""
        b, d, t = z.shape
        self.width = t
        place = self.starts.view(-1, 1) + torch.arange(t, device=z.device)
        place = torch.where(torch.arange(t, device=z.device) < self.lengths.view(-1, 1), place, self.total)
        packed = z.new_zeros(d, self.total + 1)  # the last place takes every padding frame, then goes
        packed.index_copy_(1, place.reshape(-1), z.transpose(0, 1).reshape(d, b * t))
        return packed[:, : self.total].unsqueeze(0)

    def audio(self, samples: Tensor) -> Tensor:
        """[1, total x hop] -> [B, T x hop], each chunk's samples at the start of its row, zeros after."""
        hop = samples.shape[-1] // self.frame_total
        t = torch.arange(self.width * hop, device=samples.device)
        place = (self.frame_starts * hop).view(-1, 1) + t
        valid = t < (self.frames * hop).view(-1, 1)
        return torch.where(valid, samples[0][place.clamp(max=samples.shape[-1] - 1)], 0)

    def _write_history(self, x: Tensor, key: str, h: int) -> None:
        """Each chunk's history of this layer into the last h places of its gap; its new one kept."""
        if h > self.gap:
            raise ValueError(f"{key}: a history of {h} samples does not fit a gap of {self.gap}")
        c = x.shape[1]
        behind, tail = self._places(h)
        x[0].index_copy_(1, behind, self.history(key, lambda: x.new_zeros(1, c, h)).transpose(0, 1).reshape(c, -1))
        self.keep(key, x[0][:, tail].view(c, self.rows, h).transpose(0, 1))

    def _places(self, h: int) -> tuple[Tensor, Tensor]:
        """The last h places of each chunk's gap, and the last h it leaves, at the current rate (made once a
        call per (rate, h): a rate's layers share a few)."""
        key = (self.gap, h)  # the gap grows with the rate
        if key not in self.places:
            behind = (self.starts.view(-1, 1) - h + torch.arange(h, device=self.starts.device)).reshape(-1)
            self.places[key] = behind, behind + self.lengths.repeat_interleave(h)
        return self.places[key]

    def conv(self, module: CausalConv, x: Tensor, key: str, bias: bool = True) -> Tensor:
        if module.stride != 1:
            raise ValueError("a strided convolution cannot be decoded in chunks")
        h = module.span - 1
        if h:
            self._write_history(x, key, h)
        return module(x, bias)  # its causal left padding: the output at each place of the row

    def trans_conv(self, module: CausalTransConv, x: Tensor, key: str) -> Tensor:
        stride, trim = module.conv.stride[0], module.trim
        if trim not in (0, stride):
            raise ValueError(f"transposed conv with kernel {trim + stride} and stride {stride}: not streamable here")
        if trim:
            self._write_history(x, key, 1)
        out = module(x)  # [1, C, total x stride]: place p's block from samples p and p - 1
        self.lengths, self.starts = self.lengths * stride, self.starts * stride
        self.gap, self.total = self.gap * stride, self.total * stride
        return out


class PackedStreamingDecoder(StreamingDecoder):
    """The carried decode, the layers after its transformer on a packed row (eager: its shapes follow the
    call's lengths, bucketed by `packed_frames`)."""

    @functools.cached_property
    def gap(self) -> int:
        """The frames before each chunk: the most any layer after the transformer reads behind it (3 at full size:
        the upsampling's kernel-7 ConvNeXt at twice the frame rate), found by the layout's trace of `_run`."""
        return max(self.layout(next(self.codec.parameters()).device).reach, 1)

    def packed_length(self, lengths: list[int]) -> int:
        return packed_frames(sum(lengths) + self.gap * len(lengths))

    def capture(self, graphs, rows: int, frames: int, device: torch.device) -> None:
        raise ValueError("codec.packed_decode runs eagerly (no CUDA graphs of the packed decode yet)")

    def decode(self, codes: Tensor, lengths: list[int], states: list) -> tuple[Tensor, list]:
        self._total = self.packed_length(lengths)
        return super().decode(codes, lengths, states)

    def _context(self, flats: tuple[Tensor, ...], n: Tensor) -> _Context:
        return _Packed(self._layout, flats, n, self.gap, self._total)
