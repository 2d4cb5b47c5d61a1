"""Shaping batches of variable-length jobs: which jobs share a call, and the bucketed shapes
a call is padded to (so kernels meet few distinct shapes and plan each once)."""

from __future__ import annotations

import torch
from torch import Tensor

# ~25% apart above 64 frames: a whole utterance pads by at most a quarter (then multiples of 256)
FRAME_BUCKETS = (4, 8, 16, 32, 50, 64, 80, 100, 128, 160, 192, 256, 320, 384, 512)


def bucket_frames(frames: int) -> int:
    return next((b for b in FRAME_BUCKETS if b >= frames), -(-frames // 256) * 256)


def bucket_rows(rows: int) -> int:
    return 1 << max(0, rows - 1).bit_length()


def pad_rows(t: Tensor, target: int) -> Tensor:
    """t's rows padded to `target` with copies of row 0: a real input, so the padded rows compute
    nothing degenerate; their outputs are dropped."""
    extra = target - t.shape[0]
    return torch.cat((t, t[:1].expand(extra, *t.shape[1:]))) if extra > 0 else t


def group_jobs(lengths: list[int], max_batch: int, max_padded_frames: int) -> list[list[int]]:
    """Indices of jobs per decode call, by ascending length."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        # Sorted ascending, so this job is the longest of the group if it joins.
        if group and len(group) < max_batch and (len(group) + 1) * lengths[i] <= max_padded_frames:
            group.append(i)
        else:
            groups.append([i])
    return groups
