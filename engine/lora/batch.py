"""`LoRABatch`: which adapter slot each token of a step uses, in the forms the projections
read it (torch ops, the native CPU layers, the Triton kernels, CUDA graph replays)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

from engine.device import to_device


class LoRABatch:
    """The adapter slot of every token of the current step (set by the model runner).

    With the Triton kernels (`ops`, engine/kernels/triton_lora.py) the adapter tokens are
    also grouped by slot once per step, for every projection's segment-gathered kernels.

    Decode steps replayed from CUDA graphs (engine/cuda_graphs.py) cannot branch on the
    step's adapters: for them `static` holds the grouping in fixed buffers, which
    `DecodeGraphs` fills before every replay (`static_rows`), and within `static_step()`
    every projection launches the kernels over them, whatever the step's adapters (with
    none, every tile is padding and every program returns at once).
    """

    def __init__(self, ops: ModuleType | None = None) -> None:
        self.ops = ops
        self.slots: torch.Tensor | None = None  # [T] int64; None when every token is base
        self.present: list[int] = []  # the distinct non-base slots, for the per-adapter path
        self.slots_i32: torch.Tensor | None = None  # native CPU layers: [T] int32, host
        self.order: torch.Tensor | None = None  # Triton: adapter rows grouped by slot
        self.tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # graph steps: [4, max_batch] int32 rows: order, tile slot, tile start, tile length
        self.static: torch.Tensor | None = None
        self.in_static_step = False

    def set(self, token_slots: list[int], device: torch.device) -> None:
        """An eager step's slots (every token's, in step order)."""
        present = sorted(set(token_slots) - {0})
        self.present = present
        self.slots = to_device(torch.tensor(token_slots), device) if present else None
        if present and device.type == "cpu":
            self.slots_i32 = torch.tensor(token_slots, dtype=torch.int32)
        if self.ops is None or not present:
            return
        order, tiles = group_by_slot(token_slots, self.ops.BLOCK_T)
        self.order = to_device(torch.tensor(order, dtype=torch.int32), device)
        cols = to_device(torch.tensor(tiles, dtype=torch.int32).t().contiguous(), device)
        self.tiles = (cols[0], cols[1], cols[2])

    def use_static(self, rows: torch.Tensor) -> None:
        """Take `rows` ([4, max_batch] int32, all padding: zeros) as `static` for graph steps
        of up to max_batch tokens; its first T columns serve a step of T rows. The caller
        owns the buffer and fills it before every replay (`static_rows`)."""
        assert self.ops is not None, "graph steps run the Triton kernels"
        assert rows.dtype == torch.int32 and rows.dim() == 2 and rows.shape[0] == 4
        self.static = rows

    def static_rows(self, token_slots: list[int]) -> list[list[int]]:
        """The first len(token_slots) columns of `static` for a graph step of these slots,
        on the host: the adapter rows grouped by slot, then the live tiles; 0 after them
        (a tile of length 0 is padding)."""
        assert self.ops is not None
        n = len(token_slots)
        order, tiles = group_by_slot(token_slots, self.ops.BLOCK_T)
        cols = zip(*tiles, *[(0, 0, 0)] * (n - len(tiles)), strict=True)  # 3 rows of n
        return [order + [0] * (n - len(order)), *(list(col) for col in cols)]

    @contextmanager
    def static_step(self) -> Iterator[None]:
        """Within it, every projection reads the kernels' inputs from `static`."""
        assert self.static is not None
        self.in_static_step = True
        try:
            yield
        finally:
            self.in_static_step = False

    def static_segments(
        self, num_rows: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """`order` and the tiles of a graph step of `num_rows` rows: views of `static`."""
        assert self.static is not None
        cols = self.static[:, :num_rows]
        return cols[0], (cols[1], cols[2], cols[3])


def group_by_slot(
    token_slots: list[int], per_tile: int
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The adapter tokens' rows grouped by slot in slot order (`order`; base tokens are left
    out), and the tiles over it: (slot, start in `order`, length <= per_tile)."""
    rows_of: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot:
            rows_of.setdefault(slot, []).append(row)
    order: list[int] = []
    tiles: list[tuple[int, int, int]] = []
    for slot in sorted(rows_of):
        rows = rows_of[slot]
        tiles += [
            (slot, len(order) + i, min(per_tile, len(rows) - i))
            for i in range(0, len(rows), per_tile)
        ]
        order += rows
    return order, tiles
