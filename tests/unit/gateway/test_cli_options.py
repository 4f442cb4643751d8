"""Engine options on the command line: one per config field, taken by `engine`, `generate`
and `serve`, parsed into the config, passed on by `serve` to its worker."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

import pytest

from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    GemvKernel,
    KernelBackend,
    KVCacheDtype,
    WeightFormat,
)
from engine.options import (
    Option,
    add_options,
    argv_from_args,
    config_from_args,
    declaration,
    leaf_fields,
    not_an_option,
    option,
    options_of,
)
from gateway.cli import _engine_config, _serve_worker_argv, build_parser

# one value other than the default for every engine option (a switch: given)
NON_DEFAULT: dict[str, str | None] = {
    "--model": "synthetic:tiny",
    "--dtype": "float32",
    "--device": "cpu",
    "--threads": "2",
    "--cache-dir": "/srv/cache",
    "--backend": "triton",
    "--cpu-isa": "avx2",
    "--enforce-eager": None,
    "--no-pdl": None,
    "--cuda-graph-max-batch": "32",
    "--gemv": "cublas",
    "--weights": "fp8",
    "--block-size": "32",
    "--kv-cache-gb": "0.5",
    "--num-kv-blocks": "64",
    "--no-prefix-caching": None,
    "--kv-cache-dtype": "fp8_e4m3",
    "--kv-host-gb": "1.5",
    "--kv-disk-gb": "0.25",
    "--kv-disk-path": "/srv/kv",
    "--kv-spill-ahead": None,
    "--kv-load": "thread",
    "--kv-host-reads": "copy",
    "--kv-remote-url": "redis://kv.internal:6379/1",
    "--kv-remote-gb": "2.5",
    "--kv-remote-timeout-ms": "50",
    "--kv-remote-save": "evict",
    "--max-num-seqs": "8",
    "--max-num-batched-tokens": "512",
    "--max-model-len": "1024",
    "--scheduling-policy": "fcfs",
    "--max-loaded-blocks-per-step": "64",
    "--max-loras": "2",
    "--max-lora-rank": "8",
    "--adapter-dir": "/srv/adapters",
    "--speculative-tokens": "4",
    "--prompt-lookup-max": "6",
    "--prompt-lookup-min": "1",
    "--speculative-max-step-drafts": "4",
    "--speculative-always": None,
    "--grammar-backend": "xgrammar",
    "--role": "prefill",
}
COMMANDS = (["engine"], ["generate", "hi"], ["serve"])


def _flags(flag: str) -> list[str]:
    value = NON_DEFAULT[flag]
    return [flag] if value is None else [flag, value]


def _every_flag() -> list[str]:
    return [arg for flag in NON_DEFAULT for arg in _flags(flag)]


def _get(config: object, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), config)


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _worker_config(serve_argv: list[str]) -> EngineConfig:
    """The config of the worker `serve` starts with these arguments."""
    args = _parse("serve", *serve_argv)
    (model,) = args.models or ["default"]  # serve takes --model once per model
    worker = _serve_worker_argv(args, model, "/srv/strata")
    return _engine_config(_parse("engine", *worker))


def test_every_config_field_is_an_option_or_says_why_not():
    leaves = list(leaf_fields(EngineConfig))
    assert len(leaves) > 30
    for path, f, _ in leaves:
        declared = declaration(f)
        assert declared is not None, path
        assert declared.help if isinstance(declared, Option) else declared.reason, path
    assert {o.option.flag for o in options_of(EngineConfig)} == set(NON_DEFAULT)


@dataclasses.dataclass(frozen=True)
class _Part:
    size: int = option(1, "--size", "how big")
    forgotten: int = 0


@dataclasses.dataclass(frozen=True)
class _Whole:
    name: str = not_an_option("x", "set elsewhere")
    part: _Part = dataclasses.field(default_factory=_Part)


def test_a_field_without_an_option_or_a_reason_is_refused():
    with pytest.raises(TypeError, match=r"_Whole\.part\.forgotten: declare option"):
        add_options(argparse.ArgumentParser(), _Whole)


def test_option_defaults_are_the_field_defaults():
    assert config_from_args(EngineConfig, _parse("engine")) == EngineConfig()
    assert _parse("engine").kv_cache_gb == 1.0
    assert _parse("engine", "--kv-cache-gb", "0").kv_cache_gb == 0.0
    assert _engine_config(_parse("engine", "--kv-cache-gb", "0")).cache.kv_cache_memory_bytes == 1


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_every_option_reaches_its_field_from_every_command(command):
    default = _engine_config(_parse("engine"))
    if command == ["serve"]:
        config = _worker_config(_every_flag())
    else:
        config = _engine_config(_parse(*command, *_every_flag()))
    for o in options_of(EngineConfig):
        assert _get(config, o.path) != _get(default, o.path), o.option.flag
    assert config == _engine_config(_parse("engine", *_every_flag()))


@pytest.mark.parametrize("flag", NON_DEFAULT)
def test_serve_forwards_each_option_alone_and_it_parses_back(flag):
    args = _parse("serve", *_flags(flag))
    if flag == "--model":  # serve takes it once per model; each worker gets its own
        assert _serve_worker_argv(args, args.models[0], "/srv")[0] == f"--model={args.models[0]}"
        return
    argv = argv_from_args(EngineConfig, args)
    assert argv == ([flag] if NON_DEFAULT[flag] is None else [f"{flag}={NON_DEFAULT[flag]}"])
    again = _parse("engine", *argv)
    for o in options_of(EngineConfig):
        assert getattr(again, o.dest) == getattr(args, o.dest), o.option.flag


def test_serve_passes_only_what_differs_from_the_defaults():
    args = _parse("serve")
    assert argv_from_args(EngineConfig, args) == []
    assert _serve_worker_argv(args, "default", "/srv/strata") == [
        "--adapter-dir=/srv/strata/adapters"
    ]
    assert argv_from_args(EngineConfig, _parse("serve", "--kv-cache-gb", "1")) == []


def test_serve_starts_its_worker_with_the_model_it_serves():
    """--model, else $STRATA_MODEL: what the gateway settings resolved."""
    args = _parse("serve")
    argv = _serve_worker_argv(args, "synthetic:tiny", "/srv")
    assert _engine_config(_parse("engine", *argv)).model == "synthetic:tiny"


def test_kv_cache_dtype_option_reaches_the_config():
    fp8 = _engine_config(_parse("engine", "--kv-cache-dtype", "fp8_e4m3"))
    assert fp8.cache.kv_cache_dtype is KVCacheDtype.FP8_E4M3
    assert _engine_config(_parse("engine")).cache.kv_cache_dtype is None


def test_kv_tier_options_reach_the_config():
    args = _parse("engine", "--kv-host-gb", "2", "--kv-disk-gb", "0.5", "--kv-disk-path", "/kv")
    cache = _engine_config(args).cache
    assert cache.host_memory_bytes == 2 << 30 and cache.disk_bytes == 1 << 29
    assert cache.disk_path == "/kv"
    default = _engine_config(_parse("engine")).cache
    assert default.host_memory_bytes == 0 and default.kv_load == "auto"
    assert _engine_config(_parse("engine", "--kv-load", "thread")).cache.kv_load == "thread"
    assert default.kv_host_reads == "auto"
    copies = _engine_config(_parse("engine", "--kv-host-reads", "copy"))
    assert copies.cache.kv_host_reads == "copy"


def test_kv_remote_options_reach_the_config_and_bad_ones_are_refused():
    args = _parse("engine", "--kv-remote-url", "redis://kv:6379/2", "--kv-remote-timeout-ms", "50")
    cache = _engine_config(args).cache
    assert (cache.remote_url, cache.remote_timeout_ms) == ("redis://kv:6379/2", 50)
    assert cache.remote_save == "prefill" and cache.remote_memory_bytes == 1 << 30
    assert _engine_config(_parse("engine", "--kv-remote-gb", "0.5")).cache.remote_memory_bytes == (
        1 << 29
    )
    with pytest.raises(ConfigError, match="kv_remote_url"):
        CacheConfig(remote_url="http://kv:6379")
    with pytest.raises(ConfigError, match="remote_timeout_ms"):
        CacheConfig(remote_timeout_ms=0)


def test_workers_load_adapters_only_from_the_adapter_directory():
    assert _worker_config([]).lora.adapter_dir == "/srv/strata/adapters"
    given = _serve_worker_argv(_parse("serve", "--adapter-dir", "/a"), "default", "/srv")
    assert given == ["--adapter-dir=/a"]
    config = _engine_config(_parse("engine", *given), adapter_dir="/default")
    assert config.lora.adapter_dir == "/a"
    config = _engine_config(_parse("engine"), adapter_dir="/default")
    assert config.lora.adapter_dir == "/default"


def test_the_engine_seed_is_its_own_option():
    assert _engine_config(_parse("engine", "--seed", "7"), seed=7).seed == 7
    assert _engine_config(_parse("generate", "hi", "--seed", "7")).seed == EngineConfig.seed
    assert "--seed" not in " ".join(_serve_worker_argv(_parse("serve"), "default", "/srv"))


def test_switches_turn_their_field_from_its_default():
    engine = _engine_config(_parse("engine", "--enforce-eager", "--kv-spill-ahead"))
    assert engine.enforce_eager and engine.cache.spill_ahead
    off = _engine_config(
        _parse("engine", "--no-prefix-caching", "--speculative-always", "--no-pdl")
    )
    assert not off.cache.enable_prefix_caching and not off.speculative.adaptive and not off.pdl
    default = _engine_config(_parse("engine"))
    assert default.cache.enable_prefix_caching and default.speculative.adaptive and default.pdl
    assert _worker_config(["--no-prefix-caching"]).cache.enable_prefix_caching is False


def test_enum_options_take_their_values():
    assert _engine_config(_parse("engine")).gemv is GemvKernel.AUTO
    config = _worker_config(["--gemv", "cublas", "--backend", "triton"])
    assert config.gemv is GemvKernel.CUBLAS and config.backend is KernelBackend.TRITON
    with pytest.raises(SystemExit):
        _parse("engine", "--gemv", "fastest")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_weights_option_reaches_every_command(command):
    """fp8 runs on the Triton kernels (interpreted here: a CPU machine)."""
    assert _engine_config(_parse(*command)).weights is WeightFormat.FASTEST
    assert _engine_config(_parse(*command, "--weights", "auto")).weights is WeightFormat.AUTO
    fp8 = ["--weights", "fp8", "--backend", "triton"]
    config = _engine_config(_parse(*command, *fp8))
    assert config.weights is WeightFormat.FP8
    sixteen = _engine_config(_parse(*command, "--weights", "16bit"))
    assert sixteen.weights is WeightFormat.SIXTEEN_BIT
    if command == ["serve"]:
        assert _worker_config(fp8).weights is WeightFormat.FP8


def test_fp8_weights_on_a_cpu_are_refused_before_any_model_loads():
    args = _parse("engine", "--weights", "fp8", "--device", "cpu")
    with pytest.raises(ConfigError, match="fp8 weights need the Triton kernels"):
        _engine_config(args)


def test_a_workers_role_reaches_its_config_and_its_fleet_record():
    from engine.config import WorkerRole
    from engine.worker import ListenConfig
    from gateway.cli import _fleet_config

    argv = ["engine", "--role", "decode", "--kv-host-gb", "1"]
    argv += ["--registry-url", "redis://store:6379", "--worker-id", "d-1"]
    args = build_parser().parse_args(argv)
    assert _engine_config(args).role is WorkerRole.DECODE
    fleet = _fleet_config(args, ListenConfig(secret="s" * 32))
    assert fleet is not None and fleet.role == "decode"


def test_a_decode_worker_without_a_host_tier_is_refused():
    args = build_parser().parse_args(["engine", "--role", "decode"])
    with pytest.raises(ConfigError, match="--kv-host-gb"):
        _engine_config(args)
