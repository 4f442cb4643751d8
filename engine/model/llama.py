"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2).

The model sees flattened tokens and positions plus an opaque attention context; it never sees
a request. q/k/v and gate/up are fused into one projection each; RoPE tables are built once.
Attention (including the KV-cache write) is delegated to the backend passed to `forward`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import ModelConfig, RopeScaling


class AttentionBackend(Protocol):
    """Writes a layer's new K/V into the paged cache and attends over each sequence's pages."""

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Any
    ) -> torch.Tensor:
        """q: [T, num_heads, D], k/v: [T, num_kv_heads, D] -> [T, num_heads * D]."""
        ...


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp64, with llama3/linear scaling applied."""
    # on the CPU even inside a meta-device build: tensor math on `meta` goes through torch's
    # reference implementations, which import its compiler stack (seconds per engine start)
    steps = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by `factor`, blend in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with cos/sin tables precomputed for every position."""

    cos: torch.Tensor  # [max_pos, D/2] fp32
    sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float64, device="cpu")
        freqs = torch.outer(positions, inv_freq)  # [max_pos, D/2]
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D], positions: [T] -> rotated (q, k)."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm with the residual add fused in: `forward(x, residual)` returns
    `(norm(x + residual), x + residual)`; with no residual, `(norm(x), x)`."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, hidden]; statistics in fp32 whatever the compute dtype
        if residual is not None:
            x = x + residual
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype), x


class SiluAndMul(nn.Module):
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        hidden, inter = config.hidden_size, config.intermediate_size
        # typed as nn.Module: backends swap these for fused equivalents (model/native_cpu.py)
        self.input_norm: nn.Module = RMSNorm(hidden, config.rms_norm_eps)
        self.qkv_proj: nn.Module = nn.Linear(
            hidden, self.q_size + 2 * self.kv_size, config.attention_bias
        )
        self.o_proj: nn.Module = nn.Linear(self.q_size, hidden, bias=False)
        self.post_attn_norm: nn.Module = RMSNorm(hidden, config.rms_norm_eps)
        self.gate_up_proj: nn.Module = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj: nn.Module = nn.Linear(inter, hidden, bias=False)
        self.act: nn.Module = SiluAndMul()

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope: nn.Module,
        attn: AttentionBackend,
        ctx: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] (this layer's input before the residual add) -> (out, residual)."""
        t = x.shape[0]
        h, residual = self.input_norm(x, residual)
        qkv = self.qkv_proj(h)  # [T, q + 2kv]; q, k, v below are views into it
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q, k = rope(
            positions,
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
        )
        v = v.view(t, self.num_kv_heads, self.head_dim)
        h, residual = self.post_attn_norm(
            self.o_proj(attn.forward(self.layer_idx, q, k, v, ctx)), residual
        )
        return self.down_proj(self.act(self.gate_up_proj(h))), residual


class LlamaForCausalLM(nn.Module):
    """Decoder stack plus LM head. Parameters use Strata's fused names (see `fuse_hf_weights`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # storage only: the weights come from a checkpoint or a seeded synthetic init
        # (engine/loader/build.py). Drawing the default init on the meta device would
        # import torch's compiler stack, seconds of every engine start.
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm: nn.Module = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope: nn.Module = RotaryEmbedding(config)
        self.lm_head: nn.Module = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # a backend may run every layer in one call (model/native_cpu.py); it returns None
        # for a step it cannot take, which then runs layer by layer
        self.layer_stack: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, ctx: Any
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (normed)."""
        x = self.embed_tokens(input_ids)
        stacked = None if self.layer_stack is None else self.layer_stack(x, positions, attn, ctx)
        if stacked is not None:
            return self.norm(*stacked)[0]
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rope, attn, ctx)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> fp32 logits [N, vocab]."""
        return self.lm_head(hidden).float()


def fuse_hf_weights(
    config: ModelConfig, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Map an HF-named Llama state dict onto Strata's fused parameter names.

    Accepts names with or without the `model.` prefix. Missing `lm_head.weight` is allowed
    only for tied embeddings. Raises KeyError naming the first missing tensor.
    """

    def get(name: str) -> torch.Tensor:
        for key in (f"model.{name}", name):
            if key in tensors:
                return tensors[key]
        raise KeyError(name)

    out: dict[str, torch.Tensor] = {
        "embed_tokens.weight": get("embed_tokens.weight"),
        "norm.weight": get("norm.weight"),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = tensors.get("lm_head.weight", out["embed_tokens.weight"])
    for i in range(config.num_layers):
        p = f"layers.{i}"
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        out[f"{p}.input_norm.weight"] = get(f"{p}.input_layernorm.weight")
        out[f"{p}.post_attn_norm.weight"] = get(f"{p}.post_attention_layernorm.weight")
        out[f"{p}.qkv_proj.weight"] = torch.cat(
            [get(f"{attn}.{n}_proj.weight") for n in "qkv"], dim=0
        )
        if config.attention_bias:
            out[f"{p}.qkv_proj.bias"] = torch.cat(
                [get(f"{attn}.{n}_proj.bias") for n in "qkv"], dim=0
            )
        out[f"{p}.o_proj.weight"] = get(f"{attn}.o_proj.weight")
        out[f"{p}.gate_up_proj.weight"] = torch.cat(
            [get(f"{mlp}.gate_proj.weight"), get(f"{mlp}.up_proj.weight")], dim=0
        )
        out[f"{p}.down_proj.weight"] = get(f"{mlp}.down_proj.weight")
    return out
