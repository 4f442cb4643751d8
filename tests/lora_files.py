"""PEFT-format adapter directories for tests, with the tensor names PEFT writes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.lora.adapter import TARGET_MODULES, module_shape


def write_adapter(
    root: Path,
    config: ModelConfig,
    *,
    rank: int = 8,
    modules: tuple[str, ...] = TARGET_MODULES,
    settings: dict | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    scale: float = 1.0,
    seed: int = 0,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": list(modules),
        "bias": "none", "use_rslora": False,
    } | (settings or {})  # fmt: skip
    (root / "adapter_config.json").write_text(json.dumps(adapter_config))
    if tensors is None:
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for layer in range(config.num_layers):
            for m in modules:
                fan_in, fan_out = module_shape(config, m)
                part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                base = f"base_model.model.model.layers.{layer}.{part}.{m}"
                tensors[f"{base}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * scale
                tensors[f"{base}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * scale
    save_file(tensors, str(root / "adapter_model.safetensors"))
    return root
