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
    """Hands out cache blocks. A request's table grows a block at a time; free() is idempotent."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        have = len(self._tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_tokens) <= len(self._free)

    def ensure(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to hold num_tokens; raises MemoryError if blocks run out."""
        need = self.blocks_needed(request_id, num_tokens)
        if need > len(self._free):
            raise MemoryError(f"KV cache full: {request_id} needs {need} blocks, {len(self._free)} free")
        table = self._tables.setdefault(request_id, [])
        table.extend(self._free.pop() for _ in range(need))
        return table

    def table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            self._free.extend(reversed(table))

    def owners(self) -> list[str]:
        return list(self._tables)
