"""The quantized linears (csrc/quant.c) against torch references, on every build of the
kernels: the activation quantizers (int16, and the two-level int8 of the many-rows q4 path)
bit for bit, the integer products against the same arithmetic in float64, and the whole
product against the dequantized weight within the bound that quantizing the activations
allows."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu
from engine.kernels.cpu import CpuKernels, load_cpu_kernels
from engine.kernels.cpu_quant import BLOCK, QuantFormat, QuantPath, QuantWeight, quantize

# every build of the kernels the machine makes and runs (the list grows with cpu._ARCH)
BUILDS = [
    arch
    for arch in ("native", "avx512", "avx2", "portable")
    if arch in cpu._ARCH and arch in ("native", *cpu.cpu_isa_levels())
]
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


def ref_activations8(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """x [M, K] in two 8-bit levels per block of 32, as csrc/quant.c's quant_row8: d1 =
    amax / 127, q1 = round-half-even(x * (1 / d1)); blocks whose |q1| sum to under 508 also
    get their rounding error r = x - d1 q1 (one fp32 rounding) quantized the same way."""
    m, k = x.shape
    xf = x.float().reshape(m, k // BLOCK, BLOCK)

    def level(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = v.abs().amax(dim=2) / 127
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        return torch.round(v * inv[..., None]).clamp(-127, 127), d

    q1, d1 = level(xf)
    two = (d1 != 0) & (q1.abs().sum(dim=2) < 508)
    r = (xf.double() - d1.double()[..., None] * q1.double()).float()  # exact, then rounded
    q2, d2 = level(r)
    q2, d2 = torch.where(two[..., None], q2, 0), torch.where(two, d2, 0)
    s1 = d1 * q1.sum(dim=2)
    s = (d2.double() * q2.sum(dim=2).double() + s1.double()).float()  # one fma
    return {
        "q1": q1.to(torch.int8).reshape(m, k),
        "q2": q2.to(torch.int8).reshape(m, k),
        "d1": d1,
        "d2": d2,
        "s": s,
        "two": two,
    }


def takes(kernels: CpuKernels, fmt: QuantFormat, rows: int, n: int, dtype: torch.dtype) -> str:
    """How the activations of a product of `rows` rows and `n` outputs are rounded: `int16`,
    `int8` (two 8-bit levels), or `none` (widened weights, fp32 or bf16 products)."""
    path = kernels.quant.path(fmt, rows, n, dtype)
    eight = (QuantPath.INT8, QuantPath.INT8_ROWS)
    sixteen = (QuantPath.INT16, QuantPath.INT16_PANELS, QuantPath.INT16_ROWS)
    return "int16" if path in sixteen else "int8" if path in eight else "none"


def ref_integer_product(x: torch.Tensor, w: QuantWeight, acts: str = "int16") -> torch.Tensor:
    """The kernel's arithmetic in float64: sum_b d_b xd_b dot(q_b, xq_b) - m_b xs_b, with x
    quantized to int16, or in its two 8-bit levels (`acts` int8); x as it is (`none`)."""
    values, scales, mins = w.unpacked()
    m, k = x.shape
    if acts == "none":
        return x.double() @ w.dequantize().double().T

    def dots(xq: torch.Tensor, xd: torch.Tensor) -> torch.Tensor:
        d = torch.einsum(
            "mbj,nbj->mnb",
            xq.double().reshape(m, k // BLOCK, BLOCK),
            values.double().reshape(-1, k // BLOCK, BLOCK),
        )
        return (d * xd.double()[:, None, :] * scales.double()[None]).sum(dim=2)

    if acts == "int8":
        a = ref_activations8(x)
        y, xs = dots(a["q1"], a["d1"]) + dots(a["q2"], a["d2"]), a["s"]
    else:
        xq, xd, xs = ref_activations(x)
        y = dots(xq, xd)
    if mins is not None:
        y = y - xs.double() @ mins.double().T
    return y


def activation_step(x: torch.Tensor, acts: str) -> torch.Tensor:
    """[M, K]: how far each activation may be from the value the kernel multiplies (half a
    step of its block's finest level; none where x is multiplied as it is)."""
    if acts == "none":
        return torch.zeros_like(x, dtype=torch.float64)
    if acts == "int8":
        a = ref_activations8(x)
        d = torch.where(a["two"], a["d2"], a["d1"])
    else:
        d = ref_activations(x)[1]
    return (d.double() / 2).repeat_interleave(BLOCK, dim=1)


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
# 7: a tile of 4 rows and a tail of 3 (int16 rows, int8 panels on AVX2), or two tiles of 3
# and a tail of 1 (int16 panels); 11: tiles of 8 (VNNI), 4 or 3 and their tails
@pytest.mark.parametrize("rows", [1, 3, 7, 11])
@pytest.mark.parametrize("k", [64, 96])  # 96: an odd number of blocks
@pytest.mark.parametrize("n", [37, 48])  # 37: threads split rows unevenly; 48: 3 panels
def test_linear_matches_integer_reference(kernels, fmt, dtype, rows, k, n):
    w = random_weight(fmt, n, k, seed=rows)
    x = torch.randn(rows, k, generator=gen(1)).to(dtype)
    x[rows // 2, 5] = 40.0  # an outlier: its block takes a second 8-bit level
    y = kernels.quant.linear(x, w, None, torch.float32)
    ref = ref_integer_product(x, w, takes(kernels, fmt, rows, n, dtype))
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
    # each activation is off by at most half its block's step
    step = activation_step(x, takes(kernels, fmt, rows, n, dtype))
    bound = step @ wf.abs().T + 1e-4
    assert ((y.double() - ref).abs() <= bound).all()
    # and the rounding is far smaller than the bound in practice
    assert (y.double() - ref).abs().mean() < 0.2 * bound.mean()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [40, 48])  # 48: 8-bit activations on builds that have them
def test_bf16_output_is_the_fp32_output_rounded(kernels, fmt, n):
    w = random_weight(fmt, n, 64, seed=6)
    x = torch.randn(4, 64, generator=gen(7)).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen(8)).to(torch.bfloat16)
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
    # within 2^-8 of the sum of the products' magnitudes; 8-bit activations are off by
    # half a step of their block
    bound = x.double().abs() @ wf.abs().T * 2**-8 + 1e-5
    if takes(kernels, fmt, rows, n, torch.bfloat16) == "int8":
        bound = activation_step(x, "int8") @ wf.abs().T + 1e-5
    assert ((y.double() - ref).abs() <= bound).all()
    assert torch.equal(kernels.quant.linear(x, w, bias, torch.bfloat16), y.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_8bit_activation_quantizer_matches_reference_bit_for_bit(kernels, dtype):
    x = (torch.randn(6, 128, generator=gen(20)) * 3).to(dtype)
    x[1, 32:64] = 0  # an all-zero block: scales 0, values 0, one level
    x[2, 70] = 900.0  # an outlier wipes out the block's other values at 8 bits
    x[4, 96:128] = torch.linspace(-1, 1, 32).to(dtype)  # values on exact steps
    a = kernels.quant.activations8(x)
    ref = ref_activations8(x)
    for name in ("q1", "q2", "d1", "d2", "s", "two"):
        assert torch.equal(getattr(a, name), ref[name]), name
    assert a.two[2, 2] and not a.two[1, 1] and a.d1[1, 1] == 0
    assert int(a.two.sum()) == 1  # normal blocks keep one level
    # the two levels hold the outlier's block to far better than one 8-bit step
    rebuilt = a.d1.repeat_interleave(BLOCK, 1) * a.q1 + a.d2.repeat_interleave(BLOCK, 1) * a.q2
    err = (rebuilt - x.float()).abs()[2, 64:96]
    assert err.max() <= a.d2[2, 2] / 2 + 1e-6 and err.max() < a.d1[2, 2] / 100


@pytest.mark.parametrize("fmt", FORMATS)
def test_many_rows_do_not_depend_on_their_batch(kernels, fmt):
    """Past 16 rows every build takes its many-rows path (8-bit activations or int16 panels
    on AVX2, bf16 panels on AVX512-BF16): a row's product is the same whichever rows share
    its tiles, those with two 8-bit levels included."""
    w = random_weight(fmt, 64, 128, seed=21)
    x = torch.randn(37, 128, generator=gen(22)).to(torch.bfloat16)
    x[::3, 7] = 300.0  # every third row has a two-level block
    full = kernels.quant.linear(x, w, None, torch.float32)
    for start, rows in ((0, 16), (5, 18), (20, 17)):
        part = kernels.quant.linear(x[start : start + rows].contiguous(), w, None, torch.float32)
        assert torch.equal(part, full[start : start + rows])


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_rows_get_the_bits_they_get_in_a_batch(kernels, fmt):
    """A decode step's 1 to 3 rows (8 weight rows at a time, straight from the packed rows)
    and a batch of 8 (panels, on x86 builds without AVX512-BF16 for q8) give a row the same
    bits: a request's tokens depend neither on how many requests share its steps nor on
    whether a token was prefilled or decoded. A last group of fewer than 8 weight rows too."""
    weight = torch.randn(48, 192, generator=gen(40)) * 0.05
    w48, w44 = quantize(weight, fmt), quantize(weight[:44], fmt)
    x = torch.randn(8, 192, generator=gen(41)).to(torch.bfloat16)
    x[::3, 70] = 280.0  # two-level blocks
    batch = kernels.quant.linear(x, w48, None, torch.float32)
    for start, rows in ((0, 1), (1, 2), (5, 3)):
        few = kernels.quant.linear(x[start : start + rows].contiguous(), w48, None, torch.float32)
        assert torch.equal(few, batch[start : start + rows]), (start, rows)
        short = kernels.quant.linear(x[start : start + rows].contiguous(), w44, None, torch.float32)
        assert torch.equal(short, few[:, :44])


def test_each_build_takes_the_paths_it_has(kernels, request):
    """The tests above reach every path: which one a product takes, per build and shape."""
    build = request.node.callspec.params["kernels"]
    flags = set(cpu._cpuinfo_flags().split())
    q4, q8, bf16 = QuantFormat.Q4, QuantFormat.Q8, torch.bfloat16
    few_q4 = {kernels.quant.path(q4, rows, 64, bf16) for rows in (1, 3)}
    few_q8 = {kernels.quant.path(q8, rows, 64, bf16) for rows in (1, 3)}
    many_q4, many_q8 = kernels.quant.path(q4, 16, 64, bf16), kernels.quant.path(q8, 16, 64, bf16)
    if build == "portable":
        assert few_q4 == few_q8 == {QuantPath.INT16} and many_q4 == many_q8 == QuantPath.INT16
        return
    assert few_q4 == {QuantPath.INT8_ROWS}
    assert kernels.quant.path(q4, 16, 40, bf16) == QuantPath.INT16  # 40: not whole panels
    if build == "avx2":
        assert few_q8 == {QuantPath.INT16_ROWS}
        assert (many_q4, many_q8) == (QuantPath.INT8, QuantPath.INT16_PANELS)
        assert kernels.quant.path(q8, 16, 40, bf16) == QuantPath.INT16  # not whole panels
        return
    # the avx512 build targets x86-64-v4: AVX-512 without BF16 or VNNI
    bf16_dots = kernels.has_avx512_bf16
    assert few_q8 == {QuantPath.INT16 if bf16_dots else QuantPath.INT16_ROWS}
    vnni = build == "native" and "avx512_vnni" in flags
    # from 16 rows (prompts) bf16 panels where the CPU has bf16 dot products
    assert many_q4 == (QuantPath.BF16_PANELS if bf16_dots else QuantPath.INT8)
    assert many_q8 == (QuantPath.BF16_PANELS if bf16_dots else QuantPath.INT16_PANELS)
    some_q4 = kernels.quant.path(q4, 8, 64, bf16)
    assert some_q4 == (QuantPath.INT16 if bf16_dots and not vnni else QuantPath.INT8)


def test_8bit_products_are_the_same_bits_on_every_build_that_has_them(strata_cache_dir):
    """The AVX2 and AVX512-VNNI 8-bit q4 products (and the row-by-row one) differ only in how
    they reach each block's integer sums, which are exact: the same bits come out."""
    builds = [load_cpu_kernels(str(strata_cache_dir), arch=a) for a in BUILDS]
    w = random_weight(QuantFormat.Q4, 64, 192, seed=30)
    x = torch.randn(37, 192, generator=gen(31)).to(torch.bfloat16)
    x[::5, 40] = 250.0  # two-level blocks
    eight_bit = (QuantPath.INT8, QuantPath.INT8_ROWS)
    compared = 0
    for rows in (1, 3, 4, 8, 15, 16, 37):
        have = [
            k
            for k in builds
            if k is not None and k.quant.path(QuantFormat.Q4, rows, 64, x.dtype) in eight_bit
        ]
        ys = [k.quant.linear(x[:rows].contiguous(), w, None, torch.float32) for k in have]
        assert all(torch.equal(ys[0], y) for y in ys[1:]), rows
        compared += len(ys) > 1
    if not compared:
        pytest.skip("fewer than two builds here have the 8-bit products")
