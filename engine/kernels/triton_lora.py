"""Triton kernels for multi-LoRA: segment-gathered shrink and expand (SGMV) over a step's
tokens grouped by adapter slot (`LoRABatch`, engine/lora/batch.py); tiles of length 0 are
padding, so a CUDA graph's grid depends on the batch size only. Interpreted on CPU (tests).
The design is in docs/design/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _tile(order_ptr, tile_slot, tile_start, num_rows, BLOCK_T: tl.constexpr):
    """This program's tile (of `num_rows` tokens): its slot, which lanes hold a token, the
    tokens' rows in x and y, and their rows in the h buffer (positions in `order`)."""
    tile = tl.program_id(0)
    slot = tl.load(tile_slot + tile).to(tl.int64)
    start = tl.load(tile_start + tile)
    i = tl.arange(0, BLOCK_T)
    t_ok = i < num_rows
    rows = tl.load(order_ptr + start + i, mask=t_ok, other=0).to(tl.int64)
    return slot, t_ok, rows, (start + i).to(tl.int64)


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    order_ptr,
    tile_slot,
    tile_start,
    tile_len,
    in_features,
    rank_rows,
    stride_xt,
    stride_as,
    stride_ar,
    BLOCK_T: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    num_rows = tl.load(tile_len + tl.program_id(0))
    if num_rows == 0:  # a padding tile
        return
    slot, t_ok, rows, h_rows = _tile(order_ptr, tile_slot, tile_start, num_rows, BLOCK_T)
    r = tl.arange(0, R_PAD)
    r_ok = r < rank_rows
    acc = tl.zeros([BLOCK_T, R_PAD], tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < in_features
        x = tl.load(
            x_ptr + rows[:, None] * stride_xt + k[None, :],
            mask=t_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        a = tl.load(
            a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
            mask=r_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(a.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    tl.store(h_ptr + h_rows[:, None] * R_PAD + r[None, :], acc, mask=t_ok[:, None])


@triton.jit
def _expand_kernel(
    h_ptr,
    b_ptr,
    y_ptr,
    order_ptr,
    tile_slot,
    tile_start,
    tile_len,
    out_features,
    rank_rows,
    stride_yt,
    stride_bs,
    stride_bn,
    BLOCK_T: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    num_rows = tl.load(tile_len + tl.program_id(0))
    if num_rows == 0:  # a padding tile
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot, t_ok, rows, h_rows = _tile(order_ptr, tile_slot, tile_start, num_rows, BLOCK_T)
    r = tl.arange(0, R_PAD)
    n_ok = n < out_features
    h = tl.load(h_ptr + h_rows[:, None] * R_PAD + r[None, :], mask=t_ok[:, None], other=0.0)
    y_ptrs = y_ptr + rows[:, None] * stride_yt + n[None, :]
    y_mask = t_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    h = h.to(y.dtype).to(DOT_DTYPE)  # the rounding point of the torch path
    b = tl.load(
        b_ptr + slot * stride_bs + n[:, None] * stride_bn + r[None, :],
        mask=n_ok[:, None] & (r < rank_rows)[None, :],
        other=0.0,
    )
    delta = tl.dot(h, tl.trans(b.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    out = (y.to(tl.float32) + delta.to(y.dtype).to(tl.float32)).to(y.dtype)
    tl.store(y_ptrs, out, mask=y_mask)


_INTERPRETED = isinstance(_shrink_kernel, InterpretedFunction)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
BLOCK_T = 16


def rank_pad(rank_rows: int) -> int:
    return max(16, triton.next_power_of_2(rank_rows))


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    order: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """y [T, out] += B[slot] A[slot] x for the rows in `order`, in place; returns y.

    x [T, in]; a [slots, R, in]; b [slots, out, R]; `order` [N] int32 rows grouped by slot;
    `tiles` (slot, start in order, length <= BLOCK_T) int32 [num_tiles] each, where a tile
    of length 0 is padding. The launch depends only on these shapes (no host sync), so a
    CUDA graph can capture it over static `order` and `tiles` (N = num_tiles = T).
    """
    num_tiles = tiles[0].shape[0]
    if num_tiles == 0:
        return y
    assert x.stride(-1) == 1 and y.stride(-1) == 1
    assert a.is_contiguous() and b.is_contiguous()
    rank_rows, in_features = a.shape[1], a.shape[2]
    out_features = b.shape[1]
    r_pad = rank_pad(rank_rows)
    wide = _INTERPRETED or x.dtype == torch.float32  # see triton_attention: fp32 operands
    dot = tl.float32 if wide else _TL_DTYPES[x.dtype]
    precision = "ieee" if wide else "tf32"
    h = torch.empty(order.shape[0], r_pad, dtype=torch.float32, device=x.device)  # [N, R_PAD]
    _shrink_kernel[(num_tiles,)](
        x,
        a,
        h,
        order,
        *tiles,
        in_features,
        rank_rows,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        BLOCK_T=BLOCK_T,
        R_PAD=r_pad,
        BLOCK_K=64,
        DOT_DTYPE=dot,
        DOT_PRECISION=precision,
    )
    block_n = 64
    _expand_kernel[(num_tiles, triton.cdiv(out_features, block_n))](
        h,
        b,
        y,
        order,
        *tiles,
        out_features,
        rank_rows,
        y.stride(0),
        b.stride(0),
        b.stride(1),
        BLOCK_T=BLOCK_T,
        R_PAD=r_pad,
        BLOCK_N=block_n,
        DOT_DTYPE=dot,
        DOT_PRECISION=precision,
    )
    return y
