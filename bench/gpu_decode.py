"""Decode step time, tok/s and achieved memory bandwidth of the engine's decode path, by batch
and context, with FP8 and 16-bit KV pages, against HF transformers `generate`; on a GPU at
`synthetic:llama3-8b`, on CPU small (`synthetic:tiny`). Method and figures:
docs/benchmarks.md.

    python bench/gpu_decode.py            # on a GPU: the full grid
    python bench/gpu_decode.py --quick    # fewer shapes and steps
    python bench/gpu_decode.py --batches 1 --gemv cublas   # one-token steps by cuBLAS alone
    python bench/gpu_decode.py --batches 1,64 --contexts 2048 --profile   # where a step goes
    python bench/gpu_decode.py --weights 16bit,fp8 --kv fp8 --skip-hf   # FP8 weights' steps

`--weights` takes a list of weight formats (`EngineConfig.weights`), each run as one more
engine per KV dtype in the same process, so on the same device: 16-bit weights' points keep
their KV dtype's name (`fp8`, `bf16`), the others are named `<weights>w-<kv>` (`fp8w-fp8`).
With both 16bit and fp8, `fp8_weights_step_ratio` is each point's FP8-weight step time over
the 16-bit one's, by KV dtype and shape. On CPU, FP8 weights run under Triton's interpreter
(`--backend triton`, the only place they run there): a check that the path works, not a
figure.

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import hf_model_for, machine_info, publish
from engine.attention.paged import SeqSlice
from engine.config import (
    CacheConfig,
    EngineConfig,
    GemvKernel,
    KernelBackend,
    KVCacheDtype,
    SchedulerConfig,
    WeightFormat,
    resolve_device,
)
from engine.core import EngineCore
from engine.factory import create_engine
from engine.model.fp8_weights import Fp8Linear
from engine.model.native_cpu import NativeLinear
from engine.model.triton_layers import PROJECTIONS, TritonLinear

_GIB = 1 << 30
KV_DTYPES = {"fp8": KVCacheDtype.FP8_E4M3, "bf16": KVCacheDtype.AUTO}


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 2):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times[2:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(core: EngineCore) -> int:
    model = core.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # FP8 weights' row scales
    total += sum(b.nbytes for name, b in model.named_buffers() if name.endswith("weight_scale"))
    if not model.config.tie_word_embeddings:  # the table is only indexed, never streamed
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def one_token_kernels(core: EngineCore) -> dict[str, str]:
    """Which kernel the engine gave each projection's (and the LM head's) one-token product:
    "cublas" (torch's matmul), "triton" (the GEMV), "triton-fp8" (FP8 weights) or "native"
    (the CPU kernels)."""
    return {name: _kernel_of(m) for name, m in _product_modules(core).items()}


def fp8_plans(core: EngineCore) -> dict[str, str]:
    """The GEMV tiles the engine chose for each FP8 product (none with 16-bit weights)."""
    modules = _product_modules(core)
    return {name: m.plan.name for name, m in modules.items() if isinstance(m, Fp8Linear)}


def _product_modules(core: EngineCore) -> dict[str, torch.nn.Module]:
    """The first layer's projections and the LM head, by name."""
    model = core.runner.model
    layer = model.layers[0]
    layer = getattr(layer, "inner", layer)  # a native decoder layer wraps the modules
    modules = {name: getattr(layer, name) for name in PROJECTIONS}
    modules["lm_head"] = model.lm_head
    return modules


def _kernel_of(module: torch.nn.Module) -> str:
    if isinstance(module, Fp8Linear):
        return "triton-fp8"
    if isinstance(module, TritonLinear):
        return "triton"
    return "native" if isinstance(module, NativeLinear) else "cublas"


def build_engine(
    args: argparse.Namespace,
    kv: str,
    device: torch.device,
    weights: str = "16bit",
    pdl: bool = True,
) -> EngineCore:
    """An engine whose KV pool takes what the GPU has left after the weights."""
    max_len = max(args.contexts) + 1
    fp8_on_cpu = weights == "fp8" and device.type != "cuda"
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=str(device),
        seed=args.seed,
        weights=WeightFormat(weights),
        backend=KernelBackend.TRITON if fp8_on_cpu else KernelBackend.AUTO,
        cache=CacheConfig(
            kv_cache_dtype=KV_DTYPES[kv],
            kv_cache_memory_bytes=int(args.kv_gb * _GIB),
            enable_prefix_caching=False,
        ),
        scheduler=SchedulerConfig(max_num_seqs=max(args.batches), max_model_len=max_len),
        cuda_graph_max_batch=max(args.batches),
        gemv=GemvKernel(args.gemv),
        pdl=pdl,
    )
    core, _ = create_engine(config, progress=False)
    return core


def decode_point(
    core: EngineCore,
    batch: int,
    context: int,
    steps: int,
    seed: int,
    around: AbstractContextManager[Any] | None = None,
) -> float:
    """Median seconds of one decode step of `batch` sequences at `context` tokens, after 3
    untimed steps; the timed steps run within `around` (a profiler) when given."""
    bs = core.pool.spec.block_size
    per_seq = -(-context // bs)
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(core.pool.num_blocks, generator=gen)[: batch * per_seq].tolist()
    slices = [
        SeqSlice(1, context - 1, blocks[i * per_seq : (i + 1) * per_seq]) for i in range(batch)
    ]
    ids = torch.randint(0, core.vocab_size, (batch,), generator=gen).tolist()
    positions = [context - 1] * batch
    runner = core.runner

    def step() -> float:
        start = time.perf_counter()
        hidden = runner.forward(ids, positions, slices)
        ids[:] = runner.model.compute_logits(hidden).argmax(-1).tolist()
        return time.perf_counter() - start

    with torch.inference_mode():
        for _ in range(3):
            step()
        with around or nullcontext():
            times = [step() for _ in range(steps)]
    return statistics.median(times)


def kernel_profile(
    core: EngineCore, batch: int, context: int, steps: int, seed: int, top: int = 20
) -> dict[str, Any]:
    """Per step: the device busy time and the `top` kernels by device time (on CPU, ops by
    host time), from `steps` more decode steps of this shape under torch's profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = core.pool.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities)
    seconds = decode_point(core, batch, context, steps, seed, around=prof)
    rows = []
    for event in prof.key_averages():
        # on CUDA the kernels' and copies' device time (a host op is credited with its
        # kernels' time too: counting both would count it twice); elsewhere each op's own
        # host time
        if cuda and event.device_type == DeviceType.CPU:
            continue
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us > 0:
            rows.append((us, event.count, event.key))
    rows.sort(reverse=True)
    kernels = [
        {
            "name": name[:120],
            "calls_per_step": round(count / steps, 2),
            "us_per_step": round(us / steps, 1),
        }
        for us, count, name in rows[:top]
    ]
    return {
        "step_ms": round(seconds * 1e3, 3),
        "busy_us_per_step": round(sum(us for us, _, _ in rows) / steps, 1),
        "kernels": kernels,
    }


def hf_decode_tok_s(hf, batch: int, context: int, steps: int, device: torch.device) -> float:
    gen = torch.Generator().manual_seed(batch * 100_003 + context)
    prompt = torch.randint(0, hf.config.vocab_size, (batch, context - 1), generator=gen)
    prompt = prompt.to(device)

    def run(new: int) -> float:
        _sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        _sync(device)
        return time.perf_counter() - start

    run(2)  # warm-up
    first = run(1)
    full = run(1 + steps)
    return batch * steps / max(full - first, 1e-9)


@dataclass
class Figures:
    """The measured points: per engine label, per shape (`b<batch>/c<context>`)."""

    tok_s: dict[str, dict[str, float]] = field(default_factory=dict)
    step_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    hbm_fraction: dict[str, dict[str, float]] = field(default_factory=dict)
    batch1_vs_limit: dict[str, float] = field(default_factory=dict)  # "<label>/c<context>"
    profiles: dict[str, Any] = field(default_factory=dict)  # "<label>/b<batch>/c<context>"
    skipped: list[str] = field(default_factory=list)


def engine_label(weights: str, kv: str, pdl: bool = True) -> str:
    """16-bit weights' points are named by their KV dtype alone (as before `--weights`);
    an engine without programmatic dependent launch (`--pdl off`) gets "-nopdl" after."""
    label = kv if weights == "16bit" else f"{weights}w-{kv}"
    return label if pdl else f"{label}-nopdl"


def measure_engine(
    core: EngineCore,
    label: str,
    args: argparse.Namespace,
    bandwidth: float,
    figures: Figures,
) -> None:
    """Every (batch, context) point of one engine, into `figures` (mutated)."""
    wbytes = weight_bytes(core)
    spec = core.pool.spec
    for context in args.contexts:
        for batch in args.batches:
            key = f"{label}/b{batch}/c{context}"
            shape = f"b{batch}/c{context}"
            if batch * -(-context // spec.block_size) > core.pool.num_blocks:
                figures.skipped.append(f"{key}: KV exceeds the pool")
                continue
            seconds = decode_point(core, batch, context, args.steps, args.seed)
            need = wbytes + batch * context * spec.bytes_per_token
            fraction = need / seconds / bandwidth
            figures.tok_s.setdefault(label, {})[shape] = round(batch / seconds, 1)
            figures.step_ms.setdefault(label, {})[shape] = round(seconds * 1e3, 3)
            figures.hbm_fraction.setdefault(label, {})[shape] = float(f"{fraction:.3g}")
            if batch == 1:
                limit = wbytes / bandwidth
                figures.batch1_vs_limit[f"{label}/c{context}"] = round(seconds / limit, 2)
            print(
                f"{key:>18}: step {seconds * 1e3:8.2f} ms  {batch / seconds:9.1f} tok/s  "
                f"{need / seconds / 1e9:7.1f} GB/s ({fraction:.0%} of copy)",
                flush=True,
            )
            if args.profile:
                figures.profiles[key] = kernel_profile(core, batch, context, 5, args.seed)
                print(_profile_lines(key, figures.profiles[key]), flush=True)


def fp8_weights_ratio(
    step_ms: dict[str, dict[str, float]], kv_names: list[str]
) -> dict[str, float]:
    """`<kv>/<shape>` -> FP8 weights' step time over 16-bit weights', where both ran (and
    `<kv>-nopdl/<shape>` for the engines without programmatic dependent launch)."""
    ratios = {}
    for kv, pdl in itertools.product(kv_names, (True, False)):
        sixteen = step_ms.get(engine_label("16bit", kv, pdl), {})
        fp8 = step_ms.get(engine_label("fp8", kv, pdl), {})
        for shape, ms in sixteen.items():
            if shape in fp8:
                ratios[f"{engine_label('16bit', kv, pdl)}/{shape}"] = round(fp8[shape] / ms, 3)
    return ratios


def pdl_ratio(step_ms: dict[str, dict[str, float]]) -> dict[str, float]:
    """`<label>/<shape>` -> the step time with programmatic dependent launch over without,
    where both ran."""
    ratios = {}
    for label, points in step_ms.items():
        for shape, ms in step_ms.get(f"{label}-nopdl", {}).items():
            if shape in points:
                ratios[f"{label}/{shape}"] = round(points[shape] / ms, 3)
    return ratios


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default=None, help="default: synthetic:llama3-8b on CUDA")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default=None, help="default: 1,16,64,128 (CPU: 1,4)")
    ap.add_argument("--contexts", default=None, help="default: 512,2048,8192 (CPU: 64,256)")
    ap.add_argument("--kv", default="fp8,bf16")
    ap.add_argument(
        "--weights",
        default="16bit",
        help="weight formats to run, each with every --kv: 16bit, fp8, auto (comma list)",
    )
    ap.add_argument(
        "--pdl",
        default="on",
        help="on, off or on,off: engines with and without programmatic dependent launch "
        "(EngineConfig.pdl; where the GPU has none, both run the same)",
    )
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 32, CPU 4)")
    ap.add_argument("--kv-gb", type=float, default=None, help="KV pool (default: what fits)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile", action="store_true", help="kernel times of a few steps per batch")
    ap.add_argument(
        "--gemv",
        choices=[k.value for k in GemvKernel],
        default="auto",
        help="one-token steps' products: per shape the faster (auto), cuBLAS, or Triton's GEMV",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    args.model = args.model or ("synthetic:llama3-8b" if gpu else "synthetic:tiny")
    quick_grid = ("1,64", "512,2048") if gpu else ("1,4", "64")
    full_grid = ("1,16,64,128", "512,2048,8192") if gpu else ("1,4", "64,256")
    grid = quick_grid if args.quick else full_grid
    args.batches = [int(b) for b in (args.batches or grid[0]).split(",")]
    args.contexts = [int(c) for c in (args.contexts or grid[1]).split(",")]
    args.steps = args.steps or (8 if args.quick else 32 if gpu else 4)
    kv_names = args.kv.split(",")
    weight_names = args.weights.split(",")

    bandwidth = copy_bandwidth(device, _GIB if gpu else 256 << 20)
    print(f"device {machine_info(device)['device']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    if args.model.startswith("synthetic:"):
        print(f"model {args.model}: random weights (seeded {args.seed}), real shapes")
    figures = Figures()
    config_used: dict[str, Any] = {}
    launches = [{"on": True, "off": False}[p] for p in args.pdl.split(",")]
    for pdl, weights, kv in itertools.product(launches, weight_names, kv_names):
        label = engine_label(weights, kv, pdl)
        if args.kv_gb is None:
            args.kv_gb = _kv_budget_gib(args, device)
        try:
            core = build_engine(args, kv, device, weights, pdl)
        except Exception as exc:  # the other engines' figures still count
            figures.skipped.append(f"{label}: {type(exc).__name__}: {exc}")
            print(f"{label}: failed to start ({exc!r})", flush=True)
            del exc
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
            continue
        spec = core.pool.spec
        config_used[label] = {
            "weights": weights,
            "pdl": bool(getattr(core.runner.attn, "pdl", False)),
            "attention": type(core.runner.attn).__name__,
            "decode_graphs": core.runner.graphs is not None,
            "kv_bytes_per_token": spec.bytes_per_token,
            "kv_pool_blocks": core.pool.num_blocks,
            "weight_bytes_read": weight_bytes(core),
            "one_token_products": one_token_kernels(core),
            "fp8_plans": fp8_plans(core),
        }
        products = config_used[label]["one_token_products"]
        print(f"{label}: one-token products by {products}", flush=True)
        measure_engine(core, label, args, bandwidth, figures)
        del core
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    tok_s, step_ms = figures.tok_s, figures.step_ms
    fp8_ratio = fp8_weights_ratio(step_ms, kv_names)
    for point, ratio in fp8_ratio.items():
        print(f"{point:>18}: FP8 weights' step {ratio:.3f}x the 16-bit weights'")

    hf_tok_s: dict[str, float] = {}
    ratio_vs_hf: dict[str, float] = {}
    if not args.skip_hf:
        config = EngineConfig(
            model=args.model, dtype=args.dtype, device=str(device), seed=args.seed
        )
        hf = hf_model_for(config)
        config_used["hf_attention"] = getattr(hf.config, "_attn_implementation", None)
        for context in args.contexts:
            for batch in args.batches:
                shape = f"b{batch}/c{context}"
                try:
                    peer = hf_decode_tok_s(hf, batch, context, args.steps, device)
                except torch.OutOfMemoryError:
                    figures.skipped.append(f"hf/{shape}: out of memory")
                    gc.collect()
                    if gpu:
                        torch.cuda.empty_cache()
                    continue
                hf_tok_s[shape] = round(peer, 1)
                best = max(
                    (tok_s[kv].get(shape, 0.0) for kv in kv_names if kv in tok_s), default=0.0
                )
                ratio_vs_hf[shape] = round(best / peer, 2)
                print(
                    f"transformers {shape:>12}: {peer:9.1f} tok/s  (Strata {ratio_vs_hf[shape]}x)"
                )
    summary = {
        "device": machine_info(device)["device"],
        "tok_s": tok_s,
        "hbm_fraction": figures.hbm_fraction,
        "hf_tok_s": hf_tok_s,
        "ratio_vs_hf": ratio_vs_hf,
    }
    if fp8_ratio:
        summary["fp8_weights_step_ratio"] = fp8_ratio
    if pdl_ratio(step_ms):
        summary["pdl_step_ratio"] = pdl_ratio(step_ms)
    record = {
        **machine_info(device),
        "benchmark": "gpu_decode",
        "model": args.model,
        "weights": "random (seeded), real shapes" if "synthetic" in args.model else "checkpoint",
        "dtype": args.dtype,
        "steps": args.steps,
        "gemv": args.gemv,
        "weight_formats": weight_names,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "step_ms": step_ms,
        "batch1_step_vs_weight_streaming_limit": figures.batch1_vs_limit,
        "engine": config_used,
        "profiles": figures.profiles,
        "skipped": figures.skipped,
        **summary,
    }
    publish(args.out_dir, "gpu_decode", record, summary)
    return record


def _profile_lines(key: str, prof: dict[str, Any], top: int = 8) -> str:
    head = (
        f"{key:>18}: profiled step {prof['step_ms']:.2f} ms, "
        f"busy {prof['busy_us_per_step'] / 1e3:.2f} ms"
    )
    rows = [
        f"{k['us_per_step']:>12.1f} us {k['calls_per_step']:>7.1f}x  {k['name'][:70]}"
        for k in prof["kernels"][:top]
    ]
    return "\n".join([head, *rows])


def _kv_budget_gib(args: argparse.Namespace, device: torch.device) -> float:
    """KV pool size: on a GPU, what is free minus the weights and a working margin; on CPU,
    enough for the largest shape."""
    if device.type != "cuda":
        return 1.0
    free, _ = torch.cuda.mem_get_info(device)
    weights = 16.1 * _GIB if "8b" in args.model else 3 * _GIB
    return max(1.0, (free - weights - 10 * _GIB) / _GIB)


if __name__ == "__main__":
    main()
