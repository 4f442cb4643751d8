"""Builds a ready EngineCore (and its tokenizer) from an EngineConfig."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

import engine.tokenizer
from engine.attention.triton_backend import TritonUnavailableError, load_triton_kernels
from engine.config import ConfigError, EngineConfig, KernelBackend
from engine.core import EngineCore
from engine.kernels.cpu import CpuKernels, load_cpu_kernels
from engine.loader import (
    PRESETS,
    Checkpoint,
    ModelLoadError,
    build_model,
    load_checkpoint,
    resolve_model_path,
)
from engine.loader.synthetic import SYNTHETIC_PREFIX
from engine.model.native_cpu import apply_native_cpu
from engine.model.triton_layers import apply_triton_layers
from engine.tokenizer import Tokenizer, byte_tokenizer

log = logging.getLogger(__name__)


def load_tokenizer(checkpoint: Checkpoint, cache_dir: str | None = None) -> Tokenizer:
    """The checkpoint's own tokenizer; a byte tokenizer for synthetic (random) models."""
    return tokenizer_from_source(
        checkpoint.tokenizer_source, checkpoint.config.vocab_size, cache_dir
    )


def tokenizer_from_source(source: str | None, vocab_size: int, cache_dir: str | None) -> Tokenizer:
    """`source` is a .gguf file, an HF directory, or None (a byte tokenizer of `vocab_size`).

    A GGUF's tokenizer is rebuilt from its metadata once and kept as `tokenizer.json` under
    `cache_dir` (parsing the metadata takes seconds; loading the JSON, milliseconds).
    """
    if source is None:
        return byte_tokenizer(vocab_size)
    if not source.endswith(".gguf"):
        return Tokenizer.from_dir(source)
    if cache_dir is None:
        return Tokenizer.from_gguf(source)
    entry = _tokenizer_cache_entry(cache_dir, source)
    if entry.is_dir():
        try:
            return Tokenizer.from_dir(str(entry))
        except (OSError, ValueError) as exc:
            log.warning("discarding corrupt tokenizer cache %s: %s", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
    tokenizer = Tokenizer.from_gguf(source)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=entry.parent)
        tokenizer.save(tmp)
        os.replace(tmp, entry)
    except OSError as exc:
        log.warning("could not cache the tokenizer at %s: %s", entry, exc)
    return tokenizer


def load_tokenizer_for(spec: str, cache_dir: str | None) -> Tokenizer:
    """The tokenizer of a model spec without touching its weights (for the gateway)."""
    if spec.startswith(SYNTHETIC_PREFIX):
        name = spec.removeprefix(SYNTHETIC_PREFIX)
        if name not in PRESETS:
            raise ModelLoadError(f"unknown synthetic preset {name!r}")
        return byte_tokenizer(PRESETS[name].vocab_size)
    path = resolve_model_path(spec)
    if os.path.isdir(path):
        return Tokenizer.from_dir(path)
    return tokenizer_from_source(path, 0, cache_dir)


def _tokenizer_cache_entry(cache_dir: str, gguf_path: str) -> Path:
    # keyed by the file and by the tokenizer code, so a fix to the builder is never masked
    st = os.stat(gguf_path)
    digest = hashlib.sha256()
    digest.update(f"{os.path.realpath(gguf_path)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    digest.update(Path(engine.tokenizer.__file__).read_bytes())
    name = Path(gguf_path).stem
    return Path(cache_dir) / "tokenizers" / f"{name}-{digest.hexdigest()[:12]}"


def create_engine(config: EngineConfig, *, progress: bool = True) -> tuple[EngineCore, Tokenizer]:
    """Load weights and tokenizer, size the KV pool, return the engine and tokenizer.

    Raises ModelLoadError / ConfigError with a one-line message on bad input.
    """
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    checkpoint = load_checkpoint(
        config.model, config.cache_dir, progress=progress, seed=config.seed
    )
    tokenizer = load_tokenizer(checkpoint, config.cache_dir)
    model = build_model(checkpoint, config.torch_dtype(), config.torch_device())
    kernels = native_kernels(config, model.embed_tokens.weight.dtype)
    if kernels is not None:
        apply_native_cpu(model, kernels)
    triton = use_triton(config)
    if triton and config.torch_device().type == "cuda":  # interpreted, they only cost time
        apply_triton_layers(model)
    core = EngineCore(
        model,
        config,
        model_id=checkpoint.model_id,
        eos_token_ids=tokenizer.eos_token_ids,
        kernels=kernels,
        triton=triton,
    )
    return core, tokenizer


def use_triton(config: EngineConfig) -> bool:
    """Whether attention runs on the Triton kernels (see KernelBackend)."""
    device = config.torch_device()
    if config.backend is KernelBackend.TRITON:
        _check_triton(device)
        return True
    if config.backend is not KernelBackend.AUTO or device.type != "cuda":
        return False
    try:
        _check_triton(device)
    except ConfigError as exc:
        log.warning("attention falls back to torch ops: %s", exc)
        return False
    return True


def _check_triton(device: torch.device) -> None:
    try:
        load_triton_kernels(device)
    except TritonUnavailableError as exc:
        raise ConfigError(f"the Triton backend is unavailable: {exc}") from exc


def native_kernels(config: EngineConfig, dtype: torch.dtype) -> CpuKernels | None:
    """The native CPU kernels when the config and device allow them (see KernelBackend)."""
    if config.backend in (KernelBackend.TORCH, KernelBackend.TRITON) or (
        config.torch_device().type != "cpu"
    ):
        if config.backend is KernelBackend.NATIVE:
            raise ConfigError("the native backend runs on CPU devices only")
        return None
    kernels = load_cpu_kernels(config.cache_dir)
    if kernels is None or not kernels.supports(dtype):
        if config.backend is KernelBackend.NATIVE:
            raise ConfigError(f"native CPU kernels are unavailable here for {dtype}")
        return None
    return kernels
