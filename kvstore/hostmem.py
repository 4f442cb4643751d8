"""Long-lived host tensors in arenas advised for transparent huge pages (`host_zeros`), so a
CPU decode step's sweep over weights, KV pages and adapter slots misses the TLB rarely.
STRATA_HUGE_PAGES=0 uses torch's allocator instead.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # every tensor starts on a cache line


def huge_pages_enabled() -> bool:
    return os.environ.get("STRATA_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class HostArena:
    """One anonymous mapping, advised for huge pages, handed out as zero-filled tensors.

    `huge` tells whether the kernel took the advice. `take` carves consecutive
    cache-line-aligned tensors until `nbytes` is used up. The mapping lives as long as any
    tensor taken from it.
    """

    def __init__(self, nbytes: int) -> None:
        self.capacity = nbytes
        self.used = 0
        self.huge = huge_pages_enabled() and nbytes >= HUGE_PAGE
        if not self.huge:
            self._raw: torch.Tensor | None = None
            return
        span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        # private: shared anonymous memory is shmem, which gets no huge pages by default
        mapping = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
        self._start = -raw.data_ptr() % HUGE_PAGE
        self._raw = raw
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE, self._start, span)
        except OSError as exc:  # a kernel without THP, or a sandbox that refuses the advice
            log.warning("host arena left in small pages: madvise(MADV_HUGEPAGE) failed: %s", exc)
            self.huge = False
        # touch every page now: a missing page then fails the start, not a request, and no
        # step pays for faulting (and zeroing) pages it is the first to write
        raw[self._start : self._start + span].zero_()

    @staticmethod
    def size_of(shapes: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
        """Bytes an arena needs to hand out tensors of these shapes and dtypes."""
        return sum(_aligned(_nbytes(shape, dtype)) for shape, dtype in shapes)

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled contiguous CPU tensor (torch.zeros where huge pages are off)."""
        nbytes = _nbytes(shape, dtype)
        if self._raw is None:
            return torch.zeros(*shape, dtype=dtype)
        if self.used + nbytes > self.capacity:
            raise MemoryError(f"host arena of {self.capacity} bytes has no room for {nbytes}")
        begin = self._start + self.used
        self.used += _aligned(nbytes)
        return self._raw[begin : begin + nbytes].view(dtype).view(*shape)


def host_zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A large zero-filled CPU tensor of its own, in huge pages where possible."""
    return HostArena(_nbytes(shape, dtype)).take(shape, dtype)


_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED = 1, 2  # cudaHostRegister flags


def _cuda_register(ptr: int, nbytes: int) -> Callable[[], None] | None:
    """Page-lock [ptr, ptr + nbytes) for every GPU, mapped into their address space (kernels
    read it in place): the function that undoes it, or None when CUDA refuses."""
    cudart = torch.cuda.cudart()
    if not hasattr(cudart, "cudaHostUnregister"):  # an old binding: no way to let go
        return None
    flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
    if cudart.cudaHostRegister(ptr, nbytes, flags) != cudart.cudaError.success:
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:  # or torch's next launch check would report this failure
            clear()
        return None
    return lambda: cudart.cudaHostUnregister(ptr)


def pinned_zeros(
    *shape: int,
    dtype: torch.dtype,
    register: Callable[[int, int], Callable[[], None] | None] = _cuda_register,
) -> torch.Tensor:
    """A zero-filled CPU tensor in page-locked memory of exactly its size, for the host
    KV tier on CUDA machines.

    torch's pinned allocator rounds every request up to a power of two, so a 40 GiB host
    tier would lock 64 GiB. This maps the memory itself and registers it with CUDA
    (`register`); it is unregistered when the last view of it is gone, before it is
    unmapped. Falls back to torch's allocator, with a warning, where registration fails.
    """
    nbytes = _nbytes(shape, dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    owner = np.frombuffer(mapping, dtype=np.uint8)  # dies (weakly referenced) before mapping
    raw = torch.from_numpy(owner)  # every view keeps `owner`, so the mapping, alive
    raw.zero_()  # fault every page in now, not under a request
    unregister = register(raw.data_ptr(), nbytes)
    if unregister is None:
        log.warning("cudaHostRegister refused %d bytes; pinning through torch instead", nbytes)
        return torch.zeros(*shape, dtype=dtype, pin_memory=True)
    # not at exit: the process's end lets go of everything, CUDA's teardown included
    weakref.finalize(owner, unregister).atexit = False
    return raw.view(dtype).view(*shape)
