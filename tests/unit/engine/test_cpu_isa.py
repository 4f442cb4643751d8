"""Choosing the native kernels' instruction level (`--cpu-isa`) and the dtype `--dtype auto`
takes on a CPU (engine/kernels/cpu_dtype.py)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from engine.config import ConfigError, CpuIsa, EngineConfig, KernelBackend
from engine.factory import compute_dtype, native_kernels
from engine.kernels.cpu import cpu_isa_levels, kernel_dir, resolve_cpu_isa
from engine.kernels.cpu_dtype import fastest_cpu_dtype
from engine.options import add_options, config_from_args

needs_avx2 = pytest.mark.skipif("avx2" not in cpu_isa_levels(), reason="this CPU has no AVX2")


def test_auto_is_the_best_level_the_cpu_has():
    levels = cpu_isa_levels()
    assert levels[-1] == "portable"
    assert resolve_cpu_isa("auto") == levels[0]
    assert resolve_cpu_isa("portable") == "portable"
    with pytest.raises(ValueError, match="unknown CPU instruction level 'sse9'"):
        resolve_cpu_isa("sse9")


@needs_avx2
def test_the_option_picks_the_build(strata_cache_dir):
    parser = argparse.ArgumentParser()
    add_options(parser, EngineConfig)
    args = parser.parse_args(["--cpu-isa", "avx2", "--cache-dir", str(strata_cache_dir)])
    config = config_from_args(EngineConfig, args)
    assert config.cpu_isa is CpuIsa.AVX2
    kernels = native_kernels(config, torch.bfloat16)
    assert kernels is not None and kernels.isa == "avx2"
    assert kernels.has_bf16_linear and kernels.has_f32_linear and not kernels.has_avx512_bf16
    portable = EngineConfig(cpu_isa=CpuIsa.PORTABLE, cache_dir=str(strata_cache_dir))
    kernels = native_kernels(portable, torch.bfloat16)
    assert kernels is not None and kernels.isa == "portable"
    assert not kernels.has_bf16_linear
    with pytest.raises(SystemExit):  # argparse names the choices
        parser.parse_args(["--cpu-isa", "avx1024"])


def test_the_torch_backend_ignores_the_level():
    config = EngineConfig(cpu_isa=CpuIsa.AVX2, backend=KernelBackend.TORCH)
    assert native_kernels(config, torch.bfloat16) is None
    assert compute_dtype(config) == torch.bfloat16  # auto without native kernels: bf16


@needs_avx2
def test_auto_dtype_is_measured_once_per_cpu_and_level(strata_cache_dir):
    cache = str(strata_cache_dir)
    config = EngineConfig(cpu_isa=CpuIsa.AVX2, cache_dir=cache)
    kernels = native_kernels(config, torch.bfloat16)
    assert kernels is not None
    for old in kernel_dir(cache).glob("dtype-avx2-*.json"):
        old.unlink()
    chosen = compute_dtype(config)
    assert chosen in (torch.bfloat16, torch.float32)
    (record,) = kernel_dir(cache).glob("dtype-avx2-*.json")
    kept = json.loads(record.read_text())
    assert kept["dtype"] == str(chosen).removeprefix("torch.") and kept["isa"] == "avx2"
    assert set(kept["seconds"]) == {"bfloat16", "float32"}
    # later loads read the measurement back: rewrite it, and the rewritten choice holds
    other = "float32" if kept["dtype"] == "bfloat16" else "bfloat16"
    record.write_text(json.dumps({**kept, "dtype": other}))
    assert fastest_cpu_dtype(kernels, cache) == getattr(torch, other)
    record.write_text("not json")  # a damaged record is measured again
    assert fastest_cpu_dtype(kernels, cache) in (torch.bfloat16, torch.float32)
    assert json.loads(record.read_text())["isa"] == "avx2"
    # an explicit dtype is never second-guessed
    assert compute_dtype(EngineConfig(dtype="bfloat16", cpu_isa=CpuIsa.AVX2)) == torch.bfloat16


def test_bf16_dot_products_make_auto_bf16_without_a_probe(strata_cache_dir):
    config = EngineConfig(cpu_isa=CpuIsa.AVX512, cache_dir=str(strata_cache_dir))
    if "avx512" not in cpu_isa_levels():
        with pytest.raises(ConfigError, match="cpu_isa: this CPU lacks avx512"):
            native_kernels(config, torch.bfloat16)
        return
    kernels = native_kernels(config, torch.bfloat16)
    if kernels is None or not kernels.has_avx512_bf16:
        pytest.skip("this CPU has no AVX512-BF16")
    assert compute_dtype(config) == torch.bfloat16
    assert not list(kernel_dir(str(strata_cache_dir)).glob("dtype-avx512-*.json"))
