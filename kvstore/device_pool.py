"""The device tier: one preallocated tensor holding every KV page of every layer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.base import KVCacheSpec
from kvstore.fp8 import SCALE_DTYPE
from kvstore.hostmem import host_zeros
from kvstore.transfer import HostReads, LoadMode, PageLoads, PagePool, SyncLoads
from kvstore.transfer_cuda import StreamLoads
from kvstore.transfer_thread import ThreadLoads


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":  # every decode step reads the batch's pages: huge pages
        return host_zeros(*shape, dtype=dtype)
    return torch.zeros(*shape, dtype=dtype, device=device)


def make_page_loads(
    pool: PagePool,
    mode: LoadMode | str = LoadMode.AUTO,
    host_reads: HostReads | str = HostReads.AUTO,
) -> PageLoads:
    """The page loads of `pool` in copy mode `mode` (`auto`: a CUDA stream on a GPU, sync
    elsewhere)."""
    mode = LoadMode(mode)
    if mode is LoadMode.AUTO:
        mode = LoadMode.STREAM if pool.device.type == "cuda" else LoadMode.SYNC
    if mode is LoadMode.STREAM:
        return StreamLoads(pool, host_reads)
    if mode is LoadMode.THREAD:
        return ThreadLoads(pool, host_reads)
    return SyncLoads(pool, host_reads)


class DeviceKVPool:
    """`num_blocks` pages allocated once on `device`, zero-filled.

    Layout per layer: K and V each `[num_blocks, block_size, num_kv_heads, head_dim]`; FP8
    pools add K and V scales, each `[num_blocks, block_size, num_kv_heads]` float32.
    Zero-filling matters: masked-out slots of a gathered page must hold finite values.
    The pool only stores bytes; which block belongs to whom is the block manager's business.
    Pages loaded from the tiers below arrive layer by layer (`load_pages`, kvstore/transfer.py):
    `layer` makes what runs next wait for that layer's pages.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device,
        load_mode: LoadMode | str = LoadMode.AUTO,
        host_reads: HostReads | str = HostReads.AUTO,
    ) -> None:
        assert num_blocks > 0
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = device
        shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads)
        # kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv = _zeros((*shape, spec.head_dim), spec.dtype, device)
        self.scales = _zeros(shape, SCALE_DTYPE, device) if spec.quantized else None
        self.loads = make_page_loads(self, load_mode, host_reads)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) page tensors of one layer, each [num_blocks, block_size, kv_heads, D], once
        the pages loading into it have arrived (on CUDA: for the kernels queued next)."""
        self.loads.wait_layer(layer_idx)
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(K, V) scales of one layer, each [num_blocks, block_size, kv_heads]; None unless
        the pool is FP8."""
        if self.scales is None:
            return None
        return self.scales[layer_idx, 0], self.scales[layer_idx, 1]

    # -- whole pages, for the tiers below -------------------------------------------------

    def page_parts(self) -> list[torch.Tensor]:
        """Byte views [num_layers * 2, num_blocks, bytes of one layer's K or V block] of the
        values, then (FP8) the scales: a page is each part's row of its block, in order."""
        parts = [self.kv.view(torch.uint8)]
        if self.scales is not None:
            parts.append(self.scales.view(torch.uint8))
        return [p.view(2 * self.spec.num_layers, self.num_blocks, -1) for p in parts]

    def layer_parts(self, layer_idx: int) -> list[torch.Tensor]:
        """Layer `layer_idx`'s rows of `page_parts`, each [2 (K, V), num_blocks, width]."""
        return [p[2 * layer_idx : 2 * layer_idx + 2] for p in self.page_parts()]

    def load_pages(self, blocks: Sequence[int], pages: Sequence[torch.Tensor]) -> None:
        """Store `pages` (host rows as `read_pages` returns them) into `blocks`, layer by
        layer and, on CUDA, asynchronously (`layer` waits). Rows of the host tier may be
        read in place later (the tier waits before rewriting one: kvstore/transfer.py); any
        other rows may be reused as soon as this returns."""
        self.loads.start(blocks, pages)

    def read_pages(self, blocks: Sequence[int]) -> torch.Tensor:
        """The pages of `blocks` as bytes, [n, spec.bytes_per_block] uint8 on the pool's
        device: every layer's K and V values, then (FP8) their scales."""
        out = torch.empty(
            len(blocks), self.spec.bytes_per_block, dtype=torch.uint8, device=self.device
        )
        self.read_pages_into(blocks, list(out))
        return out

    def read_pages_into(self, blocks: Sequence[int], out: Sequence[torch.Tensor]) -> None:
        """`read_pages` into given rows, one [spec.bytes_per_block] uint8 row per block, on
        any device (host slots, say): no intermediate copy. Synchronous, so the rows can be
        read (or written to disk) as soon as it returns."""
        assert len(out) == len(blocks)
        offset = 0
        for part in self.page_parts():
            width = part.shape[0] * part.shape[2]
            for block, row in zip(blocks, out, strict=True):  # one strided copy per page
                dst = row[offset : offset + width].view(part.shape[0], -1)
                dst.copy_(part[:, block])
            offset += width

    def write_pages(self, blocks: Sequence[int], pages: Sequence[torch.Tensor]) -> None:
        """Store `pages` (rows as `read_pages` returns them, on any device) into `blocks`.
        Copies from pinned host memory are asynchronous on CUDA: they are ordered on the
        stream before any later kernel or copy that touches these blocks or rows."""
        assert len(pages) == len(blocks)
        offset = 0
        for part in self.page_parts():
            width = part.shape[0] * part.shape[2]
            for block, page in zip(blocks, pages, strict=True):
                assert page.shape == (self.spec.bytes_per_block,) and page.dtype == torch.uint8
                src = page[offset : offset + width].view(part.shape[0], -1)
                part[:, block].copy_(src, non_blocking=True)
            offset += width

    @property
    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.kv.numel() * self.kv.element_size() + scales
