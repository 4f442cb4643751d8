"""The Triton GEMV kernel (interpreted on CPU) against torch's linear, and the module that
sends one-row inputs to it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.attention.triton_backend import load_triton_kernels
from engine.model.triton_layers import TritonLinear
from tests.triton_marks import INTERPRETED

pytestmark = INTERPRETED


@pytest.fixture(scope="module")
def ops():
    return load_triton_kernels(torch.device("cpu"), "triton_gemv")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "bias"), [(40, 72, False), (33, 1000, True), (8, 16, False)])
def test_gemv_matches_linear(ops, dtype, n, k, bias):
    """Rows and columns that are not multiples of the tiles, with and without a bias; in
    fp32 against fp64, in bf16 against torch's bf16 linear (one rounding of the fp32 sum)."""
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    x = torch.randn(1, k, generator=gen).to(dtype)
    got = ops.gemv(x, w, b, block_n=8, block_k=64)
    assert got.shape == (1, n) and got.dtype == dtype
    want = (x.double() @ w.double().T + (0 if b is None else b.double())).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol * k**0.5, rtol=tol)


def test_triton_linear_sends_one_row_to_the_kernel_and_more_to_torch(ops, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(48, 24)
    layer = TritonLinear(linear, ops)
    assert layer.weight is linear.weight and layer.bias is linear.bias  # shared
    calls = []
    kernel = ops.gemv

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(ops, "gemv", counted)
    with torch.no_grad():
        for rows in (1, 3):
            x = torch.randn(rows, 48, generator=gen)
            torch.testing.assert_close(layer(x), linear(x), atol=1e-5, rtol=1e-5)
    assert calls == [(1, 48)]
