"""The engine on a CUDA device: same tokens as on CPU, and the real chat answer."""

from __future__ import annotations

import pytest

from engine.attention.triton_backend import TritonPagedAttention
from engine.config import (
    CacheConfig,
    EngineConfig,
    GemvKernel,
    KernelBackend,
    KVCacheDtype,
    SpeculativeConfig,
)
from engine.evaluate import greedy_agreement
from engine.llm import LLM
from engine.protocol import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4, 5,"]


def test_fp32_greedy_tokens_match_the_cpu_engine(strata_cache_dir):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = {}
    full = CacheConfig(kv_cache_dtype=KVCacheDtype.AUTO)  # CUDA would default to FP8 pages
    for device in ("cpu", "cuda"):
        cfg = EngineConfig(
            dtype="float32", device=device, cache_dir=str(strata_cache_dir), cache=full
        )
        runs[device] = [c.token_ids for c in LLM(cfg).generate(PROMPTS, params)]
    assert runs["cuda"] == runs["cpu"]


def test_speculative_decoding_on_cuda_keeps_the_plain_tokens(strata_cache_dir):
    """Drafted steps run eagerly beside graph-replayed decode steps (bf16, FP8 pages): the
    tokens of plain decoding on the same device."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    runs = {}
    for k in (0, 4):
        spec = SpeculativeConfig(num_speculative_tokens=k, adaptive=False)  # always drafted
        cfg = EngineConfig(device="cuda", cache_dir=str(strata_cache_dir), speculative=spec)
        llm = LLM(cfg)
        runs[k] = [c.token_ids for c in llm.generate(PROMPTS, params)]
    assert llm.core.stats().num_accepted_draft_tokens > 0
    assert greedy_agreement(runs[0], runs[4]).token_rate > 0.95  # bf16 rows may round apart


def test_fp8_pages_on_cuda_follow_the_cpu_torch_path(strata_cache_dir):
    """Same quantization on both devices. fp32 rounding in K/V may move a value across an
    FP8 step, which shifts logits by a few thousandths: the two greedy runs agree until a
    near tie (top two within 0.05 nats on the CPU), and there CUDA takes the other one."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    fp8 = CacheConfig(kv_cache_dtype=KVCacheDtype.FP8_E4M3)
    runs = {}
    for device in ("cpu", "cuda"):
        cfg = EngineConfig(
            dtype="float32",
            device=device,
            cache_dir=str(strata_cache_dir),
            cache=fp8,
            backend=KernelBackend.TORCH,
        )
        llm = LLM(cfg)
        assert llm.core.pool.kv.dtype.is_floating_point and llm.core.pool.scales is not None
        runs[device] = llm.generate(PROMPTS, params)
    for cpu, cuda in zip(runs["cpu"], runs["cuda"], strict=True):
        split = _first_difference(cpu.token_ids, cuda.token_ids)
        if split is None:
            continue
        there = cpu.logprobs[split]
        assert there.top_ids[:2] == [cpu.token_ids[split], cuda.token_ids[split]]
        assert there.top_logprobs[0] - there.top_logprobs[1] < 0.05
    same = greedy_agreement([c.token_ids for c in runs["cpu"]], [c.token_ids for c in runs["cuda"]])
    assert same.identical >= 1


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def test_bf16_chat_on_cuda_answers_paris(strata_cache_dir):
    llm = LLM(EngineConfig(dtype="bfloat16", device="cuda", cache_dir=str(strata_cache_dir)))
    assert isinstance(llm.core.runner.attn, TritonPagedAttention)  # the CUDA default
    assert llm.core.runner.graphs is not None and llm.core.runner.graphs.graphs
    (out,) = llm.generate(
        ["What is the capital of France?"],
        SamplingParams(max_tokens=40, temperature=0.0),
        chat=True,
    )
    assert "Paris" in out.text
    stats = llm.core.stats()
    assert stats.num_kv_blocks_used == 0
    assert stats.kv_cache_dtype == "float8_e4m3fn"  # the CUDA default
    assert llm.core.pool.kv.device.type == "cuda"


@pytest.mark.parametrize("gemv", [GemvKernel.AUTO, GemvKernel.CUBLAS])
def test_seeded_sampling_on_cuda_is_reproducible(strata_cache_dir, gemv):
    """A seeded request repeats, alone or in the same crowd. With cuBLAS for every product
    it also repeats whatever it is batched with; with Triton's GEMV for batch 1 (auto, where
    it is faster) a step of one sequence rounds its sums apart from a step of two, which
    may change a sampled token."""
    llm = LLM(
        EngineConfig(dtype="bfloat16", device="cuda", cache_dir=str(strata_cache_dir), gemv=gemv)
    )
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=3)
    first = llm.generate([PROMPTS[0]], params)[0].token_ids
    assert llm.generate([PROMPTS[0]], params)[0].token_ids == first
    batch = [PROMPTS[1], PROMPTS[0]], [SamplingParams(max_tokens=8), params]
    crowd = llm.generate(*batch)
    assert llm.generate(*batch)[1].token_ids == crowd[1].token_ids
    if gemv is GemvKernel.CUBLAS:
        assert crowd[1].token_ids == first


def test_structured_and_seeded_sampling_on_cuda(strata_cache_dir):
    """A response format and seeded sampling on the device: the same greedy JSON as on the
    CPU, and seeded draws that repeat and stay valid."""
    import json

    schema = json.dumps(
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "population": {"type": "integer", "minimum": 0, "maximum": 10**8},
            },
            "required": ["city", "population"],
        }
    )
    ask = ["Describe Paris as JSON."]
    greedy = SamplingParams(max_tokens=60, temperature=0.0, json_schema=schema)
    texts = {}
    for device in ("cpu", "cuda"):
        cfg = EngineConfig(
            dtype="float32",
            device=device,
            cache_dir=str(strata_cache_dir),
            cache=CacheConfig(kv_cache_dtype=KVCacheDtype.AUTO),
        )
        llm = LLM(cfg)
        texts[device] = llm.generate(ask, greedy, chat=True)[0].text
    # greedily, SmolLM2 writes 1s up to the maximum's 9 digits: a bounded, finished answer
    assert texts["cuda"] == texts["cpu"] and json.loads(texts["cuda"])["city"] == "Paris"
    sampled = SamplingParams(max_tokens=60, temperature=1.0, seed=7, json_schema=schema)
    first, again = (llm.generate(ask, sampled, chat=True)[0] for _ in range(2))
    assert first.token_ids == again.token_ids
    if first.finish_reason.value == "stop":
        assert isinstance(json.loads(first.text)["population"], int)
