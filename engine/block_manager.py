"""Paged KV bookkeeping: which pool blocks each request owns, in token order."""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Hands out fixed-size KV blocks on demand and takes them back when a request ends.

    Invariants (checked by `check_integrity`): every block is either free or owned by exactly
    one request; a request owns exactly `ceil(num_tokens / block_size)` blocks for the tokens
    it has been allocated.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0
        assert block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks `allocate(request_id, num_tokens)` would take from the free list."""
        have = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_for_tokens(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks(request_id, num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to cover `num_tokens` tokens; returns the table.

        Mutates the free list. The caller must have checked `can_allocate`.
        """
        need = self.num_new_blocks(request_id, num_tokens)
        assert need <= len(self._free), "allocate() without can_allocate()"
        table = self._tables.setdefault(request_id, [])
        table.extend(self._free.popleft() for _ in range(need))
        return table

    def free(self, request_id: str) -> int:
        """Return all of the request's blocks to the free list; returns how many."""
        table = self._tables.pop(request_id, [])
        self._free.extend(reversed(table))
        return len(table)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def owns_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def owner_ids(self) -> list[str]:
        return list(self._tables)

    def check_integrity(self) -> None:
        """Assert that free and owned blocks partition the pool with no duplicates."""
        owned = [b for table in self._tables.values() for b in table]
        free = list(self._free)
        assert len(set(owned)) == len(owned), "a block is owned twice"
        assert len(set(free)) == len(free), "a block is free twice"
        assert not set(owned) & set(free), "a block is both free and owned"
        assert len(owned) + len(free) == self.num_blocks, "blocks leaked"
        assert all(0 <= b < self.num_blocks for b in owned + free), "block id out of range"
