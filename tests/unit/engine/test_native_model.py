"""The native CPU model transforms: fused bf16 decoder layers are bit-identical to the
per-module native path, and both track the torch path, on the `native` build and on the
`avx2` one (where the CPU has AVX2)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.paged import SeqSlice
from engine.config import CacheConfig, EngineConfig, KVCacheDtype, WeightFormat
from engine.core import EngineCore
from engine.kernels.cpu import cpu_isa_levels, load_cpu_kernels
from engine.loader import build_model, load_checkpoint
from engine.model.native_cpu import (
    NativeDecoderLayer,
    NativeDecoderStack,
    NativeLinear,
    apply_native_cpu,
)
from engine.model.quant_weights import QuantLinear, apply_quant_weights, quantize_model
from engine.protocol import SamplingParams
from tests.huge_pages import huge_kib, needs_thp

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["native", "avx512", "avx2"])
def kernels(request, strata_cache_dir):
    if request.param in ("avx512", "avx2") and request.param not in cpu_isa_levels():
        pytest.skip(f"this CPU has no {request.param}")
    k = load_cpu_kernels(str(strata_cache_dir), arch=request.param)
    assert k is not None
    return k


KV_DTYPES = [KVCacheDtype.AUTO, KVCacheDtype.FP8_E4M3]
NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def engine(
    kernels,
    mode: str,
    kv: KVCacheDtype = KVCacheDtype.AUTO,
    dtype: str = "bfloat16",
    weights: WeightFormat = WeightFormat.SIXTEEN_BIT,
) -> EngineCore:
    ckpt = load_checkpoint("synthetic:tiny", None, seed=5)
    model = build_model(ckpt, getattr(torch, dtype), CPU)
    if weights is not WeightFormat.SIXTEEN_BIT:
        apply_quant_weights(model, quantize_model(model, ckpt, weights), kernels.quant)
    if mode != "torch":
        apply_native_cpu(model, kernels, fuse_layers=mode == "fused")
    cache = CacheConfig(block_size=4, num_blocks=64, kv_cache_dtype=kv)
    cfg = EngineConfig(dtype=dtype, cache=cache)
    return EngineCore(
        model,
        cfg,
        model_id="tiny",
        eos_token_ids=frozenset(),
        kernels=None if mode == "torch" else kernels,
    )


def step_logits(core: EngineCore, seqs: list[tuple[list[int], int]]) -> torch.Tensor:
    """One forward over several sequences' chunks (token ids, tokens already cached)."""
    runner = core.runner
    ids, positions, slices, next_block = [], [], [], 0
    for tokens, cached in seqs:
        blocks = list(range(next_block, next_block + -(-len(tokens) // 4)))
        next_block += len(blocks)
        ids += tokens[cached:]
        positions += list(range(cached, len(tokens)))
        slices.append(SeqSlice(len(tokens) - cached, cached, blocks))
    with torch.inference_mode():
        ctx = runner.attn.build_context(slices)
        hidden = runner.model(torch.tensor(ids), torch.tensor(positions), runner.attn, ctx)
        return runner.model.compute_logits(hidden)


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_fused_layers_are_bit_identical_to_native_modules(kernels, kv):
    modules, fused = engine(kernels, "modules", kv), engine(kernels, "fused", kv)
    if not kernels.has_bf16_linear:  # without AVX512-BF16 nothing is packed, nothing fuses
        assert not any(isinstance(m, NativeDecoderLayer) for m in fused.runner.model.layers)
        return
    assert all(isinstance(m, NativeDecoderLayer) for m in fused.runner.model.layers)
    assert isinstance(fused.runner.model.layer_stack, NativeDecoderStack)
    layered = engine(kernels, "fused", kv)
    layered.runner.model.layer_stack = None  # one kernel call per layer instead of one in all
    gen = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(0, 512, (n,), generator=gen).tolist(), 0) for n in (1, 9, 23)]
    logits = step_logits(fused, seqs)
    assert torch.equal(logits, step_logits(modules, seqs))
    assert torch.equal(logits, step_logits(layered, seqs))
    # the K/V both wrote into their pools are the same bytes too (and the same FP8 scales)
    assert torch.equal(fused.pool.kv.view(torch.uint8), modules.pool.kv.view(torch.uint8))
    if kv is KVCacheDtype.FP8_E4M3:
        assert fused.pool.spec.rotate_keys and fused.pool.scales is not None
        assert torch.equal(fused.pool.scales, modules.pool.scales)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for core in (fused, modules):
        for i, n in enumerate((3, 17, 30)):
            core.add_request(str(i), list(range(1, n + 1)), params)
    outs = {}
    for name, core in (("fused", fused), ("modules", modules)):
        tokens: dict[str, list[int]] = {}
        while core.has_unfinished():
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        outs[name] = tokens
        core.check_integrity()
    assert outs["fused"] == outs["modules"]


@pytest.mark.parametrize("weights", [WeightFormat.Q4, WeightFormat.Q8])
def test_fused_layers_keep_quantized_weights_bit_identical(kernels, weights):
    """Quantized projections run inside the layer kernel (csrc/layer.h) by the same
    products as the lone quantized linears: same logits, same K/V, same tokens."""
    modules = engine(kernels, "modules", weights=weights)
    fused = engine(kernels, "fused", weights=weights)
    layers = fused.runner.model.layers
    assert all(isinstance(m, NativeDecoderLayer) for m in layers)
    assert isinstance(fused.runner.model.layer_stack, NativeDecoderStack)
    code = 4 if weights is WeightFormat.Q4 else 8
    assert all(m.weights.formats == (code,) * 4 for m in layers)
    assert all(
        isinstance(getattr(m, n), QuantLinear) for m in modules.runner.model.layers for n in NAMES
    )
    layered = engine(kernels, "fused", weights=weights)
    layered.runner.model.layer_stack = None
    gen = torch.Generator().manual_seed(2)
    # 1 and 3 rows: the few-rows products; 9 and 23 together: the many-rows ones
    for lens in ((1,), (3,), (9, 23)):
        seqs = [(torch.randint(0, 512, (n,), generator=gen).tolist(), 0) for n in lens]
        logits = step_logits(fused, seqs)
        assert torch.equal(logits, step_logits(modules, seqs))
        assert torch.equal(logits, step_logits(layered, seqs))
    assert torch.equal(fused.pool.kv.view(torch.uint8), modules.pool.kv.view(torch.uint8))


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_native_bf16_tracks_the_torch_path(kernels, kv):
    native, plain = engine(kernels, "fused", kv), engine(kernels, "torch", kv)
    gen = torch.Generator().manual_seed(1)
    seqs = [(torch.randint(0, 512, (n,), generator=gen).tolist(), 0) for n in (5, 40)]
    a, b = step_logits(native, seqs), step_logits(plain, seqs)
    assert (a - b).abs().max().item() < 0.05 * b.abs().max().item()


def test_native_fp32_packs_its_linears_and_matches_the_torch_path(kernels):
    """fp32 models get the packed fp32 linear (csrc/linear_f32.h) but no fused layers (that
    kernel is bf16), and their logits stay within fp32 rounding of the torch path."""
    native, plain = (
        engine(kernels, "fused", dtype="float32"),
        engine(kernels, "torch", dtype="float32"),
    )
    model = native.runner.model
    assert native.runner.model.layer_stack is None
    assert not any(isinstance(layer, NativeDecoderLayer) for layer in model.layers)
    linears = [model.lm_head]
    linears += [getattr(layer, n) for layer in model.layers for n in NAMES]
    assert all(isinstance(m, NativeLinear) for m in linears) == kernels.has_f32_linear
    gen = torch.Generator().manual_seed(1)
    seqs = [(torch.randint(0, 512, (n,), generator=gen).tolist(), 0) for n in (5, 40)]
    a, b = step_logits(native, seqs), step_logits(plain, seqs)
    assert (a - b).abs().max().item() < 1e-4 * b.abs().max().item()


@needs_thp
def test_packed_weights_share_one_huge_page_arena(kernels):
    """A decode step reads every packed weight: they sit together, in 2 MiB pages."""
    ckpt = load_checkpoint("synthetic:smollm2-135m", None, seed=1)
    # bf16 weights pack on AVX512-BF16 CPUs, fp32 ones on any AVX-512 CPU
    dtype = torch.bfloat16 if kernels.has_bf16_linear else torch.float32
    model = build_model(ckpt, dtype, CPU)
    apply_native_cpu(model, kernels)
    if not kernels.has_f32_linear:  # no AVX-512: nothing is packed
        assert not any(isinstance(m, NativeLinear) for m in model.modules())
        return
    packed = [model.lm_head.packed]
    layers = [getattr(layer, "inner", layer) for layer in model.layers]  # bf16 ones fused
    packed += [getattr(layer, name).packed for layer in layers for name in NAMES]
    assert len({t.untyped_storage().data_ptr() for t in packed}) == 1
    assert huge_kib(packed[0]) * 1024 >= 0.9 * sum(t.numel() * t.element_size() for t in packed)
