"""The fused Triton element-wise kernels (interpreted on CPU) against the torch modules they
replace on CUDA: RMSNorm with and without the residual add, rotary embedding over strided
q/k views, SiLU-and-multiply."""

from __future__ import annotations

import pytest
import torch

from engine.attention.triton_backend import load_triton_kernels
from engine.model.llama import RMSNorm, RotaryEmbedding, SiluAndMul
from engine.model.triton_layers import TritonRMSNorm, TritonRotary, TritonSiluMul
from engine.model_config import ModelConfig
from tests.triton_marks import INTERPRETED

pytestmark = INTERPRETED

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def ops():
    return load_triton_kernels(torch.device("cpu"), "triton_fused")


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(ops, dtype, with_residual):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.rand(96, generator=gen) + 0.5
    norm = norm.to(dtype)
    x = torch.randn(21, 96, generator=gen).to(dtype)
    residual = torch.randn(21, 96, generator=gen).to(dtype) if with_residual else None
    want, want_res = norm(x, residual)
    got, got_res = TritonRMSNorm(norm, ops)(x, residual)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    # the same sum; in bf16 the interpreter truncates where a GPU rounds to nearest
    torch.testing.assert_close(
        got_res, want_res, atol=0, rtol=0 if dtype == torch.float32 else 1e-2
    )


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(("adjacent", "tokens"), [(True, 13), (True, 1), (False, 13)])
def test_rope_on_strided_views(ops, dtype, adjacent, tokens):
    """q and k as the model passes them (views into the fused projection, k's heads right
    after q's: one launch, outputs in one buffer), also for one token, whose views' row
    strides differ; or as unrelated tensors (two launches)."""
    cfg = ModelConfig(
        vocab_size=16,
        hidden_size=96,
        intermediate_size=8,
        num_layers=1,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    rope = RotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (6 + 2 + 2) * 16, generator=gen).to(dtype)
    q = qkv[:, :96].view(tokens, 6, 16)  # views into the fused projection, as in the model
    k = qkv[:, 96:128] if adjacent else qkv[:, 128:].clone()
    k = k.view(tokens, 2, 16)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    want_q, want_k = rope(positions, q, k)
    got_q, got_k = TritonRotary(rope, ops)(positions, q, k)
    shared = got_k.data_ptr() == got_q.data_ptr() + 6 * 16 * got_q.element_size()
    assert shared == adjacent
    torch.testing.assert_close(got_q, want_q, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got_k, want_k, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", list(TOL))
def test_silu_mul(ops, dtype):
    gen = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(9, 2 * 1500, generator=gen)).to(dtype)  # two column blocks
    torch.testing.assert_close(
        TritonSiluMul(ops)(x), SiluAndMul()(x), atol=TOL[dtype], rtol=TOL[dtype]
    )
