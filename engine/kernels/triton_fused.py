"""Triton kernels that fuse the decoder's element-wise chains into one launch each: RMSNorm
with its residual add, rotary embedding, SiLU-and-multiply; they round where the torch modules
of engine/model/llama.py round. Imported through
engine.attention.triton_backend.load_triton_kernels. The design is in docs/design/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import triton_pdl


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 x rounded to `dtype` and widened back: one rounding point of the torch module."""
    return x.to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["num_rows"])  # varies by step: no recompiles
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    num_rows,
    num_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    PDL: tl.constexpr,
):
    triton_pdl.release(PDL)
    triton_pdl.wait(PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    offs = rows.to(tl.int64)[:, None] * num_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    if HAS_RESIDUAL:
        xf = _round(xf + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(res_out_ptr + offs, xf.to(dtype), mask=mask)
    var = tl.sum(xf * xf, axis=1) / num_cols
    normed = _round(xf * tl.rsqrt(var + eps)[:, None], dtype)
    w = tl.load(w_ptr + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (w[None, :] * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _rope_kernel(
    x_ptr,
    out_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    num_tokens,
    stride_xt,
    stride_xh,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr,
):
    """Neox rotation of x [T, H, 2 * HALF] (strided rows) into a contiguous out."""
    triton_pdl.release(PDL)
    triton_pdl.wait(PDL)
    for i in range(BLOCK_T):
        t = tl.program_id(0) * BLOCK_T + i
        if t < num_tokens:
            pos = tl.load(pos_ptr + t)
            j = tl.arange(0, HALF_PAD)
            h = tl.arange(0, H_PAD)
            mask = (h < NUM_HEADS)[:, None] & (j < HALF)[None, :]
            cos = tl.load(cos_ptr + pos * HALF + j, mask=j < HALF, other=0.0)
            sin = tl.load(sin_ptr + pos * HALF + j, mask=j < HALF, other=0.0)
            src = x_ptr + t.to(tl.int64) * stride_xt + h[:, None] * stride_xh + j[None, :]
            x1 = tl.load(src, mask=mask, other=0.0)
            dtype = x1.dtype
            x1 = x1.to(tl.float32)
            x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
            c = _round(cos, dtype)[None, :]  # the tables in the compute dtype, as torch has them
            s = _round(sin, dtype)[None, :]
            dst = out_ptr + (t.to(tl.int64) * NUM_HEADS + h[:, None]) * (2 * HALF) + j[None, :]
            first = _round(x1 * c, dtype) - _round(x2 * s, dtype)
            second = _round(x2 * c, dtype) + _round(x1 * s, dtype)
            tl.store(dst, first.to(dtype), mask=mask)
            tl.store(dst + HALF, second.to(dtype), mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _silu_mul_kernel(
    x_ptr, out_ptr, num_rows, inter, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows < num_rows)[:, None] & (cols < inter)[None, :]
    src = x_ptr + rows.to(tl.int64)[:, None] * (2 * inter) + cols[None, :]
    gate = tl.load(src, mask=mask, other=0.0)
    up = tl.load(src + inter, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = _round(g / (1.0 + tl.exp(-g)), gate.dtype)
    dst = out_ptr + rows.to(tl.int64)[:, None] * inter + cols[None, :]
    tl.store(dst, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def _rows_per_program(num_cols: int) -> int:
    """Rows per program: about 8K elements' worth. Fixed by the width alone for RMSNorm,
    whose row sums could otherwise be reduced in another order in a step of another size
    (a sequence's result must not depend on what it is batched with)."""
    return max(1, min(16, 8192 // triton.next_power_of_2(num_cols)))


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual) for x [T, hidden]; without a residual,
    (norm(x) * weight, x). New tensors; the inputs are not changed. `pdl`: launched to start
    early (engine/kernels/triton_pdl.py)."""
    x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    block_rows = _rows_per_program(cols)
    _add_rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
        x,
        residual.contiguous() if residual is not None else x,
        weight,
        out,
        res_out,
        rows,
        cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=triton.next_power_of_2(cols),
        PDL=pdl,
        **triton_pdl.launch_options(pdl),
    )
    return out, res_out


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """Neox rotary embedding of x [T, H, D] (rows may be strided) at `positions` [T], with
    fp32 tables cos/sin [max_pos, D / 2]; returns a new contiguous tensor. `pdl`: launched
    to start early (engine/kernels/triton_pdl.py)."""
    tokens, heads, dim = x.shape
    assert x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block_t = 1 if tokens < 512 else 4  # a program per token while that leaves SMs idle
    _rope_kernel[(triton.cdiv(tokens, block_t),)](
        x,
        out,
        positions,
        cos,
        sin,
        tokens,
        x.stride(0),
        x.stride(1),
        NUM_HEADS=heads,
        HALF=dim // 2,
        H_PAD=triton.next_power_of_2(heads),
        HALF_PAD=triton.next_power_of_2(dim // 2),
        BLOCK_T=block_t,
        PDL=pdl,
        **triton_pdl.launch_options(pdl),
    )
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    x = x.contiguous()
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    block_cols = min(1024, triton.next_power_of_2(inter))
    # element-wise, so a row's result is the same in any tile: no more rows than there are
    block_rows = min(_rows_per_program(block_cols), triton.next_power_of_2(max(1, rows)))
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(inter, block_cols))
    _silu_mul_kernel[grid](x, out, rows, inter, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols)
    return out
