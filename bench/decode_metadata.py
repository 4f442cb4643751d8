"""Host time to build a decode step's attention metadata: the block tables and the slots of
the new tokens, which the GPU waits for between two decode steps (the step's only host work
besides scheduling and sampling).

B sequences of C tokens each (their block tables of C / 16 blocks, scattered), one new
token each. Timed: `padded_tables` (numpy, row by row) against building the same table
with one tensor per row, the way steps built it before; and `slot_indices`.

    python bench/decode_metadata.py                # B = 64, 128, 256 at C = 2,048 and 8,192
    python bench/decode_metadata.py --quick

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_info, write_result
from engine.attention.paged import SeqSlice, padded_tables, slot_indices

BLOCK = 16


def row_by_row(seqs: list[SeqSlice]) -> torch.Tensor:
    """The peer: a zeroed table, one tensor per row copied in."""
    width = max(len(s.block_table) for s in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, s in enumerate(seqs):
        table[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
    return table


def median_us(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.repeats = [8], [512], 20
    rng = random.Random(args.seed)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            blocks = rng.sample(range(batch * (context // BLOCK + 1)), batch * (context // BLOCK))
            per = context // BLOCK
            # lengths vary a little, as in a real batch: tables of unequal width
            seqs = [SeqSlice(1, context - 1 - (i % BLOCK) * 3, blocks[i * per : (i + 1) * per])
                    for i in range(batch)]  # fmt: skip
            for s in seqs:
                del s.block_table[(s.context_len // BLOCK) + 1 :]
            assert torch.equal(padded_tables(seqs, torch.int32), row_by_row(seqs))
            row = {
                "batch": batch,
                "context": context,
                "padded_tables_us": median_us(
                    lambda seqs=seqs: padded_tables(seqs, torch.int32), args.repeats
                ),
                "row_by_row_us": median_us(lambda seqs=seqs: row_by_row(seqs), args.repeats),
                "slot_indices_us": median_us(
                    lambda seqs=seqs: slot_indices(seqs, BLOCK), args.repeats
                ),
            }
            row["speedup"] = round(row["row_by_row_us"] / row["padded_tables_us"], 2)
            rows.append(row)
            print(f"B={batch:4d} C={context:5d}: block table {row['padded_tables_us']:8.1f} us "
                  f"(one tensor per row {row['row_by_row_us']:8.1f} us, {row['speedup']}x); "
                  f"slots {row['slot_indices_us']:.1f} us")  # fmt: skip
    record = {
        "benchmark": "decode_metadata",
        **machine_info(torch.device("cpu")),
        "seed": args.seed,
        "repeats": args.repeats,
        "quick": args.quick,
        "rows": rows,
    }
    print(f"wrote {write_result(args.out_dir, 'decode_metadata', record)}")
    summary = {
        "block_table_us": {f"{r['batch']}x{r['context']}": r["padded_tables_us"] for r in rows},
        "speedup_vs_row_by_row": {f"{r['batch']}x{r['context']}": r["speedup"] for r in rows},
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
