"""Layer-wise page loads into the device pool, and saves of device blocks into host rows.

Owns `PageLoads`, the bookkeeping every copy mode shares: each load or save gets a ticket; a
load's layers are issued in order, each marked done by its own event, so attention waits only
for its layer (`wait_layer`), and a step waits only for its own requests' tickets. Each mode
is one subclass that only issues copies and waits for them: `SyncLoads` here, `ThreadLoads`
(kvstore/transfer_thread.py) and `StreamLoads` (kvstore/transfer_cuda.py); `make_page_loads`
picks one. The design is in docs/design/kv-pages-and-tiers.md.
"""

from __future__ import annotations

import abc
import enum
import itertools
import logging
import os
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from kvstore.base import KVCacheSpec

log = logging.getLogger(__name__)

_GATHER_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))  # staging copies at once


class HostReads(enum.StrEnum):
    """How a CUDA stream load reads host tier rows in place (`CacheConfig.kv_host_reads`)."""

    AUTO = "auto"  # the kernel
    KERNEL = "kernel"
    COPY = "copy"  # CuPy 2-D copies by runs of slots (the kernel without CuPy)


_EARLY_ISSUE_PAGES = 256  # queued pages that a CUDA stream starts copying before the step


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int]]:
    """`slots`, sorted, as runs of consecutive slots: (first slot, count) each."""
    runs: list[tuple[int, int]] = []
    for slot in sorted(slots):
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


def _row_runs(rows: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[int]]:
    """Host rows to load as (slot, block) pairs: the runs of their slots (`slot_runs`), and
    the blocks in the order of the runs' rows."""
    pairs = sorted(rows)
    return slot_runs([s for s, _ in pairs]), [b for _, b in pairs]


class LoadMode(enum.StrEnum):
    AUTO = "auto"  # stream on CUDA, sync elsewhere
    SYNC = "sync"
    THREAD = "thread"
    STREAM = "stream"


class PagePool(Protocol):
    """What page loads and saves use of the device pool (kvstore/device_pool.py), which owns
    a `PageLoads`: its page shape and device, its pages as byte views, and whole-page copies."""

    spec: KVCacheSpec
    device: torch.device

    def page_parts(self) -> list[torch.Tensor]: ...

    def layer_parts(self, layer_idx: int) -> list[torch.Tensor]: ...

    def read_pages_into(self, blocks: Sequence[int], out: Sequence[torch.Tensor]) -> None: ...

    def write_pages(self, blocks: Sequence[int], pages: Sequence[torch.Tensor]) -> None: ...


def _page_layout(pool: PagePool) -> list[tuple[int, int]]:
    """Per part of a page (the values, then FP8 scales): (its offset in the page, bytes of
    one layer's K or V row)."""
    layout = []
    offset = 0
    for part in pool.page_parts():
        layout.append((offset, part.shape[2]))
        offset += part.shape[0] * part.shape[2]
    return layout


class _HostRows:
    """One load's pages read in place: rows `slots` of the host tier's pinned tensor."""

    def __init__(self, slots: list[int]) -> None:
        self.slots = slots
        self.buffer: torch.Tensor | None = None  # nothing staged
        self.ticket = 0


class _Staged:
    """One load's pages, copied into one [n, page bytes] tensor (pinned on CUDA) by a few
    threads, each a share of the pages. `layer(l)` views, per part of a page (the values,
    then FP8 scales), every page's K and V rows of layer l: [n, 2 * width], rows a page
    apart."""

    def __init__(
        self,
        pool: PagePool,
        pages: Sequence[torch.Tensor],
        buffer: torch.Tensor,
        workers: ThreadPoolExecutor,
    ) -> None:
        self.parts = _page_layout(pool)
        offset = pool.spec.bytes_per_block
        for page in pages:
            assert page.shape == (offset,) and page.dtype == torch.uint8
        n = len(pages)
        self.buffer = buffer
        self.ticket = 0
        self.rows = buffer[: n * offset].view(n, offset)
        shares = max(1, min(n, _GATHER_THREADS))
        bounds = [n * i // shares for i in range(shares + 1)]
        copies = [
            workers.submit(torch.stack, list(pages[lo:hi]), out=self.rows[lo:hi])
            for lo, hi in itertools.pairwise(bounds)
            if hi > lo
        ]
        for copy in copies:
            copy.result()

    def layer(self, layer: int) -> list[torch.Tensor]:
        return [
            self.rows[:, off + 2 * layer * w : off + 2 * (layer + 1) * w] for off, w in self.parts
        ]


def _scatter(dst: list[torch.Tensor], src: list[torch.Tensor], index: torch.Tensor) -> None:
    """One layer's rows into the pool: dst parts [2, num_blocks, width] (PagePool.
    layer_parts), src parts [n, 2 * width] as staged (or copied to the device)."""
    for d, s in zip(dst, src, strict=True):
        d, s = _words(d, s.view(s.shape[0], 2, -1).transpose(0, 1))
        d.index_copy_(1, index, s)


def _words(*views: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Byte views as the widest integers their layouts allow: an indexed copy moves one
    element at a time."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if all(
            v.shape[-1] % size == 0
            and v.storage_offset() % size == 0
            and all(st % size == 0 for st in v.stride()[:-1])
            for v in views
        ):
            return tuple(v.view(dtype) for v in views)
    return views


class PageLoads(abc.ABC):
    """The page loads of one device pool: queued by `start`, issued together by the first
    wait (layer 0's copies of every queued load, then layer 1's, ...), then in flight. A
    subclass issues the copies of one mode (`_issue`, `_save`) and waits for them
    (`_wait_layer`); everything else, tickets and the host rows in use, is here."""

    mode: LoadMode
    issues_early = False  # whether a large queue starts copying before the step's issue
    pins_staging = False  # whether staging is pinned host memory

    def __init__(self, pool: PagePool, host_reads: HostReads | str = HostReads.AUTO) -> None:
        self.host_reads = HostReads(host_reads)
        self.pool = pool
        self.num_layers = pool.spec.num_layers
        self._queued: list[tuple[_Staged | _HostRows, list[int]]] = []  # not yet issued
        self._queued_pages = 0
        self._early_pages = 0  # issued early since the last `issue`
        self._issue_error: BaseException | None = None  # of an early issue, for the step's
        self._pending: list[Any] = []  # issued, not known to be done, oldest first
        self._failed: list[int] = []  # blocks whose pages never arrived
        self.num_started = 0  # the last ticket handed out
        self._need: frozenset[int] | None = None  # the tickets the waits cover; None: all
        self._spare: list[torch.Tensor] = []  # staging of finished loads
        self._gatherers: ThreadPoolExecutor | None = None
        self._host: torch.Tensor | None = None  # the host tier's rows, read in place
        self._reading: Counter[int] = Counter()  # host rows that queued or pending loads read
        self._writing: Counter[int] = Counter()  # host rows that pending saves write

    @property
    def backend(self) -> str:
        """What runs the copies: sync, thread, cupy or torch (CUDA streams)."""
        return self.mode.value

    @property
    def pending(self) -> bool:
        return bool(self._queued or self._pending)

    def read_host_rows(self, host: torch.Tensor) -> bool:
        """Read pages that are rows of `host` (the host tier's [slots, page bytes] tensor) in
        place, where the mode can. Returns whether they will be; the tier must then call
        `before_host_writes`."""
        assert host.dim() == 2 and host.shape[1] == self.pool.spec.bytes_per_block
        return False

    def save_host_rows(
        self, blocks: Sequence[int], slots: Sequence[int], *, inline: bool = False
    ) -> int:
        """Copy device `blocks` (every layer) into rows `slots` of the host tensor read in
        place, after the work queued so far on the device: on a thread or a CUDA stream of
        their own, so this returns at once. Returns the save's ticket: the blocks may be
        rewritten once it is done (`done`, `need`); a load started later goes after it, and
        the rows are not read on the host nor rewritten before it is done
        (`before_host_writes`).

        `inline` (the blocks' new owner runs in the next step): in the compute stream's
        order instead (on CPU, before this returns), so nothing waits for it and it never
        waits behind a long save; returns 0."""
        assert self._host is not None and len(blocks) == len(slots)
        if not blocks:
            return 0
        blocks, slots = list(blocks), list(slots)
        load = self._save(blocks, slots, inline)
        if load is None:  # done before `_save` returned
            return 0
        self.num_started += 1
        load.tickets = {self.num_started}
        load.saved_slots = slots
        self._writing.update(slots)
        self._pending.append(load)
        return 0 if inline else self.num_started

    def _save(self, blocks: list[int], slots: list[int], inline: bool) -> Any:
        """Start the copies of a save (`save_host_rows`): the in-flight record, or None when
        they are done already."""
        raise AssertionError(f"{self.mode.value} loads read no host rows in place")

    def _saves_before(self, ticket: int) -> list[Any]:
        """The saves still pending that were started before `ticket`, oldest first: a load
        started after a save may read its rows or write its blocks."""
        return [load for load in self._pending if load.saved_slots and min(load.tickets) < ticket]

    def before_host_writes(self, slots: Collection[int]) -> None:
        """Host rows `slots` are about to be read on the host or rewritten: the loads that
        read them, or the saves that write them, finish first (a host sync, only then)."""
        # rows no copy uses are not counted at all (`_unread`)
        if not (self._reading.keys().isdisjoint(slots) and self._writing.keys().isdisjoint(slots)):
            self.finish()

    def host_slots(self, pages: Sequence[torch.Tensor]) -> list[int] | None:
        """The host rows `pages` are, or None if any is not a row of the host tensor."""
        host = self._host
        if host is None:
            return None
        base, row = host.data_ptr(), host.stride(0)
        slots = []
        for page in pages:
            offset = page.data_ptr() - base
            if not (0 <= offset < host.numel() and offset % row == 0 and page.is_contiguous()):
                return None
            slots.append(offset // row)
        return slots

    def start(self, blocks: Sequence[int], pages: Sequence[torch.Tensor]) -> int:
        """Copy `pages` (rows as `DeviceKVPool.read_pages` returns them, on the host) into
        device `blocks`, layer by layer, from the next wait on. Rows of the host tier read
        in place (`read_host_rows`) are read by the copies; any others are gathered into
        staging before this returns. Returns the load's ticket (0: nothing left to wait
        for, the pages are there)."""
        assert len(blocks) == len(pages)
        if not pages:
            return 0
        slots = self.host_slots(pages)
        if slots is not None:
            return self.start_host_rows(blocks, slots)
        buffer = self._buffer(len(pages) * self.pool.spec.bytes_per_block)
        staged = _Staged(self.pool, pages, buffer, self._gather_pool())
        return self._queue(staged, blocks)

    def start_host_rows(self, blocks: Sequence[int], slots: Sequence[int]) -> int:
        """`start` for pages known by their rows `slots` of the host tensor read in place
        (`read_host_rows`): nothing is looked at per page."""
        assert self._host is not None and len(blocks) == len(slots)
        if not slots:
            return 0
        self._reading.update(slots)
        return self._queue(_HostRows(list(slots)), blocks)

    def _queue(self, src: _Staged | _HostRows, blocks: Sequence[int]) -> int:
        self.num_started += 1
        src.ticket = self.num_started
        self._queued.append((src, list(blocks)))
        self._queued_pages += len(blocks)
        early = max(_EARLY_ISSUE_PAGES, self._early_pages)
        if self.issues_early and self._queued_pages >= early:
            self._early_pages += self._queued_pages
            self.issue_ahead()  # the blocks of a failed issue are failed already
        return src.ticket

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """Staging of at least `nbytes` (pinned on CUDA): a finished load's, or a new one
        (fresh memory costs a page fault per 4 KiB)."""
        fits = [b for b in self._spare if b.numel() >= nbytes]
        if fits:
            best = min(fits, key=lambda b: b.numel())
            self._spare = [b for b in self._spare if b is not best]
            return best
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pins_staging)

    def _done(self, load: Any) -> None:
        """A finished load's staging goes back for the next ones (the largest few), and the
        host rows it read may change."""
        self._spare = sorted([*self._spare, *load.buffers], key=lambda b: -b.numel())[:4]
        self._unread(load.host_slots)
        self._unread(load.saved_slots, self._writing)

    def _unread(self, slots: Iterable[int], counts: Counter[int] | None = None) -> None:
        """Host rows a load no longer reads (or, with `counts=_writing`, a save no longer
        writes): a loop, as `Counter -=` walks every row counted."""
        reading = self._reading if counts is None else counts
        for slot in slots:
            left = reading[slot] - 1
            if left > 0:
                reading[slot] = left
            else:
                reading.pop(slot, None)

    def _gather_pool(self) -> ThreadPoolExecutor:
        if self._gatherers is None:
            self._gatherers = ThreadPoolExecutor(
                _GATHER_THREADS, thread_name_prefix="strata-kv-gather"
            )
        return self._gatherers

    def issue(self) -> None:
        """Queue the copies of every load started since the last issue, layer-major: a
        layer's pages of all of them arrive before the next layer's, whatever the order of
        the loads. The first wait does it if no one has. Raises the error of an early
        issue since the last call, if one failed."""
        error, self._issue_error, self._early_pages = self._issue_error, None, 0
        if error is not None:
            raise error
        self._issue_queued()

    def _issue_queued(self) -> None:
        if not self._queued:
            return
        queued, self._queued, self._queued_pages = self._queued, [], 0
        self._prune()
        blocks = [b for _, blocks in queued for b in blocks]
        try:
            load = self._issue(queued)
        except BaseException:
            self._failed += blocks
            self._unread(s for src, _ in queued if isinstance(src, _HostRows) for s in src.slots)
            raise
        load.blocks = blocks
        load.tickets = {src.ticket for src, _ in queued}
        load.buffers = [src.buffer for src, _ in queued if src.buffer is not None]
        load.host_slots = [s for src, _ in queued if isinstance(src, _HostRows) for s in src.slots]
        self._pending.append(load)

    @abc.abstractmethod
    def _issue(self, queued: list[tuple[_Staged | _HostRows, list[int]]]) -> Any:
        """Issue the copies of `queued` (each a load's source and its blocks), layer-major,
        after the saves started before the newest of them: the in-flight record."""

    def need(self, tickets: Collection[int] | None) -> None:
        """Make the waits (`wait_layer`, `wait_all`, `finish`) cover the copies of these
        tickets only, until `finish` (None: every copy). Others run on, unwaited for."""
        self._need = None if tickets is None else frozenset(tickets)

    def _needed(self) -> list[Any]:
        need = self._need
        if need is None:
            return self._pending
        return [load for load in self._pending if not load.tickets.isdisjoint(need)]

    def done(self, tickets: Collection[int]) -> bool:
        """Whether the copies of these tickets have all finished (a failed one too: the
        step's wait raises it); never waits. None of them is left unissued."""
        if any(src.ticket in tickets for src, _ in self._queued):
            self.issue_ahead()
        self._prune()
        return all(load.tickets.isdisjoint(tickets) for load in self._pending if not load.failed())

    def issue_ahead(self) -> None:
        """Issue what is queued now; an error is raised by the step's `issue`."""
        try:
            self._issue_queued()
        except Exception as exc:
            self._issue_error = self._issue_error or exc

    def wait_layer(self, layer: int) -> None:
        """Make what runs next (the compute stream's next kernels, or the caller on CPU) wait
        for layer `layer` of every load it needs (`need`): the queued ones are issued first."""
        self.issue()
        needed = self._needed()
        if needed:
            self._wait_layer(needed, layer)

    @abc.abstractmethod
    def _wait_layer(self, loads: list[Any], layer: int) -> None:
        """Make what runs next wait for layer `layer` of `loads`."""

    def wait_all(self) -> None:
        """`wait_layer` for the last layer, which every earlier layer's copy precedes."""
        self.wait_layer(self.num_layers - 1)

    def finish(self) -> None:
        """Block the host until every load the waits cover (`need`) is done, re-raising a
        failed copy; none of those is pending afterwards, even then. The waits cover every
        load again."""
        try:
            self.issue()
        finally:
            needed = self._needed()
            self._pending = [load for load in self._pending if load not in needed]
            self._need = None
        error: BaseException | None = None
        for load in needed:
            try:
                load.synchronize()
                self._done(load)
            except Exception as exc:
                self._failed += load.blocks
                self._unread(load.host_slots)
                self._unread(load.saved_slots, self._writing)
                error = error or exc
        if error is not None:
            raise error

    def take_failed(self) -> list[int]:
        """The blocks of loads that failed since the last call: they hold no KV."""
        failed, self._failed = self._failed, []
        return failed

    def _prune(self) -> None:
        still = []
        for load in self._pending:
            if load.query():
                self._done(load)
            else:
                still.append(load)
        self._pending = still

    def close(self) -> None:
        try:
            self.finish()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        """Stop the threads the loads own."""
        if self._gatherers is not None:
            self._gatherers.shutdown(wait=True)
            self._gatherers = None


class SyncLoads(PageLoads):
    """Loads that copy each page into its block before `start` returns: nothing is ever in
    flight (the CPU default, where the pool is in host memory too)."""

    mode = LoadMode.SYNC

    def start(self, blocks: Sequence[int], pages: Sequence[torch.Tensor]) -> int:
        assert len(blocks) == len(pages)
        if pages:
            self.pool.write_pages(blocks, pages)
        return 0

    def _issue(self, queued: list[tuple[_Staged | _HostRows, list[int]]]) -> Any:
        raise AssertionError("synchronous loads queue nothing")

    def _wait_layer(self, loads: list[Any], layer: int) -> None:
        raise AssertionError("synchronous loads leave nothing in flight")
