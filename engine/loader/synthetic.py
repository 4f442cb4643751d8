"""Synthetic models: real architectures with seeded random weights, for tests and benchmarks.

No weights are materialized at load time: the Checkpoint carries only the config and the
seed, and `init_synthetic_weights` fills a model's (already allocated) parameters in place,
directly in their dtype and on their device. Weights depend on the seed and on the device
type (CPU and CUDA generators differ), and are identical across runs for both.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig, RopeScaling
from engine.loader.base import Checkpoint, ModelLoadError

SYNTHETIC_PREFIX = "synthetic:"
WEIGHT_STD = 0.02

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "llama3.2-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            kind="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        tie_word_embeddings=True,
    ),
    "llama3-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
}


def synthetic_checkpoint(spec: str, seed: int) -> Checkpoint:
    """The Checkpoint of `synthetic:<preset>`: a preset config, the seed, and no tensors."""
    preset = spec.removeprefix(SYNTHETIC_PREFIX)
    if preset not in PRESETS:
        raise ModelLoadError(
            f"unknown synthetic preset {preset!r}; available: "
            + ", ".join(f"{SYNTHETIC_PREFIX}{name}" for name in PRESETS)
        )
    return Checkpoint(
        model_id=f"{SYNTHETIC_PREFIX}{preset}",
        config=PRESETS[preset],
        tensors={},
        tokenizer_source=None,
        source="synthetic",
        seed=seed,
    )


@torch.no_grad()
def init_synthetic_weights(model: nn.Module, seed: int) -> None:
    """Overwrite every parameter of `model` in place from a generator seeded with `seed`.

    Norm weights become 1, biases 0, everything else N(0, WEIGHT_STD). Parameters are
    visited in registration order (tied ones once), so the result is a function of the
    seed, the config and the device type.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            param.normal_(0.0, WEIGHT_STD, generator=generators[param.device])
