"""Reference clips -> codes, many clips per encoder call.

The codec encoder is causal, so a clip right-padded with silence keeps the codes of its own
frames: clips of different lengths share one call and the padding frames are cut off. Lengths
are padded to buckets (~2 s by default) and rows to powers of two, so the encoder sees few distinct
shapes: the convolution and attention kernels pick their plans once per shape, and a fresh
shape costs far more than the encode itself. `ReferencePlan` (the profile's `fish_s2` section)
sets the rows and the bucket: at C64 a call holds ~3 clips, and padding them to 4 rows and to the
longest one's 2 s bucket computes ~45% padding, where one clip a call in 1 s buckets computes ~8%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from intone.ops.batching import bucket_rows
from intone.models.fish_s2.codec import FishCodec
from intone.ops.host_copy import to_device, to_host

FRAME_BUCKET = 43  # frames (~2.0 s at 44.1 kHz / 2048)
MAX_ROWS = 16
LONGEST_USUAL_FRAMES = 4 * FRAME_BUCKET  # the padded length that bounds a call's rows (8 s)
WARM_UP_SECONDS = 10  # every length bucket up to this, primed at start-up


@dataclass(frozen=True)
class ReferencePlan:
    """Clips per encoder call at most, and the length bucket (frames) a call pads to."""

    rows: int = MAX_ROWS
    bucket: int = FRAME_BUCKET

    @classmethod
    def of(cls, rows: int, bucket_s: float, rate: int, hop: int) -> "ReferencePlan":
        return cls(rows, max(1, round(bucket_s * rate / hop)))

    @property
    def max_batch_frames(self) -> int:
        """rows x padded frames per call (`rows` clips of 8 s)."""
        return self.rows * LONGEST_USUAL_FRAMES

    def frames(self, frames: int) -> int:
        return max(1, math.ceil(frames / self.bucket)) * self.bucket

    def calls(self, frames: list[int]) -> list[list[int]]:
        """Clip indices per encoder call: by padded length, at most `rows` clips and `max_batch_frames`
        padded frames (rows rounded up to a power of two) per call."""
        order = sorted(range(len(frames)), key=lambda i: self.frames(frames[i]))
        calls: list[list[int]] = []
        for i in order:
            call = calls[-1] if calls else None
            longest = self.frames(frames[i])
            if call and len(call) < self.rows and bucket_rows(len(call) + 1) * longest <= self.max_batch_frames:
                call.append(i)
            else:
                calls.append([i])
        return calls

    def shapes(self, rate: int, hop: int) -> list[tuple[int, int]]:
        """(rows, frames) of every call of clips up to WARM_UP_SECONDS long: what start-up primes."""
        out = []
        for length in range(self.bucket, self.frames(math.ceil(WARM_UP_SECONDS * rate / hop)) + 1, self.bucket):
            rows = 1
            while rows <= bucket_rows(self.rows) and (rows == 1 or rows * length <= self.max_batch_frames):
                out.append((rows, length))
                rows *= 2
        return out


def _encode(codec: FishCodec, batch: Tensor, graphs) -> Tensor:
    if graphs is None:
        return codec.encode(batch)
    return graphs.run("fish encoder", codec.encode, batch)[0]


@torch.inference_mode()
def encode_batch(codec: FishCodec, wavs: list[Tensor], graphs=None, plan: ReferencePlan = ReferencePlan()) -> list[Tensor]:
    """44.1 kHz mono clips [N] -> codes [K, ceil(N / hop)] each (int64, CPU); the encoder replayed
    from `graphs` (an engine's FunctionGraphs) where `warm_up_encoder` captured its shape."""
    hop = codec.hop_length
    device = next(codec.parameters()).device
    frames = [max(1, math.ceil(w.shape[0] / hop)) for w in wavs]
    out: list[Tensor | None] = [None] * len(wavs)
    for call in plan.calls(frames):
        padded = plan.frames(max(frames[i] for i in call)) * hop
        batch = torch.zeros(bucket_rows(len(call)), padded, dtype=torch.float32)
        for row, i in enumerate(call):
            batch[row, : wavs[i].shape[0]] = wavs[i]
        (codes,) = to_host(_encode(codec, to_device(batch, device), graphs))
        for row, i in enumerate(call):
            out[i] = codes[row, :, : frames[i]].clone()
    return out


@torch.inference_mode()
def warm_up_encoder(codec: FishCodec, graphs=None, plan: ReferencePlan = ReferencePlan()) -> int:
    """Encode silence once per (rows, length) shape of the usual reference lengths (captured in
    `graphs` too, when given); returns the count."""
    device = next(codec.parameters()).device
    shapes = plan.shapes(codec.sample_rate, codec.hop_length)
    for rows, length in sorted(shapes, key=lambda s: -s[0] * s[1]):  # largest first: the graphs share buffers
        silence = torch.zeros(rows, length * codec.hop_length, device=device)
        codec.encode(silence)
        if graphs is not None:
            graphs.capture("fish encoder", codec.encode, silence)
    return len(shapes)
