"""Triton kernels that move KV pages between the device pool and pinned host rows in place.

A page in the host tier is one row of a pinned [slots, page bytes] tensor: per part (the
values, then FP8 scales), every layer's K row then V row. Pinned memory is mapped into the
GPU's address space, so a kernel can read or write host rows directly over PCIe: each program
copies a few KiB of one row between its host slot and its device block, wherever either is.
Nothing is staged and nothing is gathered by the CPU, and rows of a few KiB in flight reach
the link's bandwidth.

- `load_layer`: layer l of n pages, host rows -> device blocks (2n rows per part), one
  launch per part: what a layer-wise load issues per layer (kvstore/transfer.py);
- `save_pages`: every layer of n pages, device blocks -> host rows, one launch per part: a
  spill of evicted blocks into their host slots.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_WORDS = 1024  # up to 8 KiB of a row per program
_WORD_TYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _copy_rows_kernel(
    src, dst, src_index, dst_index, src_offset, src_stride, src_stride_j, dst_offset,
    dst_stride, dst_stride_j, width, WORDS: tl.constexpr,
):  # fmt: skip
    """dst[dst_offset + dst_index[i] * dst_stride + j * dst_stride_j + w] =
    src[src_offset + src_index[i] * src_stride + j * src_stride_j + w], for program (i, j)
    and w < width, in words."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    w = tl.program_id(2) * WORDS + tl.arange(0, WORDS)
    ok = w < width
    s = src_offset + tl.load(src_index + i) * src_stride + j * src_stride_j
    d = dst_offset + tl.load(dst_index + i) * dst_stride + j * dst_stride_j
    tl.store(dst + d + w, tl.load(src + s + w, mask=ok), mask=ok)


def _word(*sizes: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides every offset and size given."""
    common = math.gcd(*sizes)
    return next(w for w in _WORD_TYPES if common % w == 0)


def _check(host: torch.Tensor, parts: list[torch.Tensor]) -> None:
    assert host.dim() == 2 and host.stride(1) == 1 and host.dtype == torch.uint8
    assert all(p.dim() == 3 and p.stride(2) == 1 and p.dtype == torch.uint8 for p in parts)


def load_layer(
    host: torch.Tensor,
    slots: torch.Tensor,
    blocks: torch.Tensor,
    layout: list[tuple[int, int]],
    dst: list[torch.Tensor],
    layer: int,
) -> None:
    """Copy layer `layer` of the pages in host rows `slots` into device `blocks`.

    host: pinned uint8 [num_slots, page bytes]; slots, blocks: int64 [n] on the device;
    layout: per part, (offset in a page, bytes of one K or V row); dst: per part the pool's
    uint8 view [2 (K, V), num_blocks, row bytes]. Queued on the current stream.
    """
    _check(host, dst)
    n = slots.shape[0]
    if n == 0:
        return
    for (offset, width), out in zip(layout, dst, strict=True):
        start = offset + 2 * layer * width
        size = _word(host.stride(0), start, width, out.stride(0), out.stride(1),
                     host.data_ptr(), out.data_ptr())  # fmt: skip
        words = width // size
        kind = _WORD_TYPES[size]
        _copy_rows_kernel[(n, 2, triton.cdiv(words, _WORDS))](
            host.view(kind), out.view(kind), slots, blocks,
            start // size, host.stride(0) // size, words,
            0, out.stride(1) // size, out.stride(0) // size, words, WORDS=_WORDS,
        )  # fmt: skip


def save_pages(
    src: list[torch.Tensor],
    blocks: torch.Tensor,
    host: torch.Tensor,
    slots: torch.Tensor,
    layout: list[tuple[int, int]],
) -> None:
    """Copy every layer of device `blocks` into host rows `slots` (the inverse of
    `load_layer`, all layers at once). src: per part the pool's uint8 view [2 * num_layers,
    num_blocks, row bytes] (`DeviceKVPool.page_parts`). Queued on the current stream."""
    _check(host, src)
    n = slots.shape[0]
    if n == 0:
        return
    for (offset, width), part in zip(layout, src, strict=True):
        size = _word(host.stride(0), offset, width, part.stride(0), part.stride(1),
                     host.data_ptr(), part.data_ptr())  # fmt: skip
        words = width // size
        kind = _WORD_TYPES[size]
        _copy_rows_kernel[(n, part.shape[0], triton.cdiv(words, _WORDS))](
            part.view(kind), host.view(kind), blocks, slots,
            0, part.stride(1) // size, part.stride(0) // size,
            offset // size, host.stride(0) // size, words, words, WORDS=_WORDS,
        )  # fmt: skip
