"""Synthetic models: real architectures with seeded random weights, for tests and benchmarks.

No weights are materialized at load time: the Checkpoint carries only the config and the
seed, and `init_synthetic_weights` fills a model's (already allocated) parameters in place,
directly in their dtype and on their device. Weights depend on the seed and on the device
type (CPU and CUDA generators differ), and are identical across runs for both.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelLoadError
from engine.loader.base import Checkpoint
from engine.model_specs import PRESETS, SYNTHETIC_PREFIX

__all__ = ["PRESETS", "SYNTHETIC_PREFIX", "init_synthetic_weights", "synthetic_checkpoint"]

WEIGHT_STD = 0.02


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
