"""Paged KV cache: one pool of fixed-size blocks per layer, and the block manager that lends them."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
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
    list is emptied).

    Prefix sharing: a block full of prompt tokens may be published under the hash of the prompt up
    to its end (`publish`); a later request whose prompt starts the same takes those blocks into its
    table (`share`) instead of computing them. A block is lent to every table holding it (a count)
    and goes back to the free pool when the last one frees it, still holding its keys and values:
    it is shared again until the pool lends it out afresh (least recently freed first)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size, self.num_blocks = block_size, num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest freed first
        self._users = [0] * num_blocks  # tables holding each block
        self._by_hash: dict[bytes, int] = {}  # published prefix -> its last block
        self._hash_of: dict[int, bytes] = {}
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
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            self._forget(block)  # lent afresh: what it held is overwritten
            self._users[block] = 1
            table.append(block)
        return table

    def share(self, table: list[int], prefix_hashes: list[bytes]) -> int:
        """Start an empty `table` with the published blocks of the longest prefix found; returns how
        many blocks it took."""
        if table:
            raise ValueError("a table shares a prefix only before it holds blocks")
        for h in prefix_hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            if self._users[block] == 0:
                del self._free[block]
            self._users[block] += 1
            table.append(block)
        self.tables += bool(table)
        return len(table)

    def publish(self, table: list[int], prefix_hashes: list[bytes]) -> None:
        """The table's first len(prefix_hashes) blocks now hold those prefixes' keys and values."""
        for block, h in zip(table, prefix_hashes):
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h], self._hash_of[block] = block, h

    def free(self, table: list[int]) -> None:
        self.tables -= bool(table)
        for block in reversed(table):  # a prompt's tail is lent afresh before its head (its chain stays findable)
            self._users[block] -= 1
            if self._users[block] == 0:
                self._free[block] = None
        table.clear()

    def _forget(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._by_hash[h]


def prefix_hashes(tokens: Tensor, codes: Tensor, block_size: int, limit: int) -> list[bytes]:
    """A digest per full block of the first `limit` positions: of every token and code up to the
    block's end (so equal digests mean equal prefixes, and so equal keys and values)."""
    out, digest = [], b""
    for end in range(block_size, limit + 1, block_size):
        h = hashlib.blake2b(digest, digest_size=16)
        h.update(tokens[end - block_size: end].numpy().tobytes())
        h.update(codes[end - block_size: end].numpy().tobytes())
        digest = h.digest()
        out.append(digest)
    return out
