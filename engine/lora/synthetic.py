"""Seeded random LoRA adapters in PEFT format, for tests and benchmarks (as `synthetic:`
presets are for models)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.lora.adapter import CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE, module_shape
from engine.model_config import ModelConfig


def write_random_adapter(
    root: Path,
    config: ModelConfig,
    *,
    rank: int = 16,
    modules: tuple[str, ...] = TARGET_MODULES,
    scale: float = 0.05,
    seed: int = 0,
    settings: dict | None = None,
) -> Path:
    """An adapter directory for a base model shaped like `config`: A and B drawn from
    N(0, scale^2) (B non-zero, unlike a fresh PEFT init), lora_alpha 16."""
    root.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 16,
        "target_modules": list(modules),
        "bias": "none",
        "use_rslora": False,
    } | (settings or {})
    (root / CONFIG_FILE).write_text(json.dumps(adapter_config))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for m in modules:
            fan_in, fan_out = module_shape(config, m)
            part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            base = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * scale
            tensors[f"{base}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * scale
    save_file(tensors, str(root / WEIGHTS_FILE))
    return root
