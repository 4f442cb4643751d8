"""Host time to build a decode step's attention metadata (block tables, new tokens' slots, a
CUDA-graph step's inputs) against the earlier way of building it. Method and figures:
docs/benchmarks.md.

    python bench/decode_metadata.py                # B = 1, 64, 128, 256 at C = 2,048 and 8,192
    python bench/decode_metadata.py --quick
    python bench/decode_metadata.py --device cuda

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_info, publish, timed_calls
from engine.attention.paged import SeqSlice, padded_tables, slot_indices
from engine.cuda_graphs import GraphInputs
from engine.device import to_device

BLOCK = 16


class PerBufferStaging:
    """The peer for graph inputs: separate static buffers, each step's rows and block table
    sent as two tensors, then one launch per buffer to copy them in and to reset the padding
    (the previous `DecodeGraphs.run`)."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        n = max_batch
        self.device = device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_table = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)

    def run(self, input_ids: list[int], seqs: list[SeqSlice]) -> None:
        n = len(seqs)
        inputs = [input_ids, [s.context_len for s in seqs], slot_indices(seqs, BLOCK)]
        rows = to_device(torch.tensor(inputs, dtype=torch.long), self.device)
        self.input_ids[:n].copy_(rows[0])
        self.positions[:n].copy_(rows[1])
        self.slot_mapping[:n].copy_(rows[2])
        self.seq_lens[:n].copy_(rows[1] + 1)
        table = padded_tables(seqs, torch.int32)
        self.block_table[:n, : table.shape[1]].copy_(to_device(table, self.device))
        self.input_ids[n:] = 0
        self.positions[n:] = 0
        self.slot_mapping[n:] = -1
        self.seq_lens[n:] = 1
        self.block_table[n:] = 0


def row_by_row(seqs: list[SeqSlice]) -> torch.Tensor:
    """The peer: a zeroed table, one tensor per row copied in."""
    width = max(len(s.block_table) for s in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, s in enumerate(seqs):
        table[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
    return table


def median_us(
    fn: Callable[[], object], repeats: int, between: Callable[[], object] | None = None
) -> float:
    """Median host time of `fn`; `between` runs untimed after each call (a device sync)."""
    return round(statistics.median(timed_calls(fn, repeats, between=between)) * 1e6, 1)


def graph_input_times(
    seqs: list[SeqSlice], max_model_len: int, device: torch.device, repeats: int
) -> dict[str, float]:
    """Host time to stage one graph step's inputs, both ways, after checking that they
    agree: in a decode step where every 16th sequence (in turn) gains a block, in a step of
    sequences new to the graph (every block table row written whole), and in a step whose
    sequences all moved up a row (as when the first one leaves)."""
    max_batch = len(seqs)
    max_blocks = -(-max_model_len // BLOCK)
    ids = list(range(max_batch))
    one = GraphInputs(max_batch, max_blocks, False, device)
    peer = PerBufferStaging(max_batch, max_blocks, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    step = 0

    def staged() -> None:
        one.write(max_batch, ids, seqs, BLOCK)
        one.send()

    def grow() -> None:
        nonlocal step
        sync()
        for s in seqs[step % 16 :: 16]:
            s.block_table.append(s.block_table[0])
        step += 1

    def renew() -> None:
        sync()
        seqs[:] = [SeqSlice(s.query_len, s.context_len, list(s.block_table)) for s in seqs]

    def rotate() -> None:  # the first sequence to the end: every row moves up
        sync()
        seqs.append(seqs.pop(0))

    for _ in range(2):  # the second time, a step that only grows the tables
        staged()
        peer.run(ids, seqs)
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_table"):
            assert torch.equal(one.static[name], getattr(peer, name)), name
        grow()
    return {
        "graph_inputs_us": median_us(staged, repeats, grow),
        "graph_inputs_new_us": median_us(staged, repeats, renew),
        "graph_inputs_moved_us": median_us(staged, repeats, rotate),
        "per_buffer_us": median_us(lambda: peer.run(ids, seqs), repeats, grow),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 128, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.quick:
        args.batches, args.contexts, args.repeats = [8], [512], 20
    rng = random.Random(args.seed)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            blocks = rng.sample(range(batch * (context // BLOCK + 1)), batch * (context // BLOCK))
            per = context // BLOCK
            # lengths vary a little, as in a real batch: tables of unequal width
            seqs = [
                SeqSlice(1, context - 1 - (i % BLOCK) * 3, blocks[i * per : (i + 1) * per])
                for i in range(batch)
            ]
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
                # room for the blocks the timed steps add
                **graph_input_times(seqs, 2 * context, device, args.repeats),
            }
            row["speedup"] = round(row["row_by_row_us"] / row["padded_tables_us"], 2)
            rows.append(row)
            print(
                f"B={batch:4d} C={context:5d}: block table {row['padded_tables_us']:8.1f} us "
                f"(one tensor per row {row['row_by_row_us']:8.1f} us, {row['speedup']}x); "
                f"slots {row['slot_indices_us']:.1f} us; graph inputs "
                f"{row['graph_inputs_us']:.1f} us, new rows {row['graph_inputs_new_us']:.1f} us, "
                f"moved rows {row['graph_inputs_moved_us']:.1f} us"
                f" (per buffer {row['per_buffer_us']:.1f} us)"
            )
    record = {
        "benchmark": "decode_metadata",
        **machine_info(device),
        "seed": args.seed,
        "repeats": args.repeats,
        "quick": args.quick,
        "rows": rows,
    }
    summary = {
        "block_table_us": {f"{r['batch']}x{r['context']}": r["padded_tables_us"] for r in rows},
        "speedup_vs_row_by_row": {f"{r['batch']}x{r['context']}": r["speedup"] for r in rows},
        "graph_inputs_us": {
            f"{r['batch']}x{r['context']}": {
                k: r[f"{k}_us"]
                for k in ("graph_inputs", "graph_inputs_new", "graph_inputs_moved", "per_buffer")
            }
            for r in rows
        },
    }
    publish(args.out_dir, "decode_metadata", record, summary)
    return summary


if __name__ == "__main__":
    main()
