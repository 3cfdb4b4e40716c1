"""The block pool and per-sequence block tables: pure-Python memory accounting.

Blocks are integers; the tensors behind them live in `cache.kv_storage`. The batch policy
talks to `BlockManager` in counts (free blocks, blocks a sequence needs), never tensors.
"""

from __future__ import annotations

import math
from collections import deque


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Fixed set of block ids with reference counts and a FIFO free list."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refcount[b] = 1
        return out

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refcount[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._refcount[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            rc = self._refcount[b]
            if rc <= 0:
                raise ValueError(f"double free of block {b}")
            self._refcount[b] = rc - 1
            if rc == 1:
                self._free.append(b)


class BlockManager:
    """Block tables per sequence on top of a pool. Sequence ids are strings."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    # -- counts (what the batch policy sees) --
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def num_blocks_held(self, seq_id: str) -> int:
        return len(self._tables.get(seq_id, ()))

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Extra blocks `seq_id` needs so that it can hold `num_tokens` tokens in total."""
        return max(0, self.blocks_for(num_tokens) - self.num_blocks_held(seq_id))

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= self.pool.num_free

    # -- mutations --
    def grow(self, seq_id: str, num_tokens: int) -> list[int]:
        """Make `seq_id` hold room for `num_tokens` tokens; returns its block table."""
        table = self._tables.setdefault(seq_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need > 0:
            table.extend(self.pool.allocate(need))
        return table

    def table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def free(self, seq_id: str) -> None:
        table = self._tables.pop(seq_id, None)
        if table:
            self.pool.free(table)
