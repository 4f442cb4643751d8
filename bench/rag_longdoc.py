"""Long-document QA: time to first token with KV tiers against recomputing evicted documents,
and what each question's admission costs a stream already running. Method and figures:
docs/benchmarks.md.

    python bench/rag_longdoc.py            # D=8, L=2048, Q=4
    python bench/rag_longdoc.py --quick    # D=4, L=512, Q=2

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    add_cache_dir_argument,
    machine_info,
    parse_args,
    publish,
    scratch_dir,
)
from bench.gateway_overhead import percentile
from engine.config import CacheConfig, EngineConfig, KVCacheDtype
from engine.llm import LLM
from engine.protocol import SamplingParams
from kvstore.disk import disk_slot_nbytes

QUESTIONS = [
    "\n\nQuestion: What is the main topic of this section?\nAnswer:",
    "\n\nQuestion: Give one example from the text above.\nAnswer:",
    "\n\nQuestion: Which keywords does it mention?\nAnswer:",
    "\n\nQuestion: Summarize it in one sentence.\nAnswer:",
]


def documents(llm: LLM, count: int, length: int) -> list[list[int]]:
    topics = pydoc_data.topics.topics
    ids = llm.tokenizer.encode("\n\n".join(topics[name] for name in sorted(topics)))
    if len(ids) < count * length:
        raise SystemExit(f"the reference text has {len(ids)} tokens; need {count * length}")
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def run(
    llm: LLM, docs: list[list[int]], order: list[tuple[int, int]], questions: list[list[int]]
) -> dict:
    first = SamplingParams(max_tokens=1, temperature=0.0)
    for d, doc in enumerate(docs):  # each document read once, in order
        llm.generate([doc + questions[d % len(questions)]], first)
    ttft, prompt, cached = [], 0, {"device": 0, "host": 0, "disk": 0}
    for d, q in order:
        start = time.perf_counter()
        (out,) = llm.generate([docs[d] + questions[q]], first)
        ttft.append(time.perf_counter() - start)
        prompt += len(out.prompt_token_ids)
        below = out.num_cached_host_tokens + out.num_cached_disk_tokens
        cached["device"] += out.num_cached_tokens - below
        cached["host"] += out.num_cached_host_tokens
        cached["disk"] += out.num_cached_disk_tokens
    llm.core.check_integrity()
    return {
        "ttft_p50_ms": round(percentile(ttft, 0.5) * 1e3, 2),
        "ttft_p99_ms": round(percentile(ttft, 0.99) * 1e3, 2),
        "hit_rate": {tier: round(n / prompt, 4) for tier, n in cached.items()},
    }


def with_stream(
    llm: LLM, docs: list[list[int]], order: list[tuple[int, int]], questions: list[list[int]]
) -> dict:
    """The questions again, one at a time, while one long answer streams: the gaps between
    the stream's tokens show what admitting a question costs the batch already running
    (with tiers: copying its pages in; pages on disk are read while the stream goes on)."""
    core = llm.core
    prompt = llm.tokenizer.encode("Write a long story about the sea.")
    stream = SamplingParams(
        max_tokens=core.max_model_len - len(prompt) - 1, ignore_eos=True, temperature=0.0
    )
    core.add_request("stream", prompt, stream)
    first = SamplingParams(max_tokens=1, temperature=0.0)
    gaps, ttft, last = [], [], None
    for i, (d, q) in enumerate(order):
        core.add_request(f"q{i}", docs[d] + questions[q], first)
        start, answered = time.perf_counter(), False
        while not answered:
            outs = core.step()
            now = time.perf_counter()
            for out in outs:
                if out.request_id == "stream" and out.new_token_ids:
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                if out.request_id == "stream" and out.finished:
                    raise SystemExit("the stream ended early; raise the device pool")
                answered |= out.request_id == f"q{i}" and out.finished
        ttft.append(time.perf_counter() - start)
    core.abort_request("stream")
    core.check_integrity()
    return {
        "ttft_p50_ms": round(percentile(ttft, 0.5) * 1e3, 2),
        "stream_gap_ms": {
            "p50": round(percentile(gaps, 0.5) * 1e3, 2),
            "p99": round(percentile(gaps, 0.99) * 1e3, 2),
            "max": round(max(gaps) * 1e3, 2),
        },
    }


def measure(
    config: EngineConfig,
    docs: list[list[int]],
    order: list[tuple[int, int]],
    questions: list[list[int]],
) -> dict:
    """One engine's figures (`run`, then `with_stream`); its tiers are closed on return,
    on an error too."""
    llm = LLM(config)
    try:
        result = run(llm, docs, order, questions)
        result["with_stream"] = with_stream(llm, docs, order, questions)
        result["disk_blocks_used"] = llm.core.stats().num_kv_disk_blocks_used
    finally:
        if llm.core.tiers is not None:
            llm.core.tiers.close()
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--questions", type=int, default=4, help="per document")
    ap.add_argument("--device-docs", type=float, default=2.5, help="documents the device holds")
    ap.add_argument("--host-docs", type=float, default=3.0, help="documents the host tier holds")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=[d.value for d in KVCacheDtype])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--disk-path",
        default=None,
        help="where the disk tier's run directory goes (removed after the run; "
        "default: the temporary directory)",
    )
    add_cache_dir_argument(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="4 documents of 512 tokens, 2 questions")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parse_args(ap, argv, docs=4, doc_tokens=512, questions=2)
    if args.questions > len(QUESTIONS):
        raise SystemExit(f"at most {len(QUESTIONS)} questions per document")

    rng = random.Random(args.seed)  # the question order
    order = [(d, q) for d in range(args.docs) for q in range(args.questions)]
    rng.shuffle(order)
    kv = KVCacheDtype(args.kv_cache_dtype)
    block = 16
    small = CacheConfig(block_size=block, kv_cache_dtype=kv, num_blocks=2)
    models = args.cache_dir  # starts read the weights cached there
    probe = LLM(EngineConfig(dtype=args.dtype, device="cpu", cache=small, cache_dir=models))
    page_nbytes = probe.core.pool.spec.bytes_per_block
    questions = [probe.tokenizer.encode(q, add_special_tokens=False) for q in QUESTIONS]
    docs = documents(probe, args.docs, args.doc_tokens)
    del probe
    doc_blocks = -(-(args.doc_tokens + 32) // block)
    host_bytes = int(args.host_docs * doc_blocks) * page_nbytes
    disk_bytes = 2 * args.docs * doc_blocks * disk_slot_nbytes(page_nbytes)
    results = {}
    # the disk tier's directory (`strata-kv/`) and anything else the engines leave go with it
    with scratch_dir("strata-rag-", args.disk_path) as disk_dir:
        for name in ("tiers", "recompute"):
            tiered = name == "tiers"
            cache = CacheConfig(
                block_size=block,
                kv_cache_dtype=kv,
                num_blocks=int(args.device_docs * doc_blocks),
                host_memory_bytes=host_bytes if tiered else 0,
                disk_bytes=disk_bytes if tiered else 0,
                disk_path=str(disk_dir),
            )
            config = EngineConfig(dtype=args.dtype, device="cpu", cache=cache, cache_dir=models)
            results[name] = measure(config, docs, order, questions)
            print(f"{name:>9}: {results[name]}", flush=True)

    tiers, recompute = results["tiers"], results["recompute"]
    summary = {
        "ttft_p50_ms": {"tiers": tiers["ttft_p50_ms"], "recompute": recompute["ttft_p50_ms"]},
        "ttft_p99_ms": {"tiers": tiers["ttft_p99_ms"], "recompute": recompute["ttft_p99_ms"]},
        "speedup": round(recompute["ttft_p50_ms"] / tiers["ttft_p50_ms"], 2),
        "hit_rate": tiers["hit_rate"],
        "with_stream": {"tiers": tiers["with_stream"], "recompute": recompute["with_stream"]},
    }
    record = {
        "benchmark": "rag_longdoc",
        **machine_info(torch.device("cpu")),
        "model": "default (SmolLM2-135M-Instruct)",
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "docs": args.docs,
        "doc_tokens": args.doc_tokens,
        "questions_per_doc": args.questions,
        "device_docs": args.device_docs,
        "host_docs": args.host_docs,
        "page_bytes": page_nbytes,
        "seed": args.seed,
        "quick": args.quick,
        "recompute_hit_rate": recompute["hit_rate"],
        **summary,
    }
    publish(args.out_dir, "rag_longdoc", record, summary)
    return summary


if __name__ == "__main__":
    main()
