"""Multi-LoRA decode throughput: 32 concurrent requests through 1, 8 or 32 distinct adapters
(rank 16, every target module) against the base model, in one run.

Each configuration runs the same seeded workload (32 requests of 64 prompt tokens and 64
greedy new tokens) on the default model in bf16. `base` is the engine without adapter slots
(its decoder layers run as whole native kernels); `base_lora_engine` is the engine with 32
slots serving the base model only (no adapter applied). Every adapter is resident before the
clock starts, as on a server that has served it (loading is covered by the registry tests),
and the prefix cache is off, so every run pays its prefill.

`tok_s` is decode throughput: the tokens after each request's first over the time they took,
that is, a run of N new tokens minus a run of one (prefill and first token). `e2e_tok_s`
counts every generated token over the whole run, prefill included. The configurations take
turns for --repeats rounds (every other round in reverse order) and each figure is the
median of its rounds, so that a drift of this shared machine's speed falls on all of them
alike.

    python bench/lora.py            # full run
    python bench/lora.py --quick    # 16 new tokens, one round

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_info, write_result
from engine.config import CacheConfig, EngineConfig, LoRAConfig
from engine.llm import LLM
from engine.lora.synthetic import write_random_adapter
from engine.protocol import LoRARequest, SamplingParams


def timed(llm: LLM, prompts: list[list[int]], loras: list, new_tokens: int) -> tuple[int, float]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora=loras)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - start


def measure(llm: LLM, prompts: list[list[int]], loras: list, new_tokens: int) -> dict[str, float]:
    """One round: decode and end-to-end tokens per second."""
    first_tokens, first_s = timed(llm, prompts, loras, 1)
    tokens, elapsed = timed(llm, prompts, loras, new_tokens)
    return {"decode": (tokens - first_tokens) / (elapsed - first_s), "e2e": tokens / elapsed}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.new_tokens, args.repeats = 16, 1
    counts = [1, 8, 32]
    rng = random.Random(args.seed)
    cache = CacheConfig(kv_cache_memory_bytes=1 << 29, enable_prefix_caching=False)
    base = LLM(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, cache=cache))
    vocab = base.core.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)]
               for _ in range(args.requests)]  # fmt: skip
    slots = LoRAConfig(max_loras=max(counts), max_lora_rank=args.rank)
    llm = LLM(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, cache=cache,
                           lora=slots))  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="strata-lora-bench-"))
    adapters = [
        LoRARequest(name=f"a{i}", path=str(write_random_adapter(
            root / f"a{i}", base.core.model_config, rank=args.rank, seed=i)))
        for i in range(max(counts))
    ]  # fmt: skip
    runs: dict[str, tuple[LLM, list]] = {
        "base": (base, [None] * len(prompts)),
        "base_lora_engine": (llm, [None] * len(prompts)),
    }
    for n in counts:
        runs[str(n)] = (llm, [adapters[i % n] for i in range(len(prompts))])
    for engine, loras in runs.values():  # warm up: kernels built, every adapter loaded
        engine.generate(prompts, SamplingParams(max_tokens=2), lora=loras)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for i in range(args.repeats):
        # every other round in reverse order, so that a drift within a round does not always
        # favour the configurations measured first
        order = list(runs.items())
        for name, (engine, loras) in order[::-1] if i % 2 else order:
            rounds[name].append(measure(engine, prompts, loras, args.new_tokens))

    def median(name: str, key: str) -> float:
        return round(statistics.median(r[key] for r in rounds[name]), 1)

    tok_s = {name: median(name, "decode") for name in runs}
    e2e = {name: median(name, "e2e") for name in runs}
    ratio = {k: round(v / tok_s["base"], 3) for k, v in tok_s.items() if k != "base"}
    e2e_ratio = {k: round(v / e2e["base"], 3) for k, v in e2e.items() if k != "base"}
    for k in runs:
        extra = f"  ({ratio[k]:.2f}x base; end to end {e2e_ratio[k]:.2f}x)" if k in ratio else ""
        print(f"{k:>16}: {tok_s[k]:8.1f} decode tok/s, {e2e[k]:8.1f} end to end" + extra)
    summary = {"tok_s": tok_s, "ratio_vs_base": ratio}
    record = {
        "benchmark": "lora",
        **machine_info(torch.device(args.device)),
        "model": args.model,
        "dtype": args.dtype,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "rank": args.rank,
        "repeats": args.repeats,
        "seed": args.seed,
        "quick": args.quick,
        **summary,
        "e2e_tok_s": e2e,
        "e2e_ratio_vs_base": e2e_ratio,
        "rounds": rounds,
    }
    print(f"wrote {write_result(args.out_dir, 'lora', record)}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
