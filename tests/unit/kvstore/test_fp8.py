"""FP8 page format: quantization error bounds, exact values, page sizes."""

from __future__ import annotations

import pytest
import torch

from kvstore.base import KVCacheSpec
from kvstore.device_pool import DeviceKVPool
from kvstore.fp8 import FP8_DTYPE, FP8_MAX, can_rotate, dequantize_fp8, hadamard, quantize_fp8


def test_quantization_error_is_within_half_an_e4m3_step_of_each_row():
    x = torch.randn(500, 4, 64, generator=torch.Generator().manual_seed(0)) * 5
    values, scales = quantize_fp8(x)
    assert values.dtype == FP8_DTYPE and scales.shape == (500, 4)
    # every row's largest magnitude lands exactly on e4m3's largest finite value
    assert torch.equal(values.float().abs().amax(-1), torch.full((500, 4), FP8_MAX))
    back = dequantize_fp8(values, scales, torch.float32)
    # 3 mantissa bits: relative error at most 2^-4, plus the subnormal step near zero
    bound = x.abs() * 2.0**-4 + scales.unsqueeze(-1) * 2.0**-10
    assert ((back - x).abs() <= bound).all()
    assert (back - x).norm() / x.norm() < 0.03


def test_representable_rows_round_trip_exactly_and_zero_rows_stay_zero():
    grid = torch.tensor([448.0, -448.0, 1.0, -0.5, 0.015625, 2.0**-9, 0.0, 240.0])
    values, scales = quantize_fp8(torch.stack([grid, torch.zeros(8)]))
    assert scales.tolist() == [1.0, 1.0]  # amax 448 -> scale 1; an all-zero row -> 1
    back = dequantize_fp8(values, scales, torch.float32)
    assert torch.equal(back[0], grid)
    assert not back[1].any()


def test_scales_are_correctly_rounded_quotients():
    """The kernels divide with IEEE rounding (tl.div_rn, the native `/`); a product with the
    rounded reciprocal of 448 differs from it in the last bit for about half of all rows."""
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(2)) * 3
    _, scales = quantize_fp8(x)
    quotients = (x.double().abs().amax(-1) / FP8_MAX).float()  # the correctly rounded one
    assert torch.equal(scales, quotients)
    assert not torch.equal(x.abs().amax(-1) * (1 / FP8_MAX), quotients)  # which would fail


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_pages_take_about_half_the_bytes_of_16_bit_pages(dtype):
    # SmolLM2-135M: 30 layers, 3 KV heads of 64
    wide = KVCacheSpec(30, 3, 64, 16, dtype)
    fp8 = KVCacheSpec(30, 3, 64, 16, FP8_DTYPE)
    assert wide.bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert fp8.bytes_per_token == 2 * 30 * 3 * (64 + 4)  # values and one fp32 scale per row
    assert fp8.bytes_per_token / wide.bytes_per_token == pytest.approx(0.53125)
    assert fp8.num_blocks_for(1 << 20) > 1.8 * wide.num_blocks_for(1 << 20)


def test_fp8_pool_allocates_scales_and_counts_them():
    spec = KVCacheSpec(2, 3, 64, 16, FP8_DTYPE)
    pool = DeviceKVPool(spec, 5, torch.device("cpu"))
    assert pool.kv.dtype == FP8_DTYPE
    scales = pool.layer_scales(1)
    assert scales is not None and scales[0].shape == (5, 16, 3)
    assert pool.nbytes == spec.bytes_per_block * 5
    plain = DeviceKVPool(KVCacheSpec(2, 3, 64, 16, torch.bfloat16), 5, torch.device("cpu"))
    assert plain.layer_scales(0) is None and plain.nbytes == plain.spec.bytes_per_block * 5


def test_hadamard_rotation_preserves_dot_products_and_spreads_outliers():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(50, 64, generator=g), torch.randn(50, 64, generator=g)
    # outliers as RoPE leaves them in real models: large rotary pairs (channels c, c + D/2)
    # shared by queries and keys, whose products dominate every score. Only a row's largest
    # value is exact in FP8; the rest of a pair carries e4m3's ~3% rounding error.
    for c in (2, 7):
        angle_k, angle_q = torch.rand(2, 50, generator=g) * 6.28
        k[:, c], k[:, c + 32] = k[:, c] + 40 * angle_k.cos(), k[:, c + 32] + 40 * angle_k.sin()
        q[:, c], q[:, c + 32] = q[:, c] + 15 * angle_q.cos(), q[:, c + 32] + 15 * angle_q.sin()
    rotated = hadamard(q) @ hadamard(k).T / 64
    torch.testing.assert_close(rotated, q @ k.T, rtol=1e-5, atol=1e-3)
    assert torch.allclose(hadamard(hadamard(k)) / 64, k, atol=1e-4)  # H H = D I
    # spread over all channels, the rounding errors of a score average out
    plain = dequantize_fp8(*quantize_fp8(k), torch.float32)
    err_plain = (q @ plain.T - q @ k.T).abs().mean()
    spread = dequantize_fp8(*quantize_fp8(hadamard(k)), torch.float32)
    err_rotated = (hadamard(q) @ spread.T / 64 - q @ k.T).abs().mean()
    assert err_rotated < err_plain / 2
    assert can_rotate(64) and can_rotate(128) and not can_rotate(48)
    with pytest.raises(AssertionError):
        hadamard(torch.zeros(2, 48))
    assert KVCacheSpec(1, 1, 64, 16, FP8_DTYPE).rotate_keys
    assert not KVCacheSpec(1, 1, 48, 16, FP8_DTYPE).rotate_keys
    assert not KVCacheSpec(1, 1, 64, 16, torch.bfloat16).rotate_keys
