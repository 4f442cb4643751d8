"""Portable paged attention in plain torch (CPU and CUDA), with an optional native decode
kernel on CPU.

Per layer: one scatter writes the step's new K/V into their page slots, then each group of
sequences gathers its pages through the block table in one indexing op and attends with a
length/causal mask. Sequences are split into a decode group (one query token each) and a
prefill group (chunks padded to the longest chunk), so decode tokens never pay for padding.
Grouped-query attention is computed without repeating K/V. When a `DecodeKernel` is given,
the decode group reads pages in place instead of gathering them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.cpu_native import DecodeKernel
from kvstore.device_pool import DeviceKVPool


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a step: `query_len` new tokens after `context_len` cached."""

    query_len: int
    context_len: int
    block_table: list[int]


@dataclass
class _Group:
    block_table: torch.Tensor  # [B, max_blocks]
    seq_lens: torch.Tensor  # [B] int32, tokens each sequence attends to at its last query
    mask: torch.Tensor | None  # [B, 1, 1, Q, L] bool, True = attend; None for the native path
    max_query_len: int
    token_index: torch.Tensor | None  # [N] rows of the padded [B * Q] layout; None if Q == 1


@dataclass
class TorchAttentionContext:
    slot_mapping: torch.Tensor  # [T] flat slot of every new token
    num_decode_tokens: int
    decode: _Group | None
    prefill: _Group | None


def _build_group(
    seqs: list[SeqSlice], block_size: int, device: torch.device, with_mask: bool = True
) -> _Group:
    """Tensors for one group of sequences."""
    max_q = max(s.query_len for s in seqs)
    max_blocks = max(len(s.block_table) for s in seqs)
    max_len = max_blocks * block_size
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
    q_start = torch.empty(len(seqs), dtype=torch.long)
    total = torch.empty(len(seqs), dtype=torch.long)
    rows: list[int] = []
    for b, s in enumerate(seqs):
        tables[b, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
        q_start[b] = s.context_len
        total[b] = s.context_len + s.query_len
        rows.extend(range(b * max_q, b * max_q + s.query_len))
    mask = None
    if with_mask:
        # query i of sequence b sits at absolute position q_start[b] + i
        q_pos = q_start[:, None] + torch.arange(max_q)[None, :]  # [B, Q]
        kv_pos = torch.arange(max_len)  # [L]
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (
            kv_pos[None, None, :] < total[:, None, None]
        )  # [B, Q, L]
        mask = mask[:, None, None].to(device, non_blocking=True)
    return _Group(
        block_table=tables.to(device, non_blocking=True),
        seq_lens=total.to(torch.int32).to(device, non_blocking=True),
        mask=mask,
        max_query_len=max_q,
        token_index=None if max_q == 1 else torch.tensor(rows, dtype=torch.long).to(device),
    )


class TorchAttentionBackend:
    """Attention over a `DeviceKVPool` with torch ops only."""

    def __init__(
        self,
        pool: DeviceKVPool,
        num_heads: int,
        scale: float | None = None,
        decode_kernel: DecodeKernel | None = None,
    ) -> None:
        self.pool = pool
        self.decode_kernel = (
            decode_kernel
            if decode_kernel is not None
            and pool.device.type == "cpu"
            and decode_kernel.supports(pool.spec.dtype)
            else None
        )
        self.block_size = pool.spec.block_size
        self.num_heads = num_heads
        self.num_kv_heads = pool.spec.num_kv_heads
        self.head_dim = pool.spec.head_dim
        self.scale = scale if scale is not None else self.head_dim**-0.5

    def build_context(self, seqs: list[SeqSlice]) -> TorchAttentionContext:
        """Metadata for a step whose tokens are laid out decode sequences first.

        `seqs` must list every sequence with `query_len == 1` before any longer one.
        """
        device = self.pool.device
        bs = self.block_size
        slots = [
            s.block_table[pos // bs] * bs + pos % bs
            for s in seqs
            for pos in range(s.context_len, s.context_len + s.query_len)
        ]
        num_decode = 0
        while num_decode < len(seqs) and seqs[num_decode].query_len == 1:
            num_decode += 1
        assert all(s.query_len > 1 for s in seqs[num_decode:]), "decodes must come first"
        native = self.decode_kernel is not None
        decode = (
            _build_group(seqs[:num_decode], bs, device, with_mask=not native)
            if num_decode
            else None
        )
        prefill = _build_group(seqs[num_decode:], bs, device) if num_decode < len(seqs) else None
        return TorchAttentionContext(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(device),
            num_decode_tokens=num_decode,
            decode=decode,
            prefill=prefill,
        )

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: TorchAttentionContext,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]. Writes k/v into the pool, returns [T, H * D]."""
        k_pages, v_pages = self.pool.layer(layer_idx)
        # one scatter per tensor: the pages viewed as flat token slots
        k_pages.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, ctx.slot_mapping, k)
        v_pages.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, ctx.slot_mapping, v)
        outs = []
        nd = ctx.num_decode_tokens
        if ctx.decode is not None and self.decode_kernel is not None:
            g = ctx.decode
            out = self.decode_kernel(
                q[:nd].contiguous(), k_pages, v_pages, g.block_table, g.seq_lens, self.scale
            )
            outs.append(out.view(nd, -1))
        elif ctx.decode is not None:
            outs.append(self._attend(q[:nd].unsqueeze(1), k_pages, v_pages, ctx.decode))
        if ctx.prefill is not None:
            g = ctx.prefill
            assert g.token_index is not None
            num_seqs = g.block_table.shape[0]
            padded = q.new_zeros(num_seqs * g.max_query_len, self.num_heads, self.head_dim)
            padded.index_copy_(0, g.token_index, q[nd:])
            out = self._attend(
                padded.view(num_seqs, g.max_query_len, -1, self.head_dim), k_pages, v_pages, g
            )
            outs.append(out.index_select(0, g.token_index))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, g: _Group
    ) -> torch.Tensor:
        """q: [B, Q, H, D] -> [B * Q, H * D] over each sequence's gathered pages."""
        b, nq, h, d = q.shape
        hkv = self.num_kv_heads
        group = h // hkv
        length = g.block_table.shape[1] * self.block_size
        # gather pages: [B, max_blocks, block, Hkv, D] -> [B, Hkv, L, D]
        keys = k_pages[g.block_table].view(b, length, hkv, d).transpose(1, 2)
        values = v_pages[g.block_table].view(b, length, hkv, d).transpose(1, 2)
        # queries grouped by KV head: [B, Hkv, G * Q, D]
        qg = q.view(b, nq, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * nq, d)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scale
        assert g.mask is not None
        scores = scores.view(b, hkv, group, nq, length).masked_fill_(~g.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(b, hkv, group * nq, length)
        out = torch.matmul(probs, values)  # [B, Hkv, G * Q, D]
        out = out.view(b, hkv, group, nq, d).permute(0, 3, 1, 2, 4)  # [B, Q, Hkv, G, D]
        return out.reshape(b * nq, h * d)
