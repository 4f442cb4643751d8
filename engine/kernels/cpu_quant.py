"""Quantized weights for the native CPU kernels (csrc/quant.h): the `q8` and `q4` formats,
packed into the rows the kernels stream, quantization of float weights into them, their
reference dequantization, and the ctypes wrapper of the integer-dot-product linear. The
design is in docs/design/kernels.md ("Quantized weights").
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

BLOCK = 32  # weights per block along the input dimension, each block with its own scale
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class QuantFormat(enum.Enum):
    """`q8`: int8 values (-127..127) and one fp32 scale per block, w = d q (GGUF Q8_0).
    `q4`: 4-bit values (0..15), one fp32 scale and one min per block, w = d q - m (GGUF
    Q4_0, Q4_1 and Q4_K's sub-blocks are all of this form)."""

    Q8 = "q8"
    Q4 = "q4"

    @property
    def code(self) -> int:
        return 8 if self is QuantFormat.Q8 else 4

    def row_bytes(self, k: int) -> int:
        """Bytes of one packed row of k inputs: the values, then the scales (and mins)."""
        blocks = k // BLOCK
        return k + 4 * blocks if self is QuantFormat.Q8 else k // 2 + 8 * blocks


@dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight in a quantized format, one packed row per output channel (uint8
    [N, row_bytes]): q8 rows are K int8 values then K / 32 fp32 scales; q4 rows are K / 2
    bytes (a block's byte j holds value j in its low nibble, value j + 16 in its high one),
    then K / 32 scales, then K / 32 mins."""

    format: QuantFormat
    rows: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        k = self.in_features
        assert k % BLOCK == 0, f"in_features {k} is not a multiple of {BLOCK}"
        assert self.rows.dtype == torch.uint8 and self.rows.is_contiguous()
        assert self.rows.dim() == 2 and self.rows.shape[1] == self.format.row_bytes(k)

    @property
    def out_features(self) -> int:
        return int(self.rows.shape[0])

    @staticmethod
    def q8(values: torch.Tensor, scales: torch.Tensor) -> QuantWeight:
        """values int8 [N, K], scales fp32 [N, K / 32]."""
        n, k = values.shape
        assert values.dtype == torch.int8 and scales.shape == (n, k // BLOCK)
        rows = torch.cat([values.view(torch.uint8), _bytes(scales)], dim=1)
        return QuantWeight(QuantFormat.Q8, rows.contiguous(), k)

    @staticmethod
    def q4(values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> QuantWeight:
        """values uint8 [N, K] in 0..15, scales and mins fp32 [N, K / 32]: w = d q - m."""
        n, k = values.shape
        assert values.dtype == torch.uint8 and scales.shape == mins.shape == (n, k // BLOCK)
        blocks = values.reshape(n, k // BLOCK, BLOCK)
        packed = blocks[..., :16] | (blocks[..., 16:] << 4)  # [N, K / 32, 16]
        rows = torch.cat([packed.reshape(n, k // 2), _bytes(scales), _bytes(mins)], dim=1)
        return QuantWeight(QuantFormat.Q4, rows.contiguous(), k)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(values [N, K] int8 for q8, uint8 0..15 for q4; scales [N, K / 32]; mins or None)."""
        n, k, blocks = self.out_features, self.in_features, self.in_features // BLOCK
        if self.format is QuantFormat.Q8:
            values = self.rows[:, :k].view(torch.int8)
            return values, _floats(self.rows[:, k:], n), None
        packed = self.rows[:, : k // 2].reshape(n, blocks, 16)
        values = torch.cat([packed & 15, packed >> 4], dim=2).reshape(n, k)
        scales = _floats(self.rows[:, k // 2 : k // 2 + 4 * blocks], n)
        return values, scales, _floats(self.rows[:, k // 2 + 4 * blocks :], n)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernels multiply by, fp32 [N, K]: d q (q8) or d q - m (q4), each
        one fp32 rounding (the reference for tests, and the weight other backends get)."""
        values, scales, mins = self.unpacked()
        n, k = values.shape
        d = scales.repeat_interleave(BLOCK, dim=1)
        w = values.float() * d
        if mins is not None:
            w = w - mins.repeat_interleave(BLOCK, dim=1)
        return w.reshape(n, k)

    @staticmethod
    def cat(parts: Sequence[QuantWeight]) -> QuantWeight:
        """The weights stacked along the output rows (a fused projection)."""
        first = parts[0]
        assert all(p.format is first.format and p.in_features == first.in_features for p in parts)
        return QuantWeight(first.format, torch.cat([p.rows for p in parts]), first.in_features)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous().view(torch.uint8)


def _floats(b: torch.Tensor, n: int) -> torch.Tensor:
    return b.contiguous().view(torch.float32).reshape(n, -1)


@torch.no_grad()
def quantize(weight: torch.Tensor, fmt: QuantFormat) -> QuantWeight:
    """A float [N, K] weight (K a multiple of 32) in `fmt`, per block of 32: q8 with
    d = max|w| / 127 and q = round(w / d); q4 with the block's range over 15 levels,
    d = (max - min) / 15, m = -min, q = round((w - min) / d)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // BLOCK, BLOCK)
    if fmt is QuantFormat.Q8:
        d = w.abs().amax(dim=2) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.round(w * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantWeight.q8(q.reshape(n, k), d)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round((w - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantWeight.q4(q.reshape(n, k), d, -lo)


class QuantPath(enum.Enum):
    """How a quantized product is computed (csrc/quant.h, strata_quant_path)."""

    INT16 = 0  # activations quantized to int16 per block: every build, few rows
    INT8 = 1  # q4 weights, activations in two 8-bit levels: AVX2, many rows (panels)
    INT16_PANELS = 2  # q8 weights in int16 panels, int16 activations: many rows, no AVX512-BF16
    BF16_PANELS = 3  # weights dequantized into bf16 panels: AVX512-BF16, many rows
    INT8_ROWS = 4  # q4 weights, activations in two 8-bit levels: AVX2, few rows (8 at a time)
    INT16_ROWS = 5  # q8 weights, int16 activations: few rows, no AVX512-BF16 (8 at a time)


@dataclass(frozen=True)
class Activations8:
    """Activations in two 8-bit levels per block of 32, x ~ d1 q1 + d2 q2 (q2 = 0 and d2 = 0
    except in blocks with `two` set), and s = d1 sum(q1) + d2 sum(q2) per block."""

    q1: torch.Tensor
    q2: torch.Tensor
    d1: torch.Tensor
    d2: torch.Tensor
    s: torch.Tensor
    two: torch.Tensor


class QuantKernelError(RuntimeError):
    """The quantized linear rejected its inputs."""


class QuantKernels:
    """ctypes wrappers of csrc/quant.h in a loaded kernel library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._linear = lib.strata_quant_linear
        self._linear.argtypes = [_I, _P, _C, _P, _P, _P, _C, _I, _I, _I]
        self._linear.restype = _C
        self._acts = lib.strata_quant_activations
        self._acts.argtypes = [_P, _C, _I, _I, _P, _P, _P]
        self._acts.restype = None
        self._acts8 = lib.strata_quant_activations8
        self._acts8.argtypes = [_P, _C, _I, _I, _P, _P, _P, _P, _P, _P]
        self._acts8.restype = None
        isa: Any = lib.strata_quant_isa
        isa.restype = _C
        self.isa = {3: "avx512", 2: "avx2"}.get(int(isa()), "scalar")
        self._path = lib.strata_quant_path
        self._path.argtypes = [_I, _C, _I, _I]
        self._path.restype = _C

    def linear(
        self,
        x: torch.Tensor,
        weight: QuantWeight,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """x [M, K] (bf16 or fp32, contiguous) @ W^T (+ bias, in x's dtype) -> [M, N] in
        `out_dtype` (fp32, or x's dtype), summed in fp32 over blocks of integer products of
        W's values and x quantized to int16 per row and block of 32."""
        assert x.dtype in (torch.bfloat16, torch.float32) and x.is_contiguous() and x.dim() == 2
        assert out_dtype in (torch.float32, x.dtype)
        m, k = x.shape
        n = weight.out_features
        assert k == weight.in_features, f"x has {k} columns, the weight {weight.in_features}"
        if bias is not None:
            assert bias.dtype == x.dtype and bias.is_contiguous() and bias.shape == (n,)
        y = x.new_empty(m, n, dtype=out_dtype)
        if m == 0:
            return y
        rc = self._linear(
            weight.format.code,
            x.data_ptr(),
            x.dtype == torch.bfloat16,
            weight.rows.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            out_dtype == torch.float32,
            m,
            n,
            k,
        )
        if rc != 0:
            raise QuantKernelError(f"quantized linear rejected [{m}, {k}] x [{n}, {k}] ({rc})")
        return y

    def activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [M, K] as the linear quantizes it: (int16 values [M, K], scales [M, K / 32],
        each block's scale times its values' sum [M, K / 32])."""
        assert x.dtype in (torch.bfloat16, torch.float32) and x.is_contiguous()
        m, k = x.shape
        assert k % BLOCK == 0
        xq = torch.empty(m, k, dtype=torch.int16)
        xd = torch.empty(m, k // BLOCK, dtype=torch.float32)
        xs = torch.empty_like(xd)
        self._acts(
            x.data_ptr(),
            x.dtype == torch.bfloat16,
            m,
            k,
            xq.data_ptr(),
            xd.data_ptr(),
            xs.data_ptr(),
        )
        return xq, xd, xs

    def path(self, fmt: QuantFormat, rows: int, n: int, x_dtype: torch.dtype) -> QuantPath:
        """The arithmetic `linear` uses for `rows` rows of x_dtype and `n` outputs."""
        return QuantPath(int(self._path(fmt.code, x_dtype == torch.bfloat16, rows, n)))

    def activations8(self, x: torch.Tensor) -> Activations8:
        """x [M, K] as the many-rows q4 path quantizes it (csrc/quant.c, quant_row8)."""
        assert x.dtype in (torch.bfloat16, torch.float32) and x.is_contiguous()
        m, k = x.shape
        assert k % BLOCK == 0
        q1, q2 = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k, dtype=torch.int8)
        d1, d2, s = (torch.empty(m, k // BLOCK, dtype=torch.float32) for _ in range(3))
        two = torch.empty(m, k // BLOCK, dtype=torch.uint8)
        ptrs = [t.data_ptr() for t in (q1, q2, d1, d2, s, two)]
        self._acts8(x.data_ptr(), x.dtype == torch.bfloat16, m, k, *ptrs)
        return Activations8(q1, q2, d1, d2, s, two.bool())
