"""Prompt-lookup speculative decoding against plain decoding, in one run: `rag` (answers that
quote a document) and `chat` (no document), each by two engines alike but for speculation,
which must produce the same tokens. Method and figures: docs/benchmarks.md.

    python bench/speculative.py            # SmolLM2, bf16: 1, 4, 8 and 16 concurrent
    python bench/speculative.py --quick    # a fast smoke run
    python bench/speculative.py --temperature 0.7    # seeded sampling

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pydoc_data.topics

import torch

from bench.common import (
    add_cache_dir_argument,
    engine_record,
    generate_all,
    parse_args,
    publish,
)
from engine.attention.paged import SeqSlice
from engine.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.core import EngineCore
from engine.factory import create_engine
from engine.protocol import SamplingParams
from engine.tokenizer import Tokenizer

# entries of 2,000 tokens or more, each cut to --doc-tokens
TOPICS = [
    "specialnames",
    "compound",
    "types",
    "formatstrings",
    "string-methods",
    "typesseq",
    "debugger",
    "typesmapping",
    "attribute-access",
    "customization",
    "comparisons",
    "assignment",
    "execmodel",
    "strings",
    "import",
    "try",
]
ASKS = [
    "Quote the first sentence of the text above exactly.",
    "Repeat the first paragraph of the text above word for word.",
    "Which keywords does the text above mention? Answer with a list.",
    "Explain what the text above says, quoting it where you can.",
]
QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Give three tips for learning a language.",
    "Why is the sky blue?",
    "Describe a good breakfast.",
    "What makes a story interesting?",
    "How do plants grow?",
    "Name some famous painters.",
]


def rag_prompts(tokenizer: Tokenizer, num: int, doc_tokens: int) -> list[list[int]]:
    prompts = []
    for i in range(num):
        text = pydoc_data.topics.topics[TOPICS[i % len(TOPICS)]]
        doc = tokenizer.decode(tokenizer.encode(text)[:doc_tokens])
        ask = ASKS[i % len(ASKS)]
        prompts.append(tokenizer.encode_chat([{"role": "user", "content": f"{doc}\n\n{ask}"}]))
    return prompts


def chat_prompts(tokenizer: Tokenizer, num: int) -> list[list[int]]:
    return [
        tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(num)
    ]


def step_ms(core: EngineCore, batch: int, rows: int, context: int, repeats: int = 10) -> float:
    """Time of one forward (with logits for every row) for `batch` sequences of `context`
    cached tokens, each computing `rows` tokens: what a drafted step costs against a plain
    one. Writes K/V into blocks no request holds."""
    bs = core.pool.spec.block_size
    per_seq = (context + rows + bs - 1) // bs
    assert batch * per_seq <= core.block_manager.num_free_blocks
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    ids = [100] * (batch * rows)
    positions = [p for _ in range(batch) for p in range(context, context + rows)]
    slices = [SeqSlice(rows, context, tables[b]) for b in range(batch)]
    runner = core.runner
    times = []
    with torch.inference_mode():
        for i in range(repeats + 2):
            start = time.perf_counter()
            runner.model.compute_logits(runner.forward(ids, positions, slices))
            if i >= 2:
                times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run(
    core: EngineCore, prompts: list[list[int]], temperature: float, max_tokens: int
) -> tuple[float, list]:
    """Tokens/s over the batch, and each request's output token ids (request i seeded with i
    when sampled, so both engines draw the same numbers)."""
    params = [
        SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=i if temperature > 0 else None
        )
        for i in range(len(prompts))
    ]
    return generate_all(core, prompts, params)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", default=None, help="default 1,4,8,16 (1,4 with --quick)")
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--speculative-tokens", type=int, default=4, help="drafts per step")
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; above: seeded sampling"
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration (median)")
    ap.add_argument("--quick", action="store_true", help="1 run, short documents")
    add_cache_dir_argument(ap)
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parse_args(ap, argv, repeats=1, doc_tokens=256, max_tokens=48)
    batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,4,8,16")).split(",")]
    base = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        cache_dir=args.cache_dir,
        scheduler=SchedulerConfig(max_num_seqs=max(batches)),
    )
    spec = SpeculativeConfig(num_speculative_tokens=args.speculative_tokens)
    plain_core, tokenizer = create_engine(base, progress=False)
    spec_core, _ = create_engine(dataclasses.replace(base, speculative=spec), progress=False)

    results: dict[str, dict] = {}
    identical = True
    for workload in ("rag", "chat"):
        for n in batches:
            if workload == "rag":
                prompts = rag_prompts(tokenizer, n, args.doc_tokens)
            else:
                prompts = chat_prompts(tokenizer, n)
            rates: dict[str, list[float]] = {"plain": [], "speculative": []}
            drafts0 = spec_core.num_draft_tokens
            accepted0 = spec_core.num_accepted_draft_tokens
            outputs = {}
            engines = [("plain", plain_core), ("speculative", spec_core)]
            for _, core in engines:
                # warm: the prompts' KV is cached from here on
                run(core, prompts, args.temperature, args.max_tokens)
            for repeat in range(args.repeats):  # each engine goes first in turn
                for name, core in engines[:: 1 if repeat % 2 == 0 else -1]:
                    rate, outputs[name] = run(core, prompts, args.temperature, args.max_tokens)
                    rates[name].append(rate)
            same = outputs["plain"] == outputs["speculative"]
            identical &= same
            drafts = spec_core.num_draft_tokens - drafts0
            accepted = spec_core.num_accepted_draft_tokens - accepted0
            plain, fast = statistics.median(rates["plain"]), statistics.median(rates["speculative"])
            key = f"{workload}/{n}"
            results[key] = {
                "plain_tok_s": round(plain, 1),
                "speculative_tok_s": round(fast, 1),
                "speedup": round(fast / plain, 3),
                "drafts": drafts,
                "acceptance": round(accepted / drafts, 3) if drafts else None,
                "same_tokens": same,
                "mean_output_tokens": round(sum(map(len, outputs["plain"])) / n, 1),
            }
            r = results[key]
            print(
                f"{workload:>4} concurrency {n:>3}: plain {plain:8.1f} tok/s | speculative "
                f"{fast:8.1f} tok/s | x{r['speedup']:.2f} | accepted {r['acceptance']} | "
                f"same tokens {same}",
                flush=True,
            )
    # a step's cost by its rows, at the documents' context: 1 sequence with 4 drafts, and
    # 8 sequences with 1 draft each
    context = len(rag_prompts(tokenizer, 1, args.doc_tokens)[0])
    row_cost = {}
    for batch, rows in ((1, 5), (8, 2)):
        plain_ms, drafted_ms = (step_ms(plain_core, batch, r, context) for r in (1, rows))
        row_cost[f"{batch}x{rows}"] = {
            "plain_ms": round(plain_ms, 2),
            "drafted_ms": round(drafted_ms, 2),
            "ratio": round(drafted_ms / plain_ms, 3),
        }
        print(
            f"step of {batch} sequences at {context} tokens: {rows} rows each "
            f"{drafted_ms:.1f} ms, 1 row each {plain_ms:.1f} ms",
            flush=True,
        )
    summary = {
        "speedup": {k: r["speedup"] for k, r in results.items()},
        "acceptance": {k: r["acceptance"] for k, r in results.items()},
        "identical_outputs": identical,
    }
    record = {
        **engine_record("speculative", spec_core, args.model),
        "speculative": dataclasses.asdict(spec),
        "doc_tokens": args.doc_tokens,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "repeats": args.repeats,
        "quick": args.quick,
        "results": results,
        "step_cost_by_rows": row_cost,
        **summary,
    }
    publish(args.out_dir, "speculative", record, summary)
    return summary


if __name__ == "__main__":
    main()
