"""Multi-LoRA decode throughput: 32 concurrent requests through 1, 8 or 32 distinct adapters
against the base model, the engines taking turns step by step. Method and figures:
docs/benchmarks.md.

    python bench/lora.py            # full run
    python bench/lora.py --quick    # 16 new tokens, one round
    python bench/lora.py --quick --cpu-isa avx2   # as an AVX2-only CPU runs (4-bit weights)

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    add_cache_dir_argument,
    add_cpu_engine_arguments,
    machine_info,
    parse_args,
    publish,
    scratch_dir,
)
from engine.config import CacheConfig, CpuIsa, EngineConfig, LoRAConfig, WeightFormat
from engine.core import EngineCore
from engine.factory import create_engine, native_kernels
from engine.lora.synthetic import write_random_adapter
from engine.protocol import LoRARequest, SamplingParams


def one_round(
    runs: dict[str, tuple[EngineCore, list[LoRARequest | None]]],
    prompts: list[list[int]],
    new_tokens: int,
    tag: str,
    first: int,
) -> dict[str, tuple[int, float]]:
    """Every configuration's (decode tokens, decode seconds) for one pass of the workload."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for name, (core, loras) in runs.items():  # prefill: until every request has a token
        for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
            core.add_request(f"{tag}-{name}-{i}", prompt, params, lora=lora)
        started: set[str] = set()
        while len(started) < len(prompts):
            started.update(o.request_id for o in core.step() if o.new_token_ids)
    names = list(runs)
    names = names[first % len(names) :] + names[: first % len(names)]
    done = dict.fromkeys(names, (0, 0.0))
    while any(runs[name][0].has_unfinished() for name in names):
        for name in names:  # one decode step of each engine in turn
            core = runs[name][0]
            if not core.has_unfinished():
                continue
            start = time.perf_counter()
            outs = core.step()
            seconds = time.perf_counter() - start
            tokens, total = done[name]
            done[name] = (tokens + sum(len(o.new_token_ids) for o in outs), total + seconds)
    return done


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="default")
    add_cpu_engine_arguments(ap)
    ap.add_argument("--seed", type=int, default=0)
    add_cache_dir_argument(ap)
    ap.add_argument("--quick", action="store_true", help="16 new tokens, 1 round")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parse_args(ap, argv, new_tokens=16, repeats=1)
    counts = [1, 8, 32]
    rng = random.Random(args.seed)
    cache = CacheConfig(kv_cache_memory_bytes=1 << 28, enable_prefix_caching=False)

    def config(lora: LoRAConfig) -> EngineConfig:
        return EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            cpu_isa=CpuIsa(args.cpu_isa),
            weights=WeightFormat(args.weights),
            cache=cache,
            lora=lora,
            cache_dir=args.cache_dir,
        )

    def engine(lora: LoRAConfig) -> EngineCore:
        return create_engine(config(lora), progress=False)[0]

    base = engine(LoRAConfig())
    vocab = base.vocab_size
    prompts = [
        [rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)
    ]
    slots = LoRAConfig(max_loras=max(counts), max_lora_rank=args.rank)
    with scratch_dir("strata-lora-bench-") as root:  # the adapters' files
        adapters = [
            LoRARequest(
                name=f"a{i}",
                path=str(
                    write_random_adapter(root / f"a{i}", base.model_config, rank=args.rank, seed=i)
                ),
            )
            for i in range(max(counts))
        ]
        runs: dict[str, tuple[EngineCore, list[LoRARequest | None]]] = {
            "base": (base, [None] * len(prompts)),
            "base_lora_engine": (engine(slots), [None] * len(prompts)),
        }
        for n in counts:
            runs[str(n)] = (engine(slots), [adapters[i % n] for i in range(len(prompts))])
        one_round(runs, prompts, 2, "warm", 0)  # kernels built, every adapter loaded
        rounds: dict[str, list[tuple[int, float]]] = {name: [] for name in runs}
        for r in range(args.repeats):
            for name, got in one_round(runs, prompts, args.new_tokens, f"r{r}", r).items():
                rounds[name].append(got)
    tok_s = {
        name: round(sum(t for t, _ in got) / sum(s for _, s in got), 1)
        for name, got in rounds.items()
    }
    per_round = {
        name: [
            round((t / s) / (bt / bs), 3)
            for (t, s), (bt, bs) in zip(got, rounds["base"], strict=True)
        ]
        for name, got in rounds.items()
        if name != "base"
    }
    ratio = {name: round(statistics.median(r), 3) for name, r in per_round.items()}
    for name in runs:
        extra = f"  ({ratio[name]:.2f}x base, rounds {per_round[name]})" if name in ratio else ""
        print(f"{name:>16}: {tok_s[name]:8.1f} decode tok/s" + extra)
    summary = {"tok_s": tok_s, "ratio_vs_base": ratio}
    rounds_out = {
        name: [{"tokens": t, "seconds": round(s, 4)} for t, s in got]
        for name, got in rounds.items()
    }
    kernels = native_kernels(config(LoRAConfig()), base.dtype)
    record = {
        "benchmark": "lora",
        **machine_info(torch.device(args.device)),
        "model": args.model,
        "dtype": args.dtype,
        "weights": base.config.weights.value,  # `fastest` resolved
        "isa": kernels.isa if kernels is not None else None,  # the engines' instruction level
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "rank": args.rank,
        "repeats": args.repeats,
        "seed": args.seed,
        "quick": args.quick,
        "method": "decode steps of the engines interleaved; ratio: median of per-round ratios",
        **summary,
        "ratio_rounds": per_round,
        "rounds": rounds_out,
    }
    publish(args.out_dir, "lora", record, summary)
    return summary


if __name__ == "__main__":
    main()
