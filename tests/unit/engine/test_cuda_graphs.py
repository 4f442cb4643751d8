"""Decode over the static, padded buffers of DecodeGraphs (the inputs a captured CUDA graph
replays; on CPU the forward runs eagerly over them): padding never changes a real sequence's
result, and padding rows write nothing into the KV pool. With adapters, the LoRA kernels
over the static LoRA buffers give the eager LoRA path's result, and neither padding rows
nor a previous step's tiles reach a sequence."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.paged import SeqSlice
from engine.attention.triton_backend import TritonPagedAttention, load_triton_kernels
from engine.config import LoRAConfig
from engine.cuda_graphs import DecodeGraphs, GraphInputs, batch_ladder
from engine.loader import PRESETS, build_model, load_checkpoint
from engine.lora.layers import LoRAManager, apply_lora
from engine.lora.synthetic import write_random_adapter
from engine.protocol import LoRARequest
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
        torch.testing.assert_close(
            pool_rows, pools[0].kv.flatten(2, 3)[:, :, slots].float(), atol=1e-4, rtol=1e-2
        )


def _lora_model(root, num_adapters):
    """synthetic:tiny on the Triton LoRA kernels, with `num_adapters` random adapters in
    slots 1..num_adapters; returns the model and its LoRA batch."""
    model = build_model(
        load_checkpoint("synthetic:tiny", None, progress=False, seed=3), torch.float32, CPU
    )
    manager = LoRAManager(
        LoRAConfig(max_loras=num_adapters, max_lora_rank=8), model.config, torch.float32, CPU
    )
    batch = apply_lora(model, manager, load_triton_kernels(CPU, "triton_lora"))
    for i in range(num_adapters):
        path = write_random_adapter(root / f"a{i}", PRESETS["tiny"], rank=8, scale=0.2, seed=i)
        lora = LoRARequest(name=f"a{i}", path=str(path))
        manager.start_load(lora)
        while manager.loading:
            manager.wait(1.0)
            manager.finish_loads(set())
        assert manager.ready_slot(lora) == i + 1
    return model, batch


@INTERPRETED
def test_lora_decode_over_the_graph_buffers_matches_eager_decode(tmp_path):
    model, lora = _lora_model(tmp_path, num_adapters=4)
    cfg = model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BS, torch.float32)
    pools = [DeviceKVPool(spec, 32, CPU) for _ in range(2)]  # eager, graph buffers
    attns = [TritonPagedAttention(pool, cfg.num_heads, block_n=16) for pool in pools]
    prompt_lens = [3, 6, 2, 5, 4, 7]
    tables = [[2 * i, 2 * i + 1, 2 * i + 12] for i in range(len(prompt_lens))]  # 12 tokens
    prompts = [
        [(11 * i + 5 * j) % cfg.vocab_size for j in range(n)] for i, n in enumerate(prompt_lens)
    ]
    prefill = [SeqSlice(n, 0, t) for n, t in zip(prompt_lens, tables, strict=True)]
    positions = [p for n in prompt_lens for p in range(n)]
    graphs = DecodeGraphs(model, attns[1], max_batch=8, max_model_len=12, lora=lora)
    context_lens = list(prompt_lens)

    def eager(attn, ids, positions, seqs, slots):
        lora.set(slots, CPU)
        ids_t, pos_t = torch.tensor(ids), torch.tensor(positions)
        return model(ids_t, pos_t, attn, attn.build_context(seqs))

    def decode(num_seqs, slots):
        """One decode step of the first `num_seqs` sequences, eager and over the graph
        buffers; returns (eager, graph, eager with every token base) hidden states."""
        seqs = [SeqSlice(1, n, t) for n, t in zip(context_lens, tables, strict=True)][:num_seqs]
        ids = [(7 * n + 3) % cfg.vocab_size for n in context_lens[:num_seqs]]
        got = graphs.run(ids, seqs, slots)  # first: it must not read an eager step's state
        pos = context_lens[:num_seqs]
        base = eager(attns[0], ids, pos, seqs, [0] * num_seqs)  # its K/V rewritten next
        want = eager(attns[0], ids, pos, seqs, slots)
        for i in range(num_seqs):
            context_lens[i] += 1
        return want, got, base

    with torch.inference_mode():
        slots = [s for i, n in enumerate(prompt_lens) for s in [i % 5] * n]
        for attn in attns:
            eager(attn, [t for p in prompts for t in p], positions, prefill, slots)
        # base tokens, two tokens in one tile, three adapters and two padding rows
        want, got, base = decode(6, [1, 0, 3, 1, 2, 0])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        changed = (want - base).abs().amax(-1) > 1e-3
        assert changed.tolist() == [True, False, True, True, True, False]
        # four tiles, the last over row 0 (order [3, 2, 1, 0])
        want, got, _ = decode(4, [4, 3, 2, 1])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # a smaller step of the same graph size, all base: that tile must not run again
        want, got, base = decode(3, [0, 0, 0])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(want, base)
    assert graphs.lora_rows is not None and graphs.lora_rows[3].eq(0).all(), "no live tile"


def test_graph_inputs_mirror_every_step_as_if_written_whole():
    """A seeded run of decode steps over `GraphInputs`: sequences grow by a block, leave,
    join with new tables, and the batch shrinks and grows across graph sizes. After every
    step the device buffer holds what the step's inputs say (padding rows included), though
    a row's table is written only where it changed."""
    rng = random.Random(0)
    max_batch, max_blocks = 8, 12
    inputs = GraphInputs(max_batch, max_blocks, with_lora=True, device=CPU)
    static = inputs.static
    ladder = batch_ladder(max_batch)
    live: list[SeqSlice] = []
    next_block = 0

    def new_seq() -> SeqSlice:
        nonlocal next_block
        context = rng.randrange(1, 5 * BS)  # the next token's position: in the table
        table = list(range(next_block, next_block + context // BS + 1))
        next_block += len(table)
        return SeqSlice(1, context, table)

    for step in range(200):
        action = rng.random()
        if live and action < 0.15:
            live.pop(rng.randrange(len(live)))
        elif len(live) < max_batch and action < 0.35:
            live.insert(rng.randrange(len(live) + 1), new_seq())
        # every sequence decodes a token, gaining a block at each block boundary
        for i, s in enumerate(live):
            position = min(s.context_len + 1, max_blocks * BS - 1)  # the new token's
            if position // BS == len(s.block_table):
                s.block_table.append(next_block)
                next_block += 1
            live[i] = SeqSlice(1, position, s.block_table)
        if not live:
            continue
        n = len(live)
        size = next(s for s in ladder if s >= n)
        ids = [rng.randrange(1000) for _ in range(n)]
        lora = [[rng.randrange(4) for _ in range(n)] for _ in range(4)]
        inputs.write(size, ids, live, BS, lora)
        inputs.send()
        pad = size - n
        assert static["input_ids"][:size].tolist() == ids + [0] * pad, step
        positions = [s.context_len for s in live]
        assert static["positions"][:size].tolist() == positions + [0] * pad, step
        slots = [s.block_table[p // BS] * BS + p % BS for s, p in zip(live, positions, strict=True)]
        assert static["slot_mapping"][:size].tolist() == slots + [-1] * pad, step
        assert static["seq_lens"][:size].tolist() == [p + 1 for p in positions] + [1] * pad
        for i, s in enumerate(live):
            row = static["block_table"][i, : len(s.block_table)].tolist()
            assert row == s.block_table, (step, i)
        assert static["block_table"][n:size].eq(0).all(), step
        assert static["lora_rows"][:, :size].tolist() == [r + [0] * pad for r in lora], step


def test_graph_inputs_send_only_the_table_rows_a_step_changed():
    inputs = GraphInputs(4, 8, with_lora=False, device=CPU)
    seqs = [SeqSlice(1, 5, [3, 4]), SeqSlice(1, 9, [6, 1, 2])]
    inputs.write(2, [10, 11], seqs, BS)
    inputs.send()
    table = inputs.static["block_table"]
    table[0, 7] = 99  # stands for device memory the host mirror does not know of
    seqs = [SeqSlice(1, 6, seqs[0].block_table), seqs[1]]  # no table grows
    inputs.write(2, [12, 13], seqs, BS)
    inputs.send()
    assert inputs.static["input_ids"][:2].tolist() == [12, 13]
    assert table[0, 7] == 99, "an unchanged table row is not sent again"
    seqs[1].block_table.append(5)  # the second table grows: only its row is sent
    inputs.write(2, [14, 15], [seqs[0], SeqSlice(1, 12, seqs[1].block_table)], BS)
    inputs.send()
    assert table[1, :4].tolist() == [6, 1, 2, 5] and table[0, 7] == 99
    inputs.write(2, [16, 17], [SeqSlice(1, 6, [3, 4]), seqs[1]], BS)  # a new list: row 0 whole
    inputs.send()
    assert table[0, 7] == 0 and table[0, :2].tolist() == [3, 4]
