"""Engine throughput against HF transformers `generate`, in one run (same model, dtype and
seeded prompts; engines alternating; medians), with a roofline ceiling on CPU. Method and
figures: docs/benchmarks.md.

    python bench/engine_throughput.py            # SmolLM2, bf16, CPU: 1/8/32/64 concurrent
    python bench/engine_throughput.py --quick    # a fast smoke run
    python bench/engine_throughput.py --quick --cpu-isa avx2   # as an AVX2-only CPU runs
    # (on an AVX-512 CPU the bench reruns itself with torch, so transformers, held to AVX2,
    # and llama.cpp's AVX2 build from `make bench-peers-avx2`)
    python bench/engine_throughput.py --temperature 0.8   # sampled, not greedy
    python bench/engine_throughput.py --model synthetic:llama3.2-1b --device cuda
    python bench/engine_throughput.py --peer transformers,llama.cpp   # `make bench-peers`

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import llamacpp_peer
from bench.common import (
    add_cache_dir_argument,
    add_cpu_engine_arguments,
    avx2_peer_env,
    cpu_flags,
    engine_record,
    hf_model_for,
    llamacpp_avx2_lib,
    parse_args,
    peers_isa,
    publish,
    timed_calls,
)
from engine.config import CacheConfig, CpuIsa, EngineConfig, SchedulerConfig, WeightFormat
from engine.factory import create_engine, native_kernels
from engine.model.quant_weights import QuantLinear
from engine.model_specs import resolve_model_path
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


def strata_prefill_tok_s(core, prompt: list[int]) -> float:
    """Prompt tokens/s of one prompt's prefill (one new token)."""
    return run_strata(core, [prompt], 1) * len(prompt)


PEERS = ("transformers", "llama.cpp")


def parse_peers(text: str) -> list[str]:
    """`--peer`'s comma-separated engines, each one of PEERS (empty: Strata alone)."""
    peers = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"--peer: unknown engine {unknown[0]!r}; expected {', '.join(PEERS)}")
    return list(dict.fromkeys(peers))


def gguf_for(model: str) -> str:
    """The GGUF file llama.cpp runs for `--model`: the default model's, or the path given."""
    if model != "default" and not model.endswith(".gguf"):
        raise ValueError(f"--peer llama.cpp runs a GGUF file: --model is {model!r}")
    return resolve_model_path(model)


def _rate(fn, work: float, repeats: int = 5, best: bool = True) -> float:
    """`work` units per second over timed calls of `fn`: the best call, or the median."""
    times = timed_calls(fn, repeats, warmup=1)
    return work / (min(times) if best else statistics.median(times))


def cpu_roofline(core, batches: list[int], prompt_len: int, new_tokens: int) -> dict | None:
    """The workload's ceiling on this CPU (see the module docstring); None off the bf16
    native-kernel path, and with quantized weights (their bytes and products differ)."""
    kernels = native_kernels(core.config, core.dtype)  # the build the engine runs
    if kernels is None or core.device.type != "cpu" or core.dtype != torch.bfloat16:
        return None
    if any(isinstance(m, QuantLinear) for m in core.runner.model.modules()):
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
    add_cpu_engine_arguments(ap)
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
    ap.add_argument(
        "--peer",
        default="transformers",
        help="engines to compare with, comma-separated: transformers, llama.cpp "
        "(llama.cpp needs `make bench-peers` and a GGUF model)",
    )
    ap.add_argument("--skip-hf", action="store_true", help="measure Strata only")
    ap.add_argument(
        "--prefill-len",
        type=int,
        default=2048,
        help="prompt tokens of the separate prefill timing (one new token); 0: none",
    )
    ap.add_argument("--kv-cache-gb", type=float, default=2.0)
    add_cache_dir_argument(ap)
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parse_args(ap, argv, batches="1,8", new_tokens=32, repeats=1)
    batches = [int(b) for b in args.batches.split(",")]
    try:
        peers = [] if args.skip_hf else parse_peers(args.peer)
        gguf = gguf_for(args.model) if "llama.cpp" in peers else None
    except ValueError as exc:
        ap.error(str(exc))
    if gguf is not None and not llamacpp_peer.available():
        ap.error("--peer llama.cpp needs llama-cpp-python: `make bench-peers`")
    # on an AVX-512 CPU, llama.cpp's own build would run its AVX-512 code
    avx2_peer = peers_isa()["llama.cpp"] == "avx2" or "avx512f" not in cpu_flags()
    if gguf is not None and args.cpu_isa == "avx2" and not avx2_peer:
        ap.error(
            "--cpu-isa avx2 --peer llama.cpp on an AVX-512 CPU needs llama.cpp built for "
            f"AVX2 in {llamacpp_avx2_lib()}: `make bench-peers-avx2`"
        )

    torch.manual_seed(args.seed)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        cpu_isa=CpuIsa(args.cpu_isa),
        weights=WeightFormat(args.weights),
        seed=args.seed,
        cache_dir=args.cache_dir,
        cache=CacheConfig(
            kv_cache_memory_bytes=int(args.kv_cache_gb * (1 << 30)), enable_prefix_caching=False
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max(batches), max_num_batched_tokens=max(2048, args.prefill_len)
        ),
    )
    core, _ = create_engine(config, progress=False)
    device = core.device
    vocab = core.vocab_size
    hf = hf_model_for(config) if "transformers" in peers else None
    llama = None
    if gguf is not None:
        llama = llamacpp_peer.LlamaCppPeer(gguf, torch.get_num_threads())
        vocab = min(vocab, llama.n_vocab)

    # warm up every engine (allocator, kernels, one-time builds) outside the timings
    warm = make_prompts(2, 16, vocab, args.seed + 1)
    run_strata(core, warm, 4)
    if hf is not None:
        run_hf(hf, warm, 4, device)
    if llama is not None:
        llama.tok_s(warm, 4)

    # each engine's run of one workload; the engines take turns going first, round by round
    def engines(prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
        runs: dict[str, Any] = {
            "strata": lambda: run_strata(core, prompts, new_tokens, args.temperature)
        }
        if hf is not None:
            runs["hf"] = lambda: run_hf(hf, prompts, new_tokens, device, args.temperature)
        if llama is not None:
            runs["llamacpp"] = lambda: llama.tok_s(prompts, new_tokens)
        return runs

    def measure(runs: dict[str, Any]) -> dict[str, list[float]]:
        rates: dict[str, list[float]] = {name: [] for name in runs}
        order = list(runs)
        for i in range(args.repeats):
            turn = order[i % len(order) :] + order[: i % len(order)]
            for name in turn:
                rates[name].append(runs[name]())
        return rates

    tok_s: dict[str, dict[str, float]] = {"strata": {}, "hf": {}, "llamacpp": {}}
    rounds: dict[str, dict[str, list[float]]] = {}  # every run, for the spread behind a median
    for n in batches:
        prompts = make_prompts(n, args.prompt_len, vocab, args.seed + n)
        rates = measure(engines(prompts, args.new_tokens))
        rounds[str(n)] = {name: [round(x, 1) for x in r] for name, r in rates.items()}
        for name, r in rates.items():
            tok_s[name][str(n)] = round(statistics.median(r), 1)
        print(
            f"concurrency {n:>3}: "
            + " | ".join(f"{name} {v[str(n)]:8.1f} tok/s" for name, v in tok_s.items() if v),
            flush=True,
        )

    def ratios(peer: str) -> dict[str, float]:
        return {n: round(tok_s["strata"][n] / v, 2) for n, v in tok_s[peer].items()}

    summary: dict[str, Any] = {
        "strata_tok_s": tok_s["strata"],
        "hf_tok_s": tok_s["hf"],
        "ratio": ratios("hf"),
    }
    prefill: dict[str, float] = {}
    if llama is not None:
        summary["llamacpp_tok_s"] = tok_s["llamacpp"]
        summary["ratio_vs_llamacpp"] = ratios("llamacpp")
    if args.prefill_len > 0:
        (long_prompt,) = make_prompts(1, args.prefill_len, vocab, args.seed + 7)
        runs = {"strata": lambda: strata_prefill_tok_s(core, long_prompt)}
        if llama is not None:
            runs["llamacpp"] = lambda: llama.prefill_tok_s(long_prompt)
        prefill_rates = measure(runs)
        rounds[f"prefill_{args.prefill_len}"] = {
            name: [round(x, 1) for x in r] for name, r in prefill_rates.items()
        }
        prefill = {name: round(statistics.median(r), 1) for name, r in prefill_rates.items()}
        summary["prefill_tok_s"] = prefill
        if "llamacpp" in prefill:
            summary["prefill_ratio_vs_llamacpp"] = round(prefill["strata"] / prefill["llamacpp"], 2)
        print(
            f"prefill {args.prefill_len}: "
            + " | ".join(f"{name} {v:8.1f} prompt tok/s" for name, v in prefill.items()),
            flush=True,
        )
    if llama is not None:
        llama.close()
    roofline = cpu_roofline(core, batches, args.prompt_len, args.new_tokens)
    if roofline is not None:
        print(
            f"roofline: packed GEMM {roofline['gemm_gflops']} GFLOP/s, memory reads "
            f"{roofline['read_gb_s']} GB/s -> ceiling tok/s {roofline['ceiling_tok_s']}",
            flush=True,
        )
    kernels = native_kernels(config, core.dtype)
    record = {
        **engine_record("engine_throughput", core, args.model),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "prefill_len": args.prefill_len,
        "weights": core.config.weights.value,  # `fastest` resolved
        "quick": args.quick,
        "isa": kernels.isa if kernels is not None else None,  # the instruction level
        "repeats": args.repeats,
        "seed": args.seed,
        "temperature": args.temperature,
        "prefix_caching": False,
        "peers": peers,
        "peers_isa": peers_isa(),  # the peers' instruction level: AVX2-held or the CPU's
        "roofline": roofline,
        **summary,
        "rounds": rounds,
    }
    if llama is not None:
        record |= {
            "llamacpp_version": llamacpp_peer.version(),
            "llamacpp_mode": llamacpp_peer.MODE,
            "llamacpp_threads": llama.threads,
            "gguf": Path(gguf).name if gguf else None,
        }
    publish(args.out_dir, "engine_throughput", record, summary)
    return summary


def hold_peers(argv: list[str]) -> None:
    """With `--cpu-isa avx2` on an AVX-512 CPU, rerun this command with its peers held to
    AVX2 too (bench/common.py: AVX2_ENV); torch reads its switch when it loads."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--cpu-isa", default="auto")
    if ap.parse_known_args(argv)[0].cpu_isa != "avx2":
        return
    env = avx2_peer_env(dict(os.environ))
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


if __name__ == "__main__":
    hold_peers(sys.argv[1:])
    main()
