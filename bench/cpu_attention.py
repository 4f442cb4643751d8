"""The native CPU attention kernel (engine/kernels/cpu.py `paged_decode`) over 32-bit, bf16
and FP8 pages, for the builds of the kernels that `--builds` names: `native` (this CPU's
vector units: the AVX-512 paths where it has them), `avx2` (x86-64-v3, the AVX2 paths) and
`portable` (x86-64-v2, the scalar C paths); native and portable by default.

Two shapes of SmolLM2-135M's attention (9 query heads over 3 KV heads of 64):
- a prefill chunk: 256 query rows after 768 cached tokens (each row attends to its prefix,
  as a prompt's chunk does);
- a decode step: 32 sequences of 2,048 tokens, one new token each.
Pages are random (seeded) and scattered over the pool; queries and outputs are fp32 (bf16
with bf16 pages). Each point is the median of a few calls after one untimed call.

    python bench/cpu_attention.py
    python bench/cpu_attention.py --builds native,avx2,portable
    python bench/cpu_attention.py --quick

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_info, publish, timed_calls
from engine.kernels.cpu import CpuKernels, load_cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
PAGES = {"f32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def shapes(quick: bool) -> dict[str, tuple[int, int, bool]]:
    """name -> (rows, cached tokens, prefill: whether the rows are one prompt's chunk)."""
    if quick:
        return {"prefill": (32, 96, True), "decode": (4, 256, False)}
    return {"prefill": (256, 768, True), "decode": (32, 2048, False)}


def inputs(rows: int, cached: int, prefill: bool, page: str, gen: torch.Generator) -> dict:
    """paged_decode's arguments: scattered pages, one table per row, each row's length."""
    longest = cached + (rows if prefill else 1)
    per_seq = -(-longest // BLOCK)
    seqs = 1 if prefill else rows
    num_blocks = seqs * per_seq + 8
    dtype = PAGES[page]
    k, v = (torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    args: dict[str, Any] = {"k_pages": k.to(dtype), "v_pages": v.to(dtype)}
    if dtype == torch.float8_e4m3fn:
        for name in ("k_scales", "v_scales"):
            args[name] = torch.rand(num_blocks, BLOCK, KV_HEADS, generator=gen) + 0.5
    perm = torch.randperm(num_blocks, generator=gen)[: seqs * per_seq].view(seqs, per_seq)
    if prefill:  # every row reads the prompt's blocks, up to its own position
        table = perm.expand(rows, per_seq).contiguous()
        lens = torch.arange(cached + 1, cached + rows + 1, dtype=torch.int32)
    else:
        table = perm.contiguous()
        lens = torch.full((rows,), cached, dtype=torch.int32)
    q_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    args["q"] = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(q_dtype)
    args["block_tables"], args["seq_lens"] = table.to(torch.int64), lens
    return args


def time_point(kernels: CpuKernels, args: dict, repeats: int) -> float:
    """Median ms of one call."""

    def call() -> object:
        return kernels.paged_decode(
            args["q"],
            args["k_pages"],
            args["v_pages"],
            args["block_tables"],
            args["seq_lens"],
            HEAD_DIM**-0.5,
            k_scales=args.get("k_scales"),
            v_scales=args.get("v_scales"),
        )

    return statistics.median(timed_calls(call, repeats, warmup=1)) * 1e3


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--builds", default="native,portable")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cache-dir", default=None, help="where the kernels are built (a temp dir)")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats = 2
    ms: dict[str, dict[str, float]] = {}
    for build in args.builds.split(","):
        kernels = load_cpu_kernels(args.cache_dir, arch=build)
        if kernels is None:
            raise SystemExit("the native CPU kernels did not build (no C compiler?)")
        for name, (rows, cached, prefill) in shapes(args.quick).items():
            for page in PAGES:
                point = inputs(
                    rows, cached, prefill, page, torch.Generator().manual_seed(args.seed)
                )
                key = f"{name}/{page}"
                ms.setdefault(build, {})[key] = round(time_point(kernels, point, args.repeats), 3)
                print(f"{build:>9} {key:>13}: {ms[build][key]:9.3f} ms", flush=True)
    summary = {"device": machine_info(torch.device("cpu"))["device"], "ms": ms}
    record = {
        **machine_info(torch.device("cpu")),
        "benchmark": "cpu_attention",
        "shapes": {
            k: dict(zip(("rows", "cached", "prefill"), v, strict=True))
            for k, v in shapes(args.quick).items()
        },
        "heads": {"query": HEADS, "kv": KV_HEADS, "dim": HEAD_DIM, "block": BLOCK},
        "repeats": args.repeats,
        "quick": args.quick,
        **summary,
    }
    publish(args.out_dir, "cpu_attention", record, summary)
    return record


if __name__ == "__main__":
    main()
