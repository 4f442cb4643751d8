"""Paged attention: the portable torch path (CPU and CUDA) and the native CPU path.

Per layer: the step's new K/V go into their page slots (quantized for FP8 pools), then each
sequence attends over its pages up to its own position. The design is in
docs/design/kernels.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels.cpu import CpuKernels, LayerPages
from kvstore.device_pool import DeviceKVPool
from kvstore.fp8 import FP8_DTYPE, dequantize_fp8, hadamard, quantize_fp8

# the torch path's temporaries per layer at most (one sequence's, if that is more): a large
# batch over long contexts is attended a few sequences at a time
ATTEND_TEMP_BYTES = 1 << 30


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a step: `query_len` new tokens after `context_len` cached.

    `block_table` only grows while the same list serves a request's steps (the block
    manager's tables never lose or change an entry): decode graphs send only a row's new
    entries (engine/cuda_graphs.py)."""

    query_len: int
    context_len: int
    block_table: list[int]


@dataclass
class _Group:
    block_table: torch.Tensor  # [B, max_blocks] int64
    seq_lens: torch.Tensor  # [B] int32, tokens each sequence attends to at its last query
    mask: torch.Tensor | None  # [B, 1, 1, Q, L] bool (True = attend); None when unused
    max_query_len: int
    token_index: torch.Tensor | None  # [N] rows of the padded [B * Q] layout; None if Q == 1


@dataclass
class _Rows:
    block_table: torch.Tensor  # [T, max_blocks] int64: each token's sequence's table
    seq_lens: torch.Tensor  # [T] int32: each token's position + 1


@dataclass
class AttentionContext:
    slot_mapping: torch.Tensor  # [T] int64, flat pool slot of every new token
    num_decode_tokens: int
    decode: _Group | None  # torch path
    prefill: _Group | None  # torch path
    rows: _Rows | None = None  # native path: every token at once


def slot_indices(seqs: list[SeqSlice], block_size: int) -> list[int]:
    """Flat pool slot of every new token, sequence by sequence."""
    return [
        s.block_table[pos // block_size] * block_size + pos % block_size
        for s in seqs
        for pos in range(s.context_len, s.context_len + s.query_len)
    ]


def padded_tables(seqs: Sequence[SeqSlice], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """[B, max_blocks] int64 (or int32): each sequence's block table, zero-padded, on the
    host. Filled row by row in numpy: a tensor per row, or one nested list, took 3-5 times
    as long, which at 64 sequences of 2,048 tokens is a good part of a GPU decode step."""
    width = max(len(s.block_table) for s in seqs)
    table = np.zeros((len(seqs), width), dtype=np.int32 if dtype == torch.int32 else np.int64)
    for row, s in zip(table, seqs, strict=True):
        row[: len(s.block_table)] = s.block_table
    return torch.from_numpy(table)


def _build_group(
    seqs: list[SeqSlice], block_size: int, device: torch.device, with_mask: bool
) -> _Group:
    max_q = max(s.query_len for s in seqs)
    tables = padded_tables(seqs)
    max_blocks = tables.shape[1]
    q_start = torch.tensor([s.context_len for s in seqs], dtype=torch.long)
    total = q_start + torch.tensor([s.query_len for s in seqs], dtype=torch.long)
    mask = None
    if with_mask:
        q_pos = q_start[:, None] + torch.arange(max_q)[None, :]  # [B, Q] absolute positions
        kv_pos = torch.arange(max_blocks * block_size)  # [L]
        causal = kv_pos[None, None, :] <= q_pos[:, :, None]
        mask = (causal & (kv_pos[None, None, :] < total[:, None, None]))[:, None, None]
        mask = mask.to(device, non_blocking=True)
    token_index = None
    if max_q > 1:
        rows = [b * max_q + i for b, s in enumerate(seqs) for i in range(s.query_len)]
        token_index = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    return _Group(
        block_table=tables.to(device, non_blocking=True),
        seq_lens=total.to(torch.int32).to(device, non_blocking=True),
        mask=mask,
        max_query_len=max_q,
        token_index=token_index,
    )


def _build_rows(seqs: list[SeqSlice]) -> _Rows:
    tables = padded_tables(seqs)
    if any(s.query_len != 1 for s in seqs):  # a row per token, not per sequence
        query_lens = torch.tensor([s.query_len for s in seqs])
        tables = tables.repeat_interleave(query_lens, dim=0)
    lens = [pos + 1 for s in seqs for pos in range(s.context_len, s.context_len + s.query_len)]
    return _Rows(block_table=tables, seq_lens=torch.tensor(lens, dtype=torch.int32))


class PoolAttention:
    """What every attention backend reads off its pool: the page geometry, the softmax scale
    and whether FP8 keys are stored rotated."""

    def __init__(self, pool: DeviceKVPool, num_heads: int, scale: float | None) -> None:
        self.pool = pool
        self.block_size = pool.spec.block_size
        self.num_heads = num_heads
        self.num_kv_heads = pool.spec.num_kv_heads
        self.head_dim = pool.spec.head_dim
        self.scale = scale if scale is not None else self.head_dim**-0.5
        self.rotate_keys = pool.spec.rotate_keys


class PagedAttention(PoolAttention):
    """Attention over a `DeviceKVPool`; native CPU kernels are used when given."""

    def __init__(
        self,
        pool: DeviceKVPool,
        num_heads: int,
        scale: float | None = None,
        kernels: CpuKernels | None = None,
    ) -> None:
        super().__init__(pool, num_heads, scale)
        native = (
            kernels is not None
            and pool.device.type == "cpu"
            and kernels.supports_pages(pool.spec.dtype)
        )
        self.kernels = kernels if native else None
        self.use_sdpa = pool.device.type == "cuda"

    def build_context(self, seqs: list[SeqSlice]) -> AttentionContext:
        """Metadata for one step. `seqs` lists every `query_len == 1` sequence first, in the
        same order as their tokens in the flattened batch."""
        device = self.pool.device
        bs = self.block_size
        slots = slot_indices(seqs, bs)
        slot_mapping = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
        if self.kernels is not None:
            return AttentionContext(slot_mapping, 0, None, None, rows=_build_rows(seqs))
        num_decode = 0
        while num_decode < len(seqs) and seqs[num_decode].query_len == 1:
            num_decode += 1
        assert all(s.query_len > 1 for s in seqs[num_decode:]), "decodes must come first"
        decode = prefill = None
        if num_decode:
            decode = _build_group(seqs[:num_decode], bs, device, with_mask=True)
        if num_decode < len(seqs):
            prefill = _build_group(seqs[num_decode:], bs, device, with_mask=True)
        return AttentionContext(slot_mapping, num_decode, decode, prefill)

    def layer_pages(self, layer_idx: int, ctx: AttentionContext) -> LayerPages:
        """What a fused native decoder layer needs to do this layer's attention itself."""
        assert ctx.rows is not None, "fused layers need the native attention context"
        k_pages, v_pages = self.pool.layer(layer_idx)
        k_scales, v_scales = self.pool.layer_scales(layer_idx) or (None, None)
        return LayerPages(
            k_pages,
            v_pages,
            ctx.slot_mapping,
            ctx.rows.block_table,
            ctx.rows.seq_lens,
            self.scale,
            k_scales,
            v_scales,
            self.rotate_keys,
        )

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] (rows may be strided views).

        Writes k/v into the pool at `ctx.slot_mapping`; returns the attention output
        [T, H * D] in the same token order.
        """
        k_pages, v_pages = self.pool.layer(layer_idx)
        k_scales, v_scales = self.pool.layer_scales(layer_idx) or (None, None)
        if self.kernels is not None:
            self.kernels.kv_write(
                k,
                v,
                k_pages,
                v_pages,
                ctx.slot_mapping,
                k_scales=k_scales,
                v_scales=v_scales,
                rotate_keys=self.rotate_keys,
            )
        else:
            self._write(k, k_pages, k_scales, ctx.slot_mapping, rotate=self.rotate_keys)
            self._write(v, v_pages, v_scales, ctx.slot_mapping)
        if ctx.rows is not None:
            assert self.kernels is not None
            return self.kernels.paged_decode(
                q,
                k_pages,
                v_pages,
                ctx.rows.block_table,
                ctx.rows.seq_lens,
                self.scale,
                k_scales=k_scales,
                v_scales=v_scales,
                rotated_keys=self.rotate_keys,
            )
        outs = []
        nd = ctx.num_decode_tokens
        if ctx.decode is not None:
            outs.append(self._attend(q[:nd].unsqueeze(1), layer_idx, ctx.decode))
        if ctx.prefill is not None:
            g = ctx.prefill
            assert g.token_index is not None
            num_seqs = g.block_table.shape[0]
            padded = q.new_zeros(num_seqs * g.max_query_len, self.num_heads, self.head_dim)
            padded.index_copy_(0, g.token_index, q[nd:])
            out = self._attend(
                padded.view(num_seqs, g.max_query_len, self.num_heads, self.head_dim),
                layer_idx,
                g,
            )
            outs.append(out.index_select(0, g.token_index))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _write(
        self,
        x: torch.Tensor,
        pages: torch.Tensor,
        scales: torch.Tensor | None,
        slots: torch.Tensor,
        rotate: bool = False,
    ) -> None:
        """Store rows x [T, Hkv, D] at flat `slots` (quantizing them for an FP8 pool, after
        the Hadamard rotation when `rotate`)."""
        rows = pages.view(-1, self.num_kv_heads, self.head_dim)
        if scales is None:
            rows.index_copy_(0, slots, x)
            return
        values, row_scales = quantize_fp8(hadamard(x) if rotate else x)
        rows.view(torch.uint8).index_copy_(0, slots, values.view(torch.uint8))
        scales.view(-1, self.num_kv_heads).index_copy_(0, slots, row_scales)

    def _gather(
        self,
        pages: torch.Tensor,
        scales: torch.Tensor | None,
        table: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Pages of each sequence, in order: [B, max_blocks * block, Hkv, D] in `dtype`."""
        b, length = table.shape[0], table.shape[1] * self.block_size
        if scales is None:
            rows = pages[table]
        else:
            values = pages.view(torch.uint8)[table].view(FP8_DTYPE)
            rows = dequantize_fp8(values, scales[table], dtype)
        return rows.view(b, length, self.num_kv_heads, self.head_dim)

    def _attend(self, q: torch.Tensor, layer_idx: int, g: _Group) -> torch.Tensor:
        """q: [B, Q, H, D] -> [B * Q, H * D] over each sequence's gathered pages, a few
        sequences at a time: their temporaries (gathered and widened pages, SDPA's K/V
        repeated per query head, scores) stay within ATTEND_TEMP_BYTES."""
        b, nq, h, d = q.shape
        assert g.mask is not None
        length = g.block_table.shape[1] * self.block_size
        widths = 2 * self.num_kv_heads * (q.element_size() + 4) + 2 * h * q.element_size()
        per_seq = length * (d * widths + 4 * h * nq)
        step = max(1, ATTEND_TEMP_BYTES // per_seq)
        if b <= step:
            return self._attend_seqs(q, layer_idx, g.block_table, g.mask)
        return torch.cat(
            [
                self._attend_seqs(
                    q[i : i + step], layer_idx, g.block_table[i : i + step], g.mask[i : i + step]
                )
                for i in range(0, b, step)
            ]
        )

    def _attend_seqs(
        self, q: torch.Tensor, layer_idx: int, table: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """`_attend` for sequences with block tables `table` and mask `mask` [B, 1, 1, Q, L]."""
        b, nq, h, d = q.shape
        hkv = self.num_kv_heads
        k_pages, v_pages = self.pool.layer(layer_idx)
        k_scales, v_scales = self.pool.layer_scales(layer_idx) or (None, None)
        scale = self.scale
        if self.rotate_keys:  # q' . k' = (q H) . (k H) / D = q . k
            q = hadamard(q).to(q.dtype)
            scale /= d
        # gathered pages: [B, L, Hkv, D] -> [B, Hkv, L, D]
        keys = self._gather(k_pages, k_scales, table, q.dtype).transpose(1, 2)
        values = self._gather(v_pages, v_scales, table, q.dtype).transpose(1, 2)
        if self.use_sdpa:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                keys,
                values,
                attn_mask=mask[:, :, 0],
                scale=scale,
                enable_gqa=hkv != h,
            )  # [B, H, Q, D]
            return out.transpose(1, 2).reshape(b * nq, h * d)
        return self._attend_matmul(q, keys, values, mask, scale)

    def _attend_matmul(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q: [B, Q, H, D]; keys/values: [B, Hkv, L, D]; mask: [B, 1, 1, Q, L]."""
        b, nq, h, d = q.shape
        hkv, length = keys.shape[1], keys.shape[2]
        group = h // hkv
        # queries grouped by KV head: [B, Hkv, G * Q, D]
        qg = q.reshape(b, nq, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, -1, d)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale
        scores = scores.view(b, hkv, group, nq, length).masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(b, hkv, group * nq, length)
        out = torch.matmul(probs, values)  # [B, Hkv, G * Q, D]
        out = out.view(b, hkv, group, nq, d).permute(0, 3, 1, 2, 4)  # [B, Q, Hkv, G, D]
        return out.reshape(b * nq, h * d)
