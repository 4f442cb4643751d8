"""Swap the model's building blocks for Strata's native CPU kernels, from outside the model.

`apply_native_cpu(model, kernels)` replaces, in place, every RMSNorm (residual add fused),
the rotary embedding (applied in place inside the fused qkv buffer), SiLU*up, and every
linear layer (bf16 on AVX512-BF16 and AVX2 CPUs, fp32 on AVX-512 and AVX2 ones: whatever
`CpuKernels.can_pack` accepts) with modules that call
`CpuKernels`. bf16 layers go further: one kernel call per layer, or per step, with their
projections packed or quantized (`QuantLinear`). The model file
itself never branches on the backend. Packed linears drop the original weight, except the LM
head when it is tied to the embedding table (the lookup still needs the rows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from engine.attention.paged import PagedAttention
from engine.kernels.cpu import (
    CpuKernels,
    LayerLoRA,
    LayerWeights,
    StackLoRA,
    StackPages,
    StackWeights,
)
from engine.model.llama import (
    AttentionBackend,
    DecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
    RotaryEmbedding,
)
from engine.model.quant_weights import QuantLinear
from kvstore.hostmem import HostArena

if TYPE_CHECKING:
    from engine.lora.batch import LoRABatch


class NativeRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module, kernels: CpuKernels) -> None:
        assert isinstance(norm, RMSNorm)
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.kernels = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as RMSNorm; `residual` is updated in place to x + residual."""
        return self.kernels.rms_norm(x.contiguous(), residual, self.weight, self.eps)


class NativeRotary(nn.Module):
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, rope: nn.Module, kernels: CpuKernels) -> None:
        assert isinstance(rope, RotaryEmbedding)
        super().__init__()
        self.register_buffer("cos", rope.cos, persistent=False)
        self.register_buffer("sin", rope.sin, persistent=False)
        self.kernels = kernels

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q and k in place (they are views into the qkv projection output)."""
        self.kernels.rope_(q, k, positions, self.cos, self.sin)
        return q, k


class NativeSiluAndMul(nn.Module):
    def __init__(self, kernels: CpuKernels) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up)


class NativeLinear(nn.Module):
    """A linear on a packed copy of the weight (csrc/linear.h, bf16; csrc/linear_f32.h)."""

    packed: torch.Tensor

    def __init__(
        self,
        linear: nn.Module,
        kernels: CpuKernels,
        out_dtype: torch.dtype | None = None,
        arena: HostArena | None = None,
    ) -> None:
        super().__init__()
        assert isinstance(linear, nn.Linear)
        weight = linear.weight.data
        out = None if arena is None else arena.take(weight.shape, weight.dtype)
        self.register_buffer("packed", kernels.pack(weight, out), persistent=False)
        self.bias = linear.bias
        self.out_features = linear.out_features
        self.kernels = kernels
        self.out_dtype = out_dtype or linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear_packed(
            x.contiguous(), self.packed, self.bias, self.out_features, self.out_dtype
        )


def _layer_weight(linear: nn.Module) -> tuple[torch.Tensor, int]:
    """A projection's weight as the layer kernel reads it, and its format code."""
    if isinstance(linear, QuantLinear):
        return linear.weight.rows, linear.weight.format.code
    assert isinstance(linear, NativeLinear)
    return linear.packed, 0


class NativeDecoderLayer(nn.Module):
    """A whole bf16 decoder layer in one kernel call (no Python between its kernels).

    Built from a layer whose modules were already swapped for native ones (packed or
    quantized linears); shares their weights and produces bit-identical results.
    """

    def __init__(self, layer: DecoderLayer, rope: NativeRotary, kernels: CpuKernels) -> None:
        super().__init__()
        self.layer_idx = layer.layer_idx
        self.kernels = kernels
        self.inner = layer  # keeps the parameters and buffers registered
        linears = [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
        (qkv, fq), (o, fo), (gate_up, fg), (down, fd) = map(_layer_weight, linears)
        in_norm, post_norm = layer.input_norm, layer.post_attn_norm
        assert isinstance(in_norm, NativeRMSNorm) and isinstance(post_norm, NativeRMSNorm)
        bias = cast(torch.Tensor | None, getattr(layer.qkv_proj, "bias", None))
        self.weights = LayerWeights(
            in_norm=in_norm.weight.data,
            post_norm=post_norm.weight.data,
            eps=in_norm.eps,
            qkv=qkv,
            qkv_bias=None if bias is None else bias.data,
            o=o,
            gate_up=gate_up,
            down=down,
            cos=rope.cos,
            sin=rope.sin,
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            intermediate=cast(int, layer.gate_up_proj.out_features) // 2,
            formats=(fq, fo, fg, fd),
        )
        self.lora: LayerLoRA | None = None
        self.lora_batch: LoRABatch | None = None

    def use_lora(self, lora: LayerLoRA, batch: LoRABatch) -> None:
        """Add each token's adapter update inside the layer kernel (csrc/lora.h)."""
        self.lora, self.lora_batch = lora, batch

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope: nn.Module,
        attn: AttentionBackend,
        ctx: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as DecoderLayer.forward."""
        assert isinstance(attn, PagedAttention)
        first = residual is None
        res = torch.empty_like(x) if residual is None else residual
        batch = self.lora_batch
        slots = None if batch is None or batch.slots is None else batch.slots_i32
        out = self.kernels.decoder_layer(
            x.contiguous(),
            res,
            first,
            self.weights,
            positions,
            attn.layer_pages(self.layer_idx, ctx),
            self.lora,
            slots,
        )
        return out, res


class NativeDecoderStack:
    """Every fused layer in one kernel call per step, adapters included: no Python runs
    between layers, and the kernel threads never wait on it there."""

    def __init__(self, layers: list[NativeDecoderLayer], kernels: CpuKernels) -> None:
        self.layers = layers
        self.kernels = kernels
        self.weights = StackWeights([layer.weights for layer in layers])
        self._pages: tuple[tuple[int, ...], StackPages] | None = None
        self._lora: StackLoRA | None = None

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, attn: Any, ctx: Any
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not isinstance(attn, PagedAttention):
            return None
        lora, slots = None, None
        batch = self.layers[0].lora_batch
        if batch is not None and batch.slots is not None:
            loras = [layer.lora for layer in self.layers]
            if None in loras or any(layer.lora_batch is not batch for layer in self.layers):
                return None  # adapters on some layers only: layer by layer
            if self._lora is None or self._lora.layers != tuple(loras):
                self._lora = StackLoRA(cast(list[LayerLoRA], loras))
            lora, slots = self._lora, batch.slots_i32
        shared = attn.layer_pages(0, ctx)
        # every layer's pages, rebuilt only if the pool's storage moved
        key = (shared.k.data_ptr(), shared.v.data_ptr(), len(self.layers))
        if self._pages is None or self._pages[0] != key:
            layers = [attn.layer_pages(layer.layer_idx, ctx) for layer in self.layers]
            self._pages = key, StackPages(layers)
        attn.pool.loads.wait_all()  # the kernel reads every layer's pages
        return self.kernels.decoder_stack(
            x.contiguous(), self.weights, positions, shared, self._pages[1], lora, slots
        )


def apply_native_cpu(
    model: LlamaForCausalLM, kernels: CpuKernels, *, fuse_layers: bool = True
) -> None:
    """Replace the model's norms, rotary, activation and linears in place; with
    `fuse_layers`, bf16 layers whose linears all packed become one kernel call each."""
    dtype = model.embed_tokens.weight.dtype
    assert kernels.supports(dtype), f"no native CPU kernels for {dtype}"

    def packable(linear: nn.Module) -> bool:
        return isinstance(linear, nn.Linear) and kernels.can_pack(linear.weight)

    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

    def packable_layer(layer: DecoderLayer) -> bool:  # the fused layer kernel is bf16
        linears = [getattr(layer, n) for n in names]
        fused = (NativeLinear, QuantLinear)
        return dtype == torch.bfloat16 and all(isinstance(m, fused) for m in linears)

    linears = [getattr(block, name) for block in model.layers for name in names]
    # every packed weight in one huge-page arena: a decode step reads them all
    packed = [m.weight for m in [*linears, model.lm_head] if packable(m)]
    arena = HostArena(HostArena.size_of([(w.shape, w.dtype) for w in packed]))
    for block in model.layers:
        layer = cast(DecoderLayer, block)
        layer.input_norm = NativeRMSNorm(layer.input_norm, kernels)
        layer.post_attn_norm = NativeRMSNorm(layer.post_attn_norm, kernels)
        layer.act = NativeSiluAndMul(kernels)
        for name in names:
            if packable(getattr(layer, name)):
                setattr(layer, name, NativeLinear(getattr(layer, name), kernels, arena=arena))
    model.norm = NativeRMSNorm(model.norm, kernels)
    rope = NativeRotary(model.rope, kernels)
    model.rope = rope
    if fuse_layers and all(packable_layer(cast(DecoderLayer, b)) for b in model.layers):
        for i, block in enumerate(model.layers):
            model.layers[i] = NativeDecoderLayer(cast(DecoderLayer, block), rope, kernels)
        fused = [cast(NativeDecoderLayer, layer) for layer in model.layers]
        model.layer_stack = NativeDecoderStack(fused, kernels)
    if packable(model.lm_head):
        model.lm_head = NativeLinear(model.lm_head, kernels, torch.float32, arena)
