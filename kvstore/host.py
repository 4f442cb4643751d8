"""The host tier's pool: KV pages in one preallocated host tensor (pinned on CUDA), each
slot known by the page's prefix-cache hash, in least recently used order, with its owner.
A `KVTier` (kvstore/base.py) with nothing to read ahead: loads read its rows. The tier's
policy (what moves where) is kvstore/tiers.py's."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvstore.base import PageOwners, Tier, holds_in_lru
from kvstore.hostmem import pinned_zeros


class HostKVPool:
    """`num_blocks` page slots in one preallocated host tensor. The pool never evicts on
    its own: a page leaving host RAM moves down a tier, which is the tiers' policy
    (`TieredKVStore.take_host_slot`)."""

    tier = Tier.HOST
    shared = False

    def __init__(self, page_nbytes: int, num_blocks: int, *, pin: bool) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        # pinned: page-locked for CUDA copies (and in-place reads), of exactly this size
        rows = (num_blocks, page_nbytes)
        self.data = (
            pinned_zeros(*rows, dtype=torch.uint8) if pin else torch.empty(*rows, dtype=torch.uint8)
        )
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.owners = PageOwners()
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_used(self) -> int:
        return len(self.slots)

    @property
    def full(self) -> bool:
        return not self._free

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holds(self, key: bytes, *, touch: bool = False) -> bool:
        return holds_in_lru(self.slots, key, touch)

    def write(
        self, key: bytes, page: torch.Tensor, owner: str = "", limit: int | None = None
    ) -> bool:
        """Copy `page` into a free slot under `key` for `owner`. False, with nothing
        changed, when no slot is free or the owner holds `limit` pages already."""
        if self.holds(key, touch=True):
            return True
        if self.full or (limit is not None and self.owners.counts.get(owner, 0) >= limit):
            return False
        self.data[self.take(key, owner)].copy_(page)
        return True

    def pages_by_owner(self) -> dict[str, int]:
        return dict(self.owners.counts)

    def close(self) -> None:
        """Forget every page (the rows stay allocated while the pool lives)."""
        self.clear()

    def clear(self) -> None:
        """Forget every page."""
        self.slots.clear()
        self.owners = PageOwners()
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def take(self, key: bytes, owner: str) -> int:
        """A free slot, now holding `key` for `owner`."""
        slot = self._free.pop()
        self.slots[key] = slot
        self.owners.add(key, owner)
        return slot

    def release(self, key: bytes) -> int:
        """Forget `key`; its slot goes back to the free list (returned)."""
        slot = self.slots.pop(key)
        self.owners.remove(key)
        self._free.append(slot)
        return slot

    def take_many(self, pages: Sequence[tuple[bytes, str]]) -> list[int]:
        """`take` for each (key, owner) of `pages` (none of them here yet), in order."""
        free, slots = self._free, self.slots
        assert len(pages) <= len(free)
        taken = free[len(free) - len(pages) :][::-1]  # as many pop() would give
        del free[len(free) - len(pages) :]
        for (key, _), slot in zip(pages, taken, strict=True):
            slots[key] = slot
        self.owners.add_many(pages)
        assert len(slots) + len(free) == self.num_blocks, "a page taken twice"
        return taken

    def release_many(self, keys: Sequence[bytes]) -> list[int]:
        """`release` for each of `keys`, in order; their slots."""
        slots = self.slots
        freed = [slots.pop(key) for key in keys]
        self.owners.remove_many(keys)
        self._free += freed
        return freed

    def check_integrity(self) -> None:
        used = list(self.slots.values())
        assert len(set(used)) == len(used), "two host pages share a slot"
        assert sorted(used + self._free) == list(range(self.num_blocks)), "host slots leak"
        self.owners.check(self.slots)
