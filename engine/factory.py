"""Builds a ready EngineCore (and its tokenizer) from an EngineConfig."""

from __future__ import annotations

import dataclasses
import logging

import torch

from engine.attention.triton_backend import (
    TritonUnavailableError,
    load_triton_kernels,
    use_pdl,
)
from engine.config import ConfigError, EngineConfig, KernelBackend, WeightFormat
from engine.core import EngineCore
from engine.kernels.cpu import CpuKernels, isa_build, load_cpu_kernels, resolve_cpu_isa
from engine.kernels.cpu_dtype import fastest_cpu_dtype
from engine.loader import (
    Checkpoint,
    build_model,
    load_checkpoint,
)
from engine.model.fp8_weights import apply_fp8_weights, choose_plans, fuse_silu_mul
from engine.model.native_cpu import apply_native_cpu
from engine.model.quant_weights import apply_quant_weights, describe, quantize_model
from engine.model.triton_layers import apply_triton_layers
from engine.model_specs import tokenizer_from_source
from engine.structured.backend import Vocabulary
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def load_tokenizer(checkpoint: Checkpoint, cache_dir: str | None = None) -> Tokenizer:
    """The checkpoint's own tokenizer; a byte tokenizer for synthetic (random) models."""
    return tokenizer_from_source(
        checkpoint.tokenizer_source, checkpoint.config.vocab_size, cache_dir
    )


def create_engine(config: EngineConfig, *, progress: bool = True) -> tuple[EngineCore, Tokenizer]:
    """Load weights and tokenizer, size the KV pool, return the engine and tokenizer.

    Raises ModelLoadError / ConfigError with a one-line message on bad input.
    """
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    triton = use_triton(config)
    checkpoint = load_checkpoint(
        config.model, config.cache_dir, progress=progress, seed=config.seed
    )
    tokenizer = load_tokenizer(checkpoint, config.cache_dir)
    model = build_model(checkpoint, compute_dtype(config), config.torch_device())
    kernels = native_kernels(config, model.embed_tokens.weight.dtype)
    if config.weights is WeightFormat.FASTEST:  # the engine reports the format it runs
        config = dataclasses.replace(config, weights=fastest_weights(kernels))
    quantized = config.weights in (WeightFormat.Q8, WeightFormat.Q4) or (
        config.weights is WeightFormat.AUTO and kernels is not None
    )
    if quantized:  # before the native swap, which leaves the quantized linears alone
        weights = quantize_model(model, checkpoint, config.weights)
        apply_quant_weights(model, weights, None if kernels is None else kernels.quant)
        if weights:
            log.info("quantized weights: %s", describe(weights))
    if kernels is not None:
        apply_native_cpu(model, kernels)
    pdl = use_pdl(config.pdl, triton, config.torch_device())
    if config.weights is WeightFormat.FP8:  # before the one-token products are chosen
        ops = load_triton_kernels(config.torch_device(), "triton_fp8_linear")
        log.info("FP8 weights for %s", ", ".join(apply_fp8_weights(model, ops, pdl=pdl)))
        if not config.lora.max_loras:  # LoRA's gate_up update comes before the activation
            fuse_silu_mul(model)
        if config.torch_device().type == "cuda":
            log.info("FP8 products by kernel and tiles: %s", choose_plans(model, ops, pdl=pdl))
    if triton and config.torch_device().type == "cuda":  # interpreted, they only cost time
        gemv = apply_triton_layers(model, gemv=config.gemv, pdl=pdl)
        log.info("one-token products by kernel: %s", gemv)
    core = EngineCore(
        model,
        config,
        model_id=checkpoint.model_id,
        eos_token_ids=tokenizer.eos_token_ids,
        kernels=kernels,
        triton=triton,
        vocabulary=Vocabulary.of(tokenizer),
    )
    return core, tokenizer


def use_triton(config: EngineConfig) -> bool:
    """Whether attention runs on the Triton kernels (see KernelBackend)."""
    device = config.torch_device()
    # FP8 weights run on no other kernels (EngineConfig allows them only where these can run)
    if config.backend is KernelBackend.TRITON or config.weights is WeightFormat.FP8:
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


def compute_dtype(config: EngineConfig) -> torch.dtype:
    """The model's dtype: `--dtype`, where `auto` on a CPU with the native kernels is the
    dtype their linears run fastest (engine/kernels/cpu_dtype.py)."""
    if config.dtype == "auto":
        kernels = native_kernels(config, torch.bfloat16)
        if kernels is not None:
            return fastest_cpu_dtype(kernels, config.cache_dir)
    return config.torch_dtype()


def fastest_weights(kernels: CpuKernels | None) -> WeightFormat:
    """What `--weights fastest` runs: the checkpoint's own weights (`auto`: a GGUF's stay
    quantized) on the native kernels of an x86 CPU without AVX512-BF16, where the integer dot
    products beat 16-bit weights at every batch size (AVX2: 1.4-1.5x at 1 to 32 sequences);
    16-bit weights with AVX512-BF16, whose bf16 dot products run a batch of 32 faster than the
    quantized products do (1.3x), and without native kernels (the portable build: scalar C
    against torch's vectorized GEMMs). The figures are engine_throughput's, in
    docs/benchmarks.md."""
    if kernels is None or kernels.isa == "portable" or kernels.has_avx512_bf16:
        return WeightFormat.SIXTEEN_BIT
    return WeightFormat.AUTO


def native_kernels(config: EngineConfig, dtype: torch.dtype) -> CpuKernels | None:
    """The native CPU kernels, built for `--cpu-isa`, when the config and device allow them
    (see KernelBackend)."""
    if config.backend in (KernelBackend.TORCH, KernelBackend.TRITON) or (
        config.torch_device().type != "cpu"
    ):
        if config.backend is KernelBackend.NATIVE:
            raise ConfigError("the native backend runs on CPU devices only")
        return None
    try:
        isa = resolve_cpu_isa(config.cpu_isa.value)
    except ValueError as exc:
        raise ConfigError(f"cpu_isa: {exc}") from None
    kernels = load_cpu_kernels(config.cache_dir, arch=isa_build(isa))
    if kernels is None or not kernels.supports(dtype):
        if config.backend is KernelBackend.NATIVE:
            raise ConfigError(f"native CPU kernels are unavailable here for {dtype}")
        return None
    return kernels
