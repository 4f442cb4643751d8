"""Triton kernels that move KV pages between the device pool and pinned host rows in place,
over PCIe: `HostRowReader.load_layer` (host rows -> device blocks, one layer) and
`save_pages` (device blocks -> host rows). The design is in docs/design/kv-pages-and-tiers.md.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

_WORDS = 1024  # up to 8 KiB of a row per program
_WORD_TYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _copy_rows_kernel(
    src,
    dst,
    src_index,
    dst_index,
    src_offset,
    src_stride,
    src_stride_j,
    dst_offset,
    dst_stride,
    dst_stride_j,
    width,
    WORDS: tl.constexpr,
):
    """dst[dst_offset + dst_index[i] * dst_stride + j * dst_stride_j + w] =
    src[src_offset + src_index[i] * src_stride + j * src_stride_j + w], for program (i, j)
    and w < width, in words."""
    i = tl.program_id(0)
    j = tl.program_id(1).to(tl.int64)  # j * src_stride_j: past 2**31 words in large pools
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


@triton.jit
def _copy_two_parts_kernel(
    host,
    dst_a,
    dst_b,
    src_index,
    dst_index,
    host_stride,
    start_a,
    start_b,
    width_a,
    width_b,
    stride_a,
    stride_a_j,
    stride_b,
    stride_b_j,
    WORDS: tl.constexpr,
):
    """`_copy_rows_kernel` of two parts in one launch, in words of one size: program (i, j)
    copies the K (j even) or V row of part a (j < 2) or b of host row src_index[i] into
    block dst_index[i]."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    kv = (j % 2).to(tl.int64)
    w = tl.program_id(2) * WORDS + tl.arange(0, WORDS)
    row = tl.load(src_index + i) * host_stride
    block = tl.load(dst_index + i)
    if j < 2:
        ok = w < width_a
        s = row + start_a + kv * width_a
        tl.store(
            dst_a + block * stride_a + kv * stride_a_j + w, tl.load(host + s + w, mask=ok), mask=ok
        )
    else:
        ok = w < width_b
        s = row + start_b + kv * width_b
        tl.store(
            dst_b + block * stride_b + kv * stride_b_j + w, tl.load(host + s + w, mask=ok), mask=ok
        )


class _Part(NamedTuple):
    """One part of one layer, in words of `size` bytes."""

    size: int
    host: torch.Tensor  # the host rows, viewed as words
    dst: torch.Tensor  # the pool's [2 (K, V), num_blocks, row] of this layer, as words
    start: int  # the K row's offset in a host row
    width: int  # one K or V row
    host_stride: int  # host rows
    block_stride: int  # dst blocks
    kv_stride: int  # dst's K to V


class HostRowReader:
    """Loads of pages that are rows of one pinned host tensor into one pool, layer by layer.

    host: pinned uint8 [num_slots, page bytes]; layout: per part, (offset in a page, bytes
    of one K or V row); layers: per layer, per part, the pool's uint8 view [2 (K, V),
    num_blocks, row bytes] (`DeviceKVPool.layer_parts`).
    """

    def __init__(
        self, host: torch.Tensor, layout: list[tuple[int, int]], layers: list[list[torch.Tensor]]
    ) -> None:
        self._layers: list[list[_Part]] = []
        for layer, dst in enumerate(layers):
            _check(host, dst)
            parts = []
            for (offset, width), out in zip(layout, dst, strict=True):
                start = offset + 2 * layer * width
                size = _word(
                    host.stride(0),
                    start,
                    width,
                    out.stride(0),
                    out.stride(1),
                    host.data_ptr(),
                    out.data_ptr(),
                )
                src, to = host.view(_WORD_TYPES[size]), out.view(_WORD_TYPES[size])
                parts.append(
                    _Part(
                        size,
                        src,
                        to,
                        start // size,
                        width // size,
                        src.stride(0),
                        to.stride(1),
                        to.stride(0),
                    )
                )
            self._layers.append(parts)

    def load_layer(self, layer: int, slots: torch.Tensor, blocks: torch.Tensor) -> None:
        """Copy layer `layer` of the pages in host rows `slots` into device `blocks` (int64
        [n] each, on the device). Queued on the current stream."""
        n = slots.shape[0]
        if n == 0:
            return
        parts = self._layers[layer]
        if len(parts) == 2 and parts[0].size == parts[1].size:
            a, b = parts
            _copy_two_parts_kernel[(n, 4, triton.cdiv(max(a.width, b.width), _WORDS))](
                a.host,
                a.dst,
                b.dst,
                slots,
                blocks,
                a.host_stride,
                a.start,
                b.start,
                a.width,
                b.width,
                a.block_stride,
                a.kv_stride,
                b.block_stride,
                b.kv_stride,
                WORDS=_WORDS,
            )
            return
        for p in parts:
            _copy_rows_kernel[(n, 2, triton.cdiv(p.width, _WORDS))](
                p.host,
                p.dst,
                slots,
                blocks,
                p.start,
                p.host_stride,
                p.width,
                0,
                p.block_stride,
                p.kv_stride,
                p.width,
                WORDS=_WORDS,
            )


def save_pages(
    src: list[torch.Tensor],
    blocks: torch.Tensor,
    host: torch.Tensor,
    slots: torch.Tensor,
    layout: list[tuple[int, int]],
) -> None:
    """Copy every layer of device `blocks` into host rows `slots` (the inverse of the
    reader's `load_layer`, all layers at once). src: per part the pool's uint8 view [2 * num_layers,
    num_blocks, row bytes] (`DeviceKVPool.page_parts`). Queued on the current stream."""
    _check(host, src)
    n = slots.shape[0]
    if n == 0:
        return
    for (offset, width), part in zip(layout, src, strict=True):
        size = _word(
            host.stride(0),
            offset,
            width,
            part.stride(0),
            part.stride(1),
            host.data_ptr(),
            part.data_ptr(),
        )
        words = width // size
        kind = _WORD_TYPES[size]
        _copy_rows_kernel[(n, part.shape[0], triton.cdiv(words, _WORDS))](
            part.view(kind),
            host.view(kind),
            blocks,
            slots,
            0,
            part.stride(1) // size,
            part.stride(0) // size,
            offset // size,
            host.stride(0) // size,
            words,
            words,
            WORDS=_WORDS,
        )
