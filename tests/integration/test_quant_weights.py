"""Quantized weights through the whole engine (`--weights auto|q8|q4`): the quantized
kernels against the same quantized values dequantized on the torch backend, the default
model's own Q4_1 blocks against its 16-bit run, and the features that must keep working on
top: multi-LoRA, FP8 KV pages, speculative decoding, the per-layer path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.attention.paged import SeqSlice
from engine.config import (
    CacheConfig,
    CpuIsa,
    EngineConfig,
    KernelBackend,
    KVCacheDtype,
    LoRAConfig,
    SpeculativeConfig,
    WeightFormat,
)
from engine.evaluate import greedy_agreement
from engine.factory import fastest_weights, native_kernels
from engine.kernels.cpu import isa_build, load_cpu_kernels
from engine.kernels.cpu_quant import QuantPath
from engine.llm import LLM
from engine.model.quant_weights import QuantLinear
from engine.model_specs import PRESETS
from engine.protocol import LoRARequest, SamplingParams
from tests.lora_files import write_adapter

TINY_IDS = [(7 * i + 3) % 500 for i in range(40)]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def engine(cache_dir: Path, **kw: object) -> LLM:
    kw.setdefault("cache_dir", str(cache_dir))
    return LLM(EngineConfig(**kw))  # type: ignore[arg-type]


def all_position_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits [len(ids), vocab] from one prefill through the engine's model."""
    runner = llm.core.runner
    blocks = list(range(-(-len(ids) // llm.core.block_manager.block_size)))
    with torch.inference_mode():
        ctx = runner.attn.build_context([SeqSlice(len(ids), 0, blocks)])
        hidden = runner.model(torch.tensor(ids), torch.arange(len(ids)), runner.attn, ctx)
        return runner.model.compute_logits(hidden).float()


def quant_linears(llm: LLM) -> list[QuantLinear]:
    return [m for m in llm.core.runner.model.modules() if isinstance(m, QuantLinear)]


@pytest.mark.parametrize("fmt", [WeightFormat.Q8, WeightFormat.Q4])
def test_quantized_kernels_match_the_dequantized_weights_on_torch(strata_cache_dir, fmt):
    """Same quantized values, two ways: the native integer products (activations rounded to
    16 bits per block, or to two 8-bit levels for q4 on AVX2 builds) and torch's float
    products over the values dequantized at load."""
    common = {"model": "synthetic:tiny", "dtype": "float32", "weights": fmt}
    native = engine(strata_cache_dir, **common)
    plain = engine(strata_cache_dir, backend=KernelBackend.TORCH, **common)
    linears = quant_linears(native)
    assert len(linears) == 2 * 4 + 1  # every projection and the LM head
    assert not quant_linears(plain)
    assert native.core.runner.model.layer_stack is None  # quantized layers run one by one
    got, ref = all_position_logits(native, TINY_IDS), all_position_logits(plain, TINY_IDS)
    paths = {
        m.kernels.path(m.weight.format, len(TINY_IDS), m.out_features, torch.float32)
        for m in linears
    }
    if paths & {QuantPath.INT8, QuantPath.INT8_ROWS}:
        # 8-bit activations: each off by up to half a step of its block (1/254 of its max)
        assert (got - ref).abs().max() <= 1e-2 * ref.abs().max()
    else:
        # 16-bit activations (or none): a relative error near 1e-4 of each product
        assert (got - ref).abs().max() <= 1e-3 * ref.abs().max()
        assert [c.token_ids for c in native.generate([TINY_IDS], GREEDY)] == [
            c.token_ids for c in plain.generate([TINY_IDS], GREEDY)
        ]


@pytest.mark.parametrize("fmt", [WeightFormat.Q8, WeightFormat.Q4])
def test_quantized_logits_track_the_16bit_model(strata_cache_dir, fmt):
    common = {"model": "synthetic:tiny", "dtype": "float32"}
    quant = engine(strata_cache_dir, weights=fmt, **common)
    full = engine(strata_cache_dir, weights=WeightFormat.SIXTEEN_BIT, **common)
    assert not quant_linears(full)
    got, ref = all_position_logits(quant, TINY_IDS), all_position_logits(full, TINY_IDS)
    # blocks of 32 weights over 255 (q8) or 15 (q4) steps
    bound = {WeightFormat.Q8: 0.02, WeightFormat.Q4: 0.3}[fmt]
    assert (got - ref).abs().max() <= bound * ref.abs().max()


@pytest.fixture(scope="module")
def default_engines(strata_cache_dir) -> dict[str, LLM]:
    return {
        w: engine(strata_cache_dir, weights=WeightFormat(w), dtype="bfloat16")
        for w in ("auto", "16bit")
    }


def test_default_model_keeps_its_q4_1_blocks_and_follows_the_16bit_run(default_engines):
    auto, full = default_engines["auto"], default_engines["16bit"]
    formats = [m.weight.format.value for m in quant_linears(auto)]
    assert formats.count("q4") == 30 * 4 and formats.count("q8") == 1  # the Q8_0 LM head
    (answer,) = auto.generate(
        ["What is the capital of France?"],
        SamplingParams(max_tokens=24, temperature=0.0),
        chat=True,
    )
    assert "Paris" in answer.text
    ref = [c.token_ids for c in full.generate(PROMPTS, GREEDY)]
    got = [c.token_ids for c in auto.generate(PROMPTS, GREEDY)]
    # the same weight values; only the activations' 16-bit rounding differs
    assert greedy_agreement(ref, got).token_rate >= 0.75


def test_fastest_weights_keep_the_files_blocks_only_where_integer_products_win(
    strata_cache_dir,
):
    """`--weights fastest`, the default: the GGUF's own blocks on AVX2 (and on AVX-512
    without BF16), 16-bit weights with AVX512-BF16 dot products, on the portable build and
    on the torch backend. The engine's config reports what it runs."""
    avx2 = engine(strata_cache_dir, cpu_isa=CpuIsa.AVX2)
    assert avx2.core.config.weights is WeightFormat.AUTO
    assert len(quant_linears(avx2)) == 30 * 4 + 1
    on_torch = engine(strata_cache_dir, backend=KernelBackend.TORCH)
    assert on_torch.core.config.weights is WeightFormat.SIXTEEN_BIT
    assert not quant_linears(on_torch)
    native = engine(strata_cache_dir)
    kernels = native_kernels(native.core.config, torch.bfloat16)
    assert kernels is not None
    bf16 = kernels.isa == "avx512" and kernels.has_avx512_bf16
    assert native.core.config.weights is (WeightFormat.SIXTEEN_BIT if bf16 else WeightFormat.AUTO)
    assert bool(quant_linears(native)) is not bf16
    portable = load_cpu_kernels(str(strata_cache_dir), arch=isa_build("portable"))
    assert portable is not None and fastest_weights(portable) is WeightFormat.SIXTEEN_BIT
    assert fastest_weights(None) is WeightFormat.SIXTEEN_BIT


def test_speculative_decoding_on_quantized_weights_keeps_the_tokens(strata_cache_dir):
    spec = SpeculativeConfig(num_speculative_tokens=4, adaptive=False)
    drafted = engine(strata_cache_dir, weights=WeightFormat.AUTO, speculative=spec)
    plain = engine(strata_cache_dir, weights=WeightFormat.AUTO)
    assert quant_linears(drafted)
    prompts = ["1, 2, 3, 4, 5, 6, 7, 8,", "the cat sat on the mat. the cat sat on the"]
    assert [c.token_ids for c in drafted.generate(prompts, GREEDY)] == [
        c.token_ids for c in plain.generate(prompts, GREEDY)
    ]


def test_fp8_kv_pages_with_quantized_weights(strata_cache_dir, default_engines):
    cache = CacheConfig(kv_cache_dtype=KVCacheDtype.FP8_E4M3)
    fp8 = engine(strata_cache_dir, weights=WeightFormat.AUTO, cache=cache)
    assert quant_linears(fp8)
    (answer,) = fp8.generate(
        ["What is the capital of France?"],
        SamplingParams(max_tokens=24, temperature=0.0),
        chat=True,
    )
    assert "Paris" in answer.text
    # teacher-forced next-token distributions against 16-bit pages (measured: mean KL 0.007,
    # top-1 agreement 0.96 over this text)
    text = (
        "Once upon a time, in a small village by the sea, there lived an old fisherman who "
        "every morning went out before dawn to cast his nets, and every evening came back to "
        "tell his wife what the sea had given him."
    )
    ids = fp8.tokenizer.encode(text)
    ref, got = all_position_logits(default_engines["auto"], ids), all_position_logits(fp8, ids)
    kl = F.kl_div(F.log_softmax(got, -1), F.log_softmax(ref, -1), log_target=True, reduction="none")
    assert kl.sum(-1).mean() < 0.03
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean() >= 0.85


def test_lora_adds_its_update_on_top_of_quantized_products(strata_cache_dir, tmp_path):
    adapter = write_adapter(tmp_path / "a", PRESETS["tiny"], rank=8, scale=3.0)
    lora = LoRARequest(name="a", path=str(adapter))
    common = {
        "model": "synthetic:tiny",
        "dtype": "float32",
        "weights": WeightFormat.Q8,
        "lora": LoRAConfig(max_loras=2),
    }
    native = engine(strata_cache_dir, **common)
    plain = engine(strata_cache_dir, backend=KernelBackend.TORCH, **common)
    assert quant_linears(native)
    prompts = [TINY_IDS, TINY_IDS[:20]]
    with_adapter = [c.token_ids for c in native.generate(prompts, GREEDY, lora=[lora, None])]
    assert with_adapter == [c.token_ids for c in plain.generate(prompts, GREEDY, lora=[lora, None])]
    base = [c.token_ids for c in native.generate(prompts, GREEDY)]
    assert base[1] == with_adapter[1]  # the base row of the batch is untouched
    assert base[0] != with_adapter[0]  # and the adapter changes its own
