"""The tiers below the device pool, each a `KVTier` (kvstore/base.py): host RAM (pinned on
CUDA), then a disk file (kvstore/disk.py), and a remote store shared by a fleet
(kvstore/remote.py). Pages move whole under their prefix-cache hash, each tier keeps its
own LRU order, and the tiers are inclusive. `TieredKVStore` holds the policy of their order
(what leaves host RAM moves down, what is fetched lands in host RAM); `KVOffloader`
spills, loads, reads ahead and lands fetched pages. The design is in
docs/design/kv-pages-and-tiers.md.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kvstore.base import KVTier, PageFetch, ReadAheadTier, Tier
from kvstore.device_pool import DeviceKVPool
from kvstore.disk import DiskKVPool, DiskPrefetch, PageFormat
from kvstore.host import HostKVPool
from kvstore.remote import RemoteFetch, RemoteKVTier

log = logging.getLogger(__name__)

_NO_LIMITS: Mapping[Tier, int] = {}
_NO_PAGES: Mapping[bytes, Tier] = {}


def _page_in(fetches: Sequence[PageFetch], key: bytes) -> tuple[torch.Tensor, Tier] | None:
    """`key`'s page in the first of `fetches` that holds it, and its tier."""
    for fetch in fetches:
        page = fetch.page(key)
        if page is not None:
            return page, fetch.tier
    return None


class TieredKVStore:
    """The tiers below the device, keyed by page hash, with their spill counters and each
    owner's allowances. `tiers` holds them nearest first, `readers` those read ahead;
    `host`, `disk` and `remote` name each for what only it does (host rows read in place,
    disk pages read at once, the remote tier's quotas and counters)."""

    def __init__(
        self,
        page_nbytes: int,
        *,
        host_blocks: int,
        disk_blocks: int = 0,
        disk_dir: Path | None = None,
        disk_persistent: bool = False,
        page_format: PageFormat | None = None,
        pin: bool = False,
        remote: RemoteKVTier | None = None,
    ) -> None:
        """`disk_persistent`: the disk tier's file stays in `disk_dir` and what an earlier
        run left there written as `page_format` is found again (kvstore/disk.py).
        `remote`: a store shared by the fleet; every page leaving host RAM (or the device,
        without a host tier) is also saved there, written behind."""
        self.page_nbytes = page_nbytes
        self.host = HostKVPool(page_nbytes, host_blocks, pin=pin) if host_blocks > 0 else None
        self.disk: DiskKVPool | None = None
        if disk_blocks > 0:
            if disk_dir is None:
                raise ValueError("a disk tier needs a directory")
            try:
                self.disk = DiskKVPool(
                    disk_dir,
                    page_nbytes,
                    disk_blocks,
                    persistent=disk_persistent,
                    page_format=page_format,
                )
            except OSError as exc:
                log.warning("KV disk tier disabled: %s", exc)
        self.remote = remote
        # each a KVTier, the disk and remote tiers also read ahead (typed: mypy checks it)
        fetchers: tuple[ReadAheadTier[DiskPrefetch] | None, ReadAheadTier[RemoteFetch] | None]
        fetchers = (self.disk, remote)
        self.tiers: tuple[KVTier, ...] = tuple(t for t in (self.host, *fetchers) if t is not None)
        self.by_tier: dict[Tier, KVTier] = {t.tier: t for t in self.tiers}
        self.readers: dict[Tier, ReadAheadTier[Any]] = {
            t.tier: t for t in fetchers if t is not None
        }
        self._below_host = tuple(t for t in self.tiers if t.tier is not Tier.HOST)
        self.num_spilled = {Tier.HOST: 0, Tier.DISK: 0}
        self.num_dropped = 0
        self.allowances: dict[str, dict[Tier, int]] = {}  # owner -> pages per tier
        # called with a host slot before its row is read to move the page to disk, and
        # before it is handed out to be rewritten: copies in flight on that row finish first
        # (KVOffloader: loads that read host rows in place, spills that write them)
        self.before_host_use: Callable[[Collection[int]], None] | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    def has(self, tier: Tier) -> bool:
        return tier in self.by_tier

    def tier_of(self, key: bytes, *, touch: bool = False) -> Tier | None:
        """Which tier indexed here (host RAM, then disk) holds `key`; `touch` also marks it
        recently used there. The shared tier is not looked up: it is read ahead."""
        # per page of every lookup and load: the two indexes directly, not through `holds`
        host, disk = self.host, self.disk
        if host is not None and key in host.slots:
            if touch:
                host.slots.move_to_end(key)
            return Tier.HOST
        if disk is not None and key in disk.slots:
            if touch:
                disk.slots.move_to_end(key)
            return Tier.DISK
        return None

    def adopt_recovered(self) -> int:
        """Index the disk pages of an earlier run found since the last call (kvstore/disk.py);
        how many."""
        return 0 if self.disk is None else self.disk.adopt_recovered()

    def set_allowance(self, owner: str, host_blocks: int | None, disk_blocks: int | None) -> None:
        """At most this many of `owner`'s pages in each tier (None: no limit of its own)."""
        limits = {Tier.HOST: host_blocks, Tier.DISK: disk_blocks}
        pages = {tier: n for tier, n in limits.items() if n is not None}
        if pages:
            self.allowances[owner] = pages
        else:
            self.allowances.pop(owner, None)

    def allowance(self, owner: str, tier: Tier) -> int | None:
        """How many of `owner`'s pages `tier` may keep (None: no limit of its own)."""
        return self.allowances.get(owner, _NO_LIMITS).get(tier)

    def put(
        self, key: bytes, page: torch.Tensor, keep: Collection[bytes] = (), owner: str = ""
    ) -> None:
        """Keep a page the device is evicting: in host RAM, or on disk without a host tier.
        Pages under `keep` (about to be loaded) are not pushed out of the host tier for it."""
        if self.tier_of(key, touch=True) is Tier.HOST:
            return
        row = self.host_slot(key, keep, owner)
        if row is None:
            self.move_down(key, page, owner)
        else:
            row.copy_(page)

    def host_slot(
        self, key: bytes, keep: Collection[bytes] = (), owner: str = ""
    ) -> torch.Tensor | None:
        """A host slot's row registered under `key` (not yet in the host tier) for `owner`,
        for the caller to fill at once (`take_host_slot`)."""
        slot = self.take_host_slot(key, keep, owner)
        if slot is None:
            return None
        assert self.host is not None
        return self.host.data[slot]

    def take_host_slot(
        self, key: bytes, keep: Collection[bytes] = (), owner: str = ""
    ) -> int | None:
        """A host slot (its number) registered under `key` (not yet in the host tier) for
        `owner`, for the caller to fill. To make room, the owner's oldest page moves to disk
        when the owner is at its host allowance, else the least recently used page does;
        pages in `keep` never move. None when the page cannot go to host RAM."""
        host = self.host
        if host is None:
            return None
        assert key not in host.slots
        limit = self.allowance(owner, Tier.HOST) if self.allowances else None
        if limit == 0:
            return None
        victim: bytes | None = None
        if limit is not None and host.owners.counts.get(owner, 0) >= limit:
            victim = host.owners.oldest(host.slots, owner, keep)
            if victim is None:
                return None
        elif host.full:
            victim = host.owners.oldest(host.slots, None, keep)
            if victim is None:
                return None
        before = self.before_host_use
        if victim is not None:
            victim_owner = host.owners.of[victim]
            slot = host.release(victim)
            if before is not None:
                before((slot,))
            if not self._below_host:  # dropped (no view of the row needed)
                self.num_dropped += 1
            else:
                self.move_down(victim, host.data[slot], victim_owner)
        self.num_spilled[Tier.HOST] += 1
        slot = host.take(key, owner)
        if before is not None:
            before((slot,))
        return slot

    def take_host_slots(
        self, pages: Sequence[tuple[bytes, str]], keep: Collection[bytes] = ()
    ) -> list[int] | None:
        """`take_host_slot` for each of `pages` (key, owner) at once, in one pass over the
        least recently used pages (a spill of many pages). None, with nothing taken, where
        that does not apply: an owner has a host allowance, or the pages already there do
        not make room for them all (they would push out pages of this very batch)."""
        host = self.host
        if host is None or self.allowances:
            return None
        short = len(pages) - host.num_free
        victims: list[bytes] = []
        if short > 0:
            victims = list(itertools.islice((k for k in host.slots if k not in keep), short))
            if len(victims) < short:
                return None
        victim_owners = [host.owners.of[v] for v in victims]
        freed = host.release_many(victims)
        slots = host.take_many(pages)  # the victims' slots among them: the free list is spent
        if self.before_host_use is not None:  # before the victims' rows are read, and all
            self.before_host_use(slots)  # of them are handed out
        if not self._below_host:
            self.num_dropped += len(victims)
        else:  # read now, before the new pages are copied in
            for victim, slot, owner in zip(victims, freed, victim_owners, strict=True):
                self.move_down(victim, host.data[slot], owner)
        self.num_spilled[Tier.HOST] += len(pages)
        return slots

    def move_down(self, key: bytes, page: torch.Tensor, owner: str = "") -> None:
        """A page leaving host RAM (or the device, without a host tier): written to each
        tier below, within the owner's allowance there (the shared tier behind); dropped
        when no tier indexed here keeps it."""
        kept = False
        for tier in self._below_host:
            if tier.write(key, page, owner, self.allowance(owner, tier.tier)) and not tier.shared:
                self.num_spilled[tier.tier] += 1
                kept = True
        if not kept:
            self.num_dropped += 1

    def pages_by_owner(self) -> dict[str, dict[str, int]]:
        """Pages each owner holds in each tier below the device."""
        out: dict[str, dict[str, int]] = {}
        for tier in self.tiers:
            for owner, n in tier.pages_by_owner().items():
                out.setdefault(owner, {})[tier.tier.value] = n
        return out

    def host_row(self, key: bytes) -> int | None:
        """The host slot holding `key`'s page (now the most recently used), or None."""
        if self.host is None:
            return None
        slot = self.host.slots.get(key)
        if slot is not None:
            self.host.slots.move_to_end(key)
        return slot

    def get(self, key: bytes) -> tuple[torch.Tensor, Tier] | None:
        """A page and the tier it came from, or None (a host view: copy it before the next
        `put`)."""
        slot = self.host_row(key)
        if slot is not None:
            assert self.host is not None
            return self.host.data[slot], Tier.HOST
        if self.disk is not None:
            page = self.disk.read(key)
            if page is not None:
                return page, Tier.DISK
        return None

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


class KVOffloader:
    """Moves prefix-cache pages between a device pool and the tiers below it.

    Spills into host rows read in place run asynchronously, after the loads started before
    them (on CUDA a kernel writes the pinned host rows, all of a spill's pages at once; on
    CPU the loads' worker thread copies them); other spills are synchronous. Pages of the
    tiers that read ahead (`TieredKVStore.readers`) can be read into memory (`fetch`)
    before they are loaded. Loads go through the pool's layer-wise loads: on CUDA they run
    on their own stream while earlier layers compute.
    """

    def __init__(self, pool: DeviceKVPool, store: TieredKVStore) -> None:
        assert store.page_nbytes == pool.spec.bytes_per_block
        self.pool = pool
        self.store = store
        # on CUDA, copies between the pool and host rows run in place, by kernels
        self.in_place = store.host is not None and pool.loads.read_host_rows(store.host.data)
        self._saving: dict[int, int] = {}  # host slot -> device block, copy not yet run
        if self.in_place:
            store.before_host_use = self._before_host_use

    def _before_host_use(self, slots: Collection[int]) -> None:
        if self._saving and not self._saving.keys().isdisjoint(slots):
            self._save()  # a row about to be read or rewritten: the spill copies run now
        self.pool.loads.before_host_writes(slots)

    def _save(self, inline: bool = False) -> int:
        saving, self._saving = self._saving, {}
        if not saving:
            return 0
        return self.pool.loads.save_host_rows(list(saving.values()), list(saving), inline=inline)

    def spill(
        self,
        evicted: Sequence[tuple[int, bytes, str]],
        keep: Collection[bytes] = (),
        *,
        inline: bool = False,
    ) -> int:
        """Save the pages of device blocks about to be reused, as (block, hash, owner), without
        pushing the pages under `keep` (the ones about to be loaded) out of host RAM. Pages
        go straight into their host slots; what host RAM cannot take moves down a tier.
        Copies into host rows read in place may still be running: returns their ticket
        (kvstore/transfer.py; 0 if none), and the blocks are not to be rewritten before it
        is done. `inline`: in the order of the device's work instead, waited for by
        nothing (`PageLoads.save_host_rows`)."""
        no_room: list[tuple[int, bytes, str]] = []  # what host RAM cannot take
        # those loaded from host RAM earlier: the host copy is still good
        todo = [e for e in evicted if self.store.tier_of(e[1], touch=True) is not Tier.HOST]
        at_once = self.store.take_host_slots([(key, owner) for _, key, owner in todo], keep)
        for i, (block, key, owner) in enumerate(todo):
            slot = (
                at_once[i] if at_once is not None else self.store.take_host_slot(key, keep, owner)
            )
            if slot is None:
                no_room.append((block, key, owner))
            elif self.in_place:  # copied with the others below, or sooner if its row is used
                self._saving[slot] = block
            else:  # filled now: the next slot may push this very page down to disk
                assert self.store.host is not None
                self.pool.read_pages_into([block], [self.store.host.data[slot]])
        ticket = self._save(inline)
        if no_room:
            pages = self.pool.read_pages([b for b, _, _ in no_room]).cpu()
            for (_, key, owner), page in zip(no_room, pages, strict=True):
                self.store.move_down(key, page, owner)
        return ticket

    def find(self, keys: Sequence[bytes], *fetches: PageFetch) -> int:
        """How many of `keys`, from the first, some tier indexed here (or one of `fetches`,
        the pages read ahead for them) holds, marking them recently used, as a load
        normally follows."""
        tier_of = self.store.tier_of
        n = 0
        for key in keys:
            if tier_of(key, touch=True) is None and not (
                fetches and any(key in f.good for f in fetches)
            ):
                break
            n += 1
        return n

    def to_fetch(self, reader: ReadAheadTier[Any], keys: Sequence[bytes]) -> list[bytes]:
        """Which of `keys` (a chain) `reader` is to read ahead: for the shared tier, all of
        them (what it holds is known by reading it); for a tier indexed here, those it
        holds and no nearer tier does."""
        if reader.shared:
            return list(keys)
        tier_of = self.store.tier_of
        return [k for k in keys if tier_of(k) is reader.tier]

    def fetch(self, tier: Tier, keys: Sequence[bytes]) -> PageFetch | None:
        """Start reading ahead from `tier`, on its own threads, its pages of `keys`
        (`to_fetch`). None when they cannot start now: `tier` reads nothing ahead, nothing
        to read, or its budget is taken (`ReadAheadTier.fetch`). Poll it with `settle`;
        `release` it once loaded or no longer wanted."""
        reader = self.store.readers.get(tier)
        todo = [] if reader is None else self.to_fetch(reader, keys)
        return None if reader is None or not todo else reader.fetch(todo)

    def prefetch(self, keys: Sequence[bytes]) -> PageFetch | None:
        """`fetch` from the disk tier."""
        return self.fetch(Tier.DISK, keys)

    def settle(self, fetch: PageFetch) -> bool:
        """True once no page of `fetch` is still being read (never waits). Pages whose read
        failed are misses: `find` stops before them."""
        return self.store.readers[fetch.tier].settle(fetch)

    def release(self, fetch: PageFetch) -> None:
        """Done with `fetch`: its buffer goes once its reads have finished."""
        self.store.readers[fetch.tier].release(fetch)

    def wait_reads(self, timeout: float) -> None:
        """Block until some read ahead finishes or `timeout` seconds pass (at once if none
        is in flight). The farthest tier's reads, the slowest, are waited for first."""
        for reader in reversed(self.store.readers.values()):
            if reader.fetching:
                reader.wait_reads(timeout)
                return

    def land(self, fetch: PageFetch, owner: str) -> list[bytes]:
        """Copy the pages `fetch` got from the shared tier into host rows, for `owner`, in
        chain order, up to the first the host tier cannot take (the owner's allowance, or
        every page there is one of these); they join the host tier and loads read them
        there. Returns the keys landed."""
        host = self.store.host
        if host is None:
            return []
        keep, landed = fetch.good, []
        for key in fetch.keys:
            if key not in keep:
                break
            if self.store.tier_of(key) is not None:
                continue
            slot = self.store.take_host_slot(key, keep, owner)
            page = fetch.page(key)
            if slot is None or page is None:
                break
            host.data[slot].copy_(page)
            landed.append(key)
        return landed

    def publish(self, blocks: Sequence[int], keys: Sequence[bytes], owner: str) -> None:
        """Save the pages of device `blocks` (full, their KV written) to the shared tier
        under `keys`, written behind; pages it holds already are skipped."""
        for tier in self.store.tiers:
            if not tier.shared:
                continue
            todo = [(b, k) for b, k in zip(blocks, keys, strict=True) if not tier.holds(k)]
            if todo:
                pages = self.pool.read_pages([b for b, _ in todo]).cpu()  # one copy off a GPU
                for (_, key), page in zip(todo, pages, strict=True):
                    tier.write(key, page, owner)

    def load(
        self,
        blocks: Sequence[int],
        keys: Sequence[bytes],
        *fetches: PageFetch,
        landed: Mapping[bytes, Tier] = _NO_PAGES,
    ) -> list[Tier]:
        """Copy the pages of `keys` into device `blocks`, in order, up to the first page
        that cannot be read; returns the tier each loaded page came from. Pages read ahead
        from a tier indexed here come from `fetches` (settled) first; then host rows, then
        the disk; pages fetched from the shared tier last, unless they `landed` in host
        rows (a hit of the tier they came from)."""
        readers = self.store.readers
        near = [f for f in fetches if not readers[f.tier].shared]
        far = [f for f in fetches if readers[f.tier].shared]
        pages: list[torch.Tensor] = []
        page_blocks: list[int] = []
        rows: list[int] = []  # host slots read in place, known by number
        row_blocks: list[int] = []
        tiers: list[Tier] = []
        for block, key in zip(blocks[: len(keys)], keys, strict=True):
            got = _page_in(near, key) if near else None
            host_tier = landed.get(key, Tier.HOST) if landed else Tier.HOST
            if got is None and self.in_place:
                slot = self.store.host_row(key)
                if slot is not None:
                    rows.append(slot)
                    row_blocks.append(block)
                    tiers.append(host_tier)
                    continue
            if got is None:
                got = self.store.get(key)
                if got is None and far:
                    got = _page_in(far, key)
                elif got is not None and got[1] is Tier.HOST:
                    got = (got[0], host_tier)
            if got is None:
                break
            pages.append(got[0])
            page_blocks.append(block)
            tiers.append(got[1])
        # layer by layer, asynchronously on CUDA and on a worker thread (kvstore/transfer.py)
        if rows:
            self.pool.loads.start_host_rows(row_blocks, rows)
        if pages:
            self.pool.load_pages(page_blocks, pages)
        return tiers

    def check_integrity(self, open_fetches: Collection[PageFetch] = ()) -> None:
        """Also checks that the reads ahead not yet released are exactly `open_fetches`."""
        self.store.check_integrity()
        alive = {id(f) for r in self.store.readers.values() for f in r.open_fetches}
        assert alive == {id(f) for f in open_fetches}, "reads ahead leak"
