"""Types shared by every loader: the loaded checkpoint, its error (defined with the other
configuration errors, which import without torch), and the expected tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelLoadError
from engine.model_config import ModelConfig

__all__ = ["Checkpoint", "ModelLoadError", "check_tensors", "expected_tensor_shapes"]


@dataclass(frozen=True)
class Checkpoint:
    """A loaded model description plus its weights under HF Llama names.

    `tensors` holds names like `model.layers.0.self_attn.q_proj.weight` (no `lm_head.weight`
    when embeddings are tied), fp32 for dequantized GGUF tensors and the stored float dtype
    otherwise. It is empty for synthetic models: `build_model` then draws the weights in
    place from `seed`, directly in the target dtype and on the target device.
    `tokenizer_source` is a `.gguf` file or an HF directory holding `tokenizer.json`.
    `from_cache` tells whether a GGUF's weights came from the dequantized cache entry.
    """

    model_id: str
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer_source: str | None
    source: str
    seed: int = 0
    from_cache: bool = False

    def __post_init__(self) -> None:
        assert self.source in ("gguf", "hf", "synthetic"), self.source


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF-named tensor a checkpoint of `config` must hold, with its torch shape."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for n in range(config.num_layers):
        p = f"model.layers.{n}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (q, h)
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv, h)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv, h)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, q)
        if config.attention_bias:
            shapes[f"{p}.self_attn.q_proj.bias"] = (q,)
            shapes[f"{p}.self_attn.k_proj.bias"] = (kv,)
            shapes[f"{p}.self_attn.v_proj.bias"] = (kv,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (i, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (i, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, i)
    return shapes


def check_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor], origin: str) -> None:
    """Raise ModelLoadError naming the first missing or misshapen tensor of `origin`."""
    for name, shape in expected_tensor_shapes(config).items():
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{origin}: missing tensor {name}")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"{origin}: tensor {name} has shape {list(tensor.shape)}, expected {list(shape)}"
            )
        if not tensor.is_floating_point():
            raise ModelLoadError(f"{origin}: tensor {name} has non-float dtype {tensor.dtype}")
