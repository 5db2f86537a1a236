"""Where KV lives: fixed-size blocks with reference counts and prefix caching.

A full block is keyed by an xxhash chained over the previous block's key and its own token ids; a hit is
verified against the token ids stored with the block. Blocks whose count drops to zero keep their key and
go to the back of an LRU free list, so a later request can revive them until they are reused for new content
(which drops the old key).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: int = -1  # -1: not registered in the prefix cache
    token_ids: tuple[int, ...] = ()


def block_key(token_ids: list[int] | np.ndarray, prev_key: int) -> int:
    h = xxhash.xxh64()
    h.update(prev_key.to_bytes(8, "little", signed=True))
    h.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    return h.intdigest() & 0x7FFFFFFFFFFFFFFF


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU order
        self.cached: dict[int, int] = {}  # key -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids holding the longest cached prefix of ``token_ids``; leaves at least one token to compute
        (a fully cached prompt must still produce logits for its last token)."""
        if not self.enable_prefix_caching:
            return []
        hits, key = [], -1
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            chunk = token_ids[i * bs : (i + 1) * bs]
            key = block_key(chunk, key)
            block_id = self.cached.get(key)
            if block_id is None or self.blocks[block_id].token_ids != tuple(chunk):
                break
            hits.append(block_id)
        return hits

    def allocate(self, block_table: list[int], cached_hits: list[int], num_tokens: int) -> bool:
        """Grow ``block_table`` (in place) to hold ``num_tokens`` tokens, first reviving ``cached_hits``.
        Returns False, changing nothing, when the pool is too small."""
        need = self.blocks_needed(num_tokens) - len(block_table) - len(cached_hits)
        revive_free = sum(1 for b in cached_hits if self.blocks[b].ref_count == 0)
        if need > len(self.free) - revive_free:
            return False
        for b in cached_hits:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free[b]
            block.ref_count += 1
            block_table.append(b)
        for _ in range(max(0, need)):
            b, _ = self.free.popitem(last=False)
            block = self.blocks[b]
            if block.key >= 0:  # reused for new content: its old key must go
                if self.cached.get(block.key) == b:
                    del self.cached[block.key]
                block.key, block.token_ids = -1, ()
            block.ref_count = 1
            block_table.append(b)
        return True

    def register_full_blocks(
        self, block_table: list[int], token_ids: list[int], num_computed: int, start: int, prev_key: int
    ) -> tuple[int, int]:
        """Key the blocks ``start..`` that are full once ``num_computed`` tokens are in cache. ``prev_key`` is
        the chain key of block ``start - 1``; returns the new (start, prev_key). A key already held by another
        block is left alone: two requests that computed one prefix in the same step each keep their own block."""
        if not self.enable_prefix_caching:
            return start, prev_key
        bs = self.block_size
        full = num_computed // bs
        for i in range(start, full):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            prev_key = block_key(chunk, prev_key)
            block = self.blocks[block_table[i]]
            if block.key < 0 and prev_key not in self.cached:
                block.key, block.token_ids = prev_key, chunk
                self.cached[prev_key] = block.block_id
        return max(start, full), prev_key

    def free_blocks(self, block_table: list[int]) -> None:
        """Drop one reference to each block; tail blocks go to the LRU first, so prefixes outlive suffixes."""
        for b in reversed(block_table):
            block = self.blocks[b]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {b} freed twice"
            if block.ref_count == 0:
                self.free[b] = None
        block_table.clear()
