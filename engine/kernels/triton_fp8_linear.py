"""Triton products with FP8 weights: y = (x W8^T) * s (+ b) for x [M, K] in the compute dtype,
W8 float8_e4m3fn [N, K] and s float32 [N], one scale per output row. A GEMV for one-row
products and a tiled matmul for more rows; which kernel and tiles serve M rows is an
`Fp8Plan`. Launches depend only on shapes, so CUDA graphs capture them; interpreted on CPU
for tests. Layout and choices: docs/design/kernels.md, "FP8 weights".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from engine.kernels import triton_fused, triton_pdl


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # SILU_MUL: W holds 2N rows (gate | up) and y = silu(x gate^T) * (x up^T), [M, N], with
    # the roundings of the product's output and of triton_fused's _silu_mul_kernel.
    # PDL: the first columns' weights are loaded before waiting for the kernel before.
    triton_pdl.release(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows: columns of y
    row_ok = rows < N
    toks = tl.arange(0, BLOCK_M)  # rows of x
    tok_ok = toks < M
    cols = tl.arange(0, BLOCK_K)
    w_base = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    up_base = w_ptr + (rows.to(tl.int64) + N)[:, None] * stride_wn  # SILU_MUL: the up rows
    x_base = x_ptr + toks[:, None] * stride_xm
    w_ok = _w_mask(row_ok, cols, K, EVEN_K)
    w = tl.load(w_base + cols[None, :], mask=w_ok, other=0.0)
    up = w
    if SILU_MUL:
        up = tl.load(up_base + cols[None, :], mask=w_ok, other=0.0)
    triton_pdl.wait(PDL)
    x = _x_tile(x_base, cols, tok_ok, K, EVEN_K)
    acc = _row_dots(w, x, BLOCK_M)
    acc_up = acc
    if SILU_MUL:
        acc_up = _row_dots(up, x, BLOCK_M)
    for k in range(BLOCK_K, K, BLOCK_K):
        kk = k + cols
        w_ok = _w_mask(row_ok, kk, K, EVEN_K)
        x = _x_tile(x_base, kk, tok_ok, K, EVEN_K)
        acc += _row_dots(tl.load(w_base + kk[None, :], mask=w_ok, other=0.0), x, BLOCK_M)
        if SILU_MUL:
            acc_up += _row_dots(tl.load(up_base + kk[None, :], mask=w_ok, other=0.0), x, BLOCK_M)
    dtype = out_ptr.dtype.element_ty
    acc = _scaled(acc, s_ptr, b_ptr, rows, row_ok, HAS_BIAS)
    if SILU_MUL:
        gate = acc.to(dtype).to(tl.float32)
        up = _scaled(acc_up, s_ptr + N, b_ptr + N, rows, row_ok, HAS_BIAS).to(dtype)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = silu * up.to(tl.float32)
    out = out_ptr + toks[:, None] * stride_om + rows[None, :]
    tl.store(out, acc.to(dtype), mask=tok_ok[:, None] & row_ok[None, :])


@triton.jit
def _w_mask(row_ok, kk, K, EVEN_K: tl.constexpr):
    """Which of the weight tile's [BLOCK_N, BLOCK_K] elements exist, at columns kk."""
    ok = row_ok[:, None]
    if not EVEN_K:
        ok = ok & (kk < K)[None, :]
    return ok


@triton.jit
def _x_tile(x_base, kk, tok_ok, K, EVEN_K: tl.constexpr):
    """x's [BLOCK_M, BLOCK_K] tile at columns kk, in fp32."""
    if EVEN_K:
        x = tl.load(x_base + kk[None, :], mask=tok_ok[:, None], other=0.0)
    else:
        x = tl.load(x_base + kk[None, :], mask=tok_ok[:, None] & (kk < K)[None, :], other=0.0)
    return x.to(tl.float32)


@triton.jit
def _row_dots(w, x, BLOCK_M: tl.constexpr):
    """w [BLOCK_N, BLOCK_K] (e4m3) times x [BLOCK_M, BLOCK_K] (fp32) -> [BLOCK_M, BLOCK_N]."""
    w = w.to(tl.float32)
    if BLOCK_M == 1:
        dots = tl.sum(w * x, axis=1)[None, :]
    else:
        dots = tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    return dots


@triton.jit
def _scaled(acc, s_ptr, b_ptr, rows, row_ok, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] times the rows' scales, plus their bias."""
    acc = acc * tl.load(s_ptr + rows, mask=row_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # program -> (row tile of x, weight tile): GROUP_M row tiles in a row share a weight tile
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows: columns of y
    row_ok = rows < N
    toks = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of x
    tok_ok = toks < M
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + toks.to(tl.int64)[None, :] * stride_xm + cols[:, None]  # [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # y^T
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=row_ok[:, None], other=0.0)
            xt = tl.load(x_ptrs, mask=tok_ok[None, :], other=0.0)
        else:
            k_ok = (k + cols) < K
            w = tl.load(w_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=k_ok[:, None] & tok_ok[None, :], other=0.0)
        acc = tl.dot(w.to(DOT_DTYPE), xt.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    acc = acc * tl.load(s_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + toks.to(tl.int64)[None, :] * stride_om + rows[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & tok_ok[None, :])


_INTERPRETED = isinstance(_fp8_gemv_kernel, InterpretedFunction)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
GEMV_MAX_ROWS = 1  # rows of x up to which the GEMV kernel runs by default; the matmul above


@dataclass(frozen=True)
class GemvTiles:
    """One launch configuration of the GEMV kernel."""

    block_n: int  # weight rows per program
    block_k: int  # columns per step for one row of x (shared by more rows: at least 128)
    num_warps: int = 4

    @property
    def name(self) -> str:
        return f"n{self.block_n}/k{self.block_k}/w{self.num_warps}"


# Where compiled: 4 rows of 2,048 columns, the bytes per step of triton_gemv's best tile on
# an H100 (4 rows of 1,024 bf16 columns). Interpreted, a program costs its Python overhead
# whatever its size, so fewer, larger ones.
DEFAULT_GEMV_TILES = GemvTiles(64 if _INTERPRETED else 4, 2048)
# what the engine times at start for one-row products, per weight shape
GEMV_CANDIDATES = (
    DEFAULT_GEMV_TILES,
    GemvTiles(8, 1024),
    GemvTiles(4, 4096),
    GemvTiles(8, 2048, num_warps=8),
    GemvTiles(16, 1024),
    GemvTiles(16, 2048, num_warps=8),
    GemvTiles(2, 4096),
    GemvTiles(8, 4096, num_warps=8),
)


@dataclass(frozen=True)
class GemmTiles:
    """One launch configuration of the matmul kernel."""

    block_m: int  # rows of x (tokens) per program, >= 16 (tl.dot)
    block_n: int  # weight rows per program, >= 16
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8

    @property
    def name(self) -> str:
        return (
            f"m{self.block_m}/n{self.block_n}/k{self.block_k}/w{self.num_warps}/s{self.num_stages}"
        )


# Row buckets of the matmul: a product of M rows takes the tiles chosen for the first bucket
# of at least M rows (None: any number). Few rows stream the weights in narrow tiles, many
# programs over N; prefill chunks take square ones.
ROW_BUCKETS: tuple[int | None, ...] = (16, 64, 256, None)
GEMM_CANDIDATES: dict[int | None, tuple[GemmTiles, ...]] = {
    16: (
        GemmTiles(16, 16, 256, 4, 4),
        GemmTiles(16, 32, 256, 4, 4),
        GemmTiles(16, 16, 512, 4, 3),
        GemmTiles(16, 64, 128, 4, 4),
        GemmTiles(16, 32, 128, 4, 5),
    ),
    64: (
        GemmTiles(64, 16, 256, 4, 4),
        GemmTiles(64, 32, 256, 4, 3),
        GemmTiles(64, 32, 128, 4, 4),
        GemmTiles(64, 64, 128, 4, 4),
        GemmTiles(32, 32, 256, 4, 4),
    ),
    256: (
        GemmTiles(64, 64, 128, 4, 4),
        GemmTiles(128, 64, 64, 4, 4),
        GemmTiles(64, 128, 64, 4, 4),
        GemmTiles(128, 128, 64, 8, 3),
    ),
    None: (
        GemmTiles(128, 128, 64, 8, 3),
        GemmTiles(128, 256, 64, 8, 3),
        GemmTiles(64, 128, 64, 4, 4),
        GemmTiles(128, 128, 128, 8, 3),
    ),
}


def gemm_tiles(num_rows: int) -> GemmTiles:
    """The matmul's default tiles for x of `num_rows` rows: each bucket's first candidate
    (interpreted: one small tile whatever the rows)."""
    if _INTERPRETED:
        return GemmTiles(16, 32, 64, 4, 2)
    for bucket in ROW_BUCKETS:
        if bucket is None or num_rows <= bucket:
            return GEMM_CANDIDATES[bucket][0]
    raise AssertionError("ROW_BUCKETS ends with None")


@dataclass(frozen=True)
class Fp8Plan:
    """The kernel and tiles for each size of product of one weight shape: the GEMV (with
    `gemv`) up to `gemv_max_rows` rows, the matmul above, with the tiles of the first bucket
    of `gemm` that holds the rows."""

    gemv: GemvTiles = DEFAULT_GEMV_TILES
    gemv_max_rows: int = GEMV_MAX_ROWS
    gemm: tuple[tuple[int | None, GemmTiles], ...] = ()

    def gemm_tiles(self, num_rows: int) -> GemmTiles:
        for bucket, tiles in self.gemm:
            if bucket is None or num_rows <= bucket:
                return tiles
        return gemm_tiles(num_rows)

    @property
    def name(self) -> str:
        rows = "".join(f", <={b or 'any'}: {t.name}" for b, t in self.gemm)
        return f"1-{self.gemv_max_rows}: gemv {self.gemv.name}{rows}"


DEFAULT_PLAN = Fp8Plan()


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and weight.dim() == 2 and weight.dtype == torch.float8_e4m3fn
    assert x.shape[1] == weight.shape[1] and weight.stride(1) == 1
    assert scale.dtype == torch.float32 and scale.shape == weight.shape[:1]
    return x if x.stride(1) == 1 else x.contiguous()


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tiles: GemvTiles = DEFAULT_GEMV_TILES,
    silu_mul: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """x [M, K] (M <= a few) @ (weight [N, K] e4m3 * scale [N, 1])^T (+ bias [N]) -> [M, N]
    in x's dtype, by the GEMV kernel. With `silu_mul`, weight's rows are gate | up and the
    result is silu(gate) * up, [M, N / 2], as `silu_mul` of the plain product gives it.
    `pdl`: launched to start early (engine/kernels/triton_pdl.py; a Hopper GPU or newer)."""
    x = _check(x, weight, scale)
    (m, k), n = x.shape, weight.shape[0]
    if silu_mul:
        assert n % 2 == 0, "gate | up rows"
        n //= 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = triton.next_power_of_2(m)
    block_k = min(max(128, tiles.block_k // block_m), triton.next_power_of_2(k))
    _fp8_gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x,
        weight,
        scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0,
        SILU_MUL=silu_mul,
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=block_k,
        PDL=pdl,
        num_warps=tiles.num_warps,
        **triton_pdl.launch_options(pdl),
    )
    return out


def fp8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 * scale [N, 1])^T (+ bias [N]) -> [M, N] in x's dtype,
    by the tiled matmul (`tiles`: default `gemm_tiles(M)`)."""
    x = _check(x, weight, scale)
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    t = tiles or gemm_tiles(m)
    wide = _INTERPRETED or x.dtype == torch.float32  # fp32 operands: exact e4m3, ieee sums
    block_k = min(t.block_k, max(16, triton.next_power_of_2(k)))
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    _fp8_gemm_kernel[grid](
        x,
        weight,
        scale,
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=block_k,
        GROUP_M=t.group_m,
        DOT_DTYPE=tl.float32 if wide else _TL_DTYPES[x.dtype],
        DOT_PRECISION="ieee" if wide else "tf32",
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    return out


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    plan: Fp8Plan = DEFAULT_PLAN,
    silu_mul: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """x [M, K] -> [M, N]: as `plan` says for M rows (the GEMV kernel up to its row count,
    the matmul with the bucket's tiles above). With `silu_mul` (weight's rows gate | up),
    silu(gate) * up, [M, N / 2]: inside the GEMV, after the matmul by triton_fused's kernel,
    with the same bits either way. `pdl`: the GEMV starts early (see `fp8_gemv`)."""
    m = x.shape[0]
    if m <= plan.gemv_max_rows:
        return fp8_gemv(x, weight, scale, bias, tiles=plan.gemv, silu_mul=silu_mul, pdl=pdl)
    out = fp8_gemm(x, weight, scale, bias, tiles=plan.gemm_tiles(m))
    return triton_fused.silu_mul(out) if silu_mul else out
