"""FP8-weight products (engine/kernels/triton_fp8_linear.py) against 16-bit ones at a model's
projection shapes, by rows (tokens) per product, over the FP8 kernels' candidate tiles.

Per shape (the four projections and the LM head of `synthetic:llama3-8b`), random weights,
enough copies of each to stay out of the L2 cache, each product timed as a decode step runs
it: 16 back to back in a CUDA graph, each on the next copy (bench/gemv_sweep.py's method).
For each row count:
- 16-bit: cuBLAS (`F.linear`) and, at one row, the Triton GEMV (its default tiles);
- FP8: every candidate the engine times at start for that row count (the GEMV's at one row,
  the row bucket's matmul tiles), each checked against the dequantized product; the fastest
  is what the engine would run;
- gate_up at one row: the GEMV that applies silu(gate) * up, under each tiling, against the
  fastest GEMV followed by the activation kernel (`activation` in the record);
each as a fraction of the copy bandwidth (weight bytes over time; a read-only stream can
pass it a little), and FP8's time over the faster 16-bit one's. Summary: over a step's
products (each projection once per layer, the LM head once), FP8's time over 16-bit's by
row count, and the fastest tiles per shape and row count.

    python bench/fp8_linear.py          # on a GPU
    python bench/fp8_linear.py --quick  # small shapes, one tile each (CPU: interpreter)

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_info, publish
from bench.gemv_sweep import median_ms, shapes
from bench.gpu_decode import copy_bandwidth
from engine.attention.triton_backend import load_triton_kernels
from engine.config import resolve_device
from engine.model.fp8_weights import dequantize_weight, quantize_weight

_L2_MARGIN = 256 << 20  # bytes of weight copies per shape and format: past any L2 cache


def candidates(ops: Any, rows: int, first_only: bool = False) -> list[tuple[str, Any]]:
    """What the engine times at start for products of `rows` rows (engine/model/
    fp8_weights.py): the GEMV's tiles at one row, and the matmul's of the row bucket (with
    `first_only`, the first of each)."""
    bucket = next(b for b in ops.ROW_BUCKETS if b is None or rows <= b)
    gemv = [("fp8_gemv", t) for t in ops.GEMV_CANDIDATES] if rows == 1 else []
    gemm = [("fp8_gemm", t) for t in ops.GEMM_CANDIDATES[bucket]]
    return gemv[:1] + gemm[:1] if first_only else gemv + gemm


def bench_shape(
    ops: Any,
    gemv_ops: Any,
    n: int,
    k: int,
    args: argparse.Namespace,
    bandwidth: float,
    gated: bool = False,
) -> dict[str, Any]:
    """One weight shape: every row count's 16-bit time and the FP8 kernels' candidates;
    `gated` (gate | up rows): at one row, also the GEMV that applies silu(gate) * up against
    the GEMV followed by triton_fused's kernel, with the fastest GEMV tiles."""
    device, gen = args.device, torch.Generator(args.device).manual_seed(n + k)
    gpu = device.type == "cuda"
    w0 = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(torch.bfloat16)
    values, scales = quantize_weight(w0)
    copies = max(1, min(16, -(-_L2_MARGIN // (n * k)))) if gpu else 1
    fp8 = [(values.clone(), scales.clone()) for _ in range(copies)]
    copies16 = max(1, min(16, -(-_L2_MARGIN // (2 * n * k)))) if gpu else 1
    sixteen = [w0.clone() for _ in range(copies16)]
    dense = dequantize_weight(values, scales, torch.float32)
    del w0
    turn = itertools.count()

    def of_copy(ms: float, nbytes: int) -> float:
        return round(nbytes / (ms * 1e-3) / bandwidth, 3)

    def timed(fn: Any) -> float:
        return round(median_ms(fn, device, args.repeats), 4)

    row: dict[str, Any] = {"n": n, "k": k, "rows": {}}
    for rows in args.rows:
        x = torch.randn(rows, k, generator=gen, device=device).to(torch.bfloat16)
        want = x.float() @ dense.T
        point: dict[str, Any] = {
            "cublas_ms": timed(lambda x=x: F.linear(x, sixteen[next(turn) % copies16]))
        }
        if rows == 1:
            point["triton_gemv_ms"] = timed(
                lambda x=x: gemv_ops.gemv(x, sixteen[next(turn) % copies16])
            )
        tiles_ms = {}
        for kernel, tiles in candidates(ops, rows, first_only=not gpu):
            fn = getattr(ops, kernel)
            try:
                got = fn(x, values, scales, tiles=tiles).float()
            except Exception as exc:  # does not compile for this device: as the engine skips it
                print(f"  [{n} x {k}] {rows} rows: {tiles.name} does not run here: {exc}")
                continue
            error = float((got - want).norm() / want.norm())
            assert error < 1e-2, (n, k, rows, tiles, error)
            tiles_ms[f"{kernel.removeprefix('fp8_')} {tiles.name}"] = timed(
                lambda fn=fn, x=x, tiles=tiles: fn(x, *fp8[next(turn) % copies], tiles=tiles)
            )
        best = min(tiles_ms, key=lambda t: tiles_ms[t])
        point |= {"fp8_ms": tiles_ms[best], "fp8_tiles": best, "candidates_ms": tiles_ms}
        if gated and rows == 1:
            point["activation"] = _activation_ms(ops, x, fp8, turn, best, timed)
        best16 = min(point["cublas_ms"], point.get("triton_gemv_ms", float("inf")))
        point["fp8_vs_16bit"] = round(point["fp8_ms"] / best16, 3)
        point["fp8_of_copy"] = of_copy(point["fp8_ms"], n * k)
        point["16bit_of_copy"] = of_copy(best16, 2 * n * k)
        row["rows"][rows] = point
        print(
            f"  [{n} x {k}] {rows:>4} rows: 16-bit {best16 * 1e3:8.1f} us "
            f"({point['16bit_of_copy']:.0%}), FP8 {point['fp8_ms'] * 1e3:8.1f} us "
            f"({point['fp8_of_copy']:.0%}, {best}), {point['fp8_vs_16bit']}x",
            flush=True,
        )
    return row


def _activation_ms(
    ops: Any, x: torch.Tensor, fp8: list[Any], turn: Any, best: str, timed: Any
) -> dict[str, Any]:
    """One-row gate_up products with the activation: the GEMV that applies it (as the
    engine runs them without adapters) under each GEMV tiling, against the fastest GEMV
    (`best`, or the default tiles where the matmul was fastest) followed by triton_fused's
    kernel."""
    tiles = next((t for t in ops.GEMV_CANDIDATES if f"gemv {t.name}" == best), None)
    tiles = tiles or ops.DEFAULT_GEMV_TILES

    def separate() -> Any:
        out = ops.fp8_gemv(x, *fp8[next(turn) % len(fp8)], tiles=tiles)
        return ops.triton_fused.silu_mul(out)

    fused = {
        t.name: timed(
            lambda t=t: ops.fp8_gemv(x, *fp8[next(turn) % len(fp8)], tiles=t, silu_mul=True)
        )
        for t in ops.GEMV_CANDIDATES
    }
    fastest = min(fused, key=lambda t: fused[t])
    return {
        "in_gemv_ms": fused[fastest],
        "in_gemv_tiles": fastest,
        "separate_ms": timed(separate),
        "in_gemv_candidates_ms": fused,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default="llama3-8b", help="a synthetic preset's shapes")
    ap.add_argument("--rows", default="1,4,16,64,512")
    ap.add_argument("--repeats", type=int, default=20, help="timed graph replays per point")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    args.device = resolve_device(args.device)
    gpu = args.device.type == "cuda"
    if args.quick or not gpu:
        args.model, args.rows = "tiny", "1,5"
        args.repeats = args.repeats if gpu else 1
    args.rows = [int(r) for r in args.rows.split(",")]
    ops = load_triton_kernels(args.device, "triton_fp8_linear")
    gemv_ops = load_triton_kernels(args.device, "triton_gemv")
    bandwidth = copy_bandwidth(args.device, 1 << 30 if gpu else 64 << 20)
    print(
        f"device {machine_info(args.device)['device']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s"
    )

    results: dict[str, Any] = {}
    for name, (n, k, per_step) in shapes(args.model).items():
        print(f"{name}:", flush=True)
        gated = name == "gate_up_proj"
        results[name] = bench_shape(ops, gemv_ops, n, k, args, bandwidth, gated)
        results[name]["per_step"] = per_step
    step_ratio = {}
    for rows in args.rows:
        fp8 = sum(r["per_step"] * r["rows"][rows]["fp8_ms"] for r in results.values())
        best16 = sum(
            r["per_step"] * r["rows"][rows]["fp8_ms"] / r["rows"][rows]["fp8_vs_16bit"]
            for r in results.values()
        )
        step_ratio[f"{rows} rows"] = round(fp8 / best16, 3)
    best_tiles = {
        f"{rows} rows": {name: r["rows"][rows]["fp8_tiles"] for name, r in results.items()}
        for rows in args.rows
    }
    summary = {
        "device": machine_info(args.device)["device"],
        "model": f"synthetic:{args.model}",
        "fp8_vs_16bit_step_products": step_ratio,
        "best_tiles": best_tiles,
    }
    record = {
        **machine_info(args.device),
        "benchmark": "fp8_linear",
        "weights": "random (seeded), the model's shapes; FP8 e4m3 with a scale per row",
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "shapes": results,
        **summary,
    }
    publish(args.out_dir, "fp8_linear", record, summary)
    return record


if __name__ == "__main__":
    main()
