"""Paged KV cache: one pool of fixed-size blocks per layer, and the block manager that lends them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


class KVCache:
    """k and v as [layers, blocks, block_size, kv_heads, head_dim].

    One block beyond `num_blocks` is never lent out: padding rows of captured graphs write
    their keys to `scratch_slot`, where they can never land in a request's cache.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, dtype, device):
        shape = (layout.num_layers, num_blocks + 1, block_size, layout.num_kv_heads, layout.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_slot = num_blocks * block_size

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return self.k[i], self.v[i]

    @classmethod
    def for_memory(cls, layout: KVLayout, memory_bytes: int, block_size: int, dtype, device) -> "KVCache":
        per_block = layout.bytes_per_token(dtype) * block_size
        num_blocks = memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache memory {memory_bytes} B is less than one block ({per_block} B)"
            )
        return cls(layout, int(num_blocks), block_size, dtype, device)


class BlockManager:
    """Lends the cache's blocks. A request's block table is a list it owns (on the request
    object); `grow` extends it a block at a time and `free` gives it back whole (idempotent: the
    list is emptied)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self.tables = 0  # tables holding blocks now (what a leak check counts)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, table: list[int], num_tokens: int) -> list[int]:
        """Extend `table` to hold num_tokens; raises MemoryError if blocks run out."""
        need = max(0, self.blocks_for(num_tokens) - len(table))
        if need > len(self._free):
            raise MemoryError(f"KV cache full: {need} blocks needed, {len(self._free)} free")
        self.tables += bool(need and not table)
        table.extend(self._free.pop() for _ in range(need))
        return table

    def free(self, table: list[int]) -> None:
        self.tables -= bool(table)
        self._free.extend(reversed(table))
        table.clear()
