"""Load an HF-style checkpoint directory: `config.json` plus single or sharded safetensors."""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from engine.config import ConfigError
from engine.loader.base import Checkpoint, ModelLoadError, check_tensors, expected_tensor_shapes
from engine.model_config import ModelConfig

SHARD_INDEX = "model.safetensors.index.json"


def read_hf_config(path: str) -> ModelConfig:
    """The ModelConfig of `path/config.json`; ModelLoadError when absent or unsupported."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{path} has no config.json (expected an HF checkpoint directory)")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
        return ModelConfig.from_hf(raw)
    except (OSError, ValueError, ConfigError, KeyError, TypeError) as exc:
        reason = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ModelLoadError(f"{config_path}: {reason}") from exc


def safetensors_files(path: str) -> list[str]:
    """The weight files of a checkpoint directory, from the shard index when there is one."""
    index_path = os.path.join(path, SHARD_INDEX)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index_path}: unreadable shard index ({exc})") from exc
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise ModelLoadError(f"{path} holds no .safetensors weights")
    files = [os.path.join(path, n) for n in names]
    for file in files:
        if not os.path.isfile(file):
            raise ModelLoadError(f"{path}: weight file {os.path.basename(file)} is missing")
    return files


def read_safetensors(
    files: list[str], wanted: set[str], *, progress: bool = True
) -> dict[str, torch.Tensor]:
    """Load the `wanted` tensors found in `files` (others are skipped, not read)."""
    tensors: dict[str, torch.Tensor] = {}
    bar = tqdm(files, desc="loading weights", unit="file", file=sys.stderr, disable=not progress)
    for file in bar:
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                    if key in wanted:
                        tensors[key] = f.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file}: unreadable safetensors file ({exc})") from exc
    bar.close()
    return tensors


def load_hf_weights(
    path: str, *, progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and checked HF-named tensors of a checkpoint directory."""
    config = read_hf_config(path)
    files = safetensors_files(path)
    tensors = read_safetensors(files, set(expected_tensor_shapes(config)), progress=progress)
    check_tensors(config, tensors, path)
    return config, tensors


def load_hf_dir(path: str, *, progress: bool = True) -> Checkpoint:
    """A Checkpoint from an HF directory; its tokenizer is the dir when it has tokenizer.json."""
    config, tensors = load_hf_weights(path, progress=progress)
    has_tokenizer = os.path.isfile(os.path.join(path, "tokenizer.json"))
    return Checkpoint(
        model_id=os.path.basename(os.path.normpath(path)),
        config=config,
        tensors=tensors,
        tokenizer_source=path if has_tokenizer else None,
        source="hf",
    )
