"""The memory of the streams' flow caches (`cosyvoice3.flow.cache`): one tensor, allocated once, in blocks.

A kept hop always ends on a chunk boundary, so a stream's solved frames are whole chunks. Each block holds
one chunk of frames of one CFG row at every Euler step and layer; a stream's cache is its two lists of
blocks (conditioned rows, unconditioned rows). A hop's cache shares its earlier hops' blocks and adds
only its new frames' (no copy of the past), and a call reads the rows' past in one gather per Euler
step. Blocks are counted by reference and go back when the last cache that holds them is collected.
The pool's size is fixed when it is first used (at most `limit_bytes`, and on a GPU what start-up left
free, less a reserve for the calls' own work), so the caches never take memory that serving needs.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

log = logging.getLogger(__name__)

GPU_RESERVE = 0.1  # of the device's memory, left to the codec calls' own tensors (activations, gathers)
CPU_SHARE = 0.25  # on a CPU, of physical memory (the pool is allocated empty; pages are touched as used)


@dataclass(eq=False)  # identity: the pool releases its blocks when it is collected
class FlowCache:
    """A stream's solved frames [0, frames): the pool blocks of its conditioned and unconditioned rows (in
    frame order, `frames / chunk` each) and the input embedding's last `pad` frames before each of its two
    convolutions `tails` [steps, 2, 2 (rows), pad, dim]."""

    frames: int
    cond: list[int]
    uncond: list[int]
    tails: Tensor
    pool: FlowCachePool

    @property
    def bytes(self) -> int:
        return (len(self.cond) + len(self.uncond)) * self.pool.block_bytes + \
            self.tails.numel() * self.tails.element_size()

    def keys_values(self) -> Tensor:
        """Its keys and values [steps, layers, 2 (keys, values), 2 (rows), frames, heads, head size] (a copy)."""
        rows = [self.pool.kv[:, :, :, torch.tensor(ids, device=self.pool.kv.device)].flatten(3, 4)
                for ids in (self.cond, self.uncond)]
        return torch.stack(rows, dim=3)


class FlowCachePool:
    """kv [steps, layers, 2 (keys, values), blocks, chunk, heads, head size]; block 0 holds zeros and is never
    handed out (a padded row's missing past reads it)."""

    def __init__(self, limit_bytes: int, reserve: float = GPU_RESERVE, max_blocks: int | None = None):
        self.limit_bytes, self.reserve, self.max_blocks = limit_bytes, reserve, max_blocks
        self.kv: Tensor | None = None
        self.block_bytes = 0
        self.refused = 0  # rows that asked for blocks and kept no cache for want of them
        self._refs: list[int] = []
        self._free: list[int] = []
        self._lock = threading.Lock()
        # releases wait here until the next allocation or reading: a cache's finalizer may run inside a garbage
        # collection that a thread holding the lock set off, so it only queues its blocks
        self._released: queue.SimpleQueue[list[int]] = queue.SimpleQueue()

    @staticmethod
    def block_bytes_of(steps: int, layers: int, heads: int, size: int, chunk: int, dtype) -> int:
        return steps * layers * 2 * chunk * heads * size * dtype.itemsize

    def ensure(self, steps: int, layers: int, heads: int, size: int, chunk: int, dtype, device) -> None:
        """Allocate the pool at its first use, for caches of this shape: as many blocks as there is room for,
        halved while the device refuses them; none (every row refused) when not even two fit."""
        if self.kv is not None:
            return
        device = torch.device(device)
        self.block_bytes = self.block_bytes_of(steps, layers, heads, size, chunk, dtype)
        blocks = self._room(device) // self.block_bytes - 1  # less the zero block
        blocks = min(blocks, self.max_blocks) if self.max_blocks is not None else blocks
        while True:
            blocks = blocks if blocks >= 2 else 0  # a cache takes a block of each CFG row
            try:
                kv = torch.empty(steps, layers, 2, blocks + 1, chunk, heads, size, dtype=dtype, device=device)
                break
            except torch.OutOfMemoryError:
                blocks //= 2
        kv[:, :, :, 0] = 0
        with self._lock:
            self._free, self._refs, self.kv = list(range(blocks, 0, -1)), [0] * (blocks + 1), kv
        log.info("flow cache pool: %d blocks of %d frames, %.1f GB", blocks, chunk, blocks * self.block_bytes / 1e9)

    def _room(self, device: torch.device) -> int:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the allocator's idle segments back to the device: what is free is free
            free, total = torch.cuda.mem_get_info(device)
            return min(self.limit_bytes, max(free - int(self.reserve * total), 0))
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(self.limit_bytes, int(CPU_SHARE * physical))

    @property
    def blocks(self) -> int:
        return len(self._refs) - 1 if self._refs else 0

    @property
    def used_bytes(self) -> int:
        with self._lock:
            self._drain()
            return (self.blocks - len(self._free)) * self.block_bytes

    def allocate(self, n: int) -> list[int] | None:
        """n free blocks (one reference each), or None (counted as refused) when fewer are free."""
        with self._lock:
            self._drain()
            if n > len(self._free):
                self.refused += 1
                return None
            out = [self._free.pop() for _ in range(n)]
            for b in out:
                self._refs[b] = 1
            return out

    def retain(self, blocks: list[int]) -> None:
        """One more reference to blocks a live cache holds (so none of them is waiting to be released)."""
        with self._lock:
            for b in blocks:
                self._refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        self._released.put(blocks)

    def _drain(self) -> None:
        while True:
            try:
                blocks = self._released.get_nowait()
            except queue.Empty:
                return
            for b in blocks:
                self._refs[b] -= 1
                if self._refs[b] == 0:
                    self._free.append(b)

    def cache(self, frames: int, cond: list[int], uncond: list[int], tails: Tensor) -> FlowCache:
        """A cache over these blocks (it holds one reference to each, dropped when it is collected)."""
        out = FlowCache(frames, cond, uncond, tails, self)
        weakref.finalize(out, self.release, cond + uncond)
        return out

    def past_index(self, caches: list[FlowCache | None], blocks_per_row: int | None = None) -> Tensor:
        """The blocks of the rows' past, for `past` (once per call): the conditioned rows' end to end, then the
        unconditioned rows' (packed; rows without a cache have none), or with blocks_per_row, every row padded
        with the zero block to that many."""
        ids = []
        for side in ("cond", "uncond"):
            for c in caches:
                own = getattr(c, side) if c is not None else []
                ids += own if blocks_per_row is None else own + [0] * (blocks_per_row - len(own))
        return torch.tensor(ids, dtype=torch.long, device=self.kv.device)

    def past(self, step: int, index: Tensor) -> Tensor:
        """The past at this Euler step of the blocks `past_index` gave: [layers, 2, blocks * chunk, heads, size]."""
        return self.kv[step].index_select(2, index).flatten(2, 3)

    def frames_of(self, index: Tensor) -> Tensor:
        """The frames of the blocks `past_index` gave, in `layers_at`'s flattened blocks: [blocks * chunk]."""
        chunk = self.kv.shape[4]
        return (index[:, None] * chunk + torch.arange(chunk, device=index.device)).flatten()

    def layers_at(self, step: int) -> list[tuple[Tensor, Tensor]]:
        """Per layer, the (keys, values) of every block at this Euler step, blocks flattened: views
        [(blocks + 1) * chunk, heads, size], no copy."""
        return [(layer[0].flatten(0, 1), layer[1].flatten(0, 1)) for layer in self.kv[step]]

    def store(self, step: int, blocks: Tensor, kv: Tensor) -> None:
        """Write these blocks' keys and values at this step: blocks [n] (device), kv [layers, 2, n * chunk, heads, size]."""
        if blocks.numel() == 0:
            return
        self.kv[step].index_copy_(2, blocks, kv.unflatten(2, (blocks.shape[0], -1)).to(self.kv.dtype))
