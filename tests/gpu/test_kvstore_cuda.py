"""The FP8 page format on a CUDA device: the torch path stores the bytes it stores on CPU."""

from __future__ import annotations

import pytest
import torch

from kvstore.fp8 import quantize_fp8

pytestmark = pytest.mark.gpu


def test_fp8_quantization_on_cuda_is_bit_identical_to_cpu():
    x = torch.randn(4096, 8, 128, generator=torch.Generator().manual_seed(0)) * 3
    cpu_values, cpu_scales = quantize_fp8(x)
    values, scales = quantize_fp8(x.cuda())
    assert torch.equal(scales.cpu(), cpu_scales)
    assert torch.equal(values.cpu().view(torch.uint8), cpu_values.view(torch.uint8))
