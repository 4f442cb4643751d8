"""The engine on the Triton backend, whose kernels run under Triton's interpreter on CPU (so
workloads stay small): the same greedy tokens as the torch backend with 32-bit and FP8
pages, through chunked prefill, mixed steps, decode steps over the padded graph buffers,
prefix-cache hits and adapters (synthetic:tiny), and the real SmolLM2 answer; FP8 weights
give the tokens of their dequantized weights on the torch backend."""

from __future__ import annotations

import pytest
import torch

from engine.attention.triton_backend import TritonPagedAttention
from engine.config import (
    CacheConfig,
    EngineConfig,
    KernelBackend,
    KVCacheDtype,
    LoRAConfig,
    SchedulerConfig,
    SpeculativeConfig,
    WeightFormat,
)
from engine.llm import LLM
from engine.loader import PRESETS
from engine.lora.synthetic import write_random_adapter
from engine.model.fp8_weights import Fp8Linear
from engine.model.triton_layers import PROJECTIONS
from engine.protocol import LoRARequest, SamplingParams
from tests.triton_marks import INTERPRETED

pytestmark = INTERPRETED

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# 16-token chunks: prompts prefill over several steps, some beside other requests' decodes
SMALL_STEPS = SchedulerConfig(max_num_batched_tokens=16)


def tiny_engine(backend: KernelBackend, **options) -> LLM:
    return LLM(
        EngineConfig(
            model="synthetic:tiny",
            dtype="float32",
            seed=4,
            backend=backend,
            scheduler=SMALL_STEPS,
            **options,
        )
    )


@pytest.mark.parametrize("kv_dtype", [KVCacheDtype.AUTO, KVCacheDtype.FP8_E4M3])
def test_triton_backend_generates_the_torch_backends_tokens(kv_dtype):
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 44, 23))]
    cache = CacheConfig(kv_cache_dtype=kv_dtype)
    torch_llm = tiny_engine(KernelBackend.TORCH, cache=cache)
    triton_llm = tiny_engine(KernelBackend.TRITON, cache=cache)
    assert isinstance(triton_llm.core.runner.attn, TritonPagedAttention)
    assert triton_llm.core.runner.graphs is not None, "decode steps use the graph buffers"
    want = [c.token_ids for c in torch_llm.generate(prompts, GREEDY)]
    got = [c.token_ids for c in triton_llm.generate(prompts, GREEDY)]
    assert got == want
    assert len({tuple(t) for t in want}) == 3
    # the longest prompt again: its full blocks come from the prefix cache
    (again,) = triton_llm.generate(prompts[1:2], GREEDY)
    assert again.num_cached_tokens >= 32
    assert again.token_ids == want[1]


def test_real_model_on_triton_answers_like_the_torch_backend(make_core, smollm2_fp32):
    fp8 = CacheConfig(kv_cache_dtype=KVCacheDtype.FP8_E4M3)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    results = {}
    for backend in (KernelBackend.TORCH, KernelBackend.TRITON):
        config = EngineConfig(backend=backend, cache=fp8, enforce_eager=True)
        llm = LLM(core=make_core(config), tokenizer=smollm2_fp32[1])
        (results[backend],) = llm.generate(["The capital of France is"], params)
    assert llm.core.runner.graphs is None  # --enforce-eager
    assert results[KernelBackend.TRITON].token_ids == results[KernelBackend.TORCH].token_ids
    assert results[KernelBackend.TRITON].text.strip().startswith("Paris")


def test_triton_backend_serves_adapters_like_the_torch_backend(tmp_path):
    """Base and adapter requests in one batch (synthetic:tiny, random rank-8 adapters on
    every target module): the Triton LoRA kernels, decode steps over the graph buffers
    included, give the torch path's tokens."""
    tiny = PRESETS["tiny"]
    adapters = [
        LoRARequest(
            name=f"a{i}",
            path=str(write_random_adapter(tmp_path / f"a{i}", tiny, rank=8, scale=0.2, seed=i)),
        )
        for i in range(3)
    ]
    loras = [None, adapters[0], adapters[1], adapters[2], adapters[0]]
    prompts = [[5 + i, 17, 33 + 2 * i, 9, 101, 7 * i + 1] * (i + 1) for i in range(4)]
    prompts.append(prompts[0])  # the base request's prompt again, through an adapter
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = {}
    for backend in (KernelBackend.TORCH, KernelBackend.TRITON):
        llm = tiny_engine(backend, lora=LoRAConfig(max_loras=4, max_lora_rank=8))
        assert (llm.core.runner.lora.ops is not None) == (backend is KernelBackend.TRITON)
        assert (llm.core.runner.graphs is not None) == (backend is KernelBackend.TRITON)
        runs[backend] = [c.token_ids for c in llm.generate(prompts, params, lora=loras)]
    assert runs[KernelBackend.TRITON] == runs[KernelBackend.TORCH]
    assert runs[KernelBackend.TORCH][4] != runs[KernelBackend.TORCH][0], "adapters matter"


def test_triton_backend_checks_drafts_like_plain_decoding():
    """Speculative steps (a request's next token and its drafts in one chunk, over its
    cached pages) on the Triton kernels, FP8 pages: the tokens of plain torch decoding."""
    # this model repeats a prompt's last token: drafts stand, except those after "7 7",
    # which the prompt continues with 13 21 34
    prompts = [[3, 14, 15, 92, 65] * 5, [27, 18, 28] * 6 + [1, 2], [5, 7, 7, 13, 21, 34, 7]]
    cache = CacheConfig(kv_cache_dtype=KVCacheDtype.FP8_E4M3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [
        c.token_ids for c in tiny_engine(KernelBackend.TORCH, cache=cache).generate(prompts, params)
    ]
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False)
    triton_llm = tiny_engine(KernelBackend.TRITON, cache=cache, speculative=spec)
    assert [c.token_ids for c in triton_llm.generate(prompts, params)] == want
    stats = triton_llm.core.stats()
    assert stats.num_draft_tokens > stats.num_accepted_draft_tokens > 0


def _dequantized_twin(fp8_llm: LLM, **options) -> LLM:
    """A torch-backend engine of the same model whose projections hold the FP8 engine's
    weights dequantized (float32: exactly the values its kernels multiply by)."""
    twin = tiny_engine(KernelBackend.TORCH, **options)
    for fp8_layer, layer in zip(
        fp8_llm.core.runner.model.layers, twin.core.runner.model.layers, strict=True
    ):
        for name in PROJECTIONS:
            module = getattr(fp8_layer, name)
            module = getattr(module, "base", module)  # under an adapter's wrapper
            assert isinstance(module, Fp8Linear)
            target = getattr(layer, name)
            getattr(target, "base", target).weight.copy_(module.dequantized(torch.float32))
    return twin


def test_fp8_weights_generate_the_tokens_of_their_dequantized_weights():
    """Chunked prefill (the FP8 matmul), mixed steps and decode steps over the graph
    buffers (the FP8 GEMV): the greedy tokens of torch running the dequantized weights, and
    their logprobs to fp32 rounding, where the 32-bit weights' logprobs differ by more."""
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 44, 23))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    fp8 = tiny_engine(KernelBackend.TRITON, weights=WeightFormat.FP8)
    assert fp8.core.runner.graphs is not None
    for layer in fp8.core.runner.model.layers:  # gate_up applies the activation itself
        assert layer.gate_up_proj.silu_mul and isinstance(layer.act, torch.nn.Identity)
    runs = {
        "fp8": fp8.generate(prompts, params),
        "dequantized": _dequantized_twin(fp8).generate(prompts, params),
        "32-bit": tiny_engine(KernelBackend.TORCH).generate(prompts, params),
    }
    tokens = {name: [c.token_ids for c in run] for name, run in runs.items()}
    assert tokens["fp8"] == tokens["dequantized"]
    assert len({tuple(t) for t in tokens["fp8"]}) == 3
    logprobs = {
        name: torch.tensor([[lp.top_logprobs for lp in c.logprobs] for c in run])
        for name, run in runs.items()
    }
    torch.testing.assert_close(logprobs["fp8"], logprobs["dequantized"], atol=1e-4, rtol=0)
    assert (logprobs["fp8"] - logprobs["32-bit"]).abs().max() > 1e-3


def test_fp8_weights_serve_adapters_and_drafts_like_their_dequantized_weights(tmp_path):
    """Base and adapter requests in one batch, drafted steps among them: the adapters'
    updates add to the FP8 products as to 16-bit ones, and drafts change no token."""
    tiny = PRESETS["tiny"]
    adapters = [
        LoRARequest(
            name=f"a{i}",
            path=str(write_random_adapter(tmp_path / f"a{i}", tiny, rank=8, scale=0.2, seed=i)),
        )
        for i in range(2)
    ]
    prompts = [[3, 14, 15, 92, 65] * 5, [27, 18, 28] * 6 + [1, 2], [3, 14, 15, 92, 65] * 5]
    loras = [None, adapters[0], adapters[1]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    lora = LoRAConfig(max_loras=2, max_lora_rank=8)
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False)
    fp8 = tiny_engine(KernelBackend.TRITON, weights=WeightFormat.FP8, lora=lora, speculative=spec)
    gate_up = fp8.core.runner.model.layers[0].gate_up_proj
    assert not gate_up.base.silu_mul, "the adapters' gate_up updates precede the activation"
    got = [c.token_ids for c in fp8.generate(prompts, params, lora=loras)]
    want = [
        c.token_ids for c in _dequantized_twin(fp8, lora=lora).generate(prompts, params, lora=loras)
    ]
    assert got == want
    assert want[2] != want[0], "the adapter changes the tokens"
    assert fp8.core.stats().num_accepted_draft_tokens > 0
