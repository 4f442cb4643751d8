"""PEFT-format adapter directories for tests: seeded random ones, or given tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.lora.adapter import TARGET_MODULES
from engine.lora.synthetic import write_random_adapter
from engine.model_config import ModelConfig

# SmolLM2-135M's shapes, for adapters of the default model
SMOLLM2 = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
)


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
    """A random adapter, or one holding exactly `tensors` (to build broken ones)."""
    root = write_random_adapter(
        root, config, rank=rank, modules=modules, scale=scale, seed=seed, settings=settings
    )
    if tensors is not None:
        save_file(tensors, str(root / "adapter_model.safetensors"))
    return root
