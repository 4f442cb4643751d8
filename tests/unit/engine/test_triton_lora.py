"""The Triton multi-LoRA kernels (interpreted on CPU) against the torch path of LoRALinear:
a step mixing base tokens and several adapters, at decode and prefill sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.attention.triton_backend import load_triton_kernels
from engine.lora.layers import LoRABatch, LoRALinear
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
