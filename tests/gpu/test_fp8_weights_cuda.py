"""FP8 weights on a GPU: the compiled kernels at Llama-3-8B's shapes against the product of
the dequantized weights, the memory the 16-bit weights leave, and an FP8 engine's decode
steps replayed from CUDA graphs (adapters included) against the same steps run eagerly.

Bound for the kernels: bf16 outputs of fp32 sums over weights that are exactly e4m3 values
times a float32 scale, so within one rounding to bf16 (2^-8 relative) plus fp32 sums in
another order (1e-3 absolute, for outputs of order 1) of the fp32 reference.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.paged import SeqSlice
from engine.attention.triton_backend import load_triton_kernels
from engine.config import LoRAConfig
from engine.cuda_graphs import batch_ladder
from engine.llm import LLM
from engine.lora.layers import LoRALinear
from engine.lora.synthetic import write_random_adapter
from engine.model.fp8_weights import (
    Fp8Linear,
    apply_fp8_weights,
    dequantize_weight,
    quantize_weight,
)
from engine.model.llama import LlamaForCausalLM
from engine.model.triton_layers import PROJECTIONS
from engine.model_config import ModelConfig
from engine.protocol import LoRARequest, SamplingParams
from tests.gpu.engines import fp8_config

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
# Llama-3-8B: qkv, o, gate_up, down, LM head (N, K)
SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))


@pytest.fixture(scope="module")
def ops():
    return load_triton_kernels(CUDA, "triton_fp8_linear")


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_fp8_kernels_match_the_dequantized_product_at_llama3_8b_shapes(ops, n, k):
    gen = torch.Generator(CUDA).manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen, device=CUDA) / k**0.5).to(torch.bfloat16)
    values, scales = quantize_weight(w)
    del w
    bias = torch.randn(n, generator=gen, device=CUDA).to(torch.bfloat16)
    dense = dequantize_weight(values, scales, torch.float32)
    for rows in (1, 3, 4, 5, 17, 64, 300):
        x = torch.randn(rows, k, generator=gen, device=CUDA).to(torch.bfloat16)
        b = bias if rows in (3, 64) else None
        want = x.float() @ dense.T + (0 if b is None else b.float())
        got = ops.fp8_linear(x, values, scales, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=2**-8)
        if rows == 1:  # every tiling the engine may choose at start
            for tiles in ops.GEMV_CANDIDATES:
                got = ops.fp8_gemv(x, values, scales, tiles=tiles).float()
                torch.testing.assert_close(got, want, atol=1e-3, rtol=2**-8)


def test_the_gate_up_gemv_with_its_activation_has_the_two_kernels_bits(ops):
    """Llama-3-8B's gate_up at one row, under every GEMV tiling the engine may choose: the
    GEMV that applies silu(gate) * up gives the bits of the product followed by
    triton_fused's kernel."""
    silu_mul = load_triton_kernels(CUDA, "triton_fused").silu_mul
    gen = torch.Generator(CUDA).manual_seed(7)
    n, k = SHAPES[2]
    values, scales = quantize_weight(torch.randn(n, k, generator=gen, device=CUDA) / k**0.5)
    x = torch.randn(1, k, generator=gen, device=CUDA).to(torch.bfloat16)
    for tiles in ops.GEMV_CANDIDATES:
        want = silu_mul(ops.fp8_gemv(x, values, scales, tiles=tiles))
        got = ops.fp8_gemv(x, values, scales, tiles=tiles, silu_mul=True)
        assert got.shape == (1, n // 2) and torch.equal(got, want), tiles


def test_fp8_weights_leave_half_the_bytes_of_the_16bit_ones(ops):
    """A 4-layer Llama-3-8B stack: the projections and the LM head, once quantized, hold
    half their bytes (plus a scale per row), and the 16-bit ones are freed."""
    cfg = ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=4,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
    )
    with torch.device(CUDA):
        model = LlamaForCausalLM(cfg).to(CUDA, torch.bfloat16)
    model.requires_grad_(False)
    linears = [getattr(layer, name) for layer in model.layers for name in PROJECTIONS]
    weight_bytes = sum(m.weight.numel() * 2 for m in [*linears, model.lm_head])
    rows = sum(m.weight.shape[0] for m in [*linears, model.lm_head])
    del linears
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(CUDA)
    assert apply_fp8_weights(model, ops) == [*PROJECTIONS, "lm_head"]
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated(CUDA)
    expected = weight_bytes // 2 - 4 * rows  # 2 bytes a weight become 1; a scale per row
    assert abs(freed - expected) < 1e-3 * expected


@pytest.fixture(scope="module")
def fp8_llm(tmp_path_factory):
    """synthetic:llama3.2-1b with FP8 weights, decode graphs up to batch 8, two adapter
    slots, and one adapter loaded (its slot is the engine's `adapter_slot`)."""
    cfg = fp8_config(lora=LoRAConfig(max_loras=2, max_lora_rank=8))
    llm = LLM(cfg)
    path = write_random_adapter(
        tmp_path_factory.mktemp("adapter"), llm.core.model_config, rank=8, scale=0.05
    )
    adapter = LoRARequest(name="a0", path=str(path))
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), lora=adapter)
    slot = llm.core.lora.ready_slot(adapter) if llm.core.lora else None
    assert slot is not None
    return llm, adapter, slot


def test_an_fp8_engine_runs_fp8_products_under_adapters_in_captured_graphs(fp8_llm, ops):
    llm, _, _ = fp8_llm
    model = llm.core.runner.model
    for name in PROJECTIONS:
        module = getattr(model.layers[0], name)
        assert isinstance(module, LoRALinear) and isinstance(module.base, Fp8Linear)
    # llama3.2-1b ties its LM head to the embeddings: it stays 16-bit (its product may be
    # the 16-bit Triton GEMV's)
    assert not isinstance(model.lm_head, Fp8Linear)
    # one plan per weight shape, timed at start among the candidates
    for name in PROJECTIONS:
        plans = {getattr(layer, name).base.plan for layer in model.layers}
        (plan,) = plans
        assert plan.gemv in ops.GEMV_CANDIDATES
        assert [b for b, _ in plan.gemm] == list(ops.ROW_BUCKETS)
        assert all(t in ops.GEMM_CANDIDATES[b] for b, t in plan.gemm)
    graphs = llm.core.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == batch_ladder(8)


def test_fp8_graph_replay_follows_eager_decode(fp8_llm):
    """One decode step of 4 sequences (2 through the adapter), replayed from the size-4
    graph and run eagerly over the same pages: the same FP8 products (the matmul at 4 rows)
    and adapter kernels, attention split otherwise, so equal within bf16 rounding (1% of
    the hidden states' norm)."""
    llm, _, slot = fp8_llm
    runner = llm.core.runner
    gen = torch.Generator().manual_seed(0)
    contexts = [37, 200, 515, 1000]
    blocks = torch.randperm(llm.core.pool.num_blocks, generator=gen).tolist()
    slices, start = [], 0
    for c in contexts:
        need = -(-c // llm.core.pool.spec.block_size)
        slices.append(SeqSlice(1, c - 1, blocks[start : start + need]))
        start += need
    ids = torch.randint(0, llm.core.vocab_size, (4,), generator=gen).tolist()
    positions = [c - 1 for c in contexts]
    slots = [0, slot, 0, slot]
    graphs = runner.graphs
    with torch.inference_mode():
        replayed = runner.forward(ids, positions, slices, slots).float().clone()
        runner.graphs = None
        try:
            eager = runner.forward(ids, positions, slices, slots).float()
        finally:
            runner.graphs = graphs
        base = runner.forward(ids, positions, slices, [0] * 4).float()
    assert ((replayed - eager).norm() / eager.norm()).item() < 1e-2
    assert (eager[1] - base[1]).abs().max() > 0.1, "the adapter changes its rows"


def test_fp8_engine_generates_the_same_greedy_tokens_twice(fp8_llm):
    """Prefill, then decode steps from the graphs, base and adapter requests in one batch.
    Prompts shorter than a KV block: the second run hits no prefix cache, so it runs the
    very steps of the first, whose kernels have no atomics: the same tokens."""
    llm, adapter, _ = fp8_llm
    prompts = [[(11 * i + 7 * j) % 5000 + 1 for j in range(5 + 3 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    loras = [None, adapter, None, adapter]
    first = [c.token_ids for c in llm.generate(prompts, params, lora=loras)]
    assert all(len(t) == 16 for t in first)
    assert [c.token_ids for c in llm.generate(prompts, params, lora=loras)] == first


def test_an_fp8_engine_without_adapters_applies_the_activation_in_its_gate_up(ops):
    """Without adapters every gate_up projection applies silu(gate) * up itself (one launch
    fewer per layer), with the bits of its plan's product followed by triton_fused's
    kernel; one sequence's decode step replayed from its graph follows the eager step."""
    llm = LLM(fp8_config())
    for layer in llm.core.runner.model.layers:
        assert layer.gate_up_proj.silu_mul and isinstance(layer.act, torch.nn.Identity)
    gate_up = llm.core.runner.model.layers[0].gate_up_proj
    silu_mul = load_triton_kernels(CUDA, "triton_fused").silu_mul
    gen = torch.Generator(CUDA).manual_seed(3)
    runner = llm.core.runner
    blocks = list(range(-(-300 // llm.core.pool.spec.block_size)))
    with torch.inference_mode():
        for rows in (1, 5):
            h = torch.randn(rows, gate_up.in_features, generator=gen, device=CUDA)
            h = h.to(torch.bfloat16)
            w, s, plan = gate_up.weight, gate_up.weight_scale, gate_up.plan
            assert torch.equal(gate_up(h), silu_mul(ops.fp8_linear(h, w, s, plan=plan)))
        replayed = runner.forward([17], [299], [SeqSlice(1, 299, blocks)], [0]).float().clone()
        graphs, runner.graphs = runner.graphs, None
        try:
            eager = runner.forward([17], [299], [SeqSlice(1, 299, blocks)], [0]).float()
        finally:
            runner.graphs = graphs
    assert ((replayed - eager).norm() / eager.norm()).item() < 1e-2
