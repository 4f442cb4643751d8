"""The FP8-weight Triton kernels (interpreted on CPU) against the product of the dequantized
weights, and the choice between them by the number of rows.

Bound: the kernels sum in fp32, as the reference does in fp64, over weights that are exactly
e4m3 values times a float32 scale. fp32 outputs agree to fp32 rounding of the sums
(1e-5 relative, sqrt(K) absolute); bf16 outputs are one conversion of the fp32 result,
so they agree to one bf16 ulp (2^-7 relative: the interpreter truncates where a GPU rounds
to nearest) plus the same.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.triton_backend import load_triton_kernels
from engine.model.fp8_weights import dequantize_weight, quantize_weight
from tests.triton_marks import INTERPRETED

pytestmark = INTERPRETED


@pytest.fixture(scope="module")
def ops():
    return load_triton_kernels(torch.device("cpu"), "triton_fp8_linear")


def _case(rows: int, n: int, k: int, bias: bool, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + n * k)
    values, scales = quantize_weight(torch.randn(n, k, generator=gen) / k**0.5)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, k, generator=gen).to(dtype)
    want = x.double() @ dequantize_weight(values, scales, torch.float64).T
    if b is not None:
        want += b.double()
    return x, values, scales, b, want


def _assert_within_bound(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-5 * k**0.5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.double(), want, atol=1e-4 * k**0.5, rtol=2**-7)


@pytest.mark.parametrize("kernel", ["fp8_gemv", "fp8_gemm"])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "bias"), [(40, 72, False), (33, 1000, True), (8, 16, False)])
def test_fp8_kernels_match_the_dequantized_product(ops, kernel, rows, dtype, n, k, bias):
    """Rows, weight rows and columns that are not multiples of the tiles (1000 columns: a
    ragged last tile), with and without a bias; both kernels at every row count."""
    x, values, scales, b, want = _case(rows, n, k, bias, dtype)
    got = getattr(ops, kernel)(x, values, scales, b)
    assert got.shape == (rows, n) and got.dtype == dtype
    _assert_within_bound(got, want, k)


@pytest.mark.parametrize("rows", [1, 3])
def test_every_gemv_tiling_the_engine_may_choose_gives_the_product(ops, rows):
    x, values, scales, b, want = _case(rows, 40, 1000, True, torch.float32)
    for tiles in ops.GEMV_CANDIDATES:
        _assert_within_bound(ops.fp8_gemv(x, values, scales, b, tiles=tiles), want, 1000)


@pytest.mark.parametrize("kernel", ["fp8_gemv", "fp8_gemm"])
def test_fp8_kernels_read_strided_rows_and_tiles_over_every_column(ops, kernel):
    """x a view with a row stride past its width (a slice of a wider activation); K a
    multiple of the column tile (the unmasked loop); more weight rows than one tile."""
    gen = torch.Generator().manual_seed(3)
    values, scales = quantize_weight(torch.randn(200, 256, generator=gen) / 16)
    wide = torch.randn(5, 300, generator=gen)
    x = wide[:, :256]
    got = getattr(ops, kernel)(x, values, scales)
    want = x.double() @ dequantize_weight(values, scales, torch.float64).T
    _assert_within_bound(got, want, 256)


@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("inter", "k", "bias"), [(20, 72, False), (33, 1000, True)])
def test_the_gate_up_product_with_its_activation_has_the_two_kernels_bits(
    ops, rows, dtype, inter, k, bias
):
    """`silu_mul`: the GEMV applies silu(gate) * up to its own output (an odd number of
    columns: a ragged last tile of each half), and `fp8_linear` past the GEMV applies
    triton_fused's kernel; either way, the bits of the product followed by that kernel."""
    x, values, scales, b, _ = _case(rows, 2 * inter, k, bias, dtype)
    silu_mul = load_triton_kernels(torch.device("cpu"), "triton_fused").silu_mul
    want = silu_mul(ops.fp8_gemv(x, values, scales, b))
    got = ops.fp8_gemv(x, values, scales, b, silu_mul=True)
    assert got.shape == (rows, inter) and got.dtype == dtype
    assert torch.equal(got, want)
    plan = ops.Fp8Plan(gemv_max_rows=2)  # rows over 2: the matmul, then the kernel
    fused = ops.fp8_linear(x, values, scales, b, plan=plan, silu_mul=True)
    products = ops.fp8_linear(x, values, scales, b, plan=plan)
    assert torch.equal(fused, silu_mul(products))
    gate, up = products.double().chunk(2, dim=-1)  # and what the activation is
    torch.testing.assert_close(fused.double(), torch.nn.functional.silu(gate) * up, **_TOL[dtype])


_TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 2**-6}}


def test_fp8_linear_sends_few_rows_to_the_gemv_and_more_to_the_matmul(ops, monkeypatch):
    calls = []
    for name in ("fp8_gemv", "fp8_gemm"):
        kernel = getattr(ops, name)

        def counted(x, *args, _name=name, _kernel=kernel, **kwargs):
            calls.append((_name, x.shape[0]))
            return _kernel(x, *args, **kwargs)

        monkeypatch.setattr(ops, name, counted)
    x, values, scales, _, _ = _case(8, 24, 48, False, torch.float32)
    for rows in (1, 2, 5):
        ops.fp8_linear(x[:rows], values, scales)
    assert calls == [("fp8_gemv", 1), ("fp8_gemm", 2), ("fp8_gemm", 5)]
    calls.clear()
    for rows in (1, 4, 5):  # a plan that takes the GEMV up to 4 rows
        ops.fp8_linear(x[:rows], values, scales, plan=ops.Fp8Plan(gemv_max_rows=4))
    assert calls == [("fp8_gemv", 1), ("fp8_gemv", 4), ("fp8_gemm", 5)]


def test_no_rows_give_an_empty_product(ops):
    x, values, scales, _, _ = _case(1, 24, 48, False, torch.bfloat16)
    for kernel in (ops.fp8_gemv, ops.fp8_gemm):
        assert kernel(x[:0], values, scales).shape == (0, 24)
