"""The engine on the Triton backend (SmolLM2, fp32 compute; the kernels run under Triton's
interpreter on CPU, so the workload is small): the same greedy tokens as the torch backend
with 32-bit and FP8 pages, through chunked prefill, mixed steps, decode steps over the padded
graph buffers, and prefix-cache hits."""

from __future__ import annotations

import os

import pytest

from engine.attention.triton_backend import TritonPagedAttention
from engine.config import CacheConfig, EngineConfig, KernelBackend, KVCacheDtype, SchedulerConfig
from engine.llm import LLM
from engine.protocol import SamplingParams

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton compiles for the GPU here; tests/gpu runs the engine there",
)

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number, where fibonacci(0) is 0 '
    'and fibonacci(1) is 1, computed iteratively."""\n    if n <',
]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
# 16-token chunks: prompts prefill over several steps, some beside the other's decodes
SMALL_STEPS = SchedulerConfig(max_num_batched_tokens=16)


@pytest.mark.parametrize("kv_dtype", [KVCacheDtype.AUTO, KVCacheDtype.FP8_E4M3])
def test_triton_backend_generates_the_torch_backends_tokens(make_core, smollm2_fp32, kv_dtype):
    tokenizer = smollm2_fp32[1]
    cache = CacheConfig(kv_cache_dtype=kv_dtype)
    engines = {
        backend: LLM(
            core=make_core(EngineConfig(backend=backend, cache=cache, scheduler=SMALL_STEPS)),
            tokenizer=tokenizer,
        )
        for backend in (KernelBackend.TORCH, KernelBackend.TRITON)
    }
    triton = engines[KernelBackend.TRITON]
    assert isinstance(triton.core.runner.attn, TritonPagedAttention)
    assert triton.core.runner.graphs is not None, "decode steps use the padded graph buffers"
    want = [c.token_ids for c in engines[KernelBackend.TORCH].generate(PROMPTS, GREEDY)]
    got = [c.token_ids for c in triton.generate(PROMPTS, GREEDY)]
    assert got == want
    # the second prompt again: its full blocks come from the prefix cache
    (again,) = triton.generate(PROMPTS[1:], GREEDY)
    assert again.num_cached_tokens >= 32
    assert again.token_ids == want[1]


def test_enforce_eager_runs_decode_without_graph_buffers(make_core, smollm2_fp32):
    config = EngineConfig(backend=KernelBackend.TRITON, enforce_eager=True)
    llm = LLM(core=make_core(config), tokenizer=smollm2_fp32[1])
    assert llm.core.runner.graphs is None
    (result,) = llm.generate(["The capital of France is"], SamplingParams(max_tokens=3))
    assert result.text.strip().startswith("Paris")
