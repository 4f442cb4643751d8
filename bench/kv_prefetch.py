"""A step whose pages come back from host RAM layer by layer, against the same step with every
page resident; with `--running R`, the same arrivals beside R decoding requests. Method and
figures: docs/benchmarks.md.

    python bench/kv_prefetch.py --device cuda          # llama3.2-1b, B=8, C=8192
    python bench/kv_prefetch.py --quick                # synthetic:tiny on CPU, B=2, C=256
    python bench/kv_prefetch.py --device cuda --running 32     # a busy engine
    python bench/kv_prefetch.py --device cuda --profile /tmp/prof

`--profile DIR` adds one round, left out of the figures, whose two steps are profiled (the
host's Python calls, and torch's profiler trace and table). The last printed line is one
JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_info, publish
from engine.config import CacheConfig, EngineConfig, KVCacheDtype, SchedulerConfig
from engine.factory import create_engine
from engine.loader.synthetic import PRESETS, SYNTHETIC_PREFIX
from engine.protocol import SamplingParams

_SYNTHETIC = {SYNTHETIC_PREFIX + name for name in PRESETS}

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@contextlib.contextmanager
def profiled(out: Path | None, name: str, cuda: bool) -> Iterator[None]:
    """Profile what runs inside into `out` (nothing when None): `name`.pstats.txt (cProfile,
    by cumulative time), `name`.trace.json and `name`.ops.txt (torch's profiler)."""
    if out is None:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    calls = cProfile.Profile()
    with torch.profiler.profile(activities=activities) as traced:
        calls.enable()
        try:
            yield
        finally:
            calls.disable()
    text = io.StringIO()
    pstats.Stats(calls, stream=text).sort_stats("cumulative").print_stats(60)
    (out / f"{name}.pstats.txt").write_text(text.getvalue())
    traced.export_chrome_trace(str(out / f"{name}.trace.json"))
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    (out / f"{name}.ops.txt").write_text(traced.key_averages().table(sort_by=sort, row_limit=40))


class PhaseTimers:
    """Host seconds spent in each phase of a step, while `phases` is a dict (else untimed)."""

    def __init__(self, core) -> None:
        self.phases: dict[str, float] | None = None
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(core.pool.loads, "_issue_queued", "issue")
        self._wrap(core.runner, "execute", "forward")
        self._wrap(core.pool.loads, "finish", "finish")

    def _wrap(self, owner, method: str, phase: str) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.phases is not None:
                    spent = time.perf_counter() - start
                    self.phases[phase] = self.phases.get(phase, 0.0) + spent

        setattr(owner, method, timed)


def timed_step(
    core,
    timers: PhaseTimers,
    prompts: list[list[int]],
    tag: str,
    profile: Path | None = None,
    name: str = "",
) -> tuple[float, int, int, dict[str, float]]:
    """Seconds of the first step of `prompts` (device synchronised), their prompt tokens
    found on the device and in host RAM, and the step's phases (`PhaseTimers`); with
    `profile`, that step is profiled there under `name`."""
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}-{i}", p, ONE)
    cuda = core.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profiled(profile, name, cuda):
        phases: dict[str, float] = {}
        timers.phases = phases
        start = time.perf_counter()
        outs = core.step()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        timers.phases = None
    while core.has_unfinished():
        outs += core.step()
    host = sum(o.num_cached_host_tokens for o in outs if o.finished)
    device = sum(
        o.num_cached_tokens - o.num_cached_host_tokens - o.num_cached_disk_tokens
        for o in outs
        if o.finished
    )
    return seconds, device, host, phases


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--model",
        default=None,
        help="a synthetic preset; default: synthetic:llama3.2-1b on CUDA, synthetic:tiny elsewhere",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="rounds left out of the figures (default 1; 0 with --quick)",
    )
    ap.add_argument(
        "--running", type=int, default=0, help="requests decoding as the questions arrive (0: none)"
    )
    ap.add_argument("--kv-load", default="auto", choices=["auto", "sync", "thread", "stream"])
    ap.add_argument("--kv-host-reads", default="auto", choices=["auto", "kernel", "copy"])
    ap.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8_e4m3"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="profile one more round's steps into DIR",
    )
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.repeats = 2, 256, 2
    if args.warmup is None:
        args.warmup = 0 if args.quick else 1
    device = torch.device(args.device)
    model = args.model or ("synthetic:llama3.2-1b" if device.type == "cuda" else "synthetic:tiny")
    block = 16
    doc_blocks = -(-(args.context + 1) // block)
    kv_dtype = None if args.kv_cache_dtype is None else KVCacheDtype(args.kv_cache_dtype)
    # device room for one set of documents (the filler evicts them all) and the requests
    # decoding; host RAM for the documents and the filler
    if model not in _SYNTHETIC:
        ap.error(f"--model must be one of {sorted(_SYNTHETIC)}")
    mc = PRESETS[model.removeprefix(SYNTHETIC_PREFIX)]
    per_token = 4 * mc.num_layers * mc.num_kv_heads * mc.head_dim  # K and V, 16-bit
    rounds = args.warmup + args.repeats
    # each decoding request: its context, and a token per step of every round
    # (and while they prefill in turn, the first ones decode already)
    steps = rounds * _steps_per_round(args) + -(-args.running * args.context // _budget(args))
    growth = args.running * (-(-steps // block) + 1)
    decoder_blocks = args.running * doc_blocks + growth
    config = EngineConfig(
        model=model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        enforce_eager=args.running == 0,
        cache=CacheConfig(
            num_blocks=args.batch * (doc_blocks + 1) + decoder_blocks + 8,
            kv_cache_dtype=kv_dtype,
            # (the filler takes every free block: the documents' and the decoders' growth)
            host_memory_bytes=2 * (args.batch * doc_blocks + growth) * block * per_token,
            kv_load=args.kv_load,
            kv_host_reads=args.kv_host_reads,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=2 * args.batch + args.running, max_num_batched_tokens=_budget(args)
        ),
    )
    core, _ = create_engine(config, progress=False)
    timers = PhaseTimers(core)
    vocab = core.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    docs = torch.randint(300, vocab - 1, (args.batch, args.context), generator=g).tolist()
    filler = torch.randint(300, vocab - 1, (args.batch, args.context), generator=g).tolist()
    for i, d in enumerate(docs):  # prefill each document once
        timed_step(core, timers, [d], f"doc{i}")
    if args.running:
        return busy(core, args, model, docs, g)
    resident: list[float] = []
    prefetch: list[float] = []
    found = {"resident": [0, 0], "prefetch": [0, 0]}
    phases: dict[str, list[dict[str, float]]] = {"resident": [], "prefetch": []}
    # first the warm-up rounds; with --profile, one more round at the end: all left out
    for r in range(rounds + (args.profile is not None)):
        questions = [[*d, 300 + r] for d in docs]
        profile = args.profile if r == rounds else None
        res = timed_step(core, timers, questions, f"res{r}", profile, "resident")
        # the filler takes the device pool: every document page goes down to host RAM
        timed_step(core, timers, [[*f, r] for f in filler], f"fill{r}")
        pre = timed_step(core, timers, questions, f"pre{r}", profile, "prefetch")
        if profile is not None or r < args.warmup:
            continue
        for key, times, (s, dev, host, split) in (
            ("resident", resident, res),
            ("prefetch", prefetch, pre),
        ):
            times.append(s)
            found[key][0] += dev
            found[key][1] += host
            phases[key].append(split)
    core.check_integrity()
    res_ms = statistics.median(resident) * 1e3
    pre_ms = statistics.median(prefetch) * 1e3
    summary = {
        "step_ms": {"resident": round(res_ms, 2), "prefetch": round(pre_ms, 2)},
        "ratio": round(pre_ms / res_ms, 3),
        "phases_ms": {
            key: {
                p: round(statistics.median(s.get(p, 0.0) for s in splits) * 1e3, 2)
                for p in ("schedule", "issue", "forward", "finish")
            }
            for key, splits in phases.items()
        },
        "loads": core.pool.loads.backend,
        "host_reads": core.pool.loads.host_reads.value,
        "cached_tokens": {k: {"device": v[0], "host": v[1]} for k, v in found.items()},
    }
    print(
        f"model {model} ({'random weights' if model.startswith('synthetic:') else 'real'}), "
        f"batch {args.batch} x context {args.context}, KV {core.pool.spec.dtype}, "
        f"loads: {summary['loads']}, host rows read by: {summary['host_reads']}"
    )
    print(
        f"step with resident pages {res_ms:.2f} ms; with pages prefetched from host "
        f"{pre_ms:.2f} ms ({summary['ratio']}x)"
    )
    rounds_ms = {"resident": resident, "prefetch": prefetch}
    publish_run(core, args, model, rounds_ms, summary)
    return summary


def _budget(args) -> int:
    return max(2048, args.batch * 64 + args.running)


def _steps_per_round(args) -> int:
    """At most about how many steps a busy round takes: the filler's prefill chunks (it
    covers every free block, somewhat more than the documents), and a few for each set of
    questions."""
    return -(-2 * args.batch * args.context // _budget(args)) + 16


def run_step(core) -> tuple[float, list]:
    """One engine step of a busy engine, timed; its outputs. On CUDA only the compute
    stream is waited for: the copy and save streams run on beside the steps (a step that
    needs their pages waits for them there), and a device-wide sync would charge their
    copies to whichever step happens to be timed."""
    cuda = core.device.type == "cuda"
    if cuda:
        torch.cuda.current_stream(core.device).synchronize()
    start = time.perf_counter()
    outs = core.step()
    if cuda:
        torch.cuda.current_stream(core.device).synchronize()
    return time.perf_counter() - start, outs


def arrive(core, prompts: list[list[int]], tag: str) -> tuple[list[float], float, int, int]:
    """Add `prompts` (one token each) to the running engine and step until each has its
    token: every step's seconds, the seconds until the last token, and the prompt tokens
    found on the device and in host RAM."""
    ids = {f"{tag}-{i}" for i in range(len(prompts))}
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}-{i}", p, ONE)
    steps: list[float] = []
    device = host = 0
    while ids:
        seconds, outs = run_step(core)
        steps.append(seconds)
        for o in outs:
            if o.request_id in ids and o.finished:
                ids.discard(o.request_id)
                host += o.num_cached_host_tokens
                device += o.num_cached_tokens - o.num_cached_host_tokens - o.num_cached_disk_tokens
        assert len(steps) < 10_000, "the questions never ran"
    return steps, time.perf_counter() - start, device, host


def busy(core, args, model: str, docs, g: torch.Generator) -> dict:
    """The questions arrive while `args.running` requests decode (see the module's doc)."""
    vocab = core.vocab_size
    contexts = torch.randint(300, vocab - 1, (args.running, args.context), generator=g).tolist()
    talk = SamplingParams(max_tokens=1_000_000, temperature=0.0, ignore_eos=True)
    for i, c in enumerate(contexts):
        core.add_request(f"decode-{i}", c, talk)
    while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        run_step(core)  # their prefill
    kinds = ("decode", "resident", "prefetch", "ttft_resident", "ttft_prefetch", "waited")
    figures: dict[str, list[float]] = {k: [] for k in kinds}
    found = {"resident": [0, 0], "prefetch": [0, 0]}
    for r in range(args.warmup + args.repeats):
        questions = [[*d, 300 + r] for d in docs]
        decoding = sum(q.request_id.startswith("decode-") for q in core.scheduler.running)
        if decoding < args.running:  # they reached the model's context length
            raise SystemExit("the decoding requests finished early: use a shorter --context")
        decode = min(run_step(core)[0] for _ in range(3))  # the decoders alone
        res_steps, res_ttft, *res_found = arrive(core, questions, f"res{r}")
        # filler over every free block: each document page goes to host RAM
        n_fill = -(-core.block_manager.num_free_blocks * 16 // args.context)
        fill = {f"fill{r}-{i}" for i in range(n_fill)}
        prompts = torch.randint(300, vocab - 1, (n_fill, args.context), generator=g).tolist()
        for i, f in enumerate(prompts):
            core.add_request(f"fill{r}-{i}", f, ONE)
        while fill:
            fill -= {o.request_id for o in run_step(core)[1] if o.finished}
        pre_steps, pre_ttft, *pre_found = arrive(core, questions, f"pre{r}")
        if r < args.warmup:
            continue
        figures["decode"].append(decode)
        figures["resident"].append(res_steps[-1])  # the step they join, pages resident
        figures["prefetch"].append(max(pre_steps))  # the longest while their pages arrive
        figures["ttft_resident"].append(res_ttft)
        figures["ttft_prefetch"].append(pre_ttft)
        figures["waited"].append(len(pre_steps) - 1)
        for key, (dev, host) in (("resident", res_found), ("prefetch", pre_found)):
            found[key][0] += dev
            found[key][1] += host
    for i in range(args.running):
        core.abort_request(f"decode-{i}")
    core.check_integrity()
    ms = {k: round(statistics.median(v) * 1e3, 2) for k, v in figures.items() if k != "waited"}
    summary = {
        "running": args.running,
        "busy": {
            "step_ms": {
                "decode": ms["decode"],
                "resident": ms["resident"],
                "prefetch": ms["prefetch"],
            },
            "ratio": round(ms["prefetch"] / ms["resident"], 3),
            "ttft_ms": {"resident": ms["ttft_resident"], "prefetch": ms["ttft_prefetch"]},
            "steps_waited": statistics.median(figures["waited"]),
        },
        "loads": core.pool.loads.backend,
        "host_reads": core.pool.loads.host_reads.value,
        "cached_tokens": {k: {"device": v[0], "host": v[1]} for k, v in found.items()},
    }
    b = summary["busy"]
    print(
        f"model {model}, {args.running} requests decoding over {args.context} tokens each; "
        f"{args.batch} questions over {args.context}-token documents arrive; "
        f"KV {core.pool.spec.dtype}, loads: {summary['loads']}"
    )
    print(
        f"decode step {b['step_ms']['decode']} ms; step the questions join with resident "
        f"pages {b['step_ms']['resident']} ms; longest step while their pages arrive from "
        f"host {b['step_ms']['prefetch']} ms ({b['ratio']}x); time to first token "
        f"{b['ttft_ms']['resident']} -> {b['ttft_ms']['prefetch']} ms"
    )
    rounds_ms = {k: v for k, v in figures.items() if k != "waited"}
    publish_run(core, args, model, rounds_ms, summary)
    return summary


def publish_run(core, args, model: str, rounds: dict[str, list[float]], summary: dict) -> None:
    """Write the full record (the run, each round's seconds, `summary`) to bench/results/
    and print `summary` as the last line."""
    record = {
        "benchmark": "kv_prefetch",
        **machine_info(core.device),
        "model": model,
        "synthetic_weights": model.startswith("synthetic:"),
        "batch": args.batch,
        "context": args.context,
        "kv_dtype": str(core.pool.spec.dtype),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "quick": args.quick,
        "rounds_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in rounds.items()},
        **summary,
    }
    publish(args.out_dir, "kv_prefetch", record, summary)


if __name__ == "__main__":
    main()
