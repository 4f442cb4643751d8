"""Structured output's grammar engines compared: what a response format costs in throughput,
how long adversarial patterns take to compile, and which real schemas each engine takes.

1. Throughput: chat prompts that ask for JSON run greedily with a schema (an object of
   strings, an integer, a bounded number, a date and an array), each ending when its value
   is complete; the same prompts then run without it, each for exactly as many tokens as its
   constrained run produced (EOS ignored), so both runs compute the same tokens at the same
   batch sizes. The two alternate, after one discarded constrained run at each size; the
   medians are compared. Every constrained output is checked with `jsonschema`.
2. Adversarial patterns: the wall time to compile each (or be refused), and the longest mask
   a request of it then takes in a step (what it can add to another tenant's step).
3. Coverage: a corpus of real schemas (pydantic models, OpenAI function definitions, the
   JSON Schema keywords): compiled or refused, and whether texts the matcher lets through
   (random walks over the vocabulary) all validate, i.e. no keyword was silently ignored.

    python bench/structured_output.py                      # llguidance and xgrammar
    python bench/structured_output.py --quick              # a fast smoke run
    python bench/structured_output.py --skip-throughput    # sections 2 and 3 only

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import engine_record, generate_all, publish
from bench.structured_corpus import ADVERSARIAL, corpus
from engine.config import CacheConfig, EngineConfig, GrammarBackend, SchedulerConfig
from engine.factory import create_engine
from engine.protocol import SamplingParams
from engine.structured import SchemaError, check
from engine.structured.backend import GrammarCompiler, TokenMatcher, mask_words
from engine.structured.compilers import make_compiler
from engine.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "country": {"type": "string", "maxLength": 60},
        "population": {"type": "integer", "minimum": 0},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "founded": {"type": "string", "format": "date"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3},
    },
    "required": ["name", "country", "population", "rating", "founded", "landmarks"],
}
SUBJECTS = [
    "Paris",
    "Tokyo",
    "Lagos",
    "Lima",
    "Oslo",
    "Cairo",
    "Quito",
    "Hanoi",
    "Perth",
    "Dublin",
    "Seoul",
    "Nairobi",
    "Havana",
    "Vienna",
    "Manila",
    "Bogota",
]
STOP = -1  # a stand-in: walks end on the matcher's own final state


def prompts_for(tokenizer: Tokenizer, num: int) -> list[list[int]]:
    asks = [
        f"Describe the city of {SUBJECTS[i % len(SUBJECTS)]} (request {i}) as a JSON object "
        "with its name, country, population, a rating out of 5, the date it was founded and "
        "up to three landmarks."
        for i in range(num)
    ]
    return [tokenizer.encode_chat([{"role": "user", "content": ask}]) for ask in asks]


def throughput(core: Any, tokenizer: Tokenizer, batches: list[int], args: Any) -> dict:
    import jsonschema

    constrained = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, json_schema=json.dumps(SCHEMA)
    )
    generate_all(core, prompts_for(tokenizer, 2), [constrained] * 2)  # warm up
    results: dict[str, dict] = {}
    for n in batches:
        prompts = prompts_for(tokenizer, n)
        # a run at this size first: grammars build their lexers' states as texts need them
        generate_all(core, prompts, [constrained] * n)
        with_schema, without = [], []
        valid = finished = 0
        lengths: list[int] = []
        for _ in range(args.repeats):
            rate, outputs = generate_all(core, prompts, [constrained] * n)
            with_schema.append(rate)
            lengths = [len(tokens) for tokens in outputs]
            plain = [
                SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in lengths
            ]
            without.append(generate_all(core, prompts, plain)[0])
            for i in range(n):
                finished += lengths[i] < args.max_tokens
                try:
                    jsonschema.validate(json.loads(tokenizer.decode(outputs[i])), SCHEMA)
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
    return results


def allowed_ids(m: TokenMatcher, words: int) -> np.ndarray:
    bitmask = torch.zeros(1, words, dtype=torch.int32)
    m.fill_mask(bitmask, 0)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)


def walk(m: TokenMatcher, words: int, rng: random.Random, steps: int, stop: int) -> tuple:
    """A random walk through the tokens `m` allows (closing once long): the token ids, and
    the longest single mask in seconds. Ends at the value's end, a dead end or `steps`."""
    tokens: list[int] = []
    longest = 0.0
    for step in range(steps):
        started = time.perf_counter()
        ids = allowed_ids(m, words)
        longest = max(longest, time.perf_counter() - started)
        if m.stuck or not len(ids):
            return tokens, longest, "stuck"
        if stop in ids and (step > steps // 2 or rng.random() < 0.2):
            return tokens, longest, "complete"
        ids = ids[ids != stop]
        if not len(ids):
            return tokens, longest, "complete"
        short = ids[ids < 2000]  # common short tokens: walks that end
        token = int(rng.choice(list(short if len(short) and rng.random() < 0.9 else ids)))
        m.accept(token)
        tokens.append(token)
        if m.is_final:
            return tokens, longest, "complete"
    return tokens, longest, "long"


def adversarial(compilers: dict[str, GrammarCompiler], words: int, stop: int) -> dict:
    out: dict[str, dict] = {}
    for name, pattern in ADVERSARIAL.items():
        fields = {f"f{i}": {"type": "string", "pattern": pattern} for i in range(4)}
        schema = json.dumps({"type": "object", "properties": fields, "required": list(fields)})
        row: dict[str, Any] = {"pattern": pattern[:120], "copies": 4}
        for backend, compiler in compilers.items():
            started = time.perf_counter()
            try:
                if backend == "llguidance":
                    check(schema, None)  # the gateway's check, then the engine's matcher
                m = compiler.matcher(schema, None, frozenset({stop}))
                outcome = "compiled"
            except SchemaError as exc:
                m, outcome = None, f"refused: {str(exc)[:100]}"
            elapsed = time.perf_counter() - started
            entry: dict[str, Any] = {"compile_ms": round(elapsed * 1e3, 2), "outcome": outcome}
            if m is not None:
                tokens, longest, end = walk(m, words, random.Random(0), 64, stop)
                entry |= {
                    "max_mask_ms": round(longest * 1e3, 3),
                    "walk": end,
                    "walk_tokens": len(tokens),
                }
            row[backend] = entry
        out[name] = row
        print(
            f"adversarial {name:>16}: "
            + " | ".join(
                f"{b} {row[b]['compile_ms']:8.1f} ms {row[b]['outcome'][:20]}"
                f" mask<={row[b].get('max_mask_ms', 0):.2f} ms"
                for b in compilers
            ),
            flush=True,
        )
    return out


def coverage(
    compilers: dict[str, GrammarCompiler], tokenizer: Tokenizer, words: int, stop: int, walks: int
) -> dict:
    import jsonschema

    out: dict[str, Any] = {
        b: {"compiled": 0, "refused": 0, "silently_wrong": 0, "refusals": {}, "wrong": []}
        for b in compilers
    }
    schemas = corpus()
    for name, schema in schemas.items():
        text = json.dumps(schema)
        for backend, compiler in compilers.items():
            stats = out[backend]
            try:
                if backend == "llguidance":
                    check(text, None)
                m0 = compiler.matcher(text, None, frozenset({stop}))
            except SchemaError as exc:
                stats["refused"] += 1
                stats["refusals"][name] = str(exc)[:120]
                continue
            stats["compiled"] += 1
            del m0
            rng = random.Random(1)
            for _ in range(walks):
                m = compiler.matcher(text, None, frozenset({stop}))
                tokens, _, end = walk(m, words, rng, 160, stop)
                if end != "complete":
                    continue
                try:
                    value = json.loads(tokenizer.decode(tokens))
                    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
                except (ValueError, jsonschema.ValidationError) as exc:
                    stats["silently_wrong"] += 1
                    stats["wrong"].append(f"{name}: {str(exc).splitlines()[0][:100]}")
                    break
    for backend in compilers:
        s = out[backend]
        print(
            f"coverage {backend:>10}: {s['compiled']} compiled, {s['refused']} refused, "
            f"{s['silently_wrong']} let through an invalid text (of {len(schemas)})"
        )
    out["num_schemas"] = len(schemas)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--backends", default="llguidance,xgrammar")
    ap.add_argument("--batches", default=None, help="default 1,8,32 (1,4 with --quick)")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration (median)")
    ap.add_argument("--walks", type=int, default=3, help="random texts per corpus schema")
    ap.add_argument("--quick", action="store_true", help="1 run per batch size")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.walks = 1, 1
    batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,8,32")).split(",")]
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        cache_dir=args.cache_dir,
        cache=CacheConfig(enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max(batches)),
    )
    core, tokenizer = create_engine(config, progress=False)
    assert core.grammars is not None
    vocabulary = core.grammars.vocabulary
    compilers = {b: make_compiler(GrammarBackend(b), vocabulary) for b in args.backends.split(",")}
    words, stop = mask_words(vocabulary.size), min(tokenizer.eos_token_ids)
    runs: dict[str, Any] = {}
    for backend, compiler in compilers.items():
        if args.skip_throughput:
            break
        core.grammars = compiler
        runs[backend] = throughput(core, tokenizer, batches, args)
        for n, r in runs[backend].items():
            print(
                f"{backend:>10} concurrency {n:>3}: with schema {r['with_schema_tok_s']:8.1f} "
                f"tok/s | without {r['without_tok_s']:8.1f} tok/s | ratio {r['ratio']:.3f} | "
                f"valid {r['valid_outputs']}",
                flush=True,
            )
    attacks = adversarial(compilers, words, stop)
    covered = coverage(compilers, tokenizer, words, stop, args.walks)
    summary = {
        "ratio": {b: {n: r["ratio"] for n, r in res.items()} for b, res in runs.items()},
        "max_compile_ms": {b: max(a[b]["compile_ms"] for a in attacks.values()) for b in compilers},
        "max_mask_ms": {
            b: max(a[b].get("max_mask_ms", 0.0) for a in attacks.values()) for b in compilers
        },
        "coverage": {
            b: f"{covered[b]['compiled']} compiled, {covered[b]['refused']} refused, "
            f"{covered[b]['silently_wrong']} wrong"
            for b in compilers
        },
    }
    record = {
        **engine_record("structured_output", core, args.model),
        "schema": SCHEMA,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "quick": args.quick,
        "throughput": runs,
        "adversarial": attacks,
        "corpus": covered,
        **summary,
    }
    publish(args.out_dir, "structured_output", record, summary)
    return summary


if __name__ == "__main__":
    main()
