"""Swaps the decoder's element-wise modules for fused Triton kernels (CUDA devices).

RMSNorm (with its residual add), the rotary embedding and SiLU-and-multiply each become one
kernel launch (engine/kernels/triton_fused.py). The modules keep the weights and tables of
the ones they replace, and the same call signatures, so the model code does not change.
With `gemv`, the projections and the LM head of one-token steps run a Triton matrix-vector
kernel instead of cuBLAS (engine/kernels/triton_gemv.py); other steps keep cuBLAS.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn
from torch.nn import functional as F

from engine.attention.triton_backend import load_triton_kernels
from engine.model.llama import LlamaForCausalLM, RMSNorm, RotaryEmbedding


class TritonRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm, ops: ModuleType) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out: tuple[torch.Tensor, torch.Tensor] = self.ops.add_rms_norm(
            x, residual, self.weight, self.eps
        )
        return out


class TritonRotary(nn.Module):
    cos: torch.Tensor  # [max_pos, D/2] fp32, shared with the replaced module
    sin: torch.Tensor

    def __init__(self, rope: RotaryEmbedding, ops: ModuleType) -> None:
        super().__init__()
        self.register_buffer("cos", rope.cos, persistent=False)
        self.register_buffer("sin", rope.sin, persistent=False)
        self.ops = ops

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rope = self.ops.rope
        return rope(q, positions, self.cos, self.sin), rope(k, positions, self.cos, self.sin)


class TritonSiluMul(nn.Module):
    def __init__(self, ops: ModuleType) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.ops.silu_mul(gate_up)
        return out


class TritonLinear(nn.Module):
    """An nn.Linear (its parameters shared) whose one-row inputs go to the GEMV kernel."""

    def __init__(self, linear: nn.Linear, ops: ModuleType) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1:
            out: torch.Tensor = self.ops.gemv(x, self.weight, self.bias)
            return out
        return F.linear(x, self.weight, self.bias)


_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def apply_triton_layers(model: LlamaForCausalLM, *, gemv: bool = False) -> None:
    """Replace every RMSNorm, the rotary embedding and every activation in place; with
    `gemv`, every projection and the LM head too (`TritonLinear`)."""
    device = model.embed_tokens.weight.device
    if gemv:
        gemv_ops = load_triton_kernels(device, "triton_gemv")
        for layer in model.layers:
            for name in _PROJECTIONS:
                linear = getattr(layer, name)
                assert isinstance(linear, nn.Linear)
                setattr(layer, name, TritonLinear(linear, gemv_ops))
        assert isinstance(model.lm_head, nn.Linear)
        model.lm_head = TritonLinear(model.lm_head, gemv_ops)
    ops = load_triton_kernels(device, "triton_fused")
    for layer in model.layers:
        assert isinstance(layer.input_norm, RMSNorm) and isinstance(layer.post_attn_norm, RMSNorm)
        layer.input_norm = TritonRMSNorm(layer.input_norm, ops)
        layer.post_attn_norm = TritonRMSNorm(layer.post_attn_norm, ops)
        layer.act = TritonSiluMul(ops)
    assert isinstance(model.norm, RMSNorm) and isinstance(model.rope, RotaryEmbedding)
    model.norm = TritonRMSNorm(model.norm, ops)
    model.rope = TritonRotary(model.rope, ops)
