"""Decode over the static, padded buffers of DecodeGraphs (the inputs a captured CUDA graph
replays; on CPU the forward runs eagerly over them): padding never changes a real sequence's
result, and padding rows write nothing into the KV pool."""

from __future__ import annotations

import pytest
import torch

from engine.attention.paged import SeqSlice
from engine.attention.triton_backend import TritonPagedAttention
from engine.cuda_graphs import DecodeGraphs, batch_ladder
from engine.loader import build_model, load_checkpoint
from kvstore.base import KVCacheSpec
from kvstore.device_pool import DeviceKVPool
from tests.triton_marks import INTERPRETED

CPU = torch.device("cpu")
BS = 4


def test_batch_ladder():
    assert batch_ladder(1) == [1]
    assert batch_ladder(6) == [1, 2, 4, 6]
    assert batch_ladder(8) == [1, 2, 4, 8]
    assert batch_ladder(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert batch_ladder(30) == [1, 2, 4, 8, 16, 24, 30]


@pytest.fixture(scope="module")
def tiny_model():
    checkpoint = load_checkpoint("synthetic:tiny", None, progress=False, seed=3)
    return build_model(checkpoint, torch.float32, CPU)


@INTERPRETED
@pytest.mark.parametrize("page_dtype", [torch.float32, torch.float8_e4m3fn])
def test_padded_decode_matches_eager_decode(tiny_model, page_dtype):
    cfg = tiny_model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BS, page_dtype)
    pools = [DeviceKVPool(spec, 48, CPU) for _ in range(2)]
    attns = [TritonPagedAttention(pool, cfg.num_heads, block_n=16) for pool in pools]
    gen = torch.Generator().manual_seed(0)
    prompt_lens = [5, 19, 11]  # three sequences: the graph of size 4 carries one padding row
    tables, start = [], 0
    for n in prompt_lens:
        blocks = -(-(n + 1) // BS)
        tables.append(list(range(start + blocks - 1, start - 1, -1)))  # scattered, reversed
        start += blocks
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in prompt_lens]
    prefill = [SeqSlice(n, 0, t) for n, t in zip(prompt_lens, tables, strict=True)]
    ids = torch.cat(prompts)
    positions = torch.cat([torch.arange(n) for n in prompt_lens])
    with torch.inference_mode():
        for attn in attns:
            tiny_model(ids, positions, attn, attn.build_context(prefill))
        assert torch.equal(pools[0].kv, pools[1].kv)

        decode = [SeqSlice(1, n, t) for n, t in zip(prompt_lens, tables, strict=True)]
        new_ids = [7, 99, 301]
        new_pos = torch.tensor(prompt_lens)
        eager = tiny_model(torch.tensor(new_ids), new_pos, attns[0], attns[0].build_context(decode))
        graphs = DecodeGraphs(tiny_model, attns[1], max_batch=8, max_model_len=64)
        before = pools[1].kv.clone()
        padded = graphs.run(new_ids, decode)
    assert padded.shape == eager.shape
    # the padded batch runs its matmuls at another size: equal up to rounding
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    slots = [t[n // BS] * BS + n % BS for n, t in zip(prompt_lens, tables, strict=True)]
    diff = (pools[1].kv != before).flatten(2, 3)  # [layers, 2, slots, Hkv, D]
    changed = diff.any(-1).any(-1).any(0).any(0)
    assert changed.nonzero().flatten().tolist() == sorted(slots), "padding rows write nothing"
    assert graphs.slot_mapping[3:].eq(-1).all(), "rows past the batch are padding"
    for pool in pools:
        pool_rows = pool.kv.flatten(2, 3)[:, :, slots].float()
        torch.testing.assert_close(pool_rows, pools[0].kv.flatten(2, 3)[:, :, slots].float(),
                                   atol=1e-4, rtol=1e-2)  # fmt: skip
