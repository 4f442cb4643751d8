"""The tiers below the device pool: host RAM (pinned on CUDA machines), then files on disk.

Pages move whole, as the bytes `DeviceKVPool.read_pages` returns (values, then FP8 scales),
under their prefix-cache hash: the key is the same in every tier. Each tier keeps its own
least-recently-used order. A page the device evicts is put into the host tier; a page the
host tier evicts is written to disk; a page the disk tier evicts is dropped. A page read back
to the device stays in its tier too (the tiers are inclusive), so evicting it again costs no
copy.

Disk pages live in one preallocated file per pool, in slots rounded up to 4 KiB, opened with
`O_DIRECT` where the filesystem allows it. The file is unlinked as soon as it is open, so it
disappears with the process however that ends. Writes go to a background thread from
page-aligned staging buffers; a page whose write is still in flight (state "moving") is read
from its staging buffer. Every disk page carries a CRC-32 checked on read: a corrupt or
truncated page is a miss, never wrong KV. A disk that cannot be opened, preallocated or
written degrades to a warning and fewer cached pages.
"""

from __future__ import annotations

import enum
import errno
import logging
import mmap
import os
import zlib
from collections import OrderedDict
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from kvstore.device_pool import DeviceKVPool

log = logging.getLogger(__name__)

_ALIGN = 4096  # O_DIRECT offsets, sizes and buffers are multiples of this
_SPARE_STAGING = 64  # finished writes' buffers kept for the next ones


def disk_slot_nbytes(page_nbytes: int) -> int:
    """Bytes one page takes on disk (rounded up for O_DIRECT)."""
    return -(-page_nbytes // _ALIGN) * _ALIGN


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class _Owners:
    """Which tenant each page of a tier belongs to, with a count per tenant."""

    def __init__(self) -> None:
        self.of: dict[bytes, str] = {}
        self.counts: dict[str, int] = {}

    def add(self, key: bytes, owner: str) -> None:
        self.of[key] = owner
        self.counts[owner] = self.counts.get(owner, 0) + 1

    def remove(self, key: bytes) -> None:
        owner = self.of.pop(key)
        self.counts[owner] -= 1
        if not self.counts[owner]:
            del self.counts[owner]

    def oldest(
        self, order: Collection[bytes], owner: str | None, keep: Collection[bytes]
    ) -> bytes | None:
        """The first key of `order` (least recently used first) that belongs to `owner`
        (any owner when None) and is not in `keep`."""
        return next(
            (k for k in order if k not in keep and (owner is None or self.of[k] == owner)), None
        )

    def check(self, keys: Collection[bytes]) -> None:
        assert set(self.of) == set(keys), "page owners disagree with the pages"
        assert sum(self.counts.values()) == len(self.of), "owner counts disagree"


class HostKVPool:
    """`num_blocks` page slots in one preallocated host tensor."""

    def __init__(self, page_nbytes: int, num_blocks: int, *, pin: bool) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.data = torch.empty(num_blocks, page_nbytes, dtype=torch.uint8, pin_memory=pin)
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.owners = _Owners()
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_used(self) -> int:
        return len(self.slots)

    @property
    def full(self) -> bool:
        return not self._free

    def clear(self) -> None:
        """Forget every page."""
        self.slots.clear()
        self.owners = _Owners()
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

    def check_integrity(self) -> None:
        used = list(self.slots.values())
        assert len(set(used)) == len(used), "two host pages share a slot"
        assert sorted(used + self._free) == list(range(self.num_blocks)), "host slots leak"
        self.owners.check(self.slots)


class DiskKVPool:
    """`num_blocks` page slots in one preallocated file under `directory`.

    Raises OSError when the file cannot be created or preallocated at all; a partial
    preallocation (a nearly full disk) keeps the slots that fit.
    """

    def __init__(self, directory: Path, page_nbytes: int, num_blocks: int) -> None:
        assert num_blocks > 0
        self.page_nbytes = page_nbytes
        self.slot_nbytes = disk_slot_nbytes(page_nbytes)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"strata-kv-{os.getpid()}-{id(self):x}.pages"
        self.direct = True
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        try:
            self.fd = os.open(self.path, flags | getattr(os, "O_DIRECT", 0), 0o600)
        except OSError:
            self.direct = False  # tmpfs and some others refuse O_DIRECT
            self.fd = os.open(self.path, flags, 0o600)
        self.path.unlink()
        try:
            self.num_blocks = self._preallocate(num_blocks)
        except OSError:
            self.close()
            raise
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.owners = _Owners()
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._checksums: dict[int, int] = {}
        self._pending: dict[int, tuple[Future[None], mmap.mmap]] = {}
        self._spare: list[mmap.mmap] = []  # staging buffers of finished writes
        self._io = ThreadPoolExecutor(1, thread_name_prefix="strata-kv-disk")
        self.num_write_errors = 0
        self.num_checksum_failures = 0

    def _preallocate(self, num_blocks: int) -> int:
        """Reserve the file's space; on a disk too full for all of it, keep what fits."""
        want = num_blocks
        while want > 0:
            try:
                os.posix_fallocate(self.fd, 0, want * self.slot_nbytes)
            except OSError as exc:
                if exc.errno == errno.EOPNOTSUPP:  # a sparse file then, filled as pages arrive
                    os.ftruncate(self.fd, want * self.slot_nbytes)
                    return want
                if exc.errno not in (errno.ENOSPC, errno.EFBIG):  # disk or file-size limit
                    raise
                want //= 2
                continue
            if want < num_blocks:
                log.warning(
                    "KV disk tier: only %d of %d pages fit on %s", want, num_blocks, self.path
                )
            return want
        raise OSError(errno.ENOSPC, "no space for a single KV page", str(self.path))

    @property
    def num_used(self) -> int:
        return len(self.slots)

    def write(
        self, key: bytes, page: torch.Tensor, owner: str = "", limit: int | None = None
    ) -> bool:
        """Start writing `page` under `key` for `owner`, who may keep at most `limit` pages
        here (None: no limit). Makes room by dropping the owner's oldest page when it is at
        its limit, else the least recently used page. False when the page cannot be kept."""
        self.reap()
        if key in self.slots:
            self.slots.move_to_end(key)
            return True
        if limit == 0:
            return False
        if limit is not None and self.owners.counts.get(owner, 0) >= limit:
            victim = self.owners.oldest(self.slots, owner, ())
        elif not self._free:
            victim = self.owners.oldest(self.slots, None, ())
        else:
            victim = None
        if victim is not None:
            self._forget(victim)
        if not self._free:
            return False
        slot = self._free.pop()
        # page aligned, as O_DIRECT needs; reused, since fresh memory costs page faults
        staging = self._spare.pop() if self._spare else mmap.mmap(-1, self.slot_nbytes)
        view = memoryview(staging)
        view[: self.page_nbytes] = page.contiguous().numpy().data
        self._checksums[slot] = zlib.crc32(view[: self.page_nbytes])
        view.release()
        offset = slot * self.slot_nbytes
        future = self._io.submit(self._pwrite, staging, offset)
        self._pending[slot] = (future, staging)
        self.slots[key] = slot
        self.owners.add(key, owner)
        return True

    def _pwrite(self, staging: mmap.mmap, offset: int) -> None:
        written = os.pwritev(self.fd, [staging], offset)
        if written != self.slot_nbytes:
            raise OSError(errno.EIO, f"short write ({written} of {self.slot_nbytes} bytes)")

    def read(self, key: bytes) -> torch.Tensor | None:
        """The page stored under `key`, or None (absent, unreadable or failing its
        checksum, in which case it is forgotten)."""
        slot = self.slots.get(key)
        if slot is None:
            return None
        pending = self._pending.get(slot)
        moving = pending is not None and not pending[0].done()
        if pending is not None and moving:
            buf, got = pending[1], self.page_nbytes  # still moving: read its staging buffer
        else:
            self.reap()
            if key not in self.slots:
                return None  # its write failed
            buf = mmap.mmap(-1, self.slot_nbytes)  # page aligned, as O_DIRECT needs
            try:
                got = os.preadv(self.fd, [buf], slot * self.slot_nbytes)
            except OSError as exc:
                log.warning("KV disk tier: read failed (%s); treating the page as a miss", exc)
                got = 0
        view = memoryview(buf)[: self.page_nbytes]
        intact = got >= self.page_nbytes and zlib.crc32(view) == self._checksums.get(slot)
        view.release()
        if not intact:
            self.num_checksum_failures += 1
            log.warning("KV disk tier: page %d failed its checksum; treating it as a miss", slot)
            self._forget(key)
            return None
        self.slots.move_to_end(key)
        page = torch.frombuffer(buf, dtype=torch.uint8, count=self.page_nbytes)
        return page.clone() if moving else page  # staging buffers go back to the writer

    def _forget(self, key: bytes, reuse: bool = True) -> None:
        slot = self.slots.pop(key)
        self.owners.remove(key)
        self._checksums.pop(slot, None)
        if reuse:
            self._free.append(slot)

    def reap(self, wait: bool = False) -> None:
        """Retire finished writes; a failed write loses its page and its slot."""
        for slot, (future, staging) in list(self._pending.items()):
            if not (wait or future.done()):
                continue
            exc = future.exception()
            del self._pending[slot]
            if len(self._spare) < _SPARE_STAGING:
                self._spare.append(staging)
            else:
                staging.close()
            if exc is None:
                continue
            self.num_write_errors += 1
            log.warning("KV disk tier: write failed (%s); caching fewer pages", exc)
            for key, s in list(self.slots.items()):
                if s == slot:  # the slot is not reused: the disk may be full
                    self._forget(key, reuse=False)

    def check_integrity(self) -> None:
        used = list(self.slots.values())
        assert len(set(used)) == len(used), "two disk pages share a slot"
        assert not set(used) & set(self._free), "a disk slot is both used and free"
        for slot in used:
            assert slot in self._checksums, "a disk page has no checksum"
        self.owners.check(self.slots)

    def close(self) -> None:
        io = getattr(self, "_io", None)
        if io is not None:
            io.shutdown(wait=True)
            self.reap(wait=True)
        os.close(self.fd)


class TieredKVStore:
    """The host and disk tiers, keyed by page hash, with their hit and spill counters."""

    def __init__(
        self,
        page_nbytes: int,
        *,
        host_blocks: int,
        disk_blocks: int = 0,
        disk_dir: Path | None = None,
        pin: bool = False,
    ) -> None:
        self.page_nbytes = page_nbytes
        self.host = HostKVPool(page_nbytes, host_blocks, pin=pin) if host_blocks > 0 else None
        self.disk: DiskKVPool | None = None
        if disk_blocks > 0:
            if disk_dir is None:
                raise ValueError("a disk tier needs a directory")
            try:
                self.disk = DiskKVPool(disk_dir, page_nbytes, disk_blocks)
            except OSError as exc:
                log.warning("KV disk tier disabled: %s", exc)
        self.num_spilled = {Tier.HOST: 0, Tier.DISK: 0}
        self.num_dropped = 0
        self.allowances: dict[str, tuple[int | None, int | None]] = {}  # owner -> pages

    @property
    def enabled(self) -> bool:
        return self.host is not None or self.disk is not None

    def tier_of(self, key: bytes, *, touch: bool = False) -> Tier | None:
        """Where `key` is; `touch` also marks it recently used there."""
        for tier, pool in ((Tier.HOST, self.host), (Tier.DISK, self.disk)):
            if pool is not None and key in pool.slots:
                if touch:
                    pool.slots.move_to_end(key)
                return tier
        return None

    def set_allowance(self, owner: str, host_blocks: int | None, disk_blocks: int | None) -> None:
        """At most this many of `owner`'s pages in each tier (None: no limit of its own)."""
        if host_blocks is None and disk_blocks is None:
            self.allowances.pop(owner, None)
        else:
            self.allowances[owner] = (host_blocks, disk_blocks)

    def put(
        self, key: bytes, page: torch.Tensor, keep: Collection[bytes] = (), owner: str = ""
    ) -> None:
        """Keep a page the device is evicting: in host RAM, or on disk without a host tier.
        Pages under `keep` (about to be loaded) are not pushed out of the host tier for it."""
        if self.tier_of(key, touch=True) is Tier.HOST:
            return
        row = self.host_slot(key, keep, owner)
        if row is None:
            self.to_disk(key, page, owner)
        else:
            row.copy_(page)

    def host_slot(
        self, key: bytes, keep: Collection[bytes] = (), owner: str = ""
    ) -> torch.Tensor | None:
        """A host slot registered under `key` (not yet in the host tier) for `owner`, for
        the caller to fill at once. To make room, the owner's oldest page moves to disk
        when the owner is at its host allowance, else the least recently used page does;
        pages in `keep` never move. None when the page cannot go to host RAM."""
        host = self.host
        if host is None:
            return None
        assert key not in host.slots
        limit = self.allowances.get(owner, (None, None))[0]
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
        if victim is not None:
            victim_owner = host.owners.of[victim]
            slot = host.release(victim)
            self.to_disk(victim, host.data[slot], victim_owner)
        self.num_spilled[Tier.HOST] += 1
        return host.data[host.take(key, owner)]

    def to_disk(self, key: bytes, page: torch.Tensor, owner: str = "") -> None:
        """Write a page to the disk tier (within the owner's allowance), or drop it."""
        limit = self.allowances.get(owner, (None, None))[1]
        if self.disk is not None and self.disk.write(key, page, owner, limit):
            self.num_spilled[Tier.DISK] += 1
        else:
            self.num_dropped += 1

    def pages_by_owner(self) -> dict[str, dict[str, int]]:
        """Pages each owner holds in each tier below the device."""
        out: dict[str, dict[str, int]] = {}
        for tier, pool in ((Tier.HOST, self.host), (Tier.DISK, self.disk)):
            if pool is not None:
                for owner, n in pool.owners.counts.items():
                    out.setdefault(owner, {})[tier.value] = n
        return out

    def get(self, key: bytes) -> tuple[torch.Tensor, Tier] | None:
        """A page and the tier it came from, or None (a host view: copy it before the next
        `put`)."""
        if self.host is not None:
            slot = self.host.slots.get(key)
            if slot is not None:
                self.host.slots.move_to_end(key)
                return self.host.data[slot], Tier.HOST
        if self.disk is not None:
            page = self.disk.read(key)
            if page is not None:
                return page, Tier.DISK
        return None

    def check_integrity(self) -> None:
        if self.host is not None:
            self.host.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


class KVOffloader:
    """Moves prefix-cache pages between a device pool and the tiers below it.

    Spills are synchronous (on CUDA through pinned host memory). Loads go through the pool's
    layer-wise loads: on CUDA they run on their own stream while earlier layers compute.
    """

    def __init__(self, pool: DeviceKVPool, store: TieredKVStore) -> None:
        assert store.page_nbytes == pool.spec.bytes_per_block
        self.pool = pool
        self.store = store

    def spill(
        self, evicted: Sequence[tuple[int, bytes, str]], keep: Collection[bytes] = ()
    ) -> None:
        """Save the pages of device blocks about to be reused, as (block, hash, owner), without
        pushing the pages under `keep` (the ones about to be loaded) out of host RAM. Pages
        go straight into their host slots; what host RAM cannot take goes to disk."""
        to_disk: list[tuple[int, bytes, str]] = []
        for block, key, owner in evicted:
            if self.store.tier_of(key, touch=True) is Tier.HOST:
                continue  # loaded from there earlier: the host copy is still good
            row = self.store.host_slot(key, keep, owner)
            if row is None:
                to_disk.append((block, key, owner))
            else:  # filled now: the next slot may push this very page down to disk
                self.pool.read_pages_into([block], [row])
        if to_disk:
            pages = self.pool.read_pages([b for b, _, _ in to_disk]).cpu()
            for (_, key, owner), page in zip(to_disk, pages, strict=True):
                self.store.to_disk(key, page, owner)

    def find(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, some tier below the device holds (marking
        them recently used, as a load normally follows)."""
        n = 0
        while n < len(keys) and self.store.tier_of(keys[n], touch=True) is not None:
            n += 1
        return n

    def load(self, blocks: Sequence[int], keys: Sequence[bytes]) -> list[Tier]:
        """Copy the pages of `keys` into device `blocks`, in order, up to the first page
        that cannot be read; returns the tier each loaded page came from."""
        pages: list[torch.Tensor] = []
        tiers: list[Tier] = []
        for key in keys:
            got = self.store.get(key)
            if got is None:
                break
            pages.append(got[0])
            tiers.append(got[1])
        if pages:  # layer by layer, asynchronously on CUDA (kvstore/transfer.py)
            self.pool.load_pages(blocks[: len(pages)], pages)
        return tiers
