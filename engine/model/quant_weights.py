"""Quantized weights on a CPU (`WeightFormat` auto / q8 / q4): the decoder's projections
and the LM head held in the q8 / q4 formats of csrc/quant.h and multiplied with integer dot
products (`QuantLinear`). Applied from outside the model, before the native CPU swap, which
then leaves these modules alone. Which weights get which format is `plan_formats`; where no
quantized kernels run (CUDA, the torch backend) the quantized values are dequantized into
the model's 16-bit weights instead. Design: docs/design/kernels.md, "Quantized weights".
"""

from __future__ import annotations

import logging

import torch
from gguf import GGMLQuantizationType
from torch import nn

from engine.config import WeightFormat
from engine.kernels.cpu_quant import QuantFormat, QuantKernels, QuantWeight, quantize
from engine.loader.base import Checkpoint
from engine.loader.gguf_quant import is_quantized_type, read_kept_weights
from engine.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

# fused projection -> its HF modules, in output order
PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}


class QuantLinear(nn.Module):
    """A linear whose weight stays quantized (`QuantWeight`); products by the native
    kernels (csrc/quant.c), output in `out_dtype`."""

    def __init__(
        self,
        weight: QuantWeight,
        bias: torch.Tensor | None,
        kernels: QuantKernels,
        out_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.kernels = kernels
        self.out_dtype = out_dtype
        self.in_features, self.out_features = weight.in_features, weight.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out]."""
        return self.kernels.linear(x.contiguous(), self.weight, self.bias, self.out_dtype)


def _hf_parts(model: LlamaForCausalLM, layer: int, group: str) -> list[str]:
    return [f"model.layers.{layer}.{part}.weight" for part in PARTS[group]]


def _head_source(model: LlamaForCausalLM) -> str:
    tied = model.config.tie_word_embeddings
    return "model.embed_tokens.weight" if tied else "lm_head.weight"


def quantize_model(
    model: LlamaForCausalLM, checkpoint: Checkpoint, fmt: WeightFormat
) -> dict[str, QuantWeight]:
    """The quantized weight of every projection (fused names, `layers.{i}.qkv_proj`) and of
    the LM head (`lm_head`) that `fmt` quantizes:

    - `q8` / `q4`: every projection in that format, the LM head in q8 (its rows are the
      logits: 4 bits there cost more quality than they save);
    - `auto`: only a GGUF's block-quantized weights: where all parts of a fused projection
      are Q8_0, or all are Q4_0/Q4_1/Q4_K, their own blocks; other block types (Q6_K, Q5_K,
      mixed parts) become q8; float tensors stay 16-bit.

    A GGUF's blocks are used as they are wherever they already are in the wanted format;
    everything else is quantized from the checkpoint's float tensors (the model's own
    weights for synthetic checkpoints). Leaves `model` unchanged.
    """
    groups = {
        f"layers.{i}.{group}": _hf_parts(model, i, group)
        for i in range(model.config.num_layers)
        for group in PARTS
    }
    groups["lm_head"] = [_head_source(model)]
    types: dict[str, GGMLQuantizationType] = {}
    kept: dict[str, QuantWeight] = {}
    if checkpoint.source == "gguf" and checkpoint.tokenizer_source is not None:
        names = {name for parts in groups.values() for name in parts}
        types, kept = read_kept_weights(checkpoint.tokenizer_source, checkpoint.config, names)
    out: dict[str, QuantWeight] = {}
    for fused, parts in groups.items():
        target = _target(fmt, fused, [types.get(p) for p in parts], [kept.get(p) for p in parts])
        if target is None:
            continue
        blocks = [kept.get(p) for p in parts]
        if all(b is not None and b.format is target for b in blocks):
            out[fused] = QuantWeight.cat([b for b in blocks if b is not None])
        else:
            out[fused] = quantize(_float_weight(model, checkpoint, fused, parts), target)
    return out


def _target(
    fmt: WeightFormat,
    fused: str,
    types: list[GGMLQuantizationType | None],
    blocks: list[QuantWeight | None],
) -> QuantFormat | None:
    if fmt is WeightFormat.Q8 or (fmt is WeightFormat.Q4 and fused == "lm_head"):
        return QuantFormat.Q8
    if fmt is WeightFormat.Q4:
        return QuantFormat.Q4
    assert fmt is WeightFormat.AUTO, fmt
    if any(t is None or not is_quantized_type(t) for t in types):
        return None  # a float tensor (or not a GGUF): kept 16-bit
    formats = {b.format for b in blocks if b is not None}
    if all(b is not None for b in blocks) and len(formats) == 1:
        return formats.pop()
    return QuantFormat.Q8


def _float_weight(
    model: LlamaForCausalLM, checkpoint: Checkpoint, fused: str, parts: list[str]
) -> torch.Tensor:
    if all(p in checkpoint.tensors for p in parts):
        return torch.cat([checkpoint.tensors[p].float() for p in parts])
    module = model.lm_head if fused == "lm_head" else model.get_submodule(fused)
    assert isinstance(module, nn.Linear), f"{fused} is already swapped: {module}"
    return module.weight.detach().float()


def apply_quant_weights(
    model: LlamaForCausalLM, weights: dict[str, QuantWeight], kernels: QuantKernels | None
) -> None:
    """Swap, in place, each linear named in `weights` for a `QuantLinear` over its weight
    (the 16-bit weight is released; an LM head tied to the embedding table keeps the table
    for the lookup). Without `kernels`, the linears keep their 16-bit weights, overwritten
    with the quantized values dequantized."""
    dtype = model.embed_tokens.weight.dtype
    if kernels is None and weights:
        log.info("no quantized kernels on this backend: quantized weights are dequantized")
    for name, weight in weights.items():
        linear = model.lm_head if name == "lm_head" else model.get_submodule(name)
        assert isinstance(linear, nn.Linear), f"{name} is already swapped: {linear}"
        if kernels is None:
            if name == "lm_head" and model.config.tie_word_embeddings:
                linear.weight = nn.Parameter(weight.dequantize().to(dtype), requires_grad=False)
            else:
                linear.weight.data.copy_(weight.dequantize().to(dtype))
            continue
        out_dtype = torch.float32 if name == "lm_head" else dtype
        swapped = QuantLinear(weight, linear.bias, kernels, out_dtype)
        if name == "lm_head":
            model.lm_head = swapped
        else:
            layer, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(layer), attr, swapped)


def describe(weights: dict[str, QuantWeight]) -> str:
    """A log line's worth: how many weights in each format and their bytes."""
    counts: dict[str, tuple[int, int]] = {}
    for weight in weights.values():
        num, size = counts.get(weight.format.value, (0, 0))
        counts[weight.format.value] = num + 1, size + weight.rows.numel()
    return ", ".join(f"{n} in {f} ({s / 2**20:.0f} MiB)" for f, (n, s) in counts.items())
