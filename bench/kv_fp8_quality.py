"""FP8 KV pages versus 16-bit pages on the default model (SmolLM2-135M-Instruct, bf16).

- Perplexity on a fixed real text (`pydoc_data.topics`, the Python reference topics) of at
  least 20k tokens, in 2048-token windows fed in 512-token chunks through the paged KV, so
  later chunks read earlier ones back from the pages.
- Greedy agreement on 16 chat prompts x 64 tokens: per-position token agreement, common
  prefix, and fully identical sequences. For scale, the same figures between two 16-bit runs
  that differ only in arithmetic order (native CPU kernels vs torch ops): greedy decoding of
  a small bf16 model diverges on near-ties even without any quantization.
- KV bytes per token of each pool, scales included.

    python bench/kv_fp8_quality.py            # full run (24k tokens)
    python bench/kv_fp8_quality.py --quick    # smoke run (4k tokens, 4 prompts)

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_cache_dir_argument, machine_info, parse_args, publish
from engine.config import CacheConfig, EngineConfig, KernelBackend, KVCacheDtype
from engine.evaluate import greedy_agreement, perplexity
from engine.llm import LLM
from engine.protocol import SamplingParams

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for a job interview.",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines work?",
    "Translate 'good morning, how are you?' into French.",
    "What causes the seasons on Earth?",
    "Write a short story opening about a lighthouse keeper.",
    "Explain recursion to a ten-year-old.",
    "What are the main ingredients of a pizza margherita?",
    "Describe how a bill becomes a law.",
    "Why do cats purr?",
    "Write a limerick about a programmer.",
    "What is photosynthesis?",
    "List the planets of the solar system in order.",
]


def reference_text() -> str:
    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=24_576, help="tokens of text to score")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", help="model compute dtype (16-bit baseline)")
    add_cache_dir_argument(ap)
    ap.add_argument("--quick", action="store_true", help="4,096 tokens, 4 prompts")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parse_args(ap, argv, tokens=4096, prompts=4)

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[: args.prompts]
    noise = LLM(
        EngineConfig(
            dtype=args.dtype,
            device="cpu",
            backend=KernelBackend.TORCH,
            cache_dir=args.cache_dir,
            cache=CacheConfig(kv_cache_dtype=KVCacheDtype.AUTO, kv_cache_memory_bytes=1 << 28),
        )
    )
    noise_tokens = [o.token_ids for o in noise.generate(prompts, params, chat=True)]
    del noise
    runs = {}
    for kv in (KVCacheDtype.AUTO, KVCacheDtype.FP8_E4M3):
        llm = LLM(
            EngineConfig(
                dtype=args.dtype,
                device="cpu",
                cache_dir=args.cache_dir,
                cache=CacheConfig(kv_cache_dtype=kv, kv_cache_memory_bytes=1 << 28),
            )
        )
        ids = llm.tokenizer.encode(reference_text())[: args.tokens + 1]
        t0 = time.perf_counter()
        ppl = perplexity(llm.core, ids, window=args.window, chunk=args.chunk)
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, chat=True)
        stats = llm.core.stats()
        runs[kv.value] = {
            "kv_cache_dtype": stats.kv_cache_dtype,
            "kv_bytes_per_token": stats.kv_bytes_per_token,
            "perplexity": round(ppl.perplexity, 4),
            "scored_tokens": ppl.num_tokens,
            "perplexity_s": round(t1 - t0, 1),
            "tokens": [o.token_ids for o in outs],
        }
        print(
            f"kv {stats.kv_cache_dtype:>14}: perplexity {ppl.perplexity:.4f} over "
            f"{ppl.num_tokens} tokens ({t1 - t0:.1f}s), {stats.kv_bytes_per_token} KV bytes/token",
            flush=True,
        )
        del llm

    base, fp8 = runs["auto"], runs["fp8_e4m3"]
    agree = greedy_agreement(base["tokens"], fp8["tokens"])
    floor = greedy_agreement(base["tokens"], noise_tokens)
    summary = {
        "perplexity": {"16bit": base["perplexity"], "fp8": fp8["perplexity"]},
        "perplexity_rel_diff": round(fp8["perplexity"] / base["perplexity"] - 1, 5),
        "greedy_agreement": {
            "token_rate": round(agree.token_rate, 4),
            "prefix_rate": round(agree.prefix_rate, 4),
            "identical": f"{agree.identical}/{agree.total}",
        },
        "greedy_agreement_16bit_torch_vs_native": {
            "token_rate": round(floor.token_rate, 4),
            "prefix_rate": round(floor.prefix_rate, 4),
            "identical": f"{floor.identical}/{floor.total}",
        },
        "kv_bytes_per_token": {
            "16bit": base["kv_bytes_per_token"],
            "fp8": fp8["kv_bytes_per_token"],
        },
        "kv_bytes_ratio": round(fp8["kv_bytes_per_token"] / base["kv_bytes_per_token"], 4),
    }
    record = {
        "benchmark": "kv_fp8_quality",
        **machine_info(torch.device("cpu")),
        "model": "default (SmolLM2-135M-Instruct)",
        "compute_dtype": args.dtype,
        "text": "pydoc_data.topics, topics sorted by name, joined by blank lines",
        "window": args.window,
        "chunk": args.chunk,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "quick": args.quick,
        "runs": {k: {n: v for n, v in r.items() if n != "tokens"} for k, r in runs.items()},
        **summary,
    }
    publish(args.out_dir, "kv_fp8_quality", record, summary)
    return summary


if __name__ == "__main__":
    main()
