"""Multi-LoRA on the real SmolLM2 in fp32: the same greedy tokens as the PEFT-merged
transformers model, batch invariance across adapters, adapter-keyed prefix caching, slot
eviction and clear errors."""

from __future__ import annotations

import copy
import shutil
import threading
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, LoRAConfig
from engine.core import EngineCore
from engine.evaluate import greedy_agreement
from engine.factory import native_kernels
from engine.llm import LLM
from engine.loader import build_model
from engine.model.native_cpu import apply_native_cpu
from engine.protocol import FinishReason, InvalidRequestError, LoRARequest, SamplingParams
from tests.lora_files import SMOLLM2, write_adapter

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4, 5,"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
LOGPROBS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, rsLoRA, target modules)
ADAPTERS = {
    "r8": (8, False, ALL_MODULES),
    "r16": (16, False, ALL_MODULES),
    "r8-rs": (8, True, ALL_MODULES),
    "r16-qv": (16, False, ["q_proj", "v_proj"]),
}


@pytest.fixture(scope="module")
def peft_adapters(hf_smollm2, tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Random PEFT adapters (non-zero B) saved to disk, each with its merged HF model."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, (rank, rslora, modules)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        config = LoraConfig(
            r=rank,
            lora_alpha=rank * 2,
            target_modules=modules,
            use_rslora=rslora,
            init_lora_weights=False,
            lora_dropout=0.0,
        )
        peft_model = get_peft_model(copy.deepcopy(hf_smollm2), config)
        for module in peft_model.modules():  # PEFT's random init is large; keep it gentle
            for attr in ("lora_A", "lora_B"):
                if hasattr(module, attr):
                    for layer in getattr(module, attr).values():
                        layer.weight.data.mul_(0.3)
        peft_model.save_pretrained(str(root / name))
        out[name] = (root / name / "", peft_model.merge_and_unload().eval())
    return out


def hf_greedy(model: torch.nn.Module, tokenizer, prompt: str) -> list[int]:
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.inference_mode():
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
        )
    return gen[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def lora_llm(smollm2_checkpoint, smollm2_tokenizer, strata_cache_dir) -> LLM:
    """An engine of its own (adapters wrap the model's projections in place)."""
    model = build_model(smollm2_checkpoint, torch.float32, torch.device("cpu"))
    cfg = EngineConfig(
        cache_dir=str(strata_cache_dir),
        cache=CacheConfig(kv_cache_memory_bytes=1 << 28),
        lora=LoRAConfig(max_loras=4, max_lora_rank=16),
    )
    kernels = native_kernels(cfg, torch.float32)
    assert kernels is not None
    apply_native_cpu(model, kernels, fuse_layers=False)
    core = EngineCore(
        model,
        cfg,
        model_id=smollm2_checkpoint.model_id,
        eos_token_ids=smollm2_tokenizer.eos_token_ids,
        kernels=kernels,
    )
    return LLM(core=core, tokenizer=smollm2_tokenizer)


def request(name: str, adapters, version: int = 1) -> LoRARequest:
    return LoRARequest(name=name, version=version, path=str(adapters[name][0]))


@pytest.mark.parametrize("name", ["r8", "r16", "r8-rs"])
def test_greedy_tokens_match_the_peft_merged_model(lora_llm, peft_adapters, name):
    merged = peft_adapters[name][1]
    want = [hf_greedy(merged, lora_llm.tokenizer, p) for p in PROMPTS]
    got = lora_llm.generate(PROMPTS, GREEDY, lora=request(name, peft_adapters))
    assert [c.token_ids for c in got] == want
    base = lora_llm.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in base] != want  # the adapter really changes the output


def test_a_batch_mixing_adapters_gives_each_request_its_tokens_alone(lora_llm, peft_adapters):
    names = [*ADAPTERS, None]  # four adapters and the base model
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    loras = [None if n is None else request(n, peft_adapters) for n in names]
    alone = [
        lora_llm.generate([p], GREEDY, lora=[lo])[0].token_ids
        for p, lo in zip(prompts, loras, strict=True)
    ]
    together = lora_llm.generate(prompts, GREEDY, lora=loras)
    assert [c.token_ids for c in together] == alone
    long_prompt = " ".join(PROMPTS) * 8  # a prefill long enough for the per-adapter path
    mixed = [long_prompt, *prompts]
    both = lora_llm.generate(mixed, GREEDY, lora=[loras[0], *loras])
    assert [c.token_ids for c in both[1:]] == alone
    assert (
        both[0].token_ids == lora_llm.generate([long_prompt], GREEDY, lora=[loras[0]])[0].token_ids
    )


def test_adapters_never_share_prefix_cache_blocks(lora_llm, peft_adapters):
    prompt = "A long shared system prompt about the weather. " * 6
    first = lora_llm.generate([prompt], GREEDY, lora=request("r8", peft_adapters))[0]
    again = lora_llm.generate([prompt], GREEDY, lora=request("r8", peft_adapters))[0]
    other = lora_llm.generate([prompt], GREEDY, lora=request("r16", peft_adapters))[0]
    newer = lora_llm.generate([prompt], GREEDY, lora=request("r8", peft_adapters, version=2))[0]
    base = lora_llm.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 48
    assert other.num_cached_tokens == 0 and newer.num_cached_tokens == 0
    assert base.num_cached_tokens == 0


def test_slots_are_reused_least_recently_used_first(lora_llm, peft_adapters):
    manager = lora_llm.core.lora
    assert manager is not None
    for name in ADAPTERS:
        lora_llm.generate([PROMPTS[0]], GREEDY, lora=request(name, peft_adapters, version=7))
    loads = manager.num_loads
    # a fifth adapter (a new version) takes the least recently used slot
    lora_llm.generate([PROMPTS[0]], GREEDY, lora=request("r8", peft_adapters, version=8))
    assert manager.num_loads == loads + 1
    assert "r8@7" not in manager.loaded and "r8@8" in manager.loaded
    want = hf_greedy(peft_adapters["r16"][1], lora_llm.tokenizer, PROMPTS[0])
    got = lora_llm.generate([PROMPTS[0]], GREEDY, lora=request("r16", peft_adapters, version=7))
    assert got[0].token_ids == want  # still served from its slot


def test_bad_adapters_are_rejected_and_the_engine_goes_on(lora_llm, peft_adapters, tmp_path):
    with pytest.raises(InvalidRequestError, match=r"no adapter_config\.json"):
        lora_llm.generate([PROMPTS[0]], GREEDY, lora=LoRARequest(name="x", path=str(tmp_path)))
    assert lora_llm.generate([PROMPTS[0]], GREEDY)[0].token_ids  # still serving
    lora_llm.core.check_integrity()


def test_an_engine_without_slots_refuses_adapters(make_core, smollm2_fp32, peft_adapters):
    llm = LLM(core=make_core(), tokenizer=smollm2_fp32[1])
    with pytest.raises(InvalidRequestError, match="max_loras"):
        llm.generate([PROMPTS[0]], GREEDY, lora=request("r8", peft_adapters))


def _run(core, outputs: dict[str, list]) -> None:
    for out in core.step():
        outputs.setdefault(out.request_id, []).append(out)


def test_loading_an_adapter_never_stalls_the_running_batch(lora_llm, peft_adapters):
    core = lora_llm.core
    manager = core.lora
    assert manager is not None
    gate = threading.Event()
    manager.loader.submit(gate.wait)  # the loader thread is busy until the gate opens
    ids = lora_llm.encode(PROMPTS[0])
    base_params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    core.add_request("base", ids, base_params)
    core.add_request("tuned", ids, GREEDY, lora=request("r16", peft_adapters, version=41))
    outputs: dict[str, list] = {}
    try:
        for _ in range(10):
            _run(core, outputs)
        assert outputs["base"][-1].finished, "the base request ran while the adapter loads"
        assert "tuned" not in outputs
        assert core.has_unfinished() and core.stats().num_waiting == 1
    finally:
        gate.set()
    while core.has_unfinished():
        _run(core, outputs)
    tuned = [t for out in outputs["tuned"] for t in out.new_token_ids]
    assert tuned == hf_greedy(peft_adapters["r16"][1], lora_llm.tokenizer, PROMPTS[0])
    core.check_integrity()


def test_an_adapter_that_fails_to_load_fails_its_requests_only(lora_llm, peft_adapters, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(peft_adapters["r8"][0], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    core = lora_llm.core
    ids = lora_llm.encode(PROMPTS[1])
    core.add_request("doomed", ids, GREEDY, lora=LoRARequest(name="broken", path=str(broken)))
    core.add_request("fine", ids, SamplingParams(max_tokens=4, temperature=0.0))
    outputs: dict[str, list] = {}
    while core.has_unfinished():
        _run(core, outputs)
    (failed,) = outputs["doomed"]
    assert failed.finished and "corrupt" in (failed.error or "")
    assert outputs["fine"][-1].finished and not outputs["fine"][-1].error
    core.check_integrity()


def test_a_request_waiting_for_its_adapter_can_be_aborted(lora_llm, peft_adapters):
    core = lora_llm.core
    gate = threading.Event()
    assert core.lora is not None
    core.lora.loader.submit(gate.wait)
    try:
        ids = lora_llm.encode(PROMPTS[2])
        core.add_request("gone", ids, GREEDY, lora=request("r8", peft_adapters, version=51))
        out = core.abort_request("gone")
        assert out is not None and out.finished and out.finish_reason is FinishReason.ABORT
        assert not core.has_unfinished()
    finally:
        gate.set()
    core.check_integrity()


def test_whole_layer_kernels_apply_adapters_like_the_per_module_path(
    smollm2_checkpoint, smollm2_tokenizer, strata_cache_dir, tmp_path
):
    """bf16: the native decoder layer adds each token's adapter update inside its kernel
    (csrc/lora.h); the per-module path adds it around each native linear with torch ops.
    Same base arithmetic and rounding points, sums in another order. Strong random adapters
    make near-ties common, so free-running greedy paths part early; the comparison is made on
    the same tokens instead: the per-module path scores the fused path's continuations."""
    cfg = EngineConfig(
        dtype="bfloat16",
        cache_dir=str(strata_cache_dir),
        cache=CacheConfig(kv_cache_memory_bytes=1 << 27),
        lora=LoRAConfig(max_loras=3, max_lora_rank=16),
    )
    kernels = native_kernels(cfg, torch.bfloat16)
    assert kernels is not None
    adapters = [
        LoRARequest(
            name=f"w{i}",
            path=str(write_adapter(tmp_path / f"w{i}", SMOLLM2, rank=rank, scale=0.15, seed=i)),
        )
        for i, rank in enumerate((8, 16, 4))
    ]
    loras = [adapters[0], None, adapters[1], adapters[2]]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], " ".join(PROMPTS) * 6]  # and a long prefill
    runs: dict[str, list[list[int]]] = {}
    for mode in ("stack", "layers", "modules"):
        fuse = mode != "modules"
        model = build_model(smollm2_checkpoint, torch.bfloat16, torch.device("cpu"))
        apply_native_cpu(model, kernels, fuse_layers=fuse)
        if mode == "layers":
            model.layer_stack = None  # one kernel call per layer instead of one for all
        core = EngineCore(
            model,
            cfg,
            model_id=smollm2_checkpoint.model_id,
            eos_token_ids=smollm2_tokenizer.eos_token_ids,
            kernels=kernels,
        )
        # without AVX512-BF16 nothing is packed and no layer fuses: every mode is per module
        fused_layers = fuse and kernels.has_bf16_linear
        assert core.lora is not None and core.lora.b_transposed is fused_layers
        llm = LLM(core=core, tokenizer=smollm2_tokenizer)
        done = llm.generate(prompts, LOGPROBS, lora=loras)
        runs[mode] = [c.token_ids for c in done]
        if mode == "stack":
            fused = done
            base = [c.token_ids for c in llm.generate(prompts, GREEDY)]
    # the whole stack in one call runs the same kernels in the same order as layer by layer
    assert runs["stack"] == runs["layers"]
    assert greedy_agreement(base, runs["stack"]).token_rate < 0.7, "the adapters change the tokens"
    # llm is the per-module path's: it scores every prefix of the fused path's continuations
    prefixes = [(i, j) for i, c in enumerate(fused) for j in range(len(c.token_ids))]
    scored = llm.generate(
        [fused[i].prompt_token_ids + fused[i].token_ids[:j] for i, j in prefixes],
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=LOGPROBS.logprobs),
        lora=[loras[i] for i, _ in prefixes],
    )
    gaps = []
    for (i, j), c in zip(prefixes, scored, strict=True):
        want, got = fused[i].logprobs[j], c.logprobs[0]
        assert want.token_id in got.top_ids, f"prompt {i}, token {j}: not in the top 5"
        gaps.append(abs(want.logprob - got.top_logprobs[got.top_ids.index(want.token_id)]))
        margin = want.top_logprobs[0] - want.top_logprobs[1]
        if margin > 0.5:  # no near-tie: both paths pick the same token
            assert got.top_ids[0] == want.token_id, f"prompt {i}, token {j}"
    assert sum(gaps) / len(gaps) < 0.15 and max(gaps) < 1.0, gaps
