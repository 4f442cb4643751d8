"""Turn a Checkpoint into a ready-to-run LlamaForCausalLM without a wasted weight copy."""

from __future__ import annotations

import torch

from engine.loader.base import Checkpoint, ModelLoadError
from engine.loader.synthetic import init_synthetic_weights
from engine.model.llama import LlamaForCausalLM, RotaryEmbedding, fuse_hf_weights


def build_model(
    checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """An eval-mode, gradient-free model with the checkpoint's weights in `dtype` on `device`.

    The module is first built on the `meta` device (no memory), then its parameters are
    assigned the checkpoint tensors cast and moved one by one; weights already in `dtype`
    on `device` are shared with `checkpoint.tensors`, not copied. A synthetic checkpoint
    (empty `tensors`) gets uninitialized storage of `dtype` on `device`, filled in place
    from `checkpoint.seed`. RoPE tables are rebuilt on `device` in fp32 in both cases.
    """
    config = checkpoint.config
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if checkpoint.source == "synthetic":
        model.to(dtype=dtype)
        model.to_empty(device=device)
        _tie_embeddings(model)
        init_synthetic_weights(model, checkpoint.seed)
    else:
        _assign_weights(model, checkpoint, dtype, device)
    # non-persistent buffers are not in any state dict: compute them for real, in fp32
    model.rope = RotaryEmbedding(config).to(device)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert not tensor.is_meta, f"{name} was left on the meta device"
    model.eval()
    model.requires_grad_(False)
    return model


def _assign_weights(
    model: LlamaForCausalLM, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device
) -> None:
    """Fuse the HF-named tensors and make them the model's parameters (mutates `model`)."""
    config = checkpoint.config
    # cast before fusing so the concatenations happen once, in the target dtype and device
    converted = {
        name: tensor.to(device=device, dtype=dtype) for name, tensor in checkpoint.tensors.items()
    }
    try:
        state = fuse_hf_weights(config, converted)
    except KeyError as exc:
        raise ModelLoadError(f"{checkpoint.model_id}: missing tensor {exc.args[0]}") from exc
    del converted
    result = model.load_state_dict(state, strict=False, assign=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise ModelLoadError(
            f"{checkpoint.model_id}: weights do not fit the model "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(result.unexpected_keys)[:3]})"
        )
    _tie_embeddings(model)


def _tie_embeddings(model: LlamaForCausalLM) -> None:
    """Point the LM head at the embedding again (meta-device tricks break the tie)."""
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
