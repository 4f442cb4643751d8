"""Triton kernels for the paged KV pool: the K/V write (FP8 quantization included) and paged
attention by (query tile, KV head, split), with the kernel that merges split results.

Pools are laid out as in kvstore/device_pool.py. Interpreted on machines without a GPU
(tests). The design is in docs/design/kernels.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from engine.kernels import triton_pdl
from kvstore.fp8 import FP8_MAX

FP8_MAX_F: tl.constexpr = tl.constexpr(FP8_MAX)
_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
# FP8 pages are widened to fp16 (one conversion per pair of values on a GPU, where bf16 takes
# several); the softmax weights times the V scales (amax / 448) are raised by this power of
# two so that they stay normal fp16 numbers, and the sums lowered by it at the end (exact)
_V_GAIN: tl.constexpr = tl.constexpr(256.0)


@triton.jit
def _hadamard_rows(x, ROWS: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr):
    """x [ROWS, D] fp32 -> x H (unnormalized Walsh-Hadamard), constant-geometry form.

    Each stage adds and subtracts adjacent pairs and writes sums to the first half and
    differences to the second, which pairs the same elements, in the same order, as the
    butterflies of kvstore.fp8.hadamard: the results are bit-identical.
    """
    for _ in tl.static_range(LOG_D):
        a, b = tl.split(tl.reshape(x, (ROWS, D // 2, 2)))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (ROWS, D))
    return x


@triton.jit
def _round_e4m3(v):
    """Round fp32 values (|v| <= 448) to the nearest e4m3 value, ties to even, and cast.

    The rounding is done in fp32 so the final cast is exact whatever rounding mode the cast
    itself has: quantum 2^(e - 3) for normal values (3 mantissa bits), 2^-9 below 2^-6.
    Scaling by exact powers of two keeps every step exact (a compiled fp32 `/` is not IEEE).
    """
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    quantum = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)  # 1 / quantum
    big = 12582912.0  # 1.5 * 2^23: adding and removing it rounds to an integer, ties to even
    r = ((v * inverse + big) - big) * quantum
    return tl.where(r == 0.0, v * 0.0, r).to(tl.float8e4nv)  # keep the sign of zero


@triton.jit
def _store_fp8_rows(x, pages, scales, page_off, scale_off, mask, row_ok, d):
    """Quantize rows x [R, D] fp32 with one scale each and store values and scales."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, tl.div_rn(amax, FP8_MAX_F), 1.0)
    q = tl.clamp(tl.div_rn(x, scale[:, None]), -FP8_MAX_F, FP8_MAX_F)
    tl.store(pages + page_off[:, None] + d[None, :], _round_e4m3(q), mask=mask)
    tl.store(scales + scale_off, scale, mask=row_ok)


@triton.jit(do_not_specialize=["num_tokens"])  # varies by step: no recompiles
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_pages,
    v_pages,
    k_scales,
    v_scales,
    slots_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_pb,
    stride_pt,
    stride_ph,
    stride_sb,
    stride_st,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FP8: tl.constexpr,
    ROTATE: tl.constexpr,
    LOG_D: tl.constexpr,
    PDL: tl.constexpr,
):
    triton_pdl.release(PDL)
    triton_pdl.wait(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    slot = tl.load(slots_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    row_ok = slot >= 0
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    block, within = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    page_off = block * stride_pb + within * stride_pt + head * stride_ph
    k = tl.load(
        k_ptr + t[:, None] * stride_kt + head * stride_kh + d[None, :], mask=mask, other=0.0
    )
    v = tl.load(
        v_ptr + t[:, None] * stride_vt + head * stride_vh + d[None, :], mask=mask, other=0.0
    )
    if FP8:
        scale_off = block * stride_sb + within * stride_st + head
        k = k.to(tl.float32)
        if ROTATE:
            k = _hadamard_rows(k, BLOCK_T, D_PAD, LOG_D)
        _store_fp8_rows(k, k_pages, k_scales, page_off, scale_off, mask, row_ok, d)
        _store_fp8_rows(v.to(tl.float32), v_pages, v_scales, page_off, scale_off, mask, row_ok, d)
    else:
        tl.store(k_pages + page_off[:, None] + d[None, :], k.to(k_pages.dtype.element_ty), mask)
        tl.store(v_pages + page_off[:, None] + d[None, :], v.to(v_pages.dtype.element_ty), mask)


@triton.jit(do_not_specialize=["num_rows", "stride_bt"])  # vary by step
def _paged_attention_kernel(
    q_ptr,
    k_pages,
    v_pages,
    k_scales,
    v_scales,
    out_ptr,
    part_acc,
    part_ml,
    block_table,
    seq_lens,
    tile_seq,
    tile_row,
    tile_len,
    tile_pos,
    sm_scale,
    num_rows,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_bt,
    stride_pb,
    stride_pt,
    stride_ph,
    stride_sb,
    stride_st,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DECODE: tl.constexpr,
    FP8: tl.constexpr,
    ROTATE: tl.constexpr,
    LOG_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    triton_pdl.wait(PDL)  # and no early release: see triton_pdl
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:  # one tile per sequence, one token each: everything follows from its length
        seq = tile
        row0 = tile
        q_len = 1
        pos0 = tl.load(seq_lens + tile) - 1
    else:
        seq = tl.load(tile_seq + tile)
        row0 = tl.load(tile_row + tile)
        q_len = tl.load(tile_len + tile)
        pos0 = tl.load(tile_pos + tile)
    m = tl.arange(0, BLOCK_M)
    r = m // G_PAD  # token within the tile
    g = m % G_PAD  # query head within the KV head's group
    row_ok = (r < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + (row0 + r)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=q_mask,
        other=0.0,
    )
    compute = DOT_DTYPE
    qk_scale = sm_scale * _LOG2E  # scores in base 2
    if ROTATE:  # keys are stored as k H: (q H) . (k H) = D (q . k); q H / D keeps q's size
        q = (_hadamard_rows(q.to(tl.float32), BLOCK_M, D_PAD, LOG_D) / HEAD_DIM).to(q.dtype)
    q = q.to(compute)
    q_pos = pos0 + r
    kv_len = pos0 + q_len  # tokens the tile's last query attends to
    num_tiles = (kv_len + BLOCK_N - 1) // BLOCK_N
    per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    first = split * per_split
    last = tl.minimum(first + per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    table = block_table + seq.to(tl.int64) * stride_bt
    for kv_tile in range(first, last):
        kv_pos = kv_tile * BLOCK_N + n
        kv_ok = kv_pos < kv_len
        block = tl.load(table + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        within = kv_pos % BLOCK_SIZE
        off = block * stride_pb + within * stride_pt + kv_head * stride_ph
        kv_mask = kv_ok[:, None] & d_ok[None, :]
        k = tl.load(k_pages + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(compute)
        v = tl.load(v_pages + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(compute)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if FP8:  # one scale per (token, head): on the scores' columns, not on every element
            scale_off = block * stride_sb + within * stride_st + kv_head
            s = s * tl.load(k_scales + scale_off, mask=kv_ok, other=0.0)[None, :]
            vs = tl.load(v_scales + scale_off, mask=kv_ok, other=0.0)
        visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # l_i sums the weights, acc their scaled values; with FP8 pages, times _V_GAIN so
        # that they stay normal numbers in fp16
        pv = p * (vs * _V_GAIN)[None, :] if FP8 else p
        acc = acc * alpha[:, None] + tl.dot(pv.to(compute), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if FP8:
        acc = acc * (1.0 / _V_GAIN)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        dst = out_ptr + (row0 + r)[:, None] * stride_ot + head[:, None] * HEAD_DIM + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        prow = ((split * num_rows + row0 + r) * NUM_HEADS + head).to(tl.int64)
        tl.store(part_acc + prow[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml + prow * 2, m_i, mask=row_ok)
        tl.store(part_ml + prow * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_rows", "first_row"])
def _merge_splits_kernel(
    part_acc,
    part_ml,
    out_ptr,
    num_rows,
    first_row,
    stride_ot,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    triton_pdl.release(PDL)
    triton_pdl.wait(PDL)
    row = first_row + tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D_PAD)
    prow = ((s * num_rows + row) * NUM_HEADS + head).to(tl.int64)
    m = tl.load(part_ml + prow * 2)
    lse = tl.load(part_ml + prow * 2 + 1)
    m_max = tl.max(m, axis=0)  # finite: the first split always holds the first KV tile
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh nothing
    acc = tl.load(part_acc + prow[:, None] * D_PAD + d[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(lse * w, axis=0)
    dst = out_ptr + row * stride_ot + head * HEAD_DIM + d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# Matmuls take the compute dtype's operands on a GPU; the interpreter (3.9) computes tl.dot
# wrongly on 16-bit operands, so there they are widened to fp32 after the same rounding.
_INTERPRETED = isinstance(_paged_attention_kernel, InterpretedFunction)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _pad(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(n)))


def _log_d(head_dim: int) -> int:
    return _pad(head_dim).bit_length() - 1


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slots: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    rotate_keys: bool = False,
    block_t: int | None = None,
    pdl: bool = False,
) -> None:
    """Store k, v [T, Hkv, D] (rows may be strided) at flat `slots` [T] of the pages.

    Mutates the pages (and the scales of an FP8 pool). Slots < 0 are skipped.
    `block_t`: tokens per program; None: up to 16, no more than there are tokens, so that a
    decode step of a few sequences runs its FP8 rotation and rounding on their rows alone,
    with a warp per 128 elements of a program's tile. `pdl`: launched to start early
    (engine/kernels/triton_pdl.py).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_pages.is_contiguous()
    if num_tokens == 0:
        return
    block_t = block_t or min(16, triton.next_power_of_2(num_tokens))
    num_warps = max(1, min(4, block_t * _pad(head_dim) // 128))
    fp8 = k_scales is not None
    scale_strides = (0, 0) if k_scales is None else (k_scales.stride(0), k_scales.stride(1))
    _kv_write_kernel[(triton.cdiv(num_tokens, block_t), num_kv_heads)](
        k,
        v,
        k_pages,
        v_pages,
        k_scales if fp8 else k_pages,
        v_scales if fp8 else v_pages,
        slots,
        num_tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        *scale_strides,
        BLOCK_SIZE=k_pages.shape[1],
        HEAD_DIM=head_dim,
        D_PAD=_pad(head_dim),
        BLOCK_T=block_t,
        FP8=fp8,
        ROTATE=fp8 and rotate_keys,
        LOG_D=_log_d(head_dim),
        PDL=pdl,
        num_warps=num_warps,
        **triton_pdl.launch_options(pdl),
    )


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    out: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    seq_lens: torch.Tensor | None = None,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    tokens_per_tile: int = 1,
    num_splits: int = 1,
    first_row: int = 0,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    rotated_keys: bool = False,
    block_n: int = 64,
    launch: dict[str, int] | None = None,
    pdl: bool = False,
) -> None:
    """Attention of q [T, H, D] over paged K/V; writes `out` [rows, H * D] in place.

    Decode (`seq_lens` [S] given): row i is sequence i's one new token at position
    seq_lens[i] - 1. Prefill (`tiles` given): (seq, first row, length, first position)
    int32 [N] each, one tile per run of at most `tokens_per_tile` consecutive tokens of one
    sequence, whose rows in q and out are first row + i at position first position + i;
    the tiles cover rows `first_row` on. Either way the context may be split across
    `num_splits` programs (a power of two), merged by log-sum-exp.
    `block_table` [S, max_blocks] int32 maps each sequence's token positions to blocks.
    `launch`: Triton launch options of the attention kernel (num_warps, num_stages).
    `pdl`: both kernels launched to start early (engine/kernels/triton_pdl.py).
    """
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    group = num_heads // num_kv_heads
    g_pad = _pad(group)
    decode = seq_lens is not None
    if seq_lens is not None:
        num_tiles = num_rows = seq_lens.shape[0]
        tokens_per_tile = 1
        tile_args = (seq_lens, seq_lens, seq_lens, seq_lens, seq_lens)
    else:
        assert tiles is not None
        num_tiles, num_rows = tiles[0].shape[0], q.shape[0]
        tile_args = (tiles[0], *tiles)  # seq_lens unused
    if num_tiles == 0:
        return
    assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    assert q.stride(-1) == 1 and out.is_contiguous()
    d_pad = _pad(head_dim)
    block_m = max(16, g_pad * tokens_per_tile)
    fp8 = k_scales is not None
    scale_strides = (0, 0) if k_scales is None else (k_scales.stride(0), k_scales.stride(1))
    part_acc = part_ml = out
    if num_splits > 1:
        part_acc = torch.empty(
            num_splits * num_rows * num_heads, d_pad, dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(
            num_splits * num_rows * num_heads, 2, dtype=torch.float32, device=q.device
        )
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q,
        k_pages,
        v_pages,
        k_scales if fp8 else k_pages,
        v_scales if fp8 else v_pages,
        out,
        part_acc,
        part_ml,
        block_table,
        *tile_args,
        scale,
        num_rows,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        block_table.stride(0),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        *scale_strides,
        NUM_HEADS=num_heads,
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_SIZE=k_pages.shape[1],
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        NUM_SPLITS=num_splits,
        DECODE=decode,
        FP8=fp8,
        ROTATE=fp8 and rotated_keys,
        LOG_D=_log_d(head_dim),
        DOT_DTYPE=tl.float32 if _INTERPRETED else tl.float16 if fp8 else _TL_DTYPES[q.dtype],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or _INTERPRETED else "tf32",
        PDL=pdl,
        **(launch or {}),
        **triton_pdl.launch_options(pdl),
    )
    if num_splits > 1:
        first_row = 0 if decode else first_row
        _merge_splits_kernel[(num_rows - first_row, num_heads)](
            part_acc,
            part_ml,
            out,
            num_rows,
            first_row,
            out.stride(0),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            NUM_SPLITS=num_splits,
            PDL=pdl,
            **triton_pdl.launch_options(pdl),
        )
