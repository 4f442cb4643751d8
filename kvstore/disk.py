"""The disk tier: KV pages in one preallocated file, each with a header and a CRC-32
(kvstore/disk_page.py), read ahead into memory before their load (a `ReadAheadTier`,
kvstore/base.py). The file is anonymous (unlinked at once), or persistent: kept in its
directory and indexed again, in the background, when the next worker opens it.

Writes, reads ahead and that indexing run on a few threads; the pool's state changes on the
caller's thread only. A page that fails a check is a miss. The design is in
docs/design/kv-pages-and-tiers.md.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from kvstore.base import PageOwners, Tier, holds_in_lru
from kvstore.disk_file import open_anonymous, open_persistent
from kvstore.disk_page import HEADER_NBYTES, PageFormat, disk_slot_nbytes, pack_header
from kvstore.disk_recovery import Recovery

log = logging.getLogger(__name__)

_SPARE_STAGING_BYTES = 256 << 20  # finished writes' staging buffers kept for the next ones
_WRITE_THREADS = 4  # writes in flight at once: one at a time leaves the disk idle between them
_READ_THREADS = 4  # reads in flight at once, for the same reason
PREFETCH_BYTES = 256 << 20  # read-ahead buffers of several requests at once, at most


__all__ = ["PREFETCH_BYTES", "DiskKVPool", "DiskPrefetch", "PageFormat", "disk_slot_nbytes"]


class _Write:
    """A page on its way to its slot: `future` gives its CRC-32 once it is on disk."""

    __slots__ = ("future", "key", "owner", "staging")

    def __init__(self, future: Future[int], staging: mmap.mmap, key: bytes, owner: str) -> None:
        self.future = future
        self.staging = staging
        self.key = key
        self.owner = owner


class DiskPrefetch:
    """Pages of one request read ahead from the disk tier: page i of `keys` lands in row i of
    one page-aligned buffer and is checked against the checksum it had when the read began
    (None: the page was copied from its staging buffer, not read).

    Built by `DiskKVPool.fetch`; `DiskKVPool.settle` turns failed reads into misses."""

    tier = Tier.DISK

    def __init__(
        self,
        keys: list[bytes],
        slots: list[int],
        checksums: list[int | None],
        page_nbytes: int,
        slot_nbytes: int,
    ) -> None:
        self.keys = keys
        self.slots = slots
        self.checksums = checksums
        self.page_nbytes = page_nbytes
        self.slot_nbytes = slot_nbytes
        self.buffer = mmap.mmap(-1, len(keys) * slot_nbytes)  # page aligned, as O_DIRECT needs
        self.reads: list[Future[str | None]] = []  # None, or why row i could not be used
        self.rows = {k: i for i, k in enumerate(keys)}
        self.good: set[bytes] = set()  # read and checked (once settled)
        self.settled = False
        self.released = False

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.slot_nbytes

    @property
    def done(self) -> bool:
        return all(f.done() for f in self.reads)

    def page(self, key: bytes) -> torch.Tensor | None:
        """The page read for `key` (a view of the buffer), or None: not read ahead, not yet
        settled, or failed."""
        if key not in self.good:
            return None
        offset = self.rows[key] * self.slot_nbytes
        return torch.frombuffer(
            self.buffer, dtype=torch.uint8, count=self.page_nbytes, offset=offset
        )


class DiskKVPool:
    """`num_blocks` page slots in one preallocated file under `directory`, pages written
    as `page_format`.

    `persistent`: the file stays in `directory` (locked while open; a second worker there
    takes the next name, kvstore/disk_file.py), and the pages an earlier run left in it are
    indexed on a thread: the slots not yet scanned are neither used nor free, and
    `adopt_recovered` takes in what the scan found so far. Otherwise the file is unlinked
    as soon as it is open.

    Raises OSError when the file cannot be created or preallocated at all; a partial
    preallocation (a nearly full disk) keeps the slots that fit.
    """

    tier = Tier.DISK
    shared = False

    def __init__(
        self,
        directory: Path,
        page_nbytes: int,
        num_blocks: int,
        *,
        persistent: bool = False,
        page_format: PageFormat | None = None,
    ) -> None:
        assert num_blocks > 0
        self.page_nbytes = page_nbytes
        self.slot_nbytes = disk_slot_nbytes(page_nbytes)
        self.page_format = page_format or PageFormat()
        self.persistent = persistent
        tag = f"{id(self):x}"
        opened = open_persistent(directory) if persistent else open_anonymous(directory, tag)
        self.fd, self.path, self.direct = opened.fd, opened.path, opened.direct
        self._recovery: Recovery | None = None
        try:
            self.num_blocks = self._preallocate(num_blocks)
        except OSError:
            self.close()
            raise
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.owners = PageOwners()
        # slots an earlier run may have written: scanned in the background
        num_scan = min(self.num_blocks, -(-opened.num_existing_bytes // self.slot_nbytes))
        self._free = list(range(self.num_blocks - 1, num_scan - 1, -1))
        self._recovered: set[int] = set()  # slots holding pages of an earlier run
        self.num_recovered = 0  # pages indexed from an earlier run
        self.num_rejected = 0  # pages of an earlier run turned away: torn, garbage, foreign
        self._checksums: dict[int, int] = {}  # of the pages whose writes are retired
        self._pending: dict[int, _Write] = {}  # by slot, oldest first
        self._spare: list[mmap.mmap] = []  # staging buffers of finished writes
        self._io = ThreadPoolExecutor(_WRITE_THREADS, thread_name_prefix="strata-kv-disk")
        self._readers = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="strata-kv-read")
        self._prefetches: list[DiskPrefetch] = []  # not yet released, or still reading
        self.num_write_errors = 0
        self.num_checksum_failures = 0
        if num_scan:
            self._recovery = Recovery(
                self.fd,
                num_scan,
                self.slot_nbytes,
                opened.num_existing_bytes,
                self.page_format,
                page_nbytes,
            )

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

    def holds(self, key: bytes, *, touch: bool = False) -> bool:
        return holds_in_lru(self.slots, key, touch)

    def pages_by_owner(self) -> dict[str, int]:
        return dict(self.owners.counts)

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
        with memoryview(staging) as view:
            view[: self.page_nbytes] = page.contiguous().numpy().data
        # a slot written again before its last write was retired: that write's page is
        # forgotten, and this one goes to the disk after it
        earlier = self._pending.pop(slot, None)
        after = None if earlier is None else earlier.future
        header = (key, owner, time.time_ns())
        future = self._io.submit(self._write_slot, staging, slot, after, header)
        self._pending[slot] = _Write(future, staging, key, owner)  # oldest first: queued order
        self.slots[key] = slot
        self.owners.add(key, owner)
        return True

    def _write_slot(
        self,
        staging: mmap.mmap,
        slot: int,
        after: Future[int] | None,
        header: tuple[bytes, str, int],
    ) -> int:
        """Writer thread: the staged page's CRC-32, once it is written to `slot` with its
        header (key, owner, sequence), after `after`, the slot's earlier write (queued
        before, so running or done already)."""
        with memoryview(staging) as view:
            crc = zlib.crc32(view[: self.page_nbytes])
        key, owner, sequence = header
        staging[self.slot_nbytes - HEADER_NBYTES :] = pack_header(
            self.page_format, key, owner, self.page_nbytes, crc, sequence
        )
        if after is not None:
            wait([after])
        written = os.pwritev(self.fd, [staging], slot * self.slot_nbytes)
        if written != self.slot_nbytes:
            raise OSError(errno.EIO, f"short write ({written} of {self.slot_nbytes} bytes)")
        return crc

    def read(self, key: bytes) -> torch.Tensor | None:
        """The page stored under `key`, or None (absent, unreadable or failing its
        checksum, in which case it is forgotten)."""
        slot = self.slots.get(key)
        if slot is None:
            return None
        self.slots.move_to_end(key)
        pending = self._pending.get(slot)
        if pending is not None:  # moving: its staging buffer holds it (and goes back on reap)
            return torch.frombuffer(
                pending.staging, dtype=torch.uint8, count=self.page_nbytes
            ).clone()
        buf = mmap.mmap(-1, self.slot_nbytes)  # page aligned, as O_DIRECT needs
        try:
            got = os.preadv(self.fd, [buf], slot * self.slot_nbytes)
        except OSError as exc:
            log.warning("KV disk tier: read failed (%s); treating the page as a miss", exc)
            got = 0
        with memoryview(buf) as view:
            intact = got >= self.page_nbytes and zlib.crc32(view[: self.page_nbytes]) == (
                self._checksums.get(slot)
            )
        if not intact:
            self._count_failure(slot)
            log.warning("KV disk tier: page %d failed its checksum; treating it as a miss", slot)
            self._forget(key)
            return None
        return torch.frombuffer(buf, dtype=torch.uint8, count=self.page_nbytes)

    def _count_failure(self, slot: int) -> None:
        self.num_checksum_failures += 1
        if slot in self._recovered:  # a page of an earlier run torn after its header
            self.num_rejected += 1

    def _forget(self, key: bytes, reuse: bool = True) -> None:
        slot = self.slots.pop(key)
        self.owners.remove(key)
        self._checksums.pop(slot, None)
        self._recovered.discard(slot)
        if reuse:
            self._free.append(slot)

    def reap(self, wait: bool = False) -> None:
        """Retire finished writes: a page written keeps its checksum, a failed write loses
        its page and its slot. Writes finish about in the order they were queued, so the
        scan stops at the first one still running."""
        for slot, write in list(self._pending.items()):
            if not (wait or write.future.done()):
                break
            exc = write.future.exception()
            del self._pending[slot]
            if (len(self._spare) + 1) * self.slot_nbytes <= _SPARE_STAGING_BYTES:
                self._spare.append(write.staging)
            else:
                write.staging.close()
            if self.slots.get(write.key) != slot:
                continue  # forgotten while it was being written
            if exc is None:
                self._checksums[slot] = write.future.result()
                continue
            self.num_write_errors += 1
            log.warning("KV disk tier: write failed (%s); caching fewer pages", exc)
            self._forget(write.key, reuse=False)  # the slot is not reused: the disk may be full

    # -- reading ahead ------------------------------------------------------------------

    @property
    def num_prefetch_bytes(self) -> int:
        """Bytes of read-ahead buffers alive now: not released, or still being read into
        (at most PREFETCH_BYTES, or one prefetch's)."""
        return sum(f.nbytes for f in self._prefetches if not (f.released and f.done))

    @property
    def open_fetches(self) -> list[DiskPrefetch]:
        """Reads ahead not yet released."""
        return [f for f in self._prefetches if not f.released]

    def fetch(self, keys: Sequence[bytes]) -> DiskPrefetch | None:
        """Start reading the pages of `keys` held here on the reader threads. None when it
        cannot start: no key is here, or the other reads ahead alive would exceed
        PREFETCH_BYTES with it (alone, any size starts). Marks the pages recently used."""
        self._retire()
        keys = [k for k in keys if k in self.slots]
        used = self.num_prefetch_bytes
        if not keys or (used and used + len(keys) * self.slot_nbytes > PREFETCH_BYTES):
            return None
        slots = [self.slots[k] for k in keys]
        fetch = DiskPrefetch(
            keys, slots, [self._checksums.get(s) for s in slots], self.page_nbytes, self.slot_nbytes
        )
        for row, (key, slot) in enumerate(zip(keys, slots, strict=True)):
            self.slots.move_to_end(key)
            pending = self._pending.get(slot)
            if pending is not None:  # moving: copy its staging
                start = row * self.slot_nbytes
                fetch.buffer[start : start + self.page_nbytes] = pending.staging[: self.page_nbytes]
                read: Future[str | None] = Future()
                read.set_result(None)
            else:
                read = self._readers.submit(self._read_row, fetch, row)
            fetch.reads.append(read)
        self._prefetches.append(fetch)
        return fetch

    def _read_row(self, fetch: DiskPrefetch, row: int) -> str | None:
        """Reader thread: read page `row` of `fetch` and check it; None, or what failed."""
        start = row * self.slot_nbytes
        view = memoryview(fetch.buffer)[start : start + self.slot_nbytes]
        try:
            got = os.preadv(self.fd, [view], fetch.slots[row] * self.slot_nbytes)
        except OSError as exc:
            return f"read failed ({exc})"
        if got < self.page_nbytes:
            return f"short read ({got} of {self.page_nbytes} bytes)"
        if zlib.crc32(view[: self.page_nbytes]) != fetch.checksums[row]:
            return "checksum mismatch"
        return None

    def settle(self, fetch: DiskPrefetch) -> bool:
        """True once every read of `fetch` has finished (without waiting). The first time,
        a page that failed is counted and forgotten here, unless its slot has been reused
        since (it was evicted while being read): either way it is a miss."""
        if not fetch.done:
            return False
        if not fetch.settled:
            fetch.settled = True
            for key, slot, crc, read in zip(
                fetch.keys, fetch.slots, fetch.checksums, fetch.reads, strict=True
            ):
                error = read.result()
                if error is None:
                    fetch.good.add(key)
                    continue
                if self.slots.get(key) == slot and self._checksums.get(slot) == crc:
                    self._count_failure(slot)
                    log.warning("KV disk tier: page %d: %s; treating it as a miss", slot, error)
                    self._forget(key)
        return True

    def release(self, fetch: DiskPrefetch) -> None:
        """The request is done with `fetch`; its buffer goes once its reads have finished."""
        fetch.released = True
        self._retire()

    @property
    def fetching(self) -> bool:
        """Whether a read ahead is still in flight."""
        return any(not f.done for f in self._prefetches)

    def wait_reads(self, timeout: float) -> None:
        """Block until some read ahead finishes, or `timeout` seconds (none in flight: at
        once)."""
        running = [f for fetch in self._prefetches for f in fetch.reads if not f.done()]
        if running:
            wait(running, timeout, return_when=FIRST_COMPLETED)

    def _retire(self) -> None:
        self._prefetches = [f for f in self._prefetches if not (f.released and f.done)]

    # -- pages of an earlier run ---------------------------------------------------------

    @property
    def recovering(self) -> bool:
        """Whether slots an earlier run left are still to be indexed."""
        recovery = self._recovery
        return recovery is not None and not (recovery.finished.is_set() and not recovery.batches)

    def adopt_recovered(self) -> int:
        """Take in the pages the background scan has found since the last call: each one
        joins the index as less recently used than any page already here (the newest of a
        batch last), with the checksum its header gives, checked when it is read; slots
        holding nothing usable become free. Returns how many pages joined."""
        recovery = self._recovery
        if recovery is None or not recovery.batches:
            return 0
        num_adopted = 0
        while recovery.batches:
            batch = recovery.batches.popleft()
            self._free.extend(batch.free)
            self.num_rejected += batch.num_rejected
            newest_first = sorted(batch.pages, key=lambda p: p[1].sequence, reverse=True)
            for slot, header in newest_first:
                if header.key in self.slots:  # an older copy, or written again since
                    self._free.append(slot)
                    continue
                self.slots[header.key] = slot
                self.slots.move_to_end(header.key, last=False)
                self.owners.add(header.key, header.owner)
                self._checksums[slot] = header.payload_crc
                self._recovered.add(slot)
                num_adopted += 1
        self.num_recovered += num_adopted
        return num_adopted

    def wait_recovered(self, timeout: float | None = None) -> bool:
        """Block until the background scan has finished (or `timeout` seconds), then adopt
        what it found; whether it has finished."""
        if self._recovery is not None and not self._recovery.finished.wait(timeout):
            return False
        self.adopt_recovered()
        return True

    def check_integrity(self) -> None:
        used = list(self.slots.values())
        assert len(set(used)) == len(used), "two disk pages share a slot"
        assert not set(used) & set(self._free), "a disk slot is both used and free"
        assert len(set(self._free)) == len(self._free), "a disk slot is free twice"
        assert self._recovered <= set(used), "a recovered slot holds no page"
        for slot in used:
            assert slot in self._checksums or slot in self._pending, "a disk page has no checksum"
        self.owners.check(self.slots)
        assert self.num_prefetch_bytes <= max(
            PREFETCH_BYTES, max((f.nbytes for f in self._prefetches), default=0)
        ), "reads ahead exceed their budget"

    def close(self) -> None:
        """Finish the writes under way (a persistent file then holds every page written)
        and close the file, which lets go of its lock."""
        if self._recovery is not None:
            self._recovery.stop()
        io = getattr(self, "_io", None)
        if io is not None:
            io.shutdown(wait=True)
            self._readers.shutdown(wait=True)
            self.reap(wait=True)
        os.close(self.fd)
