"""What a response format costs: the same requests with and without a JSON Schema, in one run.

Chat prompts that ask for JSON are run greedily with a schema (an object of strings, an
integer, a bounded number, a date and an array); each request ends when its value is
complete. The same prompts then run without the schema, each for exactly as many tokens as
its constrained run produced (EOS ignored), so both runs compute the same number of tokens
at the same batch sizes. The ratio of their rates is the grammar's cost: checking each
sampled token, and finding an allowed one when the model's choice is refused. The record
also says how often that happened, and whether every constrained output parsed and matched
its schema.

    python bench/structured_output.py            # SmolLM2, bf16: 1, 8 and 32 concurrent
    python bench/structured_output.py --quick    # a fast smoke run

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import engine_record, generate_all, publish
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.factory import create_engine
from engine.protocol import SamplingParams
from engine.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "country": {"type": "string", "maxLength": 60},
        "population": {"type": "integer", "minimum": 0},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "founded": {"type": "string", "format": "date"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 60},
                      "maxItems": 3},
    },
    "required": ["name", "country", "population", "rating", "founded", "landmarks"],
}  # fmt: skip
SUBJECTS = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Quito", "Hanoi", "Perth",
            "Dublin", "Seoul", "Nairobi", "Havana", "Vienna", "Manila", "Bogota"]  # fmt: skip


def prompts_for(tokenizer: Tokenizer, num: int) -> list[list[int]]:
    asks = [
        f"Describe the city of {SUBJECTS[i % len(SUBJECTS)]} (request {i}) as a JSON object "
        "with its name, country, population, a rating out of 5, the date it was founded and "
        "up to three landmarks."
        for i in range(num)
    ]
    return [tokenizer.encode_chat([{"role": "user", "content": ask}]) for ask in asks]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", default=None, help="default 1,8,32 (1,4 with --quick)")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration (median)")
    ap.add_argument("--quick", action="store_true", help="1 run per batch size")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats = 1
    batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,8,32")).split(",")]
    config = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, cache_dir=args.cache_dir,
        cache=CacheConfig(enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max(batches)),
    )  # fmt: skip
    core, tokenizer = create_engine(config, progress=False)
    schema_text = json.dumps(SCHEMA)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                 json_schema=schema_text)  # fmt: skip
    generate_all(core, prompts_for(tokenizer, 2), [constrained] * 2)  # warm up

    import jsonschema

    results: dict[str, dict] = {}
    for n in batches:
        prompts = prompts_for(tokenizer, n)
        with_schema, without = [], []
        valid = finished = 0
        for _ in range(args.repeats):
            rate, outputs = generate_all(core, prompts, [constrained] * n)
            with_schema.append(rate)
            lengths = [len(tokens) for tokens in outputs]
            plain = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
                     for k in lengths]  # fmt: skip
            without.append(generate_all(core, prompts, plain)[0])
            for i in range(n):
                text = tokenizer.decode(outputs[i])
                finished += lengths[i] < args.max_tokens
                try:
                    jsonschema.validate(json.loads(text), SCHEMA)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
        results[str(n)] = {
            "with_schema_tok_s": round(statistics.median(with_schema), 1),
            "without_tok_s": round(statistics.median(without), 1),
            "ratio": round(statistics.median(with_schema) / statistics.median(without), 3),
            "completed_values": f"{finished}/{n * args.repeats}",
            "valid_outputs": f"{valid}/{n * args.repeats}",
            "mean_output_tokens": round(sum(lengths) / n, 1),
        }
        r = results[str(n)]
        print(f"concurrency {n:>3}: with schema {r['with_schema_tok_s']:8.1f} tok/s | without "
              f"{r['without_tok_s']:8.1f} tok/s | ratio {r['ratio']:.3f} | valid "
              f"{r['valid_outputs']}", flush=True)  # fmt: skip
    summary = {
        "with_schema_tok_s": {n: r["with_schema_tok_s"] for n, r in results.items()},
        "without_tok_s": {n: r["without_tok_s"] for n, r in results.items()},
        "ratio": {n: r["ratio"] for n, r in results.items()},
    }
    record = {
        **engine_record("structured_output", core, args.model),
        "schema": SCHEMA, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "quick": args.quick, "results": results, **summary,
    }  # fmt: skip
    publish(args.out_dir, "structured_output", record, summary)
    return summary


if __name__ == "__main__":
    main()
