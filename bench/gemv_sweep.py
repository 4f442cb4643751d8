"""Triton's GEMV (engine/kernels/triton_gemv.py) against cuBLAS at a model's one-token
projection shapes, over a sweep of tile sizes and warps per program.

A batch-1 decode step is bound by streaming the weights, so each matrix-vector product is
timed as weight bytes over time, against the device's copy bandwidth (device-to-device,
read + write) measured in the same run. The weights are random bf16 (never zeros), and
each product reads another of enough copies that they do not fit in the GPU's L2 cache.
On a GPU each is timed as a decode step runs it: a CUDA graph of back-to-back products
(each on the next copy), replayed, its time over the products. Per shape: cuBLAS
(`F.linear`), every Triton configuration, and the best one; overall, the
configuration with the least total time over the shapes, weighted by how often a step runs
each (once per layer; the LM head once), and that total against cuBLAS's.

    python bench/gemv_sweep.py            # on a GPU: synthetic:llama3-8b's shapes
    python bench/gemv_sweep.py --quick    # small shapes, two configurations (CPU: interpreter)

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_info, publish, timed_calls
from bench.gpu_decode import copy_bandwidth
from engine.attention.triton_backend import load_triton_kernels
from engine.config import resolve_device
from engine.cuda_graphs import graph_ms_per_call
from engine.model_specs import PRESETS

_L2_MARGIN = 256 << 20  # bytes of weight copies per shape: well past any L2 cache
_GRAPH_CALLS = 16  # products per timed graph (CUDA)


def shapes(preset: str) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, products per decode step) of the model's projections and LM head."""
    c = PRESETS[preset]
    h, layers = c.hidden_size, c.num_layers
    return {
        "qkv_proj": (c.q_size + 2 * c.kv_size, h, layers),
        "o_proj": (h, c.q_size, layers),
        "gate_up_proj": (2 * c.intermediate_size, h, layers),
        "down_proj": (h, c.intermediate_size, layers),
        "lm_head": (c.vocab_size, h, 1),
    }


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median ms of one call of `fn`: on CUDA per product of a graph of `_GRAPH_CALLS` calls
    replayed `repeats` times (no launch gaps, as in a captured decode step); elsewhere per
    host call."""
    if device.type != "cuda":
        return statistics.median(timed_calls(fn, repeats, warmup=1)) * 1e3
    return graph_ms_per_call([fn] * _GRAPH_CALLS, repeats)


def sweep_shape(
    ops: Any,
    n: int,
    k: int,
    configs: list[dict[str, int]],
    device: torch.device,
    gen: torch.Generator,
    repeats: int,
    bandwidth: float,
) -> dict[str, Any]:
    """cuBLAS and every configuration of the Triton GEMV on random weights [n, k]: time,
    fraction of the copy bandwidth, error against cuBLAS, and the best configuration."""
    nbytes = n * k * 2
    copies = max(1, min(16, -(-_L2_MARGIN // nbytes))) if device.type == "cuda" else 1
    weights = [
        (torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        for _ in range(copies)
    ]
    x = torch.randn(1, k, generator=gen, device=device).to(torch.bfloat16)
    turn = itertools.count()
    want = F.linear(x, weights[0]).float()

    def rate(ms: float) -> float:
        return round(nbytes / (ms * 1e-3) / bandwidth, 3)

    def cublas() -> torch.Tensor:
        return F.linear(x, weights[next(turn) % copies])

    cublas_ms = median_ms(cublas, device, repeats)
    points = []
    for cfg in configs:
        tiles = {"block_n": cfg["block_n"], "block_k": cfg["block_k"]}
        launch = {"num_warps": cfg["num_warps"]}

        def triton_gemv(tiles: dict[str, int] = tiles, launch: dict[str, int] = launch) -> Any:
            return ops.gemv(x, weights[next(turn) % copies], **tiles, launch=launch)

        got = ops.gemv(x, weights[0], **tiles, launch=launch).float()
        error = float((got - want).norm() / want.norm())
        assert error < 2e-2, (n, k, cfg, error)  # bf16 outputs, fp32 sums either way
        ms = median_ms(triton_gemv, device, repeats)
        points.append(
            {
                "config": "n{block_n}/k{block_k}/w{num_warps}".format(**cfg),
                "ms": round(ms, 4),
                "of_copy": rate(ms),
                "rel_error": round(error, 5),
            }
        )
    best = min(points, key=lambda p: p["ms"])
    return {
        "n": n,
        "k": k,
        "weight_bytes": nbytes,
        "cublas_ms": round(cublas_ms, 4),
        "cublas_of_copy": rate(cublas_ms),
        "triton": points,
        "best": best["config"],
        "best_vs_cublas": round(cublas_ms / best["ms"], 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default="llama3-8b", help="a synthetic preset's shapes")
    ap.add_argument("--block-n", default="4,8,16")
    ap.add_argument("--block-k", default="256,512,1024")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--repeats", type=int, default=30, help="timed graph replays per point (GPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    if args.quick or not gpu:
        args.model, args.block_n, args.block_k, args.warps = "tiny", "8", "64,128", "4"
        args.repeats = 1 if not gpu else args.repeats
    configs = [
        {"block_n": int(n), "block_k": int(k), "num_warps": int(w)}
        for n, k, w in itertools.product(
            args.block_n.split(","), args.block_k.split(","), args.warps.split(",")
        )
    ]
    ops = load_triton_kernels(device, "triton_gemv")
    bandwidth = copy_bandwidth(device, 1 << 30 if gpu else 64 << 20)
    gen = torch.Generator(device).manual_seed(args.seed)
    print(f"device {machine_info(device)['device']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")

    results: dict[str, Any] = {}
    total_ms: dict[str, float] = {}
    for name, (n, k, per_step) in shapes(args.model).items():
        row = sweep_shape(ops, n, k, configs, device, gen, args.repeats, bandwidth)
        row["per_step"] = per_step
        total_ms["cublas"] = total_ms.get("cublas", 0.0) + per_step * row["cublas_ms"]
        for point in row["triton"]:
            total_ms[point["config"]] = total_ms.get(point["config"], 0.0) + per_step * point["ms"]
        results[name] = row
        best = next(t for t in row["triton"] if t["config"] == row["best"])
        print(
            f"{name:>13} [{n} x {k}]: cuBLAS {row['cublas_ms'] * 1e3:8.1f} us "
            f"({row['cublas_of_copy']:.0%} of copy), best Triton {row['best']} "
            f"{best['ms'] * 1e3:8.1f} us ({best['of_copy']:.0%}, "
            f"{row['best_vs_cublas']}x)",
            flush=True,
        )

    cublas_total = total_ms.pop("cublas")
    best_config = min(total_ms, key=lambda key: total_ms[key])
    summary = {
        "device": machine_info(device)["device"],
        "model": f"synthetic:{args.model}",
        "step_ms": {"cublas": round(cublas_total, 3), best_config: round(total_ms[best_config], 3)},
        "best_config": best_config,
        "best_vs_cublas": round(cublas_total / total_ms[best_config], 3),
        "of_copy": {
            name: {
                "cublas": r["cublas_of_copy"],
                "best": next(t["of_copy"] for t in r["triton"] if t["config"] == best_config),
            }
            for name, r in results.items()
        },
    }
    record = {
        **machine_info(device),
        "benchmark": "gemv_sweep",
        "weights": "random bf16 (seeded), the model's shapes",
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "configs": configs,
        "step_ms_by_config": {k: round(v, 3) for k, v in total_ms.items()},
        "shapes": results,
        **summary,
    }
    publish(args.out_dir, "gemv_sweep", record, summary)
    return record


if __name__ == "__main__":
    main()
