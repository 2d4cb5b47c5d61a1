"""Reference clips -> codes, many clips per encoder call.

The codec encoder is causal, so a clip right-padded with silence keeps the codes of its own
frames: clips of different lengths share one call and the padding frames are cut off. Lengths
are padded to buckets of ~2 s and rows to powers of two, so the encoder sees few distinct
shapes: the convolution and attention kernels pick their plans once per shape, and a fresh
shape costs far more than the encode itself.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from intone.ops.batching import bucket_rows
from intone.models.fish_s2.codec import FishCodec

FRAME_BUCKET = 43  # frames (~2.0 s at 44.1 kHz / 2048)
MAX_ROWS = 16
MAX_BATCH_FRAMES = MAX_ROWS * 4 * FRAME_BUCKET  # rows x padded frames per call (16 clips of 8 s)
WARM_UP_SECONDS = 10  # every length bucket up to this, primed at start-up


def bucket_frames(frames: int) -> int:
    return max(1, math.ceil(frames / FRAME_BUCKET)) * FRAME_BUCKET


def plan_calls(frames: list[int]) -> list[list[int]]:
    """Clip indices per encoder call: by padded length, at most MAX_ROWS rows and
    MAX_BATCH_FRAMES padded frames (rows rounded up to a power of two) per call."""
    order = sorted(range(len(frames)), key=lambda i: bucket_frames(frames[i]))
    calls: list[list[int]] = []
    for i in order:
        call = calls[-1] if calls else None
        longest = bucket_frames(frames[i])
        if call and len(call) < MAX_ROWS and bucket_rows(len(call) + 1) * longest <= MAX_BATCH_FRAMES:
            call.append(i)
        else:
            calls.append([i])
    return calls


def _encode(codec: FishCodec, batch: Tensor, graphs) -> Tensor:
    if graphs is None:
        return codec.encode(batch)
    return graphs.run("fish encoder", codec.encode, batch)[0]


@torch.inference_mode()
def encode_batch(codec: FishCodec, wavs: list[Tensor], graphs=None) -> list[Tensor]:
    """44.1 kHz mono clips [N] -> codes [K, ceil(N / hop)] each (int64, CPU); the encoder replayed
    from `graphs` (an engine's FunctionGraphs) where `warm_up_encoder` captured its shape."""
    hop = codec.hop_length
    device = next(codec.parameters()).device
    frames = [max(1, math.ceil(w.shape[0] / hop)) for w in wavs]
    out: list[Tensor | None] = [None] * len(wavs)
    for call in plan_calls(frames):
        padded = bucket_frames(max(frames[i] for i in call)) * hop
        batch = torch.zeros(bucket_rows(len(call)), padded, dtype=torch.float32)
        for row, i in enumerate(call):
            batch[row, : wavs[i].shape[0]] = wavs[i]
        codes = _encode(codec, batch.to(device, non_blocking=True), graphs).cpu()
        for row, i in enumerate(call):
            out[i] = codes[row, :, : frames[i]].clone()
    return out


@torch.inference_mode()
def warm_up_encoder(codec: FishCodec, graphs=None) -> int:
    """Encode silence once per (rows, length) bucket of the usual reference lengths (captured in
    `graphs` too, when given); returns the count."""
    device = next(codec.parameters()).device
    hop, rate = codec.hop_length, codec.sample_rate
    shapes = 0
    for length in range(FRAME_BUCKET, bucket_frames(math.ceil(WARM_UP_SECONDS * rate / hop)) + 1, FRAME_BUCKET):
        rows = 1
        while rows <= MAX_ROWS and rows * length <= MAX_BATCH_FRAMES:
            silence = torch.zeros(rows, length * hop, device=device)
            codec.encode(silence)
            if graphs is not None:
                graphs.capture("fish encoder", codec.encode, silence)
            shapes += 1
            rows *= 2
    return shapes
