"""Prompt scoring (an evaluation harness's loglikelihood requests) against HF transformers.

Both score the same seeded prompts: every prompt token's logprob given the tokens before it,
plus the top-1 alternative at each position (what lm-eval's `is_greedy` reads). Strata runs
them as `SamplingParams(max_tokens=0, prompt_logprobs=1)` requests, continuously batched;
transformers runs one padded forward per batch of `--hf-batch` prompts, then `log_softmax`,
the gather and the top-1. Figures are prompt tokens scored per second, wall time. Strata's
scores are compared with transformers' on every prompt: the max and mean |difference| are
reported (in bf16 the two round differently; in fp32 they agree within 1e-3).

    python bench/prompt_scoring.py            # 64 prompts of 256 tokens, bf16, CPU
    python bench/prompt_scoring.py --quick    # a fast smoke run

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    add_cache_dir_argument,
    engine_record,
    hf_model_for,
    parse_args,
    publish,
)
from bench.engine_throughput import make_prompts
from engine.config import EngineConfig, SchedulerConfig
from engine.factory import create_engine
from engine.protocol import SamplingParams

SCORE = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=1)


def run_strata(core, prompts: list[list[int]]) -> tuple[float, list[list[float]]]:
    """Prompt tokens scored per second, and each prompt's scores (tokens 1..)."""
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(f"s{i}", p, SCORE)
    scores: dict[str, list[float]] = {f"s{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for out in core.step():
            scores[out.request_id] += [lp.logprob for lp in out.prompt_logprobs or ()]
    elapsed = time.perf_counter() - start
    scored = sum(len(p) - 1 for p in prompts)
    return scored / elapsed, [scores[f"s{i}"] for i in range(len(prompts))]


def run_hf(model, prompts: list[list[int]], batch: int) -> tuple[float, list[list[float]]]:
    device = next(model.parameters()).device
    start = time.perf_counter()
    results = []
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch], device=device)
            logits = model(ids).logits[:, :-1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            own = logprobs.gather(2, ids[:, 1:, None]).squeeze(2)
            logprobs.topk(1, dim=-1)  # the top alternative, as the harness reads it
            results += own.tolist()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return sum(len(p) - 1 for p in prompts) / elapsed, results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=8, help="prompts per transformers forward")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each (median)")
    ap.add_argument("--seed", type=int, default=0)
    add_cache_dir_argument(ap)
    ap.add_argument("--quick", action="store_true", help="8 prompts of 64 tokens, 1 run")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parse_args(ap, argv, prompts=8, prompt_len=64, repeats=1)

    torch.manual_seed(args.seed)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        cache_dir=args.cache_dir,
        scheduler=SchedulerConfig(max_num_batched_tokens=2048),
    )
    core, _ = create_engine(config, progress=False)
    hf = hf_model_for(config)
    prompts = make_prompts(args.prompts, args.prompt_len, core.vocab_size, args.seed)
    run_strata(core, prompts[:2])  # warm both paths outside the timings
    run_hf(hf, prompts[:2], args.hf_batch)

    ours: list[float] = []
    peer: list[float] = []
    max_diff = mean_diff = 0.0
    for i in range(args.repeats):  # alternating which goes first
        if i % 2:
            peer.append(run_hf(hf, prompts, args.hf_batch)[0])
        rate, strata_scores = run_strata(core, prompts)
        ours.append(rate)
        if not i % 2:
            rate, hf_scores = run_hf(hf, prompts, args.hf_batch)
            peer.append(rate)
            diff = (torch.tensor(strata_scores) - torch.tensor(hf_scores)).abs()
            max_diff, mean_diff = diff.max().item(), diff.mean().item()
    summary = {
        "strata_tok_s": round(statistics.median(ours), 1),
        "hf_tok_s": round(statistics.median(peer), 1),
        "ratio": round(statistics.median(ours) / statistics.median(peer), 2),
        # bf16: two implementations round differently (fp32 agrees within 1e-3)
        "max_abs_logprob_diff": round(max_diff, 4),
        "mean_abs_logprob_diff": round(mean_diff, 4),
    }
    print(
        f"scoring {args.prompts} prompts x {args.prompt_len} tokens: strata "
        f"{summary['strata_tok_s']} tok/s | transformers {summary['hf_tok_s']} tok/s | "
        f"ratio {summary['ratio']}x | max |logprob diff| {summary['max_abs_logprob_diff']}",
        flush=True,
    )
    record = {
        **engine_record("prompt_scoring", core, args.model),
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "hf_batch": args.hf_batch,
        "quick": args.quick,
        "repeats": args.repeats,
        "seed": args.seed,
        **summary,
        "rounds": {"strata": [round(x, 1) for x in ours], "hf": [round(x, 1) for x in peer]},
    }
    publish(args.out_dir, "prompt_scoring", record, summary)
    return summary


if __name__ == "__main__":
    main()
