"""The engine on the Triton backend, whose kernels run under Triton's interpreter on CPU (so
workloads stay small): the same greedy tokens as the torch backend with 32-bit and FP8
pages, through chunked prefill, mixed steps, decode steps over the padded graph buffers,
prefix-cache hits and adapters (synthetic:tiny), and the real SmolLM2 answer."""

from __future__ import annotations

import pytest

from engine.attention.triton_backend import TritonPagedAttention
from engine.config import (
    CacheConfig,
    EngineConfig,
    KernelBackend,
    KVCacheDtype,
    LoRAConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine.llm import LLM
from engine.loader import PRESETS
from engine.lora.synthetic import write_random_adapter
from engine.protocol import LoRARequest, SamplingParams
from tests.triton_marks import INTERPRETED

pytestmark = INTERPRETED

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# 16-token chunks: prompts prefill over several steps, some beside other requests' decodes
SMALL_STEPS = SchedulerConfig(max_num_batched_tokens=16)


def tiny_engine(backend: KernelBackend, **options) -> LLM:
    return LLM(EngineConfig(model="synthetic:tiny", dtype="float32", seed=4, backend=backend,
                            scheduler=SMALL_STEPS, **options))  # fmt: skip


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
        LoRARequest(name=f"a{i}", path=str(write_random_adapter(
            tmp_path / f"a{i}", tiny, rank=8, scale=0.2, seed=i)))
        for i in range(3)
    ]  # fmt: skip
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
    want = [c.token_ids for c in tiny_engine(KernelBackend.TORCH, cache=cache).generate(
        prompts, params)]  # fmt: skip
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False)
    triton_llm = tiny_engine(KernelBackend.TRITON, cache=cache, speculative=spec)
    assert [c.token_ids for c in triton_llm.generate(prompts, params)] == want
    stats = triton_llm.core.stats()
    assert stats.num_draft_tokens > stats.num_accepted_draft_tokens > 0
