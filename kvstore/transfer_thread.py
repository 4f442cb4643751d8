"""Page loads on a CPU worker thread (`ThreadLoads`): the same per-layer copies a CUDA stream
runs, each layer signalled by an event, so attention on one layer overlaps the copies of the
next. Saves into host rows run on a thread of their own. The shared bookkeeping is
kvstore/transfer.py's `PageLoads`."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvstore import transfer
from kvstore.transfer import HostReads, LoadMode, PageLoads, PagePool, _HostRows, _Staged


class ThreadLoads(PageLoads):
    """Loads and saves of a device pool in host memory, on worker threads."""

    mode = LoadMode.THREAD

    def __init__(self, pool: PagePool, host_reads: HostReads | str = HostReads.AUTO) -> None:
        if pool.device.type == "cuda":
            raise ValueError("thread loads need a CPU pool")
        super().__init__(pool, host_reads)
        self._worker: ThreadPoolExecutor | None = None
        self._saver: ThreadPoolExecutor | None = None
        self._save_error: BaseException | None = None  # of a save: later loads then fail

    def read_host_rows(self, host: torch.Tensor) -> bool:
        super().read_host_rows(host)
        self._host = host
        return True

    def _save(self, blocks: list[int], slots: list[int], inline: bool) -> _ThreadLoad | None:
        """The save on a thread of its own (the pool is in host memory too), or before this
        returns if `inline`. If it fails, every later load fails too: none may read a row it
        left torn."""
        host = self._host
        assert host is not None
        if inline:
            self.pool.read_pages_into(blocks, [host[s] for s in slots])
            return None
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

    def _issue(self, queued: list[tuple[_Staged | _HostRows, list[int]]]) -> _ThreadLoad:
        """The copies on the worker thread: per layer, the staged pages, then the host rows
        read in place, a scatter per run of neighbouring slots."""
        staged = [
            (src, torch.tensor(blocks, dtype=torch.long))
            for src, blocks in queued
            if isinstance(src, _Staged)
        ]
        rows = [
            (s, b)
            for src, blocks in queued
            if isinstance(src, _HostRows)
            for s, b in zip(src.slots, blocks, strict=True)
        ]
        newest = queued[-1][0].ticket  # it goes after the saves started before this
        load = _ThreadLoad(self.num_layers)
        parts = [self.pool.layer_parts(layer) for layer in range(self.num_layers)]
        host, layout = self._host, transfer._page_layout(self.pool)
        row_runs, blocks = transfer._row_runs(rows)
        runs, at = [], 0
        for first, count in row_runs:
            runs.append((first, count, torch.tensor(blocks[at : at + count])))
            at += count

        saves = [save.future for save in self._saves_before(newest)]

        def run() -> None:
            for save in saves:  # the host rows and blocks they touch are ready after them
                save.exception()
            if self._save_error is not None:  # a torn row must not be read
                raise RuntimeError("a save into host rows failed") from self._save_error
            # the views may come from a step's inference mode, which is per thread
            with torch.inference_mode():
                for layer in range(self.num_layers):
                    for src, index in staged:
                        transfer._scatter(parts[layer], src.layer(layer), index)
                    for first, count, index in runs:
                        assert host is not None
                        span = host[first : first + count]  # this layer's K and V rows
                        layer_rows = [
                            span[:, o + 2 * layer * w : o + 2 * (layer + 1) * w] for o, w in layout
                        ]
                        transfer._scatter(parts[layer], layer_rows, index)
                    load.done[layer].set()

        if self._worker is None:  # the loads run in the order they were issued
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="strata-kv-load")
        load.future = self._worker.submit(run)
        load.future.add_done_callback(load.finished)
        return load

    def _wait_layer(self, loads: list[Any], layer: int) -> None:
        for load in loads:
            load.wait(layer)

    def _shutdown(self) -> None:
        super()._shutdown()
        for pool in (self._worker, self._saver):
            if pool is not None:
                pool.shutdown(wait=True)
        self._worker = self._saver = None


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
