"""Shaping batches of variable-length jobs: which jobs share a call, and the bucketed shapes
a call is padded to (so kernels meet few distinct shapes and plan each once)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# ~25% apart above 64 frames: a whole utterance pads by at most a quarter (then multiples of 256)
FRAME_BUCKETS = (4, 8, 16, 32, 50, 64, 80, 100, 128, 160, 192, 256, 320, 384, 512)


def bucket_frames(frames: int, buckets: tuple[int, ...] = FRAME_BUCKETS) -> int:
    """The smallest of `buckets` (ascending) that holds `frames`; beyond the last, a multiple of 256."""
    return next((b for b in buckets if b >= frames), -(-frames // 256) * 256)


def with_buckets(extra) -> tuple[int, ...]:
    """FRAME_BUCKETS and the extra lengths, ascending."""
    return tuple(sorted(set(FRAME_BUCKETS) | set(extra)))


def bucket_rows(rows: int, granule: int = 0, exact: int = 0) -> int:
    """rows padded to a power of two; with a granule, above it to a multiple of it instead (33 rows:
    64, or 40 with a granule of 8); up to `exact` rows, not padded at all."""
    if rows <= exact:
        return rows
    power = 1 << max(0, rows - 1).bit_length()
    return -(-rows // granule) * granule if granule and power > granule else power


def row_buckets(max_rows: int, granule: int = 0, exact: int = 0) -> list[tuple[int, int]]:
    """(bucket, fewest rows that reach it) for every bucket of 1..max_rows rows, ascending."""
    found: dict[int, int] = {}
    for rows in range(1, max_rows + 1):
        found.setdefault(bucket_rows(rows, granule, exact), rows)
    return sorted(found.items())


def pad_rows(t: Tensor, target: int) -> Tensor:
    """t's rows padded to `target` with copies of row 0: a real input, so the padded rows compute
    nothing degenerate; their outputs are dropped."""
    extra = target - t.shape[0]
    return torch.cat((t, t[:1].expand(extra, *t.shape[1:]))) if extra > 0 else t


def group_jobs(lengths: list[int], max_batch: int, max_padded_frames: int,
               call_cost: int | None = None, padded: Callable[[int, int], int] | None = None) -> list[list[int]]:
    """Indices of jobs per decode call, by ascending length; every call within `max_batch` jobs and
    `max_padded_frames` (jobs x longest), or a single job.

    call_cost None: greedy, each call as full as the bounds allow. Otherwise the cheapest split of
    the sorted jobs into calls, a call costing `call_cost + padded(jobs, longest)` (its fixed cost in
    padded length units, plus the padded work, by default jobs x longest; a call replayed from a graph
    pays its graph's shape): one call over lengths 110..380 pads ~40% of its work, and a network whose
    cost grows with the padded length (CosyVoice3's flow) then does better in a few calls of similar lengths."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if call_cost is None:
        return _greedy_groups(order, lengths, max_batch, max_padded_frames)
    return _cheapest_groups(order, lengths, max_batch, max_padded_frames, call_cost,
                            padded or (lambda rows, longest: rows * longest))


def _fits(rows: int, longest: int, max_batch: int, max_padded_frames: int) -> bool:
    return rows == 1 or (rows <= max_batch and rows * longest <= max_padded_frames)


def _greedy_groups(order: list[int], lengths: list[int], max_batch: int, max_padded_frames: int) -> list[list[int]]:
    groups: list[list[int]] = []
    for i in order:
        # Sorted ascending, so this job is the longest of the group if it joins.
        if groups and _fits(len(groups[-1]) + 1, lengths[i], max_batch, max_padded_frames):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _cheapest_groups(order: list[int], lengths: list[int], max_batch: int, max_padded_frames: int,
                     call_cost: int, padded: Callable[[int, int], int]) -> list[list[int]]:
    """Dynamic programme over the sorted jobs: best[k] is the cheapest cost of the first k, whose
    last call is order[start[k]:k] (contiguous in sorted order: an optimal split never interleaves)."""
    n = len(order)
    best, start = [0] + [0] * n, [0] * (n + 1)
    for k in range(1, n + 1):
        longest = lengths[order[k - 1]]
        best[k] = -1
        for j in range(k - 1, -1, -1):
            if not _fits(k - j, longest, max_batch, max_padded_frames):
                break
            cost = best[j] + call_cost + padded(k - j, longest)
            if best[k] < 0 or cost < best[k]:
                best[k], start[k] = cost, j
    groups, k = [], n
    while k:
        groups.append(order[start[k]:k])
        k = start[k]
    return groups[::-1]
