"""The engine on a CUDA device: same tokens as on CPU, and the real chat answer."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.protocol import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4, 5,"]


def test_fp32_greedy_tokens_match_the_cpu_engine(strata_cache_dir):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(EngineConfig(dtype="float32", device=device, cache_dir=str(strata_cache_dir)))
        runs[device] = [c.token_ids for c in llm.generate(PROMPTS, params)]
    assert runs["cuda"] == runs["cpu"]


def test_bf16_chat_on_cuda_answers_paris(strata_cache_dir):
    llm = LLM(EngineConfig(dtype="bfloat16", device="cuda", cache_dir=str(strata_cache_dir)))
    assert llm.core.runner.attn.use_sdpa
    (out,) = llm.generate(
        ["What is the capital of France?"],
        SamplingParams(max_tokens=40, temperature=0.0),
        chat=True,
    )
    assert "Paris" in out.text
    stats = llm.core.stats()
    assert stats.num_kv_blocks_used == 0
    assert llm.core.pool.kv.device.type == "cuda"


def test_seeded_sampling_on_cuda_is_reproducible(strata_cache_dir):
    llm = LLM(EngineConfig(dtype="bfloat16", device="cuda", cache_dir=str(strata_cache_dir)))
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=3)
    first = llm.generate([PROMPTS[0]], params)[0].token_ids
    crowd = llm.generate([PROMPTS[1], PROMPTS[0]], [SamplingParams(max_tokens=8), params])
    assert crowd[1].token_ids == first
