"""FP8 (e4m3) KV pages: values in `float8_e4m3fn` with one float32 scale per (token, KV head),
keys Walsh-Hadamard-rotated before they are quantized. The reference for the native and
Triton kernels, which store the same bytes. The design is in
docs/design/kv-pages-and-tiers.md.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_DTYPE = torch.float32


def can_rotate(head_dim: int) -> bool:
    """Whether keys of this width get the Hadamard rotation (powers of two only)."""
    return head_dim > 1 and head_dim & (head_dim - 1) == 0


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> x H in float32, H the unnormalized Walsh-Hadamard matrix (D a power of
    two), by log2(D) butterfly stages; every stage is exact sums and differences in fp32."""
    d = x.shape[-1]
    assert can_rotate(d), f"Hadamard rotation needs a power-of-two width, not {d}"
    y = x.float().reshape(-1, d)
    h = 1
    while h < d:
        pairs = y.view(-1, d // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, d)
        h *= 2
    return y.view(x.shape)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] float8_e4m3fn, scales [...] float32)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # a tensor divisor: CUDA divides by a Python scalar as a product with its rounded
    # reciprocal, which is not always the correctly rounded quotient the kernels store
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    values = (xf / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values, scale


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(values [..., D], scales [...]) -> [..., D] in `dtype`."""
    return (values.float() * scales.unsqueeze(-1)).to(dtype)
