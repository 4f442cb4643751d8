"""Decode steps replayed from CUDA graphs: one graph per batch size of a ladder, captured over
static padded inputs (`GraphInputs`: one device buffer written through a pinned host mirror,
block tables sent only where they grew). On a CPU the same buffers run eagerly. The design
is in docs/design/scheduler.md.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import numpy as np
import torch

from engine.attention.paged import SeqSlice
from engine.attention.triton_backend import TritonContext, TritonPagedAttention
from engine.lora.batch import LoRABatch
from engine.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def batch_ladder(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, 16, 24, ... up to (and including) `max_batch`."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += list(range(8, max_batch, 8))
    return [*sizes, max_batch]


def graph_ms_per_call(calls: Sequence[Callable[[], object]], repeats: int = 20) -> float:
    """Median device ms per call of `calls` run back to back in one CUDA graph, replayed
    `repeats` times: kernels timed as a captured decode step runs them, without the gaps
    that launching each from the host leaves. Each call runs once first, outside the
    capture (Triton compiles there)."""
    device = torch.cuda.current_device()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return statistics.median(times)


class GraphInputs:
    """A decode graph's inputs in one device buffer and a host mirror of it (pinned on CUDA).

    Layout, for `max_batch` rows: int64 token ids, positions and KV slots [3, max_batch];
    then int32: the adapter rows [4, max_batch] (with adapters), sequence lengths
    [max_batch] and the block table [max_batch, max_blocks]. `write` fills the host side
    for a step; `send` copies what changed to the device, queued on the current stream:
    everything before the block table, and the band of table rows that changed.

    A block table row is written incrementally: it remembers the list it mirrors and how
    many of its entries it holds, and a step whose sequence in that row has the same list
    (which only grows, see `SeqSlice`) writes the new entries alone. A sequence found in
    another row (the rows after one that left move up) has that row copied over first. A
    row that turns to padding is zeroed once.
    """

    def __init__(
        self, max_batch: int, max_blocks: int, with_lora: bool, device: torch.device
    ) -> None:
        n = max_batch
        self.max_blocks = max_blocks
        self._i64_bytes = 3 * n * 8
        self._table_start = self._i64_bytes + 4 * ((4 * n if with_lora else 0) + n)
        nbytes = self._table_start + 4 * n * max_blocks
        self.device_buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host_buffer = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.static = self._views(self.device_buffer, n, with_lora)
        host = self._views(self.host_buffer, n, with_lora)
        self.host = {name: view.numpy() for name, view in host.items()}
        # per table row: the list it mirrors and how many of its entries it holds, and how
        # many columns are not zero
        self._rows: list[tuple[list[int] | None, int]] = [(None, 0)] * n
        self._widths = [0] * n
        self._dirty = (0, 0)  # table rows written since the last send
        self._rows_index = np.arange(n)
        # the last send, which the host waits for before writing the mirror again (CUDA)
        self._sent = torch.cuda.Event() if device.type == "cuda" else None

    def _views(self, buffer: torch.Tensor, n: int, with_lora: bool) -> dict[str, torch.Tensor]:
        i64 = buffer[: self._i64_bytes].view(torch.int64).view(3, n)
        i32 = buffer[self._i64_bytes :].view(torch.int32)
        lora = 4 * n if with_lora else 0
        views = {
            "input_ids": i64[0],
            "positions": i64[1],
            "slot_mapping": i64[2],
            "seq_lens": i32[lora : lora + n],
            "block_table": i32[lora + n :].view(n, self.max_blocks),
        }
        if with_lora:
            views["lora_rows"] = i32[:lora].view(4, n)
        return views

    def write(
        self,
        size: int,
        input_ids: list[int],
        seqs: list[SeqSlice],
        block_size: int,
        lora_rows: list[list[int]] | None = None,
    ) -> None:
        """The host mirror for a decode step of len(seqs) sequences (one new token each) in
        a graph of `size` rows; the rows from len(seqs) to `size` become padding."""
        if self._sent is not None and not self._sent.query():
            self._sent.synchronize()  # the last step's copy has yet to read the mirror
        h = self.host
        n = len(seqs)
        h["input_ids"][:n] = input_ids
        positions = h["positions"]
        positions[:n] = [s.context_len for s in seqs]  # one new token each
        h["input_ids"][n:size] = 0
        positions[n:size] = 0
        self._write_tables(size, seqs)
        # each new token's slot, from the tables just mirrored
        pos = positions[:n]
        blocks = h["block_table"][self._rows_index[:n], pos // block_size]
        h["slot_mapping"][:n] = blocks.astype(np.int64) * block_size + pos % block_size
        h["slot_mapping"][n:size] = -1
        h["seq_lens"][:size] = positions[:size] + 1
        if lora_rows is not None:
            h["lora_rows"][:, :n] = lora_rows
            h["lora_rows"][:, n:size] = 0  # no tiles: stale ones from a larger step never run

    def _write_tables(self, size: int, seqs: list[SeqSlice]) -> None:
        table, rows, widths = self.host["block_table"], self._rows, self._widths
        lo, hi = self._dirty if self._dirty[1] else (size, 0)
        # a sequence in another row than last step (one before it left, or one joined):
        # its row is copied within the mirror, in numpy, then only its new entries written
        moved = [i for i, s in enumerate(seqs) if rows[i][0] is not s.block_table]
        if moved:
            row_of = {id(m): j for j, (m, _) in enumerate(rows) if m is not None}
            pairs = [
                (i, row_of[id(seqs[i].block_table)])
                for i in moved
                if id(seqs[i].block_table) in row_of
            ]
            if pairs:
                dst, src = [i for i, _ in pairs], [j for _, j in pairs]
                table[dst] = table[src]  # the right side is read whole first
                states = [(rows[j], widths[j]) for j in src]
                for i, (state, width) in zip(dst, states, strict=True):
                    rows[i], widths[i] = state, width
                lo, hi = min(lo, dst[0]), max(hi, dst[-1] + 1)
        for i, s in enumerate(seqs):
            blocks = s.block_table
            mirrored, have = rows[i]
            if mirrored is not blocks or len(blocks) < have:
                have = 0
            if len(blocks) > have:
                table[i, have : len(blocks)] = blocks[have:]
                rows[i] = (blocks, len(blocks))
                widths[i] = max(widths[i], len(blocks))
                lo, hi = min(lo, i), max(hi, i + 1)
        for i in range(len(seqs), size):
            if widths[i]:
                table[i, : widths[i]] = 0  # a padding row reads block 0
                rows[i], widths[i] = (None, 0), 0
                lo, hi = min(lo, i), max(hi, i + 1)
        self._dirty = (lo, hi) if lo < hi else (0, 0)

    def send(self) -> None:
        """Copy what `write` changed to the device (no host wait on CUDA)."""
        start = self._table_start
        self.device_buffer[:start].copy_(self.host_buffer[:start], non_blocking=True)
        lo, hi = self._dirty
        if lo < hi:
            row_bytes = 4 * self.max_blocks
            band = slice(start + lo * row_bytes, start + hi * row_bytes)
            self.device_buffer[band].copy_(self.host_buffer[band], non_blocking=True)
            self._dirty = (0, 0)
        if self._sent is not None:
            self._sent.record()


class DecodeGraphs:
    """Static decode inputs, one captured forward per ladder size (CUDA), padded replay."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        attn: TritonPagedAttention,
        max_batch: int,
        max_model_len: int,
        lora: LoRABatch | None = None,
    ) -> None:
        """`lora`: the model's adapter batch (Triton kernels), whose static buffers this
        allocates and fills; None without adapters."""
        self.model = model
        self.attn = attn
        self.device = attn.pool.device
        self.sizes = batch_ladder(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // attn.block_size)
        self.max_model_len = max_model_len
        self.lora = lora
        self.inputs = GraphInputs(self.max_batch, self.max_blocks, lora is not None, self.device)
        static = self.inputs.static
        self.input_ids = static["input_ids"]
        self.positions = static["positions"]
        self.slot_mapping = static["slot_mapping"]
        self.seq_lens = static["seq_lens"]
        self.block_table = static["block_table"]
        self.lora_rows = static.get("lora_rows")
        if lora is not None:
            assert self.lora_rows is not None
            lora.use_static(self.lora_rows)
        self._reset_padding()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def context(self, size: int) -> TritonContext:
        """The attention context over the first `size` rows of the static buffers."""
        return TritonContext(
            slot_mapping=self.slot_mapping[:size],
            block_table=self.block_table[:size],
            num_decode=size,
            seq_lens=self.seq_lens[:size],
            tiles=None,
            num_splits=self.attn.decode_splits(size, self.max_model_len),
        )

    def _forward(self, size: int) -> torch.Tensor:
        ids, pos = self.input_ids[:size], self.positions[:size]
        with nullcontext() if self.lora is None else self.lora.static_step():
            return self.model(ids, pos, self.attn, self.context(size))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every ladder size, largest first, sharing one memory pool (CUDA only).

        Each size runs once eagerly first: Triton compiles there, never inside a capture.
        The padding rows write nothing, so capturing leaves the KV pool unchanged; every
        LoRA tile is padding then, so the LoRA kernels are captured but update nothing.
        """
        if self.device.type != "cuda":
            return
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured decode graphs for batch sizes %s", self.sizes)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    def run(
        self, input_ids: list[int], seqs: list[SeqSlice], lora_slots: list[int] | None = None
    ) -> torch.Tensor:
        """Hidden states [n, hidden] for a decode-only step of n = len(seqs) sequences;
        `lora_slots`: each sequence's adapter slot (0: base), when adapters are enabled."""
        n = len(seqs)
        size = next(s for s in self.sizes if s >= n)
        lora_rows = None
        if self.lora is not None:
            assert lora_slots is not None and len(lora_slots) == n
            lora_rows = self.lora.static_rows(lora_slots)
        self.inputs.write(size, input_ids, seqs, self.attn.block_size, lora_rows)
        self.inputs.send()
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:n]
        graph.replay()
        return self.outputs[size][:n]

    def _reset_padding(self) -> None:
        """Every row becomes padding (see the module docstring)."""
        lora_rows: list[list[int]] | None = None if self.lora is None else [[]] * 4
        self.inputs.write(self.max_batch, [], [], self.attn.block_size, lora_rows)
        self.inputs.send()
