"""FP8 KV pages on the real SmolLM2 (fp32 compute): quality against full-precision pages,
both attention paths, prefix-cache reuse, and the size the engine reports."""

from __future__ import annotations

import pydoc_data.topics

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, KernelBackend, KVCacheDtype
from engine.evaluate import greedy_agreement, perplexity
from engine.llm import LLM
from engine.protocol import SamplingParams

FP8 = CacheConfig(kv_cache_dtype=KVCacheDtype.FP8_E4M3)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Photosynthesis is the process by which",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def text_ids(smollm2_fp32) -> list[int]:
    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[name] for name in sorted(topics))
    return smollm2_fp32[1].encode(text)[:2049]


def test_default_kv_dtype_is_fp8_on_cuda_and_the_compute_dtype_elsewhere():
    cache = CacheConfig()
    assert cache.storage_dtype(torch.bfloat16, torch.device("cuda")) == torch.float8_e4m3fn
    assert cache.storage_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    forced = CacheConfig(kv_cache_dtype=KVCacheDtype.AUTO)
    assert forced.storage_dtype(torch.float16, torch.device("cuda")) == torch.float16
    assert FP8.storage_dtype(torch.float32, torch.device("cpu")) == torch.float8_e4m3fn


def test_fp8_perplexity_is_within_one_percent_of_full_precision_pages(make_core, text_ids):
    full = perplexity(make_core(), text_ids, window=1024, chunk=256)
    fp8_native = perplexity(make_core(EngineConfig(cache=FP8)), text_ids, window=1024, chunk=256)
    torch_cfg = EngineConfig(cache=FP8, backend=KernelBackend.TORCH)
    fp8_torch = perplexity(make_core(torch_cfg), text_ids, window=1024, chunk=256)
    assert full.num_tokens == fp8_native.num_tokens == 2048
    assert 5 < full.perplexity < 30  # real text on a real model
    for fp8 in (fp8_native, fp8_torch):
        assert fp8.perplexity != full.perplexity  # the pages really are quantized
        assert abs(fp8.perplexity / full.perplexity - 1) < 0.01


def test_fp8_native_and_torch_paths_generate_the_same_tokens(make_core, smollm2_fp32):
    tokenizer = smollm2_fp32[1]
    native = LLM(core=make_core(EngineConfig(cache=FP8)), tokenizer=tokenizer)
    reference = LLM(
        core=make_core(EngineConfig(cache=FP8, backend=KernelBackend.TORCH)), tokenizer=tokenizer
    )
    assert native.core.runner.attn.kernels is not None
    assert reference.core.runner.attn.kernels is None
    got = [c.token_ids for c in native.generate(PROMPTS, GREEDY)]
    want = [c.token_ids for c in reference.generate(PROMPTS, GREEDY)]
    assert greedy_agreement(want, got).identical == len(PROMPTS)
    full = LLM(core=make_core(), tokenizer=tokenizer)
    agreement = greedy_agreement([c.token_ids for c in full.generate(PROMPTS, GREEDY)], got)
    assert agreement.prefix_rate > 0.25  # close to full precision, not identical to it


def test_fp8_chat_answer_names_paris(make_core, smollm2_fp32):
    llm = LLM(core=make_core(EngineConfig(cache=FP8)), tokenizer=smollm2_fp32[1])
    (result,) = llm.generate(
        ["What is the capital of France?"], SamplingParams(max_tokens=40), chat=True
    )
    assert "Paris" in result.text


def test_fp8_prefix_cache_hits_give_the_same_tokens_as_recompute(make_core, smollm2_fp32):
    document = " ".join(PROMPTS) * 4
    prompts = [f"{document}\nQuestion {i}: {q}" for i, q in enumerate(PROMPTS)]
    cold_cfg = EngineConfig(
        cache=CacheConfig(kv_cache_dtype=KVCacheDtype.FP8_E4M3, enable_prefix_caching=False)
    )
    cold = LLM(core=make_core(cold_cfg), tokenizer=smollm2_fp32[1])
    reference = [c.token_ids for c in cold.generate(prompts, GREEDY)]
    warm = LLM(core=make_core(EngineConfig(cache=FP8)), tokenizer=smollm2_fp32[1])
    first = warm.generate(prompts[:1], GREEDY)
    rest = warm.generate(prompts[1:], GREEDY)
    assert all(c.num_cached_tokens >= 64 for c in rest)
    assert [c.token_ids for c in first + rest] == reference
    warm.core.check_integrity()


def test_engine_reports_fp8_page_size(make_core):
    fp8 = make_core(EngineConfig(cache=FP8))
    full = make_core()
    stats, info = fp8.stats(), fp8.model_info()
    assert stats.kv_cache_dtype == info.kv_cache_dtype == "float8_e4m3fn"
    assert full.stats().kv_cache_dtype == "float32"
    # SmolLM2: 30 layers x 3 KV heads x (64 values + a 4-byte scale), K and V
    assert stats.kv_bytes_per_token == info.kv_bytes_per_token == 2 * 30 * 3 * 68
    assert full.stats().kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    # the same memory budget holds about 3.8x the fp32 blocks (1.9x what bf16 would hold)
    assert fp8.stats().num_kv_blocks_total > 3.7 * full.stats().num_kv_blocks_total
    # the prefix cache never mixes pages of different formats
    assert fp8.scheduler.cache_namespace != full.scheduler.cache_namespace
