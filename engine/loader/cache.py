"""On-disk cache of dequantized GGUF checkpoints as HF-style directories.

An entry lives at `<cache_dir>/models/<model-id>-<hash>/` and holds `config.json` plus one
`model.safetensors` (fp32 for dequantized tensors). The hash covers the GGUF file's real
path, size and mtime and the cache format version, so a replaced file gets a new entry.
Entries are written into a temporary sibling directory and renamed into place, so readers
never see half an entry; an entry that fails to load is deleted and rebuilt by the caller.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time

import torch
from safetensors.torch import save_file

from engine.loader.base import ModelLoadError
from engine.loader.hf_loader import load_hf_weights
from engine.model_config import ModelConfig

log = logging.getLogger(__name__)

# bump when the conversion changes, so entries written by an older loader are not reused
CACHE_FORMAT_VERSION = 1
_TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 24 * 3600


def cache_entry_dir(cache_dir: str, gguf_path: str, model_id: str) -> str:
    """The entry directory for one GGUF file (it may not exist yet)."""
    real = os.path.realpath(gguf_path)
    st = os.stat(real)
    key = f"{CACHE_FORMAT_VERSION}\0{real}\0{st.st_size}\0{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", model_id).strip(".") or "model"
    return os.path.join(cache_dir, "models", f"{name}-{digest}")


def load_cache_entry(
    entry: str, *, progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]] | None:
    """Config and tensors of a cache entry; None when absent.

    A corrupt entry (unreadable config, truncated or incomplete weights) is deleted and
    None returned, so the caller rebuilds it.
    """
    if not os.path.isdir(entry):
        return None
    try:
        return load_hf_weights(entry, progress=progress)
    except ModelLoadError as exc:
        log.warning("discarding corrupt model cache entry %s: %s", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def write_cache_entry(entry: str, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> bool:
    """Atomically create `entry` from a config and HF-named tensors.

    Replaces an existing (corrupt) entry. Returns False, leaving no partial files behind,
    when the cache cannot be written (read-only or full disk): caching is an optimization.
    """
    models_dir = os.path.dirname(entry)
    try:
        os.makedirs(models_dir, exist_ok=True)
        _remove_stale_tmp_dirs(models_dir)
        tmp = tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=models_dir)
    except OSError as exc:
        log.warning("cannot write model cache under %s: %s", models_dir, exc)
        return False
    try:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config.to_hf(), f, indent=2)
        weights = {name: t.contiguous() for name, t in tensors.items()}
        save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if os.path.isdir(entry):
            shutil.rmtree(entry)
        os.rename(tmp, entry)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.isdir(entry):  # another process finished the same entry first
            return True
        log.warning("cannot write model cache entry %s: %s", entry, exc)
        return False
    return True


def _remove_stale_tmp_dirs(models_dir: str) -> None:
    """Delete temporary directories left by writers that crashed a day or more ago."""
    cutoff = time.time() - _STALE_TMP_SECONDS
    for name in os.listdir(models_dir):
        path = os.path.join(models_dir, name)
        if name.startswith(_TMP_PREFIX) and os.path.getmtime(path) < cutoff:
            shutil.rmtree(path, ignore_errors=True)
