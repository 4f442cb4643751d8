"""The Triton multi-LoRA kernels (interpreted on CPU) against the torch path of LoRALinear:
a step mixing base tokens and several adapters, at decode and prefill sizes; and their
graph form, over fixed-size buffers padded with length-0 tiles, against the dynamic launch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.attention.triton_backend import load_triton_kernels
from engine.lora.batch import LoRABatch, group_by_slot
from engine.lora.layers import LoRALinear
from tests.triton_marks import INTERPRETED

pytestmark = INTERPRETED

CPU = torch.device("cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("num_tokens", [7, 90])  # the torch path's BGMV and SGMV branches
def test_kernels_match_the_torch_lora_path(dtype, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    slots, rows, fan_in, fan_out = 5, 48, 80, 120  # 3 parts x rank 16; odd widths
    a = (torch.randn(slots, rows, fan_in, generator=gen) / 8).to(dtype)
    b = (torch.randn(slots, fan_out, rows, generator=gen) / 8).to(dtype)
    a[0], b[0] = 0, 0  # slot 0 is the base model
    base = nn.Linear(fan_in, fan_out, bias=False).to(dtype)
    x = torch.randn(num_tokens, fan_in, generator=gen).to(dtype)
    # base tokens, one adapter with more tokens than a tile, and scattered others
    token_slots = torch.randint(0, slots, (num_tokens,), generator=gen).tolist()
    token_slots[: min(20, num_tokens)] = [2] * min(20, num_tokens)
    outs = []
    for ops in (None, load_triton_kernels(CPU, "triton_lora")):
        batch = LoRABatch(ops)
        batch.set(token_slots, CPU)
        with torch.inference_mode():
            outs.append(LoRALinear(base, a, b, batch)(x))
    want, got = outs
    assert not torch.equal(want, base(x).detach()), "the adapters change the output"
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_segments_group_tokens_by_slot():
    batch = LoRABatch(load_triton_kernels(CPU, "triton_lora"))
    token_slots = [0, 3, 1, 3, 0] + [1] * 17
    batch.set(token_slots, CPU)
    assert batch.order is not None and batch.tiles is not None
    order = batch.order.tolist()
    assert order == [2, *range(5, 22), 1, 3]  # slot 1's rows, then slot 3's; no base rows
    tiles = list(zip(*(t.tolist() for t in batch.tiles), strict=True))
    assert tiles == [(1, 0, 16), (1, 16, 2), (3, 18, 2)]


def test_static_rows_pad_with_zero_length_tiles():
    batch = LoRABatch(load_triton_kernels(CPU, "triton_lora"))
    order, tile_slot, tile_start, tile_len = batch.static_rows([0, 3, 1, 3, 0])
    assert order == [2, 1, 3, 0, 0]
    assert list(zip(tile_slot, tile_start, tile_len, strict=True)) == [
        (1, 0, 1),
        (3, 1, 2),
        (0, 0, 0),
        (0, 0, 0),
        (0, 0, 0),
    ]
    assert batch.static_rows([0, 0]) == [[0, 0]] * 4


@pytest.mark.parametrize("dtype", list(TOL))
def test_padding_tiles_leave_the_dynamic_result(dtype):
    """The graph form of a launch: `order` and the tiles at a capacity of one per row, the
    live tiles first and length-0 tiles of leftover slots and starts after them, give the
    dynamic launch's result exactly; with no live tile, y is unchanged."""
    ops = load_triton_kernels(CPU, "triton_lora")
    gen = torch.Generator().manual_seed(7)
    num_rows, slots, rows, fan_in, fan_out = 12, 4, 16, 40, 72
    a = (torch.randn(slots, rows, fan_in, generator=gen) / 8).to(dtype)
    b = (torch.randn(slots, fan_out, rows, generator=gen) / 8).to(dtype)
    x = torch.randn(num_rows, fan_in, generator=gen).to(dtype)
    y = torch.randn(num_rows, fan_out, generator=gen).to(dtype)
    token_slots = [2, 0, 1, 2, 3, 0, 2, 1] + [0] * 4  # the last 4 rows: padding
    order, tiles = group_by_slot(token_slots, ops.BLOCK_T)
    dynamic_tiles = torch.tensor(tiles, dtype=torch.int32).t().contiguous()
    want = ops.lora_apply(
        y.clone(), x, a, b, torch.tensor(order, dtype=torch.int32), tuple(dynamic_tiles)
    )
    assert not torch.equal(want, y), "the adapters change the output"
    static = torch.randint(0, slots, (4, num_rows), generator=gen, dtype=torch.int32)
    static[0, : len(order)] = torch.tensor(order)
    static[1:, : len(tiles)] = dynamic_tiles
    static[3, len(tiles) :] = 0
    got = ops.lora_apply(y.clone(), x, a, b, static[0], (static[1], static[2], static[3]))
    assert torch.equal(got, want)
    static[3] = 0
    assert torch.equal(ops.lora_apply(y.clone(), x, a, b, static[0], tuple(static[1:])), y)
