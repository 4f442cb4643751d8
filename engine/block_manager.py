"""Paged KV bookkeeping: which pool blocks each request holds, in token order, and which full
blocks the prefix cache remembers, by a hash chain salted with the cache namespace.

With a connector to the tiers below the device (kvstore/base.py `KVConnector`), reallocated
cached blocks move their pages down a tier and later prompts load them back; the block
manager tracks the copies' tickets. The design
is in docs/design/kv-pages-and-tiers.md.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Sequence

from kvstore.base import KVConnector, Tier

log = logging.getLogger(__name__)

_SHARE_SCAN = 64  # free blocks looked at for one over its tenant's share


class BlockManager:
    """Hands out fixed-size KV blocks on demand and takes them back when a request ends.

    Invariants (checked by `check_integrity`): a block's reference count equals the number
    of tables holding it; the free list holds exactly the blocks nobody holds; every cached
    hash maps to a block carrying that hash.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        connector: KVConnector | None = None,
    ) -> None:
        assert num_blocks > 0
        assert block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # free blocks, least recently freed first (the next to be reused, and evicted)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._hash_of: dict[int, bytes] = {}  # cached blocks, held or free
        self._cached: dict[bytes, int] = {}
        self._owner: dict[str, str] = {}  # request id -> the tenant it runs for
        self._block_owner: dict[int, str] = {}  # cached block -> tenant that cached it last
        self._cached_by_owner: dict[str, int] = {}  # cached blocks per tenant
        self.connector = connector if enable_caching else None
        self.num_hit_blocks = 0
        self.num_evicted_blocks = 0
        self.num_tier_hit_blocks = {Tier.HOST: 0, Tier.DISK: 0, Tier.REMOTE: 0}
        self.num_spilled_ahead = 0
        # copies (kvstore/transfer.py tickets) still running, maybe finished since
        self._waits: dict[str, set[int]] = {}  # request id -> those its blocks wait for
        self._block_ticket: dict[int, int] = {}  # block -> the load writing it
        self._save_ticket: dict[int, int] = {}  # free block -> a save ahead reading it

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> Collection[bytes]:
        """The hashes of the cached blocks (a live view: read it on the owning thread)."""
        return self._cached.keys()

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- the prefix cache -------------------------------------------------------------------

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (changes nothing)."""
        hits: list[int] = []
        if self.enable_caching:
            for h in hashes:
                block = self._cached.get(h)
                if block is None:
                    break
                hits.append(block)
        return hits

    def lookup_below(self, request_id: str, hashes: list[bytes]) -> list[bytes]:
        """The longest prefix of `hashes` that the tiers below the device, or the pages
        read ahead for the request, hold (changes nothing); call it with what follows the
        device hits."""
        if self.connector is None:
            return []
        return hashes[: self.connector.find(request_id, hashes)]

    @property
    def has_disk_tier(self) -> bool:
        return self.connector is not None and self.connector.has_disk

    @property
    def has_remote_tier(self) -> bool:
        return self.connector is not None and self.connector.has_remote

    def prefetch_below(
        self, request_id: str, hashes: list[bytes], rest: Sequence[bytes] = (), owner: str = ""
    ) -> bool:
        """Start, or check on, reading ahead the request's pages of `hashes` that are on
        disk (from `lookup_below`), and fetching those of `rest` (what no tier here holds)
        from the remote tier, once per request; True once none is still being read, so
        `load_below` will not wait. Pages fetched land in host RAM, for `owner`. A request
        refused for lack of read-ahead room starts first once there is room."""
        if self.connector is None:
            return True
        return self.connector.read_ahead(request_id, hashes, rest, owner)

    def remote_pages_arrived(self, request_id: str) -> bool:
        """Whether the request has pages fetched from the remote tier, ready to load."""
        return self.connector is not None and self.connector.fetched(request_id)

    def wait_below(self, timeout: float) -> None:
        """Block until some read ahead finishes or `timeout` seconds pass."""
        if self.connector is not None:
            self.connector.wait_reads(timeout)

    def load_below(self, request_id: str, start: int, hashes: list[bytes]) -> list[Tier]:
        """Copy the pages of `hashes` from the lower tiers (or the request's reads ahead)
        into the request's blocks `start..`, up to the first that cannot be read, and cache
        them under their hashes; the reads ahead are then released. Returns each loaded
        block's tier."""
        if not hashes:
            return []
        assert self.connector is not None
        table = self._tables[request_id]
        tiers, ticket = self.connector.load(request_id, table[start : start + len(hashes)], hashes)
        n = len(tiers)
        loaded = table[start : start + n]
        if ticket:  # copies in flight: the request, and hits, wait
            self._wait(request_id, [ticket])
            self._block_ticket.update(dict.fromkeys(loaded, ticket))
        self._cache(loaded, hashes[:n], self._owner.get(request_id, ""))
        for tier in self.num_tier_hit_blocks:
            self.num_tier_hit_blocks[tier] += tiers.count(tier)
        return tiers

    def _wait(self, request_id: str, tickets: Iterable[int]) -> None:
        waits = {t for t in tickets if t}
        if waits:
            self._waits.setdefault(request_id, set()).update(waits)

    def load_tickets(self, request_ids: Iterable[str]) -> frozenset[int]:
        """The copies into (or out of) these requests' blocks that may still be running
        (kvstore/transfer.py tickets): a step that runs them must wait for them."""
        if not self._waits:  # the usual step: nothing of its own in flight
            return frozenset()
        waits = self._waits
        return frozenset().union(*(waits[r] for r in request_ids if r in waits))

    def loads_ready(self, request_id: str) -> bool:
        """Whether the copies into (or out of) the request's blocks are all done (never
        waits)."""
        waits = self._waits.get(request_id)
        if waits is None:
            return True
        assert self.connector is not None
        if not self.connector.loads_done(waits):
            return False
        del self._waits[request_id]
        for blocks in (self._block_ticket, self._save_ticket):  # forget finished copies
            if blocks and self.connector.loads_done(set(blocks.values())):
                blocks.clear()
        return True

    def _settle_loads(self, request_id: str) -> None:
        """Wait for the loads into the request's blocks before they can be handed out again;
        the blocks of a load that failed are no longer cached."""
        if self.loads_ready(request_id):
            return
        assert self.connector is not None
        self.uncache(self.connector.finish_loads())
        self._waits.pop(request_id, None)

    def commit(self, request_id: str, hashes: list[bytes], start: int = 0) -> None:
        """Remember the request's blocks `start..len(hashes)` (full, their KV written) under
        these hashes. A hash already cached keeps its block; the duplicate stays private."""
        if not self.enable_caching:
            return
        table = self._tables[request_id]
        end = min(len(hashes), len(table))
        owner = self._owner.get(request_id, "")
        self._cache(table[start:end], hashes[start:end], owner)
        if self.connector is not None and end > start:
            self.connector.publish(table[start:end], hashes[start:end], owner)

    def _cache(self, blocks: Sequence[int], hashes: Sequence[bytes], owner: str) -> None:
        """Make each of `blocks` findable under its hash of `hashes` (unless either is
        cached already), for `owner`."""
        hash_of, cached, block_owner = self._hash_of, self._cached, self._block_owner
        added = 0
        for block, h in zip(blocks, hashes, strict=True):
            if block in hash_of or h in cached:
                continue
            hash_of[block] = h
            cached[h] = block
            block_owner[block] = owner
            added += 1
        if added:
            self._cached_by_owner[owner] = self._cached_by_owner.get(owner, 0) + added

    # -- allocation ---------------------------------------------------------------------------

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks `allocate(request_id, num_tokens)` would take from the free list."""
        have = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_for_tokens(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int, hits: Sequence[int] = ()) -> bool:
        """Whether `allocate(request_id, num_tokens, hits)` would succeed."""
        have = len(self._tables.get(request_id, ())) + len(hits)
        fresh = max(0, self.blocks_for_tokens(num_tokens) - have)
        revived = sum(1 for b in hits if self._refs[b] == 0)  # leave the free list
        return fresh + revived <= len(self._free)

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        hits: Sequence[int] = (),
        below: Sequence[bytes] = (),
        owner: str = "",
        background: bool = False,
    ) -> list[int]:
        """Grow the request's table to cover `num_tokens` tokens, starting a new table with
        the cached blocks `hits` (from `lookup`); returns the table. `below` names the pages
        (from `lookup_below`) that `load_below` will fetch next: evictions spill around them.
        `owner` (the tenant, for a new table) is charged for the blocks it caches.
        The pages the new blocks held are saved to host RAM in the device's order, before
        anything the next step runs; with `background` (the request waits outside the batch
        for its copies anyway) on a stream of their own, which the steps do not wait for.

        Mutates the free list and the cache. The caller must have checked `can_allocate`.
        """
        if request_id not in self._tables:
            self._owner[request_id] = owner
        table = self._tables.setdefault(request_id, [])
        if hits:
            assert not table, "cache hits only start a table"
            for block in hits:
                if self._refs[block] == 0:
                    del self._free[block]
                self._refs[block] += 1
            table.extend(hits)
            self.num_hit_blocks += len(hits)
            if self._block_ticket:  # pages another request's load may still be bringing
                self._wait(request_id, [self._block_ticket.get(b, 0) for b in hits])
        need = max(0, self.blocks_for_tokens(num_tokens) - len(table))  # tables never shrink here
        assert need <= len(self._free), "allocate() without can_allocate()"
        evicted: list[tuple[int, bytes, str]] = []
        free, refs = self._free, self._refs
        # with one tenant or none caching, no share to weigh: the least recently freed, in
        # order (evicting only lowers the count of tenants)
        if len(self._cached_by_owner) < 2:
            handout = list(itertools.islice(free, need))
            for block in handout:
                del free[block]
                refs[block] = 1
            evicted = self._evict_many(handout)
            table += handout
        else:
            for _ in range(need):
                block = self._next_free()
                del free[block]
                gone = self._evict(block)
                if gone is not None:
                    evicted.append((block, *gone))
                refs[block] = 1
                table.append(block)
        if self._save_ticket and need:  # blocks a save ahead may still be reading
            self._wait(request_id, [self._save_ticket.pop(b, 0) for b in table[-need:]])
        if evicted and self.connector is not None:  # saved before anything overwrites them
            ticket = self.connector.save(evicted, keep=set(below), inline=not background)
            self._wait(request_id, [ticket])
        return table

    def spill_ahead(self, watermark: int) -> int:
        """Copy down now the cached pages among the next `watermark` free blocks to be handed
        out (the least recently freed) that no tier below holds yet; they stay cached on the
        device. Allocations that reuse those blocks then find their pages already saved and
        copy nothing. Returns how many pages were copied."""
        if self.connector is None or watermark <= 0:
            return 0
        ahead: list[tuple[int, bytes, str]] = []
        for i, block in enumerate(self._free):
            if i >= watermark:
                break
            h = self._hash_of.get(block)
            if h is not None and not self.connector.holds(h):
                ahead.append((block, h, self._block_owner[block]))
        if ahead:
            ticket = self.connector.save(ahead)
            if ticket:  # still copying: whoever gets one of these blocks waits for it
                self._save_ticket.update(dict.fromkeys((b for b, _, _ in ahead), ticket))
            self.num_spilled_ahead += len(ahead)
        return len(ahead)

    def _next_free(self) -> int:
        """The free block to hand out next: the least recently freed, unless it holds a
        cached page of a tenant within its device share while a tenant over its share has a
        cached page among the next few (then that one). A tenant's share is an equal split
        of the pool between the tenants with cached pages on it."""
        oldest = next(iter(self._free))
        owner = self._block_owner.get(oldest)
        if owner is None or len(self._cached_by_owner) < 2:
            return oldest
        share = self.num_blocks / len(self._cached_by_owner)
        if self._cached_by_owner[owner] > share:
            return oldest
        for i, block in enumerate(self._free):
            if i >= _SHARE_SCAN:
                break
            other = self._block_owner.get(block)
            if other is not None and self._cached_by_owner[other] > share:
                return block
        return oldest

    def uncache(self, blocks: Sequence[int]) -> None:
        """Forget the hashes of `blocks`, whose contents are not their KV (a page load that
        failed): no later prompt may hit them."""
        for block in blocks:
            if self._evict(block) is not None:
                self.num_evicted_blocks -= 1  # not an eviction

    def _evict_many(self, blocks: list[int]) -> list[tuple[int, bytes, str]]:
        """`_evict` for each of `blocks`: (block, hash, owner) of those that were cached."""
        hash_of, cached, block_owner = self._hash_of, self._cached, self._block_owner
        gone = []
        for block in blocks:
            h = hash_of.pop(block, None)
            if h is not None:
                del cached[h]
                gone.append((block, h, block_owner.pop(block)))
        self.num_evicted_blocks += len(gone)
        counts = self._cached_by_owner
        for owner, n in Counter(owner for _, _, owner in gone).items():
            counts[owner] -= n
            if not counts[owner]:
                del counts[owner]
        return gone

    def _evict(self, block: int) -> tuple[bytes, str] | None:
        """Forget a cached block; its hash and owner, or None if it was not cached."""
        h = self._hash_of.pop(block, None)
        if h is None:
            return None
        del self._cached[h]
        self.num_evicted_blocks += 1
        owner = self._block_owner.pop(block)
        self._cached_by_owner[owner] -= 1
        if not self._cached_by_owner[owner]:
            del self._cached_by_owner[owner]
        return h, owner

    def free(self, request_id: str) -> int:
        """Drop the request's hold on its blocks, and its reads ahead; returns how many
        blocks it held. Blocks nobody holds go to the free list, the request's last block
        first (so it is reused first). Pages still loading into them arrive first."""
        self._settle_loads(request_id)
        table = self._tables.pop(request_id, [])
        self._owner.pop(request_id, None)
        if self.connector is not None:
            self.connector.release(request_id)
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
        return len(table)

    def reset_cache(self) -> None:
        """Forget every cached block (held blocks keep their contents)."""
        self._hash_of.clear()
        self._cached.clear()
        self._block_owner.clear()
        self._cached_by_owner.clear()

    def blocks_by_owner(self) -> dict[str, int]:
        """Device blocks per tenant: those its requests hold, and cached ones it left."""
        held: dict[str, set[int]] = {}
        for rid, table in self._tables.items():
            held.setdefault(self._owner.get(rid, ""), set()).update(table)
        for block in self._free:
            if block in self._block_owner:
                held.setdefault(self._block_owner[block], set()).add(block)
        return {owner: len(blocks) for owner, blocks in held.items()}

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def owns_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def owner_ids(self) -> list[str]:
        return list(self._tables)

    def check_integrity(self) -> None:
        """Assert that reference counts, the free list and the cache agree."""
        held = [0] * self.num_blocks
        for table in self._tables.values():
            assert len(set(table)) == len(table), "a table holds a block twice"
            for b in table:
                assert 0 <= b < self.num_blocks, "block id out of range"
                held[b] += 1
        assert held == self._refs, "reference counts disagree with the tables"
        free = {b for b in range(self.num_blocks) if held[b] == 0}
        assert set(self._free) == free, "the free list is not the unheld blocks"
        assert len(self._cached) == len(self._hash_of), "cache maps disagree"
        assert set(self._block_owner) == set(self._hash_of), "cached blocks without owners"
        counts: dict[str, int] = {}
        for owner in self._block_owner.values():
            counts[owner] = counts.get(owner, 0) + 1
        assert counts == self._cached_by_owner, "cached-block counts per tenant disagree"
        assert set(self._owner) == set(self._tables), "tables without owners"
        assert set(self._waits) <= set(self._tables), "copies waited for by no request"
        for h, b in self._cached.items():
            assert self._hash_of.get(b) == h, "a cached hash points at the wrong block"
        if self.connector is not None:
            self.connector.check_integrity()
