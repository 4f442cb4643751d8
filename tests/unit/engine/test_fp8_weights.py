"""FP8 weights: the quantizer's round trip, the model transform (which products, what it
releases) and where the option is refused."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from engine.attention.triton_backend import (
    TritonPagedAttention,
    load_triton_kernels,
    pdl_supported,
)
from engine.config import ConfigError, EngineConfig, KernelBackend, WeightFormat
from engine.factory import create_engine
from engine.loader import PRESETS, build_model
from engine.loader.synthetic import synthetic_checkpoint
from engine.model import fp8_weights
from engine.model.fp8_weights import (
    Fp8Linear,
    apply_fp8_weights,
    dequantize_weight,
    fuse_silu_mul,
    quantize_weight,
)
from engine.model.triton_layers import PROJECTIONS
from tests.triton_marks import INTERPRETED


def _weight(seed: int, n: int = 48, k: int = 40) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[1] *= 1e-3  # rows of very different magnitudes get scales of their own
    w[2] = 0.0
    return w.to(torch.bfloat16)


def test_quantized_rows_keep_their_largest_magnitude_and_e4m3_precision():
    w = _weight(0)
    values, scales = quantize_weight(w)
    assert values.dtype == torch.float8_e4m3fn and values.shape == w.shape
    assert scales.dtype == torch.float32 and scales.shape == (48,)
    back = dequantize_weight(values, scales, torch.float32)
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    # each row's largest magnitude is e4m3's largest finite value times the scale
    nonzero = amax > 0
    torch.testing.assert_close(back.abs().amax(dim=1)[nonzero], amax[nonzero], rtol=1e-6, atol=0)
    assert scales[2] == 1.0 and not back[2].any()  # an all-zero row
    # 3 mantissa bits: within half a step (2^-4 relative) of each value, above e4m3's
    # subnormals (values under 2^-6 of the scale round to a grid of 2^-9 of it)
    normal = wf.abs() >= scales[:, None] * 2**-6
    error = (back - wf).abs()
    assert (error[normal] <= wf.abs()[normal] * 2**-4).all()
    assert (error[~normal] <= (scales[:, None] * 2**-10).expand_as(wf)[~normal]).all()


def test_quantizing_a_dequantized_weight_gives_the_same_bytes():
    values, scales = quantize_weight(_weight(1))
    again, again_scales = quantize_weight(dequantize_weight(values, scales, torch.float32))
    assert torch.equal(again.view(torch.uint8), values.view(torch.uint8))
    torch.testing.assert_close(again_scales, scales, rtol=0, atol=0)


def test_quantizing_by_bands_of_rows_matches_one_pass(monkeypatch):
    w = _weight(2, n=50)
    whole = quantize_weight(w)
    monkeypatch.setattr(fp8_weights, "_CHUNK_BYTES", 7 * 4 * 40)  # bands of 7 rows
    banded = quantize_weight(w)
    assert torch.equal(banded[0].view(torch.uint8), whole[0].view(torch.uint8))
    assert torch.equal(banded[1], whole[1])


def _model(tied: bool):
    config = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=tied)
    checkpoint = dataclasses.replace(synthetic_checkpoint("synthetic:tiny", 0), config=config)
    return build_model(checkpoint, torch.float32, torch.device("cpu"))


@INTERPRETED
@pytest.mark.parametrize("tied", [False, True])
def test_every_projection_and_an_untied_lm_head_become_fp8(tied):
    """The products answer as the dequantized weights do; a tied LM head (the embedding
    table) stays 16-bit; the replaced 16-bit weights are released."""
    ops = load_triton_kernels(torch.device("cpu"), "triton_fp8_linear")
    model = _model(tied)
    old = {name: getattr(model.layers[1], name).weight for name in PROJECTIONS}
    old["lm_head"] = model.lm_head.weight
    released = {name: weakref.ref(w) for name, w in old.items()}
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    swapped = apply_fp8_weights(model, ops)
    assert swapped == [*PROJECTIONS] + ([] if tied else ["lm_head"])
    for name in PROJECTIONS:
        for layer in model.layers:
            assert isinstance(getattr(layer, name), Fp8Linear)
    module = model.layers[1].qkv_proj
    with torch.inference_mode():
        want = F.linear(x, module.dequantized(torch.float32))
        torch.testing.assert_close(module(x), want, atol=1e-5, rtol=1e-5)
    assert isinstance(model.lm_head, nn.Linear) == tied
    if tied:
        assert model.lm_head.weight is model.embed_tokens.weight
    del old
    gc.collect()
    dead = {name for name, ref in released.items() if ref() is None}
    assert dead == set(swapped)


def test_fp8_weights_are_a_config_error_off_the_triton_kernels():
    with pytest.raises(ConfigError, match="fp8 weights need the Triton kernels"):
        EngineConfig(device="cpu", weights=WeightFormat.FP8)
    for backend in (KernelBackend.TORCH, KernelBackend.NATIVE):
        with pytest.raises(ConfigError, match="fp8 weights"):
            EngineConfig(device="cpu", backend=backend, weights=WeightFormat.FP8)
    # on a CPU only the interpreted Triton kernels run them (tests)
    EngineConfig(device="cpu", backend=KernelBackend.TRITON, weights=WeightFormat.FP8)
    for weights in (WeightFormat.AUTO, WeightFormat.SIXTEEN_BIT):
        assert EngineConfig(device="cpu", weights=weights).weights is weights


def test_kernels_start_early_only_on_a_gpu_that_can(tmp_path):
    """Programmatic dependent launch needs a CUDA device of compute capability 9.0 or more:
    an engine on the interpreted Triton kernels launches plainly whatever its config says."""
    assert not pdl_supported(torch.device("cpu"))
    config = EngineConfig(
        model="synthetic:tiny", device="cpu", backend=KernelBackend.TRITON, cache_dir=str(tmp_path)
    )
    assert config.pdl
    core, _ = create_engine(config, progress=False)
    assert isinstance(core.runner.attn, TritonPagedAttention) and not core.runner.attn.pdl


@INTERPRETED
def test_each_fp8_product_takes_the_plan_that_timed_fastest(monkeypatch):
    """`choose_plans` with a stand-in for the CUDA-graph timer (which runs a call, as the
    real one runs them all, and gives each tiling a time of its own per shape and rows):
    every module of a group gets that group's fastest GEMV and the fastest matmul tiles of
    each row bucket; a candidate that fails is skipped."""
    ops = load_triton_kernels(torch.device("cpu"), "triton_fp8_linear")
    model = _model(tied=False)
    apply_fp8_weights(model, ops)
    fastest_gemv = {64: ops.GEMV_CANDIDATES[1], 128: ops.GEMV_CANDIDATES[2]}  # by in_features
    broken = ops.GEMM_CANDIDATES[64][0]
    timed = []

    def fake_timer(calls):
        tiles, (x, *_) = calls[0].keywords["tiles"], calls[0].args
        rows, width = x.shape
        timed.append((rows, tiles, len(calls)))
        if isinstance(tiles, ops.GemvTiles):  # timed as the engine launches it
            assert all(call.keywords["pdl"] for call in calls)
        if tiles == broken:
            raise RuntimeError("out of shared memory")
        if isinstance(tiles, ops.GemvTiles):
            return 1.0 if tiles == fastest_gemv[width] else 2.0
        # the matmul: its last candidate is fastest in every bucket, and slower than the
        # GEMV at one row
        return 1.5 if tiles == ops.GEMM_CANDIDATES[_bucket(ops, rows)][-1] else 3.0

    monkeypatch.setattr(fp8_weights, "graph_ms_per_call", fake_timer)
    chosen = fp8_weights.choose_plans(model, ops, pdl=True)
    assert set(chosen) == {*PROJECTIONS, "lm_head"}
    for name in PROJECTIONS:
        for layer in model.layers:
            plan = getattr(layer, name).plan
            assert plan.gemv == fastest_gemv[getattr(layer, name).in_features]
            assert plan.gemv_max_rows == 1
            assert plan.gemm == tuple((b, ops.GEMM_CANDIDATES[b][-1]) for b in ops.ROW_BUCKETS)
            assert chosen[name] == plan.name
    assert model.lm_head.plan.gemv == fastest_gemv[64]
    # per group: the GEMV's candidates and the first bucket's at one row, then each bucket's
    # at its size (512 for the last), each over at least 8 products
    per_group = (
        len(ops.GEMV_CANDIDATES)
        + len(ops.GEMM_CANDIDATES[ops.ROW_BUCKETS[0]])
        + sum(len(ops.GEMM_CANDIDATES[b]) for b in ops.ROW_BUCKETS)
    )
    assert len(timed) == 5 * per_group and {n for _, _, n in timed} == {8}
    assert {r for r, _, _ in timed} == {1, *(b or 512 for b in ops.ROW_BUCKETS)}


def _bucket(ops, rows: int):
    return next(b for b in ops.ROW_BUCKETS if b is None or rows <= b)


@INTERPRETED
def test_a_plan_sends_each_size_of_product_to_its_kernel_and_tiles():
    ops = load_triton_kernels(torch.device("cpu"), "triton_fp8_linear")
    small, large = ops.GEMM_CANDIDATES[16][1], ops.GEMM_CANDIDATES[None][1]
    plan = ops.Fp8Plan(gemv_max_rows=1, gemm=((16, small), (None, large)))
    assert plan.gemm_tiles(2) == small and plan.gemm_tiles(16) == small
    assert plan.gemm_tiles(17) == large and plan.gemm_tiles(4096) == large
    assert "<=16: " + small.name in plan.name


@INTERPRETED
def test_gate_up_with_the_activation_gives_each_layer_the_same_bits():
    """After `fuse_silu_mul` the layers' MLPs (gate_up, the activation, down) give the bits
    they gave with triton_fused's activation after the product: one row (the GEMV applies
    it) and five (the matmul, then the kernel)."""
    ops = load_triton_kernels(torch.device("cpu"), "triton_fp8_linear")
    silu_mul = load_triton_kernels(torch.device("cpu"), "triton_fused").silu_mul
    model = _model(tied=False)
    apply_fp8_weights(model, ops)
    gen = torch.Generator().manual_seed(5)
    hs = [torch.randn(rows, model.config.hidden_size, generator=gen) for rows in (1, 5)]
    with torch.inference_mode():
        want = [
            [layer.down_proj(silu_mul(layer.gate_up_proj(h))) for h in hs] for layer in model.layers
        ]
        fuse_silu_mul(model)
        got = [
            [layer.down_proj(layer.act(layer.gate_up_proj(h))) for h in hs]
            for layer in model.layers
        ]
    assert all(isinstance(layer.act, nn.Identity) for layer in model.layers)
    for got_layer, want_layer in zip(got, want, strict=True):
        for g, w in zip(got_layer, want_layer, strict=True):
            assert torch.equal(g, w)


@INTERPRETED
def test_a_fused_gate_up_is_timed_with_its_activation(monkeypatch):
    """`choose_plans` times the gate_up GEMV that applies the activation, and the matmul
    followed by it; the other projections without."""
    ops = load_triton_kernels(torch.device("cpu"), "triton_fp8_linear")
    model = _model(tied=False)
    apply_fp8_weights(model, ops)
    fuse_silu_mul(model)
    outputs: dict[tuple[int, int], set[int]] = {}
    ran: set[tuple[int, int, type]] = set()

    def timer(calls):
        x, weight = calls[0].args[:2]
        kernel = type(calls[0].keywords["tiles"])
        if (weight.shape[0], x.shape[0], kernel) not in ran:  # one run per kernel: interpreted
            ran.add((weight.shape[0], x.shape[0], kernel))
            outputs.setdefault((weight.shape[0], x.shape[0]), set()).add(calls[0]().shape[1])
        return 1.0

    monkeypatch.setattr(fp8_weights, "graph_ms_per_call", timer)
    fp8_weights.choose_plans(model, ops)
    inter = model.config.intermediate_size
    for (n, _rows), widths in outputs.items():
        assert widths == ({inter} if n == 2 * inter else {n})
    assert {rows for n, rows in outputs if n == 2 * inter} == {1, 16, 64, 256, 512}
