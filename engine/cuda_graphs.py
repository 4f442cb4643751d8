"""Decode steps replayed from CUDA graphs.

A decode step launches a few hundred small kernels; on a GPU their launch overhead alone can
exceed the time the step spends reading weights. `DecodeGraphs` captures the model's forward
for a ladder of batch sizes (1, 2, 4, 8, then every multiple of 8 up to the largest) over
preallocated input buffers, and a decode step of n sequences replays the graph of the
smallest captured size >= n:

- inputs (token ids, positions, KV slots, block tables, sequence lengths) are copied into the
  static buffers; rows past n are padding: slot -1 (their K/V are not written), length 1
  over block 0, token 0 at position 0; their outputs are never read;
- the block table has a fixed width (the longest context the engine allows) and every size
  has a fixed number of split-K programs, so one graph serves any mix of context lengths;
- with adapters (a `LoRABatch` on the Triton kernels), each step's adapter tokens grouped by
  slot go into the batch's static buffers (`LoRABatch.static`) in the same copy as the other
  inputs; the LoRA kernels of a size-n graph always launch n tiles' programs, those past the
  step's live tiles returning at once, so one graph serves any mix of adapters, or none.
  Padding rows are base tokens: in no tile.

Prefill and mixed steps, and batches above the largest size, run eagerly. On a CPU device the
same buffers and padding are used but the forward runs eagerly (there is nothing to capture),
which lets tests check that padding never changes a real sequence's result.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

from engine.attention.paged import SeqSlice, padded_tables, slot_indices
from engine.attention.triton_backend import TritonContext, TritonPagedAttention
from engine.device import to_device
from engine.lora.layers import LoRABatch
from engine.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def batch_ladder(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, 16, 24, ... up to (and including) `max_batch`."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += list(range(8, max_batch, 8))
    return [*sizes, max_batch]


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
        n, dev = self.max_batch, self.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.block_table = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.lora = lora
        self.lora_rows = None if lora is None else lora.allocate_static(n, dev)  # [4, n]
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
        self._reset_padding(0)
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
        inputs = [
            input_ids,
            [s.context_len for s in seqs],
            slot_indices(seqs, self.attn.block_size),
        ]
        if self.lora is not None:
            assert lora_slots is not None and len(lora_slots) == n
            inputs += self.lora.static_rows(lora_slots)
        rows = to_device(torch.tensor(inputs, dtype=torch.long), self.device)  # [3 (+ 4), n]
        self.input_ids[:n].copy_(rows[0])
        self.positions[:n].copy_(rows[1])
        self.slot_mapping[:n].copy_(rows[2])
        self.seq_lens[:n].copy_(rows[1] + 1)
        if self.lora_rows is not None:
            self.lora_rows[:, :n].copy_(rows[3:])
        table = padded_tables(seqs, torch.int32)
        self.block_table[:n, : table.shape[1]].copy_(to_device(table, self.device))
        self._reset_padding(n)
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:n]
        graph.replay()
        return self.outputs[size][:n]

    def _reset_padding(self, n: int) -> None:
        """Rows from n on become padding (see the module docstring)."""
        self.input_ids[n:] = 0
        self.positions[n:] = 0
        self.slot_mapping[n:] = -1
        self.seq_lens[n:] = 1
        self.block_table[n:] = 0
        if self.lora_rows is not None:
            self.lora_rows[:, n:] = 0  # no tiles: stale ones from a larger step never run
