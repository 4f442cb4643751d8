"""Engine throughput against HF transformers `generate`, in one run (same model, dtype and
seeded prompts; engines alternating; medians), with a roofline ceiling on CPU. Method and
figures: docs/benchmarks.md.

    python bench/engine_throughput.py            # SmolLM2, bf16, CPU: 1/8/32/64 concurrent
    python bench/engine_throughput.py --quick    # a fast smoke run
    python bench/engine_throughput.py --temperature 0.8   # sampled, not greedy
    python bench/engine_throughput.py --model synthetic:llama3.2-1b --device cuda

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
    timed_calls,
)
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.factory import create_engine
from engine.kernels.cpu import load_cpu_kernels
from engine.protocol import SamplingParams


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # stay clear of the special tokens at the start of most vocabularies
    return torch.randint(300, vocab - 1, (num, length), generator=g).tolist()


def run_strata(core, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0) -> float:
    """Tokens/s; with a temperature, each request samples with a seed of its own."""
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        seed = i if temperature > 0 else None
        params = SamplingParams(
            max_tokens=new_tokens, temperature=temperature, seed=seed, ignore_eos=True
        )
        core.add_request(f"b{i}", p, params)
    produced = 0
    while core.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in core.step())
    elapsed = time.perf_counter() - start
    assert produced == len(prompts) * new_tokens, produced
    return produced / elapsed


def run_hf(
    model, prompts: list[list[int]], new_tokens: int, device: torch.device, temperature: float = 0.0
) -> float:
    ids = torch.tensor(prompts, device=device)
    # with a temperature, plain sampling: no top-k or top-p from the model's defaults
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            **(sampling if temperature > 0 else {"do_sample": False}),
        )
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return produced / elapsed


def _rate(fn, work: float, repeats: int = 5, best: bool = True) -> float:
    """`work` units per second over timed calls of `fn`: the best call, or the median."""
    times = timed_calls(fn, repeats, warmup=1)
    return work / (min(times) if best else statistics.median(times))


def cpu_roofline(core, batches: list[int], prompt_len: int, new_tokens: int) -> dict | None:
    """The workload's ceiling on this CPU (see the module docstring); None off the bf16
    native-kernel path."""
    kernels = load_cpu_kernels(core.config.cache_dir)
    if kernels is None or core.device.type != "cpu" or core.dtype != torch.bfloat16:
        return None
    mc = core.model_config
    hidden, inter = mc.hidden_size, mc.intermediate_size
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    body = mc.num_layers * hidden * (q + 2 * kv + q + 3 * inter)  # weights per token
    head = mc.vocab_size * hidden
    if not kernels.can_pack(torch.empty(2 * inter, hidden, dtype=torch.bfloat16)):
        return None
    x = torch.randn(2048, hidden).bfloat16()
    packed = kernels.pack(torch.randn(2 * inter, hidden).bfloat16())
    gemm = _rate(
        lambda: kernels.linear_packed(x, packed, None, 2 * inter, torch.bfloat16),
        2.0 * 2048 * 2 * inter * hidden,
    )
    buf = torch.ones(64 << 20, dtype=torch.float64)  # 512 MiB, far past the caches
    read = _rate(buf.sum, buf.numel() * 8.0, best=False)  # shared memory bus: the median
    kv_bytes = core.pool.spec.bytes_per_token
    weight_bytes = (body + head) * core.dtype.itemsize
    ceiling: dict[str, float] = {}
    for n in batches:
        # prefill (and the first token's logits) is compute-bound
        seconds = 2.0 * n * (prompt_len * body + head) / gemm
        for t in range(1, new_tokens):  # each decode step: compute or memory, whichever is more
            step_bytes = weight_bytes + n * (prompt_len + t) * kv_bytes
            seconds += max(2.0 * n * (body + head) / gemm, step_bytes / read)
        ceiling[str(n)] = round(n * new_tokens / seconds, 1)
    return {
        "gemm_gflops": round(gemm / 1e9, 1),
        "read_gb_s": round(read / 1e9, 1),
        "ceiling_tok_s": ceiling,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy; above: plain sampling, each Strata request with its own seed",
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs per configuration (median)")
    ap.add_argument("--quick", action="store_true", help="batches 1,8, 32 new tokens, 1 run")
    ap.add_argument("--skip-hf", action="store_true", help="measure Strata only")
    ap.add_argument("--kv-cache-gb", type=float, default=2.0)
    add_cache_dir_argument(ap)
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parse_args(ap, argv, batches="1,8", new_tokens=32, repeats=1)
    batches = [int(b) for b in args.batches.split(",")]

    torch.manual_seed(args.seed)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        cache_dir=args.cache_dir,
        cache=CacheConfig(
            kv_cache_memory_bytes=int(args.kv_cache_gb * (1 << 30)), enable_prefix_caching=False
        ),
        scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=2048),
    )
    core, _ = create_engine(config, progress=False)
    device = core.device
    vocab = core.vocab_size
    hf = None if args.skip_hf else hf_model_for(config)

    # warm up both paths (allocator, kernels, one-time builds) outside the timings
    warm = make_prompts(2, 16, vocab, args.seed + 1)
    run_strata(core, warm, 4)
    if hf is not None:
        run_hf(hf, warm, 4, device)

    strata_tok_s: dict[str, float] = {}
    hf_tok_s: dict[str, float] = {}
    ratio: dict[str, float] = {}
    rounds: dict[str, dict[str, list[float]]] = {}  # every run, for the spread behind a median
    for n in batches:
        prompts = make_prompts(n, args.prompt_len, vocab, args.seed + n)
        ours: list[float] = []
        peer: list[float] = []
        for i in range(args.repeats):  # alternating which engine goes first
            if hf is not None and i % 2:
                peer.append(run_hf(hf, prompts, args.new_tokens, device, args.temperature))
            ours.append(run_strata(core, prompts, args.new_tokens, args.temperature))
            if hf is not None and not i % 2:
                peer.append(run_hf(hf, prompts, args.new_tokens, device, args.temperature))
        rounds[str(n)] = {"strata": [round(x, 1) for x in ours], "hf": [round(x, 1) for x in peer]}
        strata_tok_s[str(n)] = round(statistics.median(ours), 1)
        line = f"concurrency {n:>3}: strata {strata_tok_s[str(n)]:8.1f} tok/s"
        if hf is not None:
            hf_tok_s[str(n)] = round(statistics.median(peer), 1)
            ratio[str(n)] = round(strata_tok_s[str(n)] / hf_tok_s[str(n)], 2)
            line += f" | transformers {hf_tok_s[str(n)]:8.1f} tok/s | ratio {ratio[str(n)]:.2f}x"
        print(line, flush=True)

    summary = {"strata_tok_s": strata_tok_s, "hf_tok_s": hf_tok_s, "ratio": ratio}
    roofline = cpu_roofline(core, batches, args.prompt_len, args.new_tokens)
    if roofline is not None:
        print(
            f"roofline: packed GEMM {roofline['gemm_gflops']} GFLOP/s, memory reads "
            f"{roofline['read_gb_s']} GB/s -> ceiling tok/s {roofline['ceiling_tok_s']}",
            flush=True,
        )
    record = {
        **engine_record("engine_throughput", core, args.model),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "quick": args.quick,
        "repeats": args.repeats,
        "seed": args.seed,
        "temperature": args.temperature,
        "prefix_caching": False,
        "roofline": roofline,
        **summary,
        "rounds": rounds,
    }
    publish(args.out_dir, "engine_throughput", record, summary)
    return summary


if __name__ == "__main__":
    main()
