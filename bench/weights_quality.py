"""Perplexity of the default model (SmolLM2-135M-Instruct, a Q4_1 GGUF) per weight format.

The text and windows of bench/kv_fp8_quality.py (`pydoc_data.topics`, 2048-token windows
fed in 512-token chunks through the paged KV), scored by:

- `fp32`: the file's weights dequantized, fp32 compute: the reference;
- `16bit`: the same in bf16 (what Strata ran before quantized weights);
- `q8`: every projection quantized to q8 at load (from the dequantized file), bf16 compute;
- `auto`: the file's own Q4_1 blocks (and its Q8_0 LM head) kept quantized;
- `llama.cpp`: llama.cpp on the same file and token ids, where llama-cpp-python is installed
  (`make bench-peers`); without it the run says so and goes on.

    python bench/weights_quality.py            # full run (24k tokens)
    python bench/weights_quality.py --quick    # smoke run (4k tokens)
    python bench/weights_quality.py --quick --cpu-isa avx2   # Strata's AVX2 kernels

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import llamacpp_peer
from bench.common import add_cache_dir_argument, machine_info, parse_args, publish
from bench.kv_fp8_quality import reference_text
from engine.config import CacheConfig, CpuIsa, EngineConfig, WeightFormat
from engine.evaluate import perplexity
from engine.kernels.cpu import resolve_cpu_isa
from engine.llm import LLM
from engine.model.quant_weights import QuantLinear
from engine.model_specs import resolve_model_path

# run name -> (compute dtype, weights)
RUNS = {
    "fp32": ("float32", WeightFormat.SIXTEEN_BIT),
    "16bit": ("bfloat16", WeightFormat.SIXTEEN_BIT),
    "q8": ("bfloat16", WeightFormat.Q8),
    "auto": ("bfloat16", WeightFormat.AUTO),
}


def llamacpp_perplexity(path: str, ids: list[int], window: int, chunk: int) -> float:
    """exp(mean NLL) of ids[1:] by llama.cpp, in the same non-overlapping windows."""
    import llama_cpp

    llamacpp_peer._silence(llama_cpp)
    llm = llama_cpp.Llama(
        path,
        n_ctx=window + 1,
        n_batch=chunk,
        logits_all=True,
        n_threads=torch.get_num_threads(),
        verbose=False,
    )
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        seq = ids[start : start + window + 1]
        llm.reset()
        llm.eval(seq[:-1])
        logits = np.asarray(llm.scores[: len(seq) - 1], dtype=np.float64)
        top = logits.max(axis=1, keepdims=True)
        logz = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        nll += float((logz - logits[np.arange(len(seq) - 1), seq[1:]]).sum())
        count += len(seq) - 1
    llm.close()
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=24_576, help="tokens of text to score")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    add_cache_dir_argument(ap)
    ap.add_argument("--quick", action="store_true", help="4,096 tokens")
    ap.add_argument(
        "--cpu-isa",
        default="auto",
        choices=[i.value for i in CpuIsa],
        help="instruction level of Strata's native CPU kernels (auto: the best this CPU has)",
    )
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parse_args(ap, argv, tokens=4096)
    torch.manual_seed(args.seed)

    runs: dict[str, dict] = {}
    ids: list[int] = []
    for name, (dtype, weights) in RUNS.items():
        llm = LLM(
            EngineConfig(
                dtype=dtype,
                device="cpu",
                weights=weights,
                cpu_isa=CpuIsa(args.cpu_isa),
                seed=args.seed,
                cache_dir=args.cache_dir,
                cache=CacheConfig(kv_cache_memory_bytes=1 << 28),
            )
        )
        ids = llm.tokenizer.encode(reference_text())[: args.tokens + 1]
        formats = sorted(
            {
                m.weight.format.value
                for m in llm.core.runner.model.modules()
                if isinstance(m, QuantLinear)
            }
        )
        t0 = time.perf_counter()
        ppl = perplexity(llm.core, ids, window=args.window, chunk=args.chunk)
        seconds = time.perf_counter() - t0
        runs[name] = {
            "dtype": dtype,
            "weights": weights.value,
            "quantized_formats": formats,
            "perplexity": round(ppl.perplexity, 4),
            "scored_tokens": ppl.num_tokens,
            "seconds": round(seconds, 1),
        }
        print(
            f"{name:>6} ({dtype}, weights {weights.value}{', ' if formats else ''}"
            f"{'/'.join(formats)}): perplexity {ppl.perplexity:.4f} over {ppl.num_tokens} "
            f"tokens ({seconds:.1f}s)",
            flush=True,
        )
        del llm

    llamacpp = None
    if llamacpp_peer.available():
        llamacpp = round(
            llamacpp_perplexity(resolve_model_path("default"), ids, args.window, args.chunk), 4
        )
        print(f"llama.cpp {llamacpp_peer.version()}: perplexity {llamacpp:.4f}", flush=True)
    else:
        print("llama.cpp: not installed (`make bench-peers`); its perplexity is left out")

    ref = runs["fp32"]["perplexity"]
    summary = {
        "perplexity": {name: r["perplexity"] for name, r in runs.items()},
        "rel_diff_vs_fp32": {
            name: round(r["perplexity"] / ref - 1, 5) for name, r in runs.items() if name != "fp32"
        },
        "llamacpp_perplexity": llamacpp,
    }
    if llamacpp is not None:
        summary["llamacpp_rel_diff_vs_fp32"] = round(llamacpp / ref - 1, 5)
    record = {
        "benchmark": "weights_quality",
        **machine_info(torch.device("cpu")),
        "model": "default (SmolLM2-135M-Instruct, Q4_1 GGUF)",
        "text": "pydoc_data.topics, topics sorted by name, joined by blank lines",
        "window": args.window,
        "chunk": args.chunk,
        "isa": resolve_cpu_isa(args.cpu_isa),  # the instruction level of Strata's kernels
        "quick": args.quick,
        "seed": args.seed,
        "llamacpp_version": llamacpp_peer.version() if llamacpp is not None else None,
        "runs": runs,
        **summary,
    }
    publish(args.out_dir, "weights_quality", record, summary)
    return summary


if __name__ == "__main__":
    main()
