"""PagedAttention's torch paths against a dense reference: causal attention over contiguous
K/V per sequence, for a step that mixes decode tokens and prefill chunks."""

from __future__ import annotations

import pytest
import torch

from engine.attention import paged
from engine.attention.paged import PagedAttention, SeqSlice
from kvstore.base import KVCacheSpec
from kvstore.device_pool import DeviceKVPool

H, HKV, D, BS = 6, 2, 16, 4


def dense_reference(q, keys, values, context_len):
    """q: [Q, H, D]; keys/values: [L, Hkv, D] for one sequence -> [Q, H * D]."""
    group = H // HKV
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("qhd,hld->hql", q.float(), k.float()) * D**-0.5
    q_pos = context_len + torch.arange(q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[1])[None, :] > q_pos, float("-inf"))
    out = torch.einsum("hql,hld->qhd", scores.softmax(-1), v.float())
    return out.reshape(q.shape[0], H * D)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "seq-by-seq"])
@pytest.mark.parametrize("use_sdpa", [False, True])
def test_mixed_step_matches_dense_attention(use_sdpa, chunked, monkeypatch):
    """`chunked`: a temporaries budget smaller than one sequence's: each group of
    sequences (the decodes, the prefill chunks) is attended one sequence at a time."""
    if chunked:
        monkeypatch.setattr(paged, "ATTEND_TEMP_BYTES", 1)
    gen = torch.Generator().manual_seed(0)
    pool = DeviceKVPool(KVCacheSpec(1, HKV, D, BS, torch.float32), 64, torch.device("cpu"))
    attn = PagedAttention(pool, H)
    attn.use_sdpa = use_sdpa
    # (context already cached, new tokens this step): two decodes, then three prefill chunks
    shapes = [(9, 1), (0, 1), (0, 7), (5, 3), (12, 6)]
    blocks = iter(torch.randperm(64, generator=gen).tolist())
    seqs, history = [], []
    for ctx_len, q_len in shapes:
        total = ctx_len + q_len
        table = [next(blocks) for _ in range(-(-total // BS))]
        seqs.append(SeqSlice(q_len, ctx_len, table))
        k_all = torch.randn(total, HKV, D, generator=gen)
        v_all = torch.randn(total, HKV, D, generator=gen)
        history.append((k_all, v_all))
        flat_k, flat_v = pool.layer(0)[0].view(-1, HKV, D), pool.layer(0)[1].view(-1, HKV, D)
        for pos in range(ctx_len):  # what earlier steps wrote
            slot = table[pos // BS] * BS + pos % BS
            flat_k[slot], flat_v[slot] = k_all[pos], v_all[pos]
    num_tokens = sum(q for _, q in shapes)
    q = torch.randn(num_tokens, H, D, generator=gen)
    k_new = torch.cat([k[c:] for (k, _), (c, _) in zip(history, shapes, strict=True)])
    v_new = torch.cat([v[c:] for (_, v), (c, _) in zip(history, shapes, strict=True)])
    ctx = attn.build_context(seqs)
    out = attn.forward(0, q, k_new, v_new, ctx)
    start = 0
    for (k_all, v_all), (ctx_len, q_len) in zip(history, shapes, strict=True):
        expected = dense_reference(q[start : start + q_len], k_all, v_all, ctx_len)
        torch.testing.assert_close(out[start : start + q_len], expected, atol=1e-5, rtol=1e-4)
        start += q_len


def test_decodes_must_come_first():
    pool = DeviceKVPool(KVCacheSpec(1, HKV, D, BS, torch.float32), 8, torch.device("cpu"))
    with pytest.raises(AssertionError, match="decodes must come first"):
        PagedAttention(pool, H).build_context([SeqSlice(3, 0, [0]), SeqSlice(1, 2, [1])])
