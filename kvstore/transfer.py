"""Layer-wise page loads into the device pool, and saves of device blocks into host rows.

Owns `PageLoads`: each load or save gets a ticket; a load's layers are issued in order, each
marked done by its own event, so attention waits only for its layer (`wait_layer`), and a
step waits only for its own requests' tickets. Copy modes: `stream` (CUDA), `sync`, `thread`.
The design is in docs/design/kv-pages-and-tiers.md.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import threading
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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


_MAX_RUN_COPIES = 32  # 2-D copies per layer and part (each a host call) before the kernel reads
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


def _cupy() -> Any:
    try:
        import cupy  # noqa: PLC0415 (GPU machines only)
    except Exception:
        return None
    return cupy


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


def _triton_loads() -> Any:
    try:
        from kvstore import triton_load  # noqa: PLC0415 (GPU machines: compiles kernels)
    except Exception as exc:
        log.warning("Triton unusable for KV page loads (%s); pages go through staging", exc)
        return None
    return triton_load


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


class PageLoads:
    """The page loads of one device pool: queued by `start`, issued together by the first
    wait (layer 0's copies of every queued load, then layer 1's, ...), then in flight."""

    def __init__(
        self,
        pool: PagePool,
        mode: LoadMode | str = LoadMode.AUTO,
        host_reads: HostReads | str = HostReads.AUTO,
    ) -> None:
        mode = LoadMode(mode)
        self.host_reads = HostReads(host_reads)
        cuda = pool.device.type == "cuda"
        if mode is LoadMode.AUTO:
            mode = LoadMode.STREAM if cuda else LoadMode.SYNC
        if (mode is LoadMode.STREAM) != cuda and mode is not LoadMode.SYNC:
            raise ValueError(f"{mode.value} loads need a {'CUDA' if not cuda else 'CPU'} pool")
        self.pool = pool
        self.mode = mode
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
        self._worker: ThreadPoolExecutor | None = None
        self._gatherers: ThreadPoolExecutor | None = None
        self._cupy = None
        self._gpu = 0  # the pool's CUDA device (STREAM mode)
        self._stream: Any = None
        self._torch_stream: torch.cuda.Stream | None = None
        self._save_stream: Any = None  # saves into host rows: CuPy's, and torch's view
        self._save_torch_stream: torch.cuda.Stream | None = None
        self._saver: ThreadPoolExecutor | None = None  # saves on CPU
        self._host: torch.Tensor | None = None  # the host tier's rows, read in place
        self._kernels: Any = None  # kvstore/triton_load.py, once rows are read in place
        self._reader: Any = None  # its HostRowReader of the host rows, on a CUDA stream
        self._reading: Counter[int] = Counter()  # host rows that queued or pending loads read
        self._writing: Counter[int] = Counter()  # host rows that pending saves write
        self._save_error: BaseException | None = None  # of a save on CPU: loads then fail
        if mode is LoadMode.STREAM:
            # the pool's GPU: "cuda" alone is the current one, not necessarily the first
            index = pool.device.index
            self._gpu = torch.cuda.current_device() if index is None else index
            self._cupy = _cupy()
            if self._cupy is not None:
                try:
                    with self._cupy.cuda.Device(self._gpu):
                        self._stream = self._cupy.cuda.Stream(non_blocking=True)
                        self._save_stream = self._cupy.cuda.Stream(non_blocking=True)
                except Exception as exc:
                    log.warning("CuPy unusable for KV page loads (%s); using torch streams", exc)
                    self._cupy = None
            if self._cupy is not None:
                self._torch_stream = torch.cuda.ExternalStream(self._stream.ptr, device=pool.device)
                self._save_torch_stream = torch.cuda.ExternalStream(
                    self._save_stream.ptr, device=pool.device
                )
            else:
                self._torch_stream = torch.cuda.Stream(device=pool.device)
                self._save_torch_stream = torch.cuda.Stream(device=pool.device)
            log.info("KV page loads: layer-wise on a CUDA stream (%s)", self.backend)
            if self.host_reads is HostReads.COPY and self._cupy is None:
                log.warning("host rows are read by the kernel: 2-D copies need CuPy")

    @property
    def backend(self) -> str:
        """What runs the copies: sync, thread, cupy or torch (CUDA streams)."""
        if self.mode is LoadMode.STREAM:
            return "cupy" if self._cupy is not None else "torch"
        return self.mode.value

    @property
    def pending(self) -> bool:
        return bool(self._queued or self._pending)

    def read_host_rows(self, host: torch.Tensor) -> bool:
        """Read pages that are rows of `host` (the host tier's [slots, page bytes] tensor) in
        place: on a worker thread, or on a CUDA stream when `host` is pinned and Triton works.
        Returns whether they will be; the tier must then call `before_host_writes`."""
        assert host.dim() == 2 and host.shape[1] == self.pool.spec.bytes_per_block
        if self.mode is LoadMode.THREAD:
            self._host = host
        elif self.mode is LoadMode.STREAM and host.is_pinned():
            self._kernels = self._kernels or _triton_loads()
            if self._kernels is not None:
                self._host = host
                layers = [self.pool.layer_parts(layer) for layer in range(self.num_layers)]
                self._reader = self._kernels.HostRowReader(host, _page_layout(self.pool), layers)
        return self._host is not None

    def save_host_rows(
        self, blocks: Sequence[int], slots: Sequence[int], *, inline: bool = False
    ) -> int:
        """Copy device `blocks` (every layer) into rows `slots` of the host tensor read in
        place, after the work queued so far on the device: on a thread or a CUDA stream of
        their own (one kernel per part), so this returns at once. Returns the save's ticket:
        the blocks may be rewritten once it is done (`done`, `need`); a load started later
        goes after it, and the rows are not read on the host nor rewritten before it is
        done (`before_host_writes`).

        `inline` (the blocks' new owner runs in the next step): in the compute stream's
        order instead (on CPU, before this returns), so nothing waits for it and it never
        waits behind a long save; returns 0."""
        assert self._host is not None and len(blocks) == len(slots)
        if not blocks:
            return 0
        blocks, slots = list(blocks), list(slots)
        if self.mode is LoadMode.THREAD:
            if inline:
                self.pool.read_pages_into(blocks, [self._host[s] for s in slots])
                return 0
            load: Any = self._save_thread(blocks, slots)
        elif self._cupy is None:
            load = self._save_on_stream(blocks, slots, inline)
        else:
            with self._cupy.cuda.Device(self._gpu):
                load = self._save_on_stream(blocks, slots, inline)
        self.num_started += 1
        load.tickets = {self.num_started}
        load.saved_slots = slots
        self._writing.update(slots)
        self._pending.append(load)
        return 0 if inline else self.num_started

    def _save_thread(self, blocks: list[int], slots: list[int]) -> _ThreadLoad:
        """The save on a thread of its own (on CPU the pool is in host memory too). If it
        fails, every later load fails too: none may read a row it left torn."""
        host = self._host
        assert host is not None
        load = _ThreadLoad(self.num_layers)

        def run() -> None:
            try:
                self.pool.read_pages_into(blocks, [host[s] for s in slots])
            except BaseException as exc:
                self._save_error = exc
                raise

        if self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="strata-kv-save")
        load.future = self._saver.submit(run)
        load.future.add_done_callback(load.finished)
        return load

    def _saves_before(self, ticket: int) -> list[Any]:
        """The saves still pending that were started before `ticket`, oldest first: a load
        started after a save may read its rows or write its blocks."""
        return [load for load in self._pending if load.saved_slots and min(load.tickets) < ticket]

    def _save_on_stream(self, blocks: list[int], slots: list[int], inline: bool) -> _StreamLoad:
        device = self.pool.device
        compute = torch.cuda.current_stream(device)
        cp_stream, stream = (
            (None, compute) if inline else (self._save_stream, self._save_torch_stream)
        )
        assert stream is not None
        index = torch.tensor([blocks, slots]).to(device, non_blocking=True)
        if not inline:
            self._after_compute(cp_stream, stream)
        load = _StreamLoad()
        with torch.cuda.stream(stream):
            index.record_stream(stream)
            load.indexes = [index]
            self._kernels.save_pages(
                self.pool.page_parts(), index[0], self._host, index[1], _page_layout(self.pool)
            )
            load.events = [self._record(cp_stream, stream)] * self.num_layers
        return load

    def _after_compute(self, cp_stream: Any, stream: torch.cuda.Stream) -> None:
        """A copy stream's next work goes after the work already queued on the compute
        stream (on the blocks it reads or writes)."""
        compute = torch.cuda.current_stream(self.pool.device)
        cp = self._cupy
        if cp is not None:
            ready = cp.cuda.Event(disable_timing=True)
            cp.cuda.runtime.eventRecord(ready.ptr, compute.cuda_stream)
            cp_stream.wait_event(ready)
        else:
            stream.wait_stream(compute)

    def _record(self, cp_stream: Any, stream: torch.cuda.Stream) -> Any:
        """An event marking a stream's work so far: CuPy's (`cp_stream`, or None for a
        stream CuPy did not make) or torch's."""
        cp = self._cupy
        if cp is None:
            event = torch.cuda.Event()
            event.record(stream)
        elif cp_stream is None:
            event = cp.cuda.Event(disable_timing=True)
            cp.cuda.runtime.eventRecord(event.ptr, stream.cuda_stream)
        else:
            event = cp.cuda.Event(disable_timing=True)
            event.record(cp_stream)
        return event

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
        if self.mode is LoadMode.SYNC:  # straight from the rows, nothing staged
            self.pool.write_pages(blocks, pages)
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
        if self.mode is LoadMode.STREAM and self._queued_pages >= early:
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
        pin = self.mode is LoadMode.STREAM
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

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
            self._pending.append(self._issue_batch(queued, blocks))
        except BaseException:
            self._failed += blocks
            self._unread(s for src, _ in queued if isinstance(src, _HostRows) for s in src.slots)
            raise

    def _issue_batch(
        self, queued: list[tuple[_Staged | _HostRows, list[int]]], blocks: list[int]
    ) -> Any:
        # each queued load's blocks, and for the staged ones their rows of each layer
        indexes = [torch.tensor(b, dtype=torch.long) for _, b in queued]
        newest = queued[-1][0].ticket  # it goes after the saves started before this
        if self.mode is LoadMode.THREAD:
            staged = [
                (src, index)
                for (src, _), index in zip(queued, indexes, strict=True)
                if isinstance(src, _Staged)
            ]
            rows = [
                (s, b)
                for src, blocks in queued
                if isinstance(src, _HostRows)
                for s, b in zip(src.slots, blocks, strict=True)
            ]
            load: Any = self._issue_thread(staged, rows, newest)
        elif self._cupy is None:
            load = self._issue_stream([src for src, _ in queued], indexes, newest)
        else:
            with self._cupy.cuda.Device(self._gpu):  # CuPy's events, there
                load = self._issue_stream([src for src, _ in queued], indexes, newest)
        load.blocks = blocks
        load.tickets = {src.ticket for src, _ in queued}
        load.buffers = [src.buffer for src, _ in queued if src.buffer is not None]
        load.host_slots = [s for src, _ in queued if isinstance(src, _HostRows) for s in src.slots]
        return load

    # -- CPU worker thread --------------------------------------------------------------------

    def _issue_thread(
        self, staged: list[tuple[_Staged, torch.Tensor]], rows: list[tuple[int, int]], newest: int
    ) -> _ThreadLoad:
        """The copies on the worker thread: per layer, the staged pages, then the host rows
        read in place (`rows`: (slot, block) pairs), a scatter per run of neighbouring slots."""
        load = _ThreadLoad(self.num_layers)
        parts = [self.pool.layer_parts(layer) for layer in range(self.num_layers)]
        host, layout = self._host, _page_layout(self.pool)
        row_runs, blocks = _row_runs(rows)
        runs, at = [], 0
        for first, count in row_runs:
            runs.append((first, count, torch.tensor(blocks[at : at + count])))
            at += count

        saves = [load.future for load in self._saves_before(newest)]

        def run() -> None:
            for save in saves:  # the host rows and blocks they touch are ready after them
                save.exception()
            if self._save_error is not None:  # a torn row must not be read
                raise RuntimeError("a save into host rows failed") from self._save_error
            # the views may come from a step's inference mode, which is per thread
            with torch.inference_mode():
                for layer in range(self.num_layers):
                    for src, index in staged:
                        _scatter(parts[layer], src.layer(layer), index)
                    for first, count, index in runs:
                        assert host is not None
                        span = host[first : first + count]  # this layer's K and V rows
                        rows = [
                            span[:, o + 2 * layer * w : o + 2 * (layer + 1) * w] for o, w in layout
                        ]
                        _scatter(parts[layer], rows, index)
                    load.done[layer].set()

        load.future = self._worker_pool().submit(run)
        load.future.add_done_callback(load.finished)
        return load

    def _worker_pool(self) -> ThreadPoolExecutor:
        """The loads' thread: they run in the order they were issued."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="strata-kv-load")
        return self._worker

    # -- CUDA stream --------------------------------------------------------------------------

    def _issue_stream(
        self, loads: list[_Staged | _HostRows], indexes: list[torch.Tensor], newest: int
    ) -> _StreamLoad:
        device, stream = self.pool.device, self._torch_stream
        assert stream is not None
        cp = self._cupy
        # the loads read in place go as one: per layer, one kernel per part for all of them
        in_place = [
            (src, index)
            for src, index in zip(loads, indexes, strict=True)
            if isinstance(src, _HostRows)
        ]
        staged = [
            (src, index)
            for src, index in zip(loads, indexes, strict=True)
            if isinstance(src, _Staged)
        ]
        # on the compute stream: waited for below
        host_rows = host_blocks = None
        runs: list[tuple[int, int]] = []  # with 2-D copies: the host rows by runs of slots
        if in_place and self.host_reads is HostReads.COPY and cp is not None:
            pairs = [
                (s, b)
                for src, index in in_place
                for s, b in zip(src.slots, index.tolist(), strict=True)
            ]
            runs, blocks = _row_runs(pairs)
            if len(runs) <= _MAX_RUN_COPIES:
                host_blocks = torch.tensor(blocks).to(device, non_blocking=True)
                in_place = []
            else:
                runs = []
        if in_place:
            slots = [s for src, _ in in_place for s in src.slots]
            host_rows = torch.tensor(slots).to(device, non_blocking=True)
            host_blocks = torch.cat([index for _, index in in_place]).to(device, non_blocking=True)
        staged = [(src, index.to(device, non_blocking=True)) for src, index in staged]
        on_device = [t for t in (host_rows, host_blocks) if t is not None]
        on_device += [index for _, index in staged]
        layout = _page_layout(self.pool)
        load = _StreamLoad()
        # the copies go after the work already queued on their blocks, and after the saves
        self._after_compute(self._stream, stream)
        for save in self._saves_before(newest):  # on the compute stream or their own
            if cp is not None:
                self._stream.wait_event(save.events[-1])
            else:
                stream.wait_event(save.events[-1])
        try:
            with torch.cuda.stream(stream):
                for index in on_device:
                    index.record_stream(stream)
                load.indexes = on_device
                # 2-D copies land here, a page's K and V rows side by side, then scatter
                n_rows = sum(count for _, count in runs)
                landing = (
                    [
                        torch.empty(n_rows, 2 * width, dtype=torch.uint8, device=device)
                        for _, width in layout
                    ]
                    if runs
                    else []
                )
                load.indexes += landing
                for layer in range(self.num_layers):
                    dst = self.pool.layer_parts(layer) if runs or staged else []
                    if runs:
                        assert self._host is not None and host_blocks is not None
                        self._copy_runs(runs, layer, layout, landing)
                        _scatter(dst, landing, host_blocks)
                    if host_rows is not None:  # read in place, stored at the blocks
                        self._reader.load_layer(layer, host_rows, host_blocks)
                    for src, index in staged:
                        rows = src.layer(layer)
                        dev = [torch.empty(r.shape, dtype=r.dtype, device=device) for r in rows]
                        for d, r in zip(dev, rows, strict=True):
                            if cp is not None:  # a CuPy async copy: rows a page apart
                                cp.cuda.runtime.memcpy2DAsync(
                                    d.data_ptr(),
                                    d.stride(0),
                                    r.data_ptr(),
                                    r.stride(0),
                                    r.shape[1],
                                    r.shape[0],
                                    cp.cuda.runtime.memcpyHostToDevice,
                                    self._stream.ptr,
                                )
                            else:
                                d.copy_(r, non_blocking=True)
                        _scatter(dst, dev, index)
                    load.events.append(self._record(self._stream, stream))
        except BaseException:
            stream.synchronize()  # copies already queued must not outlive their staging
            raise
        return load

    def _copy_runs(
        self,
        runs: list[tuple[int, int]],
        layer: int,
        layout: list[tuple[int, int]],
        landing: list[torch.Tensor],
    ) -> None:
        """Layer `layer` of the host rows in `runs`, per part one CuPy 2-D copy per run into
        `landing` (rows in slot order), on the copy stream."""
        assert self._host is not None and self._cupy is not None
        runtime = self._cupy.cuda.runtime
        host, page = self._host.data_ptr(), self._host.stride(0)
        for (offset, width), out in zip(layout, landing, strict=True):
            at = out.data_ptr()
            for first, count in runs:
                runtime.memcpy2DAsync(
                    at,
                    2 * width,
                    host + first * page + offset + 2 * layer * width,
                    page,
                    2 * width,
                    count,
                    runtime.memcpyHostToDevice,
                    self._stream.ptr,
                )
                at += count * 2 * width

    # -- waiting --------------------------------------------------------------------------------

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
        if not needed:
            return
        if self.mode is LoadMode.THREAD:
            for load in needed:
                load.wait(layer)
            return
        compute = torch.cuda.current_stream(self.pool.device)
        for load in needed:
            event = load.events[layer]
            if self._cupy is not None:
                self._cupy.cuda.runtime.streamWaitEvent(compute.cuda_stream, event.ptr, 0)
            else:
                compute.wait_event(event)

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
            for pool in (self._worker, self._gatherers, self._saver):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._worker = self._gatherers = self._saver = None


class _ThreadLoad:
    def __init__(self, num_layers: int) -> None:
        self.done = [threading.Event() for _ in range(num_layers)]
        self.blocks: list[int] = []
        self.buffers: list[torch.Tensor] = []  # staging, reused once the load is done
        self.host_slots: list[int] = []  # host rows read in place
        self.saved_slots: list[int] = []  # host rows a save writes
        self.future: Future[None] | None = None
        self.tickets: set[int] = set()

    def failed(self) -> bool:
        return self.future is not None and self.future.done() and not self.query()

    def finished(self, future: Future[None]) -> None:
        for event in self.done:  # a failed copy must not leave waiters hanging
            event.set()

    def wait(self, layer: int) -> None:
        self.done[layer].wait()
        assert self.future is not None
        if self.future.done() and self.future.exception() is not None:
            raise self.future.exception()  # type: ignore[misc]

    def query(self) -> bool:
        assert self.future is not None
        return self.future.done() and self.future.exception() is None

    def synchronize(self) -> None:
        assert self.future is not None
        self.future.result()


class _StreamLoad:
    def __init__(self) -> None:
        self.blocks: list[int] = []
        # the pinned staging the copies read: alive (and not reused) until they are done
        self.buffers: list[torch.Tensor] = []
        self.host_slots: list[int] = []  # the host rows it reads in place
        self.saved_slots: list[int] = []  # host rows a save writes
        self.indexes: list[torch.Tensor] = []
        self.events: list[Any] = []
        self.tickets: set[int] = set()

    def failed(self) -> bool:
        return False  # a failed copy fails the device: the step's wait raises it

    def query(self) -> bool:
        last = self.events[-1]  # a torch event (query()) or a CuPy one (done)
        return bool(last.query() if hasattr(last, "query") else last.done)

    def synchronize(self) -> None:
        self.events[-1].synchronize()  # blocks the host with either kind
