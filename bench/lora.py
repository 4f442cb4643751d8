"""Multi-LoRA decode throughput: 32 concurrent requests through 1, 8 or 32 distinct adapters
(rank 16, every target module) against the base model, in one run.

Each configuration runs the same seeded workload (32 requests of 64 prompt tokens and 64
greedy new tokens) on the default model in bf16. `base` is the engine without adapter slots
(its decoder layers run as whole native kernels); `base_lora_engine` is the engine with 32
slots serving the base model only (every projection wrapped, no adapter applied).

    python bench/lora.py            # full run
    python bench/lora.py --quick    # 16 new tokens

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import random
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


def tokens_per_second(llm: LLM, prompts: list[list[int]], loras, params) -> float:
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), lora=loras[:2])  # warm up, load
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.new_tokens = 16
    counts = [1, 8, 32]
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    cache = CacheConfig(kv_cache_memory_bytes=1 << 29)
    base = LLM(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, cache=cache))
    vocab = base.core.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)]
               for _ in range(args.requests)]  # fmt: skip
    tok_s: dict[str, float] = {}
    tok_s["base"] = tokens_per_second(base, prompts, [None] * len(prompts), params)
    model_config = base.core.model_config
    del base
    slots = LoRAConfig(max_loras=max(counts), max_lora_rank=args.rank)
    llm = LLM(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, cache=cache,
                           lora=slots))  # fmt: skip
    tok_s["base_lora_engine"] = tokens_per_second(llm, prompts, [None] * len(prompts), params)
    root = Path(tempfile.mkdtemp(prefix="strata-lora-bench-"))
    adapters = [
        LoRARequest(name=f"a{i}", path=str(write_random_adapter(
            root / f"a{i}", model_config, rank=args.rank, seed=i)))
        for i in range(max(counts))
    ]  # fmt: skip
    for n in counts:
        loras = [adapters[i % n] for i in range(len(prompts))]
        tok_s[str(n)] = tokens_per_second(llm, prompts, loras, params)
    tok_s = {k: round(v, 1) for k, v in tok_s.items()}
    ratio = {k: round(v / tok_s["base"], 3) for k, v in tok_s.items() if k != "base"}
    for k, v in tok_s.items():
        print(f"{k:>16}: {v:8.1f} tok/s" + (f"  ({ratio[k]:.2f}x base)" if k in ratio else ""))
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
        "seed": args.seed,
        "quick": args.quick,
        **summary,
    }
    print(f"wrote {write_result(args.out_dir, 'lora', record)}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
