"""A shared remote KV tier across workers: documents read on worker A, questions about them
asked on worker B, time to first token through the remote tier (a valkey-server both
workers use) against recomputing the document on B. Method and figures: docs/benchmarks.md.

    python bench/kv_shared_cross.py            # 4 documents of 2,048 tokens, 2 questions
    python bench/kv_shared_cross.py --quick    # 2 documents, 2 questions

Both workers run in this process (two engines), each with its own device pool; B keeps no
tier of its own, and its device cache is emptied before every question, so each question's
document comes from the remote tier (or, for the baseline, is computed). The last printed
line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_cache_dir_argument, machine_info, parse_args, publish, scratch_dir
from bench.gateway_overhead import percentile
from engine.config import CacheConfig, EngineConfig
from engine.llm import LLM
from engine.protocol import SamplingParams
from tenants.store import EmbeddedStore

QUESTIONS = [
    "\n\nQuestion: What is the main topic of this section?\nAnswer:",
    "\n\nQuestion: Give one example from the text above.\nAnswer:",
    "\n\nQuestion: Which keywords does it mention?\nAnswer:",
]
BLOCK = 16
REMOTE_TIMEOUT_MS = 2000  # fetches on a contended machine: a timeout would be a recompute
ANSWER = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def documents(llm: LLM, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` documents of `length` tokens from Python's own help text, picked by `seed`."""
    topics = pydoc_data.topics.topics
    ids = llm.tokenizer.encode("\n\n".join(topics[name] for name in sorted(topics)))
    num = len(ids) // length
    if num < count:
        raise SystemExit(f"the reference text has {len(ids)} tokens; need {count * length}")
    picks = random.Random(seed).sample(range(num), count)
    return [ids[i * length : (i + 1) * length] for i in picks]


def answer(llm: LLM, request_id: str, prompt: list[int]) -> tuple[float, list[int], int, int]:
    """Run one request on `llm`'s engine: seconds to its first token, its tokens, and its
    prompt tokens cached in all and from the remote tier."""
    core = llm.core
    start = time.perf_counter()
    core.add_request(request_id, prompt, ANSWER)
    first: float | None = None
    tokens: list[int] = []
    cached = remote = 0
    while core.has_unfinished():
        for out in core.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter() - start
            tokens += out.new_token_ids
            cached, remote = out.num_cached_tokens, out.num_cached_remote_tokens
    assert first is not None
    return first, tokens, cached, remote


def wait_saved(llm: LLM, timeout: float = 120.0) -> None:
    """Until worker A's remote saves queued so far have been sent (write-behind)."""
    remote = llm.core.tiers.remote if llm.core.tiers is not None else None
    assert remote is not None
    deadline = time.monotonic() + timeout
    while not remote.idle:
        if time.monotonic() > deadline:
            raise SystemExit("worker A's saves did not reach the remote tier")
        time.sleep(0.01)


def run_cross_worker(
    quick: bool,
    seed: int,
    *,
    docs: int | None = None,
    doc_tokens: int = 2048,
    questions: int = 2,
    dtype: str = "bfloat16",
    cache_dir: str | None = None,
    model: str = "default",
    device: str = "cpu",
    host_gb: float = 0.0,
) -> dict[str, Any]:
    """Documents read on worker A, questions on worker B: B's time to first token with the
    documents' KV fetched from the shared remote tier, and recomputed. `host_gb`: each
    engine's host tier (pinned on CUDA), where pages fetched from the remote tier land; it is
    emptied with B's device cache before each question. Returns the figures:
    `speedup` (recompute TTFT p50 over remote TTFT p50), `ttft_p50_ms`, `ttft_p99_ms`,
    `tokens_identical` (B's greedy answers equal the recompute's), `remote_hit_rate` (of
    B's prompt tokens, those loaded from the remote tier) and the remote tier's counters."""
    num_docs = docs if docs is not None else (2 if quick else 4)
    if questions > len(QUESTIONS):
        raise SystemExit(f"at most {len(QUESTIONS)} questions per document")
    blocks = -(-(doc_tokens + 64) // BLOCK) + 8  # one document and a question, on B
    with scratch_dir("strata-kv-shared-") as scratch:
        store = EmbeddedStore(scratch / "kv-remote", max_bytes=2 << 30)
        url = store.start()
        try:

            def engine(remote: bool, num_blocks: int) -> LLM:
                cache = CacheConfig(
                    block_size=BLOCK,
                    num_blocks=num_blocks,
                    host_memory_bytes=int(host_gb * (1 << 30)),
                    remote_url=url if remote else None,
                    remote_timeout_ms=REMOTE_TIMEOUT_MS,
                )
                extra = {} if cache_dir is None else {"cache_dir": cache_dir}
                config = EngineConfig(model=model, dtype=dtype, device=device, cache=cache, **extra)
                return LLM(config)

            a = engine(True, num_docs * blocks)
            b = engine(True, blocks)
            c = engine(False, blocks)  # the baseline: B without the remote tier
            texts = documents(a, num_docs, doc_tokens, seed)
            asks = [a.tokenizer.encode(q, add_special_tokens=False) for q in QUESTIONS]
            order = [(d, q) for d in range(num_docs) for q in range(questions)]
            random.Random(seed).shuffle(order)
            for d, doc in enumerate(texts):  # each document read once on A
                answer(a, f"read-{d}", doc + asks[-1])
            wait_saved(a)
            ttft: dict[str, list[float]] = {"remote": [], "recompute": []}
            identical, prompt_tokens, remote_tokens = True, 0, 0
            answer(c, "warm", texts[0][:64])  # first-call costs out of the baseline
            for i, (d, q) in enumerate(order):
                prompt = texts[d] + asks[q]
                for llm in (b, c):  # neither keeps the document between questions
                    llm.core.block_manager.reset_cache()
                    if llm.core.tiers is not None and llm.core.tiers.host is not None:
                        llm.core.tiers.host.clear()
                got, tokens, _, remote = answer(b, f"q{i}", prompt)
                ref, expected, _, _ = answer(c, f"q{i}", prompt)
                ttft["remote"].append(got)
                ttft["recompute"].append(ref)
                identical &= tokens == expected
                prompt_tokens += len(prompt)
                remote_tokens += remote
            counters = b.core.stats().kv_remote
            saved = a.core.stats().kv_remote
            for llm in (a, b, c):
                llm.core.close()
        finally:
            store.stop()
    p50 = {k: round(percentile(v, 0.5) * 1e3, 2) for k, v in ttft.items()}
    return {
        "speedup": round(p50["recompute"] / p50["remote"], 2),
        "ttft_p50_ms": p50,
        "ttft_p99_ms": {k: round(percentile(v, 0.99) * 1e3, 2) for k, v in ttft.items()},
        "tokens_identical": identical,
        "remote_hit_rate": round(remote_tokens / prompt_tokens, 4),
        "docs": num_docs,
        "doc_tokens": doc_tokens,
        "questions_per_doc": questions,
        "remote_loads": counters,
        "remote_saves": saved,
        "device": device,
        "host_tier_gb": host_gb,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--questions", type=int, default=2, help="per document")
    ap.add_argument("--dtype", default="bfloat16")
    add_cache_dir_argument(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="2 documents, 2 questions each")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parse_args(ap, argv, docs=2)
    summary = run_cross_worker(
        args.quick,
        args.seed,
        docs=args.docs,
        doc_tokens=args.doc_tokens,
        questions=args.questions,
        dtype=args.dtype,
        cache_dir=args.cache_dir,
    )
    record = {
        "benchmark": "kv_shared_cross",
        **machine_info(torch.device("cpu")),
        "model": "default (SmolLM2-135M-Instruct)",
        "dtype": args.dtype,
        "remote_store": "embedded valkey-server, Unix socket, same machine",
        "remote_timeout_ms": REMOTE_TIMEOUT_MS,
        "seed": args.seed,
        "quick": args.quick,
        **summary,
    }
    publish(args.out_dir, "kv_shared_cross", record, summary)
    return summary


if __name__ == "__main__":
    main()
