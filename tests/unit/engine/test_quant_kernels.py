"""The quantized linears (csrc/quant.c) against torch references, on every build of the
kernels: the activation quantizer bit for bit, the integer products against the same
arithmetic in float64, and the whole product against the dequantized weight within the
bound that quantizing the activations allows."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu
from engine.kernels.cpu import CpuKernels, load_cpu_kernels
from engine.kernels.cpu_quant import BLOCK, QuantFormat, QuantWeight, quantize

# every build of the kernels the machine makes (the list grows with cpu._ARCH)
BUILDS = [arch for arch in ("native", "avx2", "portable") if arch in cpu._ARCH]
FORMATS = [QuantFormat.Q8, QuantFormat.Q4]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=BUILDS)
def kernels(request, strata_cache_dir) -> CpuKernels:
    k = load_cpu_kernels(str(strata_cache_dir), arch=request.param)
    assert k is not None, "the C kernels must build on the test machine"
    return k


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ref_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] quantized per block of 32 as csrc/quant.c does: d = amax / 32767, values
    round-half-even(x * (1 / d)), and d times the values' sum."""
    m, k = x.shape
    xf = x.float().reshape(m, k // BLOCK, BLOCK)
    d = xf.abs().amax(dim=2) / 32767
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xf * inv[..., None]).clamp(-32767, 32767)
    return q.to(torch.int16).reshape(m, k), d, d * q.sum(dim=2)


def ref_integer_product(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The kernel's arithmetic in float64: sum_b d_b xd_b dot(q_b, xq_b) - m_b xs_b."""
    xq, xd, xs = ref_activations(x)
    values, scales, mins = w.unpacked()
    m, k = x.shape
    dots = torch.einsum(
        "mbj,nbj->mnb",
        xq.double().reshape(m, k // BLOCK, BLOCK),
        values.double().reshape(-1, k // BLOCK, BLOCK),
    )
    y = (dots * xd.double()[:, None, :] * scales.double()[None]).sum(dim=2)
    if mins is not None:
        y = y - xs.double() @ mins.double().T
    return y


def random_weight(fmt: QuantFormat, n: int, k: int, seed: int) -> QuantWeight:
    return quantize(torch.randn(n, k, generator=gen(seed)) * 0.05, fmt)


@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_quantizer_matches_reference_bit_for_bit(kernels, dtype):
    x = (torch.randn(5, 96, generator=gen()) * 3).to(dtype)
    x[1, 32:64] = 0  # an all-zero block: scale 0, values 0
    xq, xd, xs = kernels.quant.activations(x)
    rq, rd, rs = ref_activations(x)
    assert torch.equal(xq, rq) and torch.equal(xd, rd) and torch.equal(xs, rs)
    assert xq[1, 32:64].abs().sum() == 0 and xd[1, 1] == 0


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 6])  # 6: one full tile of 4 rows and a tail of 2
@pytest.mark.parametrize("k", [64, 96])  # 96: an odd number of blocks
def test_linear_matches_integer_reference(kernels, fmt, dtype, rows, k):
    n = 37  # threads split rows unevenly
    w = random_weight(fmt, n, k, seed=rows)
    x = torch.randn(rows, k, generator=gen(1)).to(dtype)
    y = kernels.quant.linear(x, w, None, torch.float32)
    ref = ref_integer_product(x, w)
    # fp32 sums of per-block terms: a few roundings of terms as large as the row's magnitude
    values, scales, mins = w.unpacked()
    terms = values.double().abs() * scales.double().repeat_interleave(BLOCK, dim=1)
    if mins is not None:
        terms = terms + mins.double().abs().repeat_interleave(BLOCK, dim=1)
    magnitude = x.double().abs() @ terms.T  # [M, N]: the sum of the terms' magnitudes
    assert ((y.double() - ref).abs() <= 1e-5 * magnitude + 1e-6).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_within_activation_rounding_of_dequantized_product(kernels, fmt, dtype):
    rows, n, k = 9, 64, 128
    w = random_weight(fmt, n, k, seed=3)
    x = torch.randn(rows, k, generator=gen(4)).to(dtype)
    bias = torch.randn(n, generator=gen(5)).to(dtype)
    y = kernels.quant.linear(x, w, bias, torch.float32)
    wf = w.dequantize().double()
    ref = x.double() @ wf.T + bias.double()
    # each activation is off by at most half its block's step d_x / 2
    _, xd, _ = ref_activations(x)
    step = (xd.double() / 2).repeat_interleave(BLOCK, dim=1)  # [M, K]
    bound = step @ wf.abs().T + 1e-4
    assert ((y.double() - ref).abs() <= bound).all()
    # and the rounding is far smaller than the bound in practice
    assert (y.double() - ref).abs().mean() < 0.2 * bound.mean()


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_output_is_the_fp32_output_rounded(kernels, fmt):
    w = random_weight(fmt, 40, 64, seed=6)
    x = torch.randn(4, 64, generator=gen(7)).to(torch.bfloat16)
    bias = torch.randn(40, generator=gen(8)).to(torch.bfloat16)
    y32 = kernels.quant.linear(x, w, bias, torch.float32)
    y16 = kernels.quant.linear(x, w, bias, torch.bfloat16)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16, y32.to(torch.bfloat16))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_then_dequantize_is_within_half_a_step(fmt):
    w = torch.randn(16, 64, generator=gen(9))
    q = quantize(w, fmt)
    _, scales, _ = q.unpacked()
    err = (q.dequantize() - w).abs().reshape(16, 2, BLOCK)
    assert (err <= scales[..., None] / 2 + 1e-6).all()
    assert q.rows.shape == (16, fmt.row_bytes(64))


def test_packed_rows_round_trip_their_parts():
    values = torch.randint(0, 16, (3, 64), generator=gen(10), dtype=torch.uint8)
    scales, mins = torch.rand(3, 2, generator=gen(11)), torch.rand(3, 2, generator=gen(12))
    q, d, m = QuantWeight.q4(values, scales, mins).unpacked()
    assert torch.equal(q, values) and torch.equal(d, scales) and m is not None
    assert torch.equal(m, mins)
    v8 = torch.randint(-127, 128, (3, 64), generator=gen(13), dtype=torch.int8)
    q8, d8, none = QuantWeight.q8(v8, scales).unpacked()
    assert torch.equal(q8, v8) and torch.equal(d8, scales) and none is None


def test_weight_needs_whole_blocks():
    with pytest.raises(AssertionError, match="multiple of 32"):
        QuantWeight(QuantFormat.Q8, torch.zeros(2, 50, dtype=torch.uint8), 40)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [16, 23])  # many rows: bf16 panels on AVX512-BF16 CPUs
def test_many_rows_within_bf16_rounding_of_the_dequantized_product(kernels, fmt, rows):
    n, k = 128, 96
    w = random_weight(fmt, n, k, seed=14)
    x = torch.randn(rows, k, generator=gen(15)).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen(16)).to(torch.bfloat16)
    y = kernels.quant.linear(x, w, bias, torch.float32)
    wf = w.dequantize().double()
    ref = x.double() @ wf.T + bias.double()
    # weights rounded to bf16 (a relative 2^-9) or activations to 16 bits: either way far
    # within 2^-8 of the sum of the products' magnitudes
    bound = x.double().abs() @ wf.abs().T * 2**-8 + 1e-5
    assert ((y.double() - ref).abs() <= bound).all()
    assert torch.equal(kernels.quant.linear(x, w, bias, torch.bfloat16), y.to(torch.bfloat16))
