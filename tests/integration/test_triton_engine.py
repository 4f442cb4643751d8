"""The engine on the Triton backend (SmolLM2, fp32 compute; the kernels run under Triton's
interpreter on CPU, so the workload is small): the same greedy tokens as the torch backend
with 32-bit and FP8 pages, through chunked prefill, mixed steps, decode steps over the padded
graph buffers, and prefix-cache hits."""

from __future__ import annotations

import os

import pytest

from engine.attention.triton_backend import TritonPagedAttention
from engine.config import (
    CacheConfig,
    EngineConfig,
    KernelBackend,
    KVCacheDtype,
    LoRAConfig,
    SchedulerConfig,
)
from engine.llm import LLM
from engine.loader import PRESETS
from engine.lora.synthetic import write_random_adapter
from engine.protocol import LoRARequest, SamplingParams

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


def test_triton_backend_serves_adapters_like_the_torch_backend(tmp_path):
    """Base and adapter requests in one batch (synthetic:tiny, random rank-8 adapters on
    every target module): the Triton LoRA kernels give the torch path's tokens."""
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
        config = EngineConfig(
            model="synthetic:tiny", dtype="float32", seed=4, backend=backend,
            lora=LoRAConfig(max_loras=4, max_lora_rank=8),
        )  # fmt: skip
        llm = LLM(config)
        assert (llm.core.runner.lora.ops is not None) == (backend is KernelBackend.TRITON)
        runs[backend] = [c.token_ids for c in llm.generate(prompts, params, lora=loras)]
    assert runs[KernelBackend.TRITON] == runs[KernelBackend.TORCH]
    assert runs[KernelBackend.TORCH][4] != runs[KernelBackend.TORCH][0], "adapters matter"
