"""Rebuilding the disk tier's index from a page file an earlier run left: a thread reads
the header of every slot, in order, and hands them over in batches; the pool takes them in
on its own thread (`DiskKVPool.adopt_recovered`), so serving starts at once and hits
appear as pages are indexed. Nothing here changes the pool.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections import deque
from dataclasses import dataclass, field

from kvstore.disk_page import (
    ALIGN,
    HEADER_NBYTES,
    HeaderError,
    PageFormat,
    PageHeader,
    is_blank,
    unpack_header,
)

log = logging.getLogger(__name__)

BATCH_SLOTS = 256  # slots scanned per batch handed over


@dataclass
class RecoveryBatch:
    """Slots scanned: the usable pages found (slot, header), the slots holding nothing
    usable (free to reuse), and how many of those held a page turned away (torn, garbage,
    another model's)."""

    pages: list[tuple[int, PageHeader]] = field(default_factory=list)
    free: list[int] = field(default_factory=list)
    num_rejected: int = 0

    @property
    def num_slots(self) -> int:
        return len(self.pages) + len(self.free)


class Recovery:
    """Scans the first `num_slots` slots of the file open as `fd` (`num_existing_bytes` long
    when opened) on a thread of its own. `batches` fills as it goes; `finished` is set once
    the last batch is in."""

    def __init__(
        self,
        fd: int,
        num_slots: int,
        slot_nbytes: int,
        num_existing_bytes: int,
        page_format: PageFormat,
        page_nbytes: int,
    ) -> None:
        assert slot_nbytes % ALIGN == 0
        self.fd = fd
        self.num_slots = num_slots
        self.slot_nbytes = slot_nbytes
        self.num_existing_bytes = num_existing_bytes
        self.page_format = page_format
        self.page_nbytes = page_nbytes
        self.batches: deque[RecoveryBatch] = deque()
        self.finished = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-kv-recover", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        buf = mmap.mmap(-1, ALIGN)  # page aligned, as O_DIRECT needs
        batch = RecoveryBatch()
        num_pages = num_rejected = 0
        try:
            for slot in range(self.num_slots):
                if self._stop.is_set():
                    return
                header = self._read(slot, buf)
                if isinstance(header, PageHeader):
                    batch.pages.append((slot, header))
                    num_pages += 1
                else:
                    batch.free.append(slot)
                    if header is not None:
                        batch.num_rejected += 1
                        num_rejected += 1
                        log.debug("KV disk tier: slot %d turned away: %s", slot, header)
                if batch.num_slots >= BATCH_SLOTS:
                    self.batches.append(batch)
                    batch = RecoveryBatch()
            self.batches.append(batch)
            log.info(
                "KV disk tier: %d pages indexed from an earlier run, %d turned away",
                num_pages,
                num_rejected,
            )
        finally:
            buf.close()
            self.finished.set()

    def _read(self, slot: int, buf: mmap.mmap) -> PageHeader | str | None:
        """The slot's header, or why its page is turned away, or None: never written."""
        end = (slot + 1) * self.slot_nbytes
        if end > self.num_existing_bytes:
            return "cut short by the end of the file"
        try:
            got = os.preadv(self.fd, [buf], end - ALIGN)
        except OSError as exc:
            return f"read failed ({exc})"
        if got < ALIGN:
            return "short read"
        with memoryview(buf) as view:
            raw = view[ALIGN - HEADER_NBYTES :]
            try:
                if is_blank(raw):
                    return None
                return unpack_header(raw, self.page_format, self.page_nbytes)
            except HeaderError as exc:
                return str(exc)
            finally:
                raw.release()

    def stop(self) -> None:
        """Stop scanning (what is scanned stays in `batches`) and wait for the thread."""
        self._stop.set()
        self._thread.join()
