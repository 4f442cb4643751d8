"""Swaps the decoder's element-wise modules for fused Triton kernels on CUDA, and one-token
products for the Triton GEMV where `GemvKernel` says so (per weight shape with `auto`, timed
at start). The model code does not change. The design is in docs/design/kernels.md.
"""

from __future__ import annotations

import logging
from functools import partial
from types import ModuleType

import torch
from torch import nn
from torch.nn import functional as F

from engine.attention.triton_backend import load_triton_kernels
from engine.config import GemvKernel
from engine.cuda_graphs import graph_ms_per_call
from engine.model.llama import LlamaForCausalLM, RMSNorm, RotaryEmbedding, SiluAndMul

log = logging.getLogger(__name__)


class TritonRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm, ops: ModuleType, *, pdl: bool = False) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.ops = ops
        self.pdl = pdl  # launched to start early (engine/kernels/triton_pdl.py)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out: tuple[torch.Tensor, torch.Tensor] = self.ops.add_rms_norm(
            x, residual, self.weight, self.eps, pdl=self.pdl
        )
        return out


class TritonRotary(nn.Module):
    cos: torch.Tensor  # [max_pos, D/2] fp32, shared with the replaced module
    sin: torch.Tensor

    def __init__(self, rope: RotaryEmbedding, ops: ModuleType, *, pdl: bool = False) -> None:
        super().__init__()
        self.register_buffer("cos", rope.cos, persistent=False)
        self.register_buffer("sin", rope.sin, persistent=False)
        self.ops = ops
        self.pdl = pdl

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One launch when k's heads follow q's in memory (views into the fused QKV
        projection, as the model passes them): the rotated q and k are views into one output."""
        rope = partial(self.ops.rope, pdl=self.pdl)
        both = _adjacent_heads(q, k)
        if both is None:
            return rope(q, positions, self.cos, self.sin), rope(k, positions, self.cos, self.sin)
        out = rope(both, positions, self.cos, self.sin)
        return out[:, : q.shape[1]], out[:, q.shape[1] :]


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [T, Hq, D] and k [T, Hk, D] as one [T, Hq + Hk, D] view, when k's heads are the ones
    right after q's in every row; else None."""
    tokens, q_heads, dim = q.shape
    row, head = q.stride(0), q.stride(1)
    follows = k.data_ptr() == q.data_ptr() + q_heads * head * q.element_size()
    same = k.dtype == q.dtype and k.shape[::2] == q.shape[::2] and k.stride(1) == head
    # a single token's row stride means nothing (views of one row may differ in it)
    same_rows = tokens == 1 or k.stride(0) == row
    if not (follows and same and same_rows and head == dim and q.stride(2) == k.stride(2) == 1):
        return None
    return q.as_strided((tokens, q_heads + k.shape[1], dim), (row, head, 1))


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


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Triton's GEMV replaces cuBLAS for a shape (`GemvKernel.AUTO`) when it is this much faster
_AUTO_MARGIN = 0.97


def apply_triton_layers(
    model: LlamaForCausalLM, *, gemv: GemvKernel = GemvKernel.CUBLAS, pdl: bool = False
) -> dict[str, str]:
    """Replace every RMSNorm, the rotary embedding and every activation in place, and the
    one-token product of each projection and the LM head as `gemv` says (`TritonLinear`).
    With `pdl`, the norms and the rotation launch to start early
    (engine/kernels/triton_pdl.py: a Hopper GPU or newer).
    Returns, per projection name and "lm_head", the product's kernel: "cublas" or "triton",
    or "fp8" for products already swapped for FP8 ones (engine/model/fp8_weights.py), which
    are left as they are."""
    device = model.embed_tokens.weight.device
    groups = {name: [getattr(layer, name) for layer in model.layers] for name in PROJECTIONS}
    groups["lm_head"] = [model.lm_head]
    choice = dict.fromkeys(groups, "cublas")
    for name, linears in list(groups.items()):
        if not all(isinstance(linear, nn.Linear) for linear in linears):
            choice[name] = "fp8"
            del groups[name]
    if gemv is not GemvKernel.CUBLAS:
        gemv_ops = load_triton_kernels(device, "triton_gemv")
        for name, linears in groups.items():
            if gemv is GemvKernel.TRITON or _triton_is_faster(linears, gemv_ops, name):
                choice[name] = "triton"
                wrapped = [TritonLinear(linear, gemv_ops) for linear in linears]
                if name == "lm_head":
                    model.lm_head = wrapped[0]
                else:
                    for layer, module in zip(model.layers, wrapped, strict=True):
                        setattr(layer, name, module)
    ops = load_triton_kernels(device, "triton_fused")
    for layer in model.layers:
        assert isinstance(layer.input_norm, RMSNorm) and isinstance(layer.post_attn_norm, RMSNorm)
        layer.input_norm = TritonRMSNorm(layer.input_norm, ops, pdl=pdl)
        layer.post_attn_norm = TritonRMSNorm(layer.post_attn_norm, ops, pdl=pdl)
        if isinstance(layer.act, SiluAndMul):  # else its projection applies it (FP8)
            layer.act = TritonSiluMul(ops)
    assert isinstance(model.norm, RMSNorm) and isinstance(model.rope, RotaryEmbedding)
    model.norm = TritonRMSNorm(model.norm, ops, pdl=pdl)
    model.rope = TritonRotary(model.rope, ops, pdl=pdl)
    return choice


@torch.inference_mode()
def _triton_is_faster(linears: list[nn.Linear], gemv_ops: ModuleType, name: str) -> bool:
    """Time one-token products of these weights (up to 16 of them, the first layers') back
    to back in a CUDA graph, through cuBLAS and through Triton's GEMV."""
    weights = [(m.weight, m.bias) for m in linears[:16]]
    weights = [weights[i % len(weights)] for i in range(max(8, len(weights)))]
    w0 = weights[0][0]
    x = torch.randn(1, w0.shape[1], dtype=w0.dtype, device=w0.device)
    cublas = graph_ms_per_call([partial(F.linear, x, w, b) for w, b in weights])
    triton = graph_ms_per_call([partial(gemv_ops.gemv, x, w, b) for w, b in weights])
    log.info("one-token %s: cuBLAS %.1f us, Triton GEMV %.1f us", name, cublas * 1e3, triton * 1e3)
    return triton < _AUTO_MARGIN * cublas
