"""Page loads on a GPU (`StreamLoads`): layer-wise copies on CUDA streams of their own, CuPy
async copies where CuPy is installed, host rows read in place by a Triton kernel. The shared
bookkeeping is kvstore/transfer.py's `PageLoads`."""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvstore.transfer import (
    HostReads,
    LoadMode,
    PageLoads,
    PagePool,
    _HostRows,
    _page_layout,
    _row_runs,
    _scatter,
    _Staged,
)

log = logging.getLogger(__name__)

_MAX_RUN_COPIES = 32  # 2-D copies per layer and part (each a host call) before the kernel reads


def _cupy() -> Any:
    try:
        import cupy  # noqa: PLC0415 (GPU machines only)
    except Exception:
        return None
    return cupy


def _triton_loads() -> Any:
    try:
        from kvstore import triton_load  # noqa: PLC0415 (GPU machines: compiles kernels)
    except Exception as exc:
        log.warning("Triton unusable for KV page loads (%s); pages go through staging", exc)
        return None
    return triton_load


class StreamLoads(PageLoads):
    """Loads and saves of a device pool on a GPU, each on a CUDA stream of its own (CuPy's
    where installed, torch's otherwise): a layer's copies are marked by an event the compute
    stream waits on. Host rows are read in place by a Triton kernel when they are pinned,
    or by CuPy 2-D copies of runs of rows (`HostReads.COPY`)."""

    mode = LoadMode.STREAM
    issues_early = True
    pins_staging = True

    def __init__(self, pool: PagePool, host_reads: HostReads | str = HostReads.AUTO) -> None:
        if pool.device.type != "cuda":
            raise ValueError("stream loads need a CUDA pool")
        super().__init__(pool, host_reads)
        self._kernels: Any = None  # kvstore/triton_load.py, once rows are read in place
        self._reader: Any = None  # its HostRowReader of the host rows
        # the pool's GPU: "cuda" alone is the current one, not necessarily the first
        index = pool.device.index
        self._gpu = torch.cuda.current_device() if index is None else index
        self._cupy = _cupy()
        self._stream: Any = None
        self._save_stream: Any = None  # saves into host rows: CuPy's, and torch's view
        if self._cupy is not None:
            try:
                with self._cupy.cuda.Device(self._gpu):
                    self._stream = self._cupy.cuda.Stream(non_blocking=True)
                    self._save_stream = self._cupy.cuda.Stream(non_blocking=True)
            except Exception as exc:
                log.warning("CuPy unusable for KV page loads (%s); using torch streams", exc)
                self._cupy = None
        self._torch_stream: torch.cuda.Stream
        self._save_torch_stream: torch.cuda.Stream
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
        return "cupy" if self._cupy is not None else "torch"

    def read_host_rows(self, host: torch.Tensor) -> bool:
        """Pinned host rows are read in place by the Triton kernel, where Triton works."""
        super().read_host_rows(host)
        if host.is_pinned():
            self._kernels = self._kernels or _triton_loads()
            if self._kernels is not None:
                self._host = host
                layers = [self.pool.layer_parts(layer) for layer in range(self.num_layers)]
                self._reader = self._kernels.HostRowReader(host, _page_layout(self.pool), layers)
        return self._host is not None

    def _save(self, blocks: list[int], slots: list[int], inline: bool) -> _StreamLoad:
        if self._cupy is None:
            return self._save_on_stream(blocks, slots, inline)
        with self._cupy.cuda.Device(self._gpu):
            return self._save_on_stream(blocks, slots, inline)

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

    def _issue(self, queued: list[tuple[_Staged | _HostRows, list[int]]]) -> _StreamLoad:
        indexes = [torch.tensor(b, dtype=torch.long) for _, b in queued]
        newest = queued[-1][0].ticket  # it goes after the saves started before this
        sources = [src for src, _ in queued]
        if self._cupy is None:
            return self._issue_stream(sources, indexes, newest)
        with self._cupy.cuda.Device(self._gpu):  # CuPy's events, there
            return self._issue_stream(sources, indexes, newest)

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

    def _wait_layer(self, loads: list[Any], layer: int) -> None:
        compute = torch.cuda.current_stream(self.pool.device)
        for load in loads:
            event = load.events[layer]
            if self._cupy is not None:
                self._cupy.cuda.runtime.streamWaitEvent(compute.cuda_stream, event.ptr, 0)
            else:
                compute.wait_event(event)


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
