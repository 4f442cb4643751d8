"""LoRA adapters in PEFT format: `adapter_config.json` + `adapter_model.safetensors`.

`load_adapter` reads one adapter and checks it against the base model before anything can
serve it: LoRA only (no DoRA, no trained biases, no extra saved modules), target modules
among q/k/v/o/gate/up/down, ranks 1-64, every tensor of the right shape for its layer and
module, finite values. Any failure is an `AdapterError` with one line saying what is wrong
and where. The scaling (`lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA) is folded
into B, so a module's update is simply `x A^T B^T`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.model_config import ModelConfig
from engine.protocol import InvalidRequestError

MAX_RANK = 64
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module names -> which projection of the decoder layer they adapt
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter that cannot be served with this base model (one line: what and where)."""


class AdapterPathError(InvalidRequestError):
    """An adapter whose directory lies outside the adapter directory. The message names the
    adapter, never a path: it reaches the tenant who asked for it."""

    code = "adapter_path_not_allowed"


def resolve_under(path: str, root: str, name: str) -> str:
    """`path` with symlinks and `..` resolved, if it lies under `root` (resolved the same
    way); raises AdapterPathError otherwise."""
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(Path(root).resolve()):
        raise AdapterPathError(
            f"the adapter '{name}' lies outside this worker's adapter directory", param="model"
        )
    return str(resolved)


@dataclass(frozen=True)
class LoRAWeights:
    """One module's update: `x @ a.T @ b.T`, with the adapter's scaling already in `b`."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    rank: int
    scaling: float
    target_modules: frozenset[str]
    weights: dict[tuple[int, str], LoRAWeights]  # (layer, module) -> update

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a target module in this base model."""
    h, i = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (h, config.q_size),
        "k_proj": (h, config.kv_size),
        "v_proj": (h, config.kv_size),
        "o_proj": (config.q_size, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[module]


def load_adapter(
    path: str | Path,
    config: ModelConfig,
    *,
    name: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    """Read and validate the PEFT adapter in directory `path` for a base model shaped like
    `config`. Raises AdapterError."""
    root = Path(path)
    name = name or root.name
    rank, scaling, targets = read_adapter_settings(root, name)
    tensors = _read_tensors(root, name)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.search(key)
        if match is None:
            raise AdapterError(
                f"{name}: unsupported tensor {key!r} (only LoRA A/B of {', '.join(TARGET_MODULES)})"
            )
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in TARGET_MODULES:
            raise AdapterError(f"{name}: module {module!r} in {key!r} is not supported")
        if module not in targets:
            raise AdapterError(f"{name}: {key!r} adapts {module}, which target_modules omits")
        if not 0 <= layer < config.num_layers:
            raise AdapterError(
                f"{name}: {key!r} is for layer {layer}; the base model has {config.num_layers}"
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise AdapterError(f"{name}: {WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{name}: {where} has lora_{next(iter(ab))} but not its pair")
        fan_in, fan_out = module_shape(config, module)
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise AdapterError(
                f"{name}: {where} has A {tuple(a.shape)} and B {tuple(b.shape)}; this base "
                f"model needs A ({rank}, {fan_in}) and B ({fan_out}, {rank})"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{name}: {where} has non-finite values")
        weights[layer, module] = LoRAWeights(
            a=a.to(dtype).contiguous(), b=(b.float() * scaling).to(dtype).contiguous()
        )
    return LoRAAdapter(name, rank, scaling, frozenset(m for _, m in weights), weights)


def read_adapter_settings(path: str | Path, name: str) -> tuple[int, float, frozenset[str]]:
    """(rank, scaling, target modules) from the adapter's config alone: the quick checks,
    without reading its weights. Raises AdapterError."""
    root = Path(path)
    settings = _read_config(root)
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise AdapterError(f"{name}: rank r={rank!r} is outside 1-{MAX_RANK}")
    if not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise AdapterError(f"{name}: lora_alpha={alpha!r} is not a finite number")
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    targets = _targets(name, settings.get("target_modules"))
    if not (root / WEIGHTS_FILE).is_file():
        raise AdapterError(f"{name}: no {WEIGHTS_FILE} in {root}")
    return rank, scaling, targets


def _read_config(root: Path) -> dict[str, Any]:
    file = root / CONFIG_FILE
    try:
        settings = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{root.name}: no {CONFIG_FILE} in {root}") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{root.name}: {CONFIG_FILE} is unreadable ({exc})") from None
    if not isinstance(settings, dict):
        raise AdapterError(f"{root.name}: {CONFIG_FILE} is not a JSON object")
    unsupported = {
        "peft_type": settings.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(settings.get("use_dora")),
        "bias": settings.get("bias", "none") != "none",
        "modules_to_save": bool(settings.get("modules_to_save")),
        "rank_pattern": bool(settings.get("rank_pattern")),
        "alpha_pattern": bool(settings.get("alpha_pattern")),
        "fan_in_fan_out": bool(settings.get("fan_in_fan_out")),
    }
    for key, bad in unsupported.items():
        if bad:
            raise AdapterError(f"{root.name}: {key}={settings.get(key)!r} is not supported")
    return settings


def _targets(name: str, value: Any) -> frozenset[str]:
    """target_modules as PEFT writes it: a list of module names, or a regex over the full
    module paths (matched here against `model.layers.0.<attn|mlp>.<module>`)."""
    if isinstance(value, str):
        pattern = re.compile(value)
        targets = frozenset(
            m
            for m in TARGET_MODULES
            if pattern.fullmatch(f"model.layers.0.{'mlp' if m in _MLP else 'self_attn'}.{m}")
        )
    elif isinstance(value, list) and all(isinstance(m, str) for m in value):
        targets = frozenset(m.rsplit(".", 1)[-1] for m in value)
        unknown = sorted(targets - set(TARGET_MODULES))
        if unknown:
            raise AdapterError(
                f"{name}: target module(s) {', '.join(unknown)} not supported (supported: "
                f"{', '.join(TARGET_MODULES)})"
            )
    else:
        raise AdapterError(f"{name}: target_modules must be a list of names or a regex")
    if not targets:
        raise AdapterError(f"{name}: target_modules selects no supported module")
    return targets


def _read_tensors(root: Path, name: str) -> dict[str, torch.Tensor]:
    file = root / WEIGHTS_FILE
    if not file.is_file():
        raise AdapterError(f"{name}: no {WEIGHTS_FILE} in {root}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{name}: {WEIGHTS_FILE} is corrupt or unreadable ({exc})") from None
