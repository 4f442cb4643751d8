"""Engine options on the command line: parsed into the config, passed on by `serve`."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, GemvKernel, KernelBackend, KVCacheDtype, WeightFormat
from gateway.cli import _engine_argv, _engine_config, _serve_worker_argv, build_parser


def test_kv_cache_dtype_option_reaches_the_config():
    parser = build_parser()
    fp8 = _engine_config(parser.parse_args(["engine", "--kv-cache-dtype", "fp8_e4m3"]))
    assert fp8.cache.kv_cache_dtype is KVCacheDtype.FP8_E4M3
    assert _engine_config(parser.parse_args(["engine"])).cache.kv_cache_dtype is None


def test_kv_tier_options_reach_the_config():
    args = build_parser().parse_args(
        ["engine", "--kv-host-gb", "2", "--kv-disk-gb", "0.5", "--kv-disk-path", "/srv/kv"]
    )
    cache = _engine_config(args).cache
    assert cache.host_memory_bytes == 2 << 30 and cache.disk_bytes == 1 << 29
    assert cache.disk_path == "/srv/kv"
    default = _engine_config(build_parser().parse_args(["engine"])).cache
    assert default.host_memory_bytes == 0 and default.kv_load == "auto"
    threaded = build_parser().parse_args(["engine", "--kv-load", "thread"])
    assert _engine_config(threaded).cache.kv_load == "thread"
    assert default.kv_host_reads == "auto"
    copies = build_parser().parse_args(["engine", "--kv-host-reads", "copy"])
    assert _engine_config(copies).cache.kv_host_reads == "copy"


def test_workers_load_adapters_only_from_the_adapter_directory():
    parser = build_parser()
    assert _serve_worker_argv(parser.parse_args(["serve"]), "/srv/strata") == [
        "--adapter-dir",
        "/srv/strata/adapters",
    ]
    given = _serve_worker_argv(parser.parse_args(["serve", "--adapter-dir", "/a"]), "/srv")
    assert given == ["--adapter-dir", "/a"]
    config = _engine_config(parser.parse_args(["engine", *given]), adapter_dir="/default")
    assert config.lora.adapter_dir == "/a"
    config = _engine_config(parser.parse_args(["engine"]), adapter_dir="/default")
    assert config.lora.adapter_dir == "/default"


def test_serve_passes_engine_options_to_its_worker():
    parser = build_parser()
    argv = _engine_argv(
        parser.parse_args(
            ["serve", "--kv-cache-dtype", "fp8_e4m3", "--no-prefix-caching", "--kv-host-gb", "4"]
        )
    )
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert argv[argv.index("--kv-host-gb") + 1] == "4.0"
    assert _engine_argv(parser.parse_args(["serve", "--kv-load", "sync"])) == ["--kv-load", "sync"]
    copies = _engine_argv(parser.parse_args(["serve", "--kv-host-reads", "copy"]))
    assert copies == ["--kv-host-reads", "copy"]
    assert "--no-prefix-caching" in argv
    assert _engine_argv(parser.parse_args(["serve"])) == []
    switches = _engine_argv(parser.parse_args(["serve", "--enforce-eager", "--kv-spill-ahead"]))
    assert switches == ["--enforce-eager", "--kv-spill-ahead"]
    engine = _engine_config(parser.parse_args(["engine", *switches, "--backend", "triton"]))
    assert engine.enforce_eager and engine.cache.spill_ahead
    assert engine.backend is KernelBackend.TRITON
    assert _engine_config(parser.parse_args(["engine"])).gemv is GemvKernel.AUTO
    gemv = _engine_argv(parser.parse_args(["serve", "--gemv", "cublas"]))
    assert gemv == ["--gemv", "cublas"]
    assert _engine_config(parser.parse_args(["engine", *gemv])).gemv is GemvKernel.CUBLAS


def test_speculative_options_reach_the_config_and_the_worker():
    parser = build_parser()
    assert _engine_config(parser.parse_args(["engine"])).speculative.num_speculative_tokens == 0
    flags = [
        "--speculative-tokens",
        "5",
        "--prompt-lookup-min",
        "1",
        "--speculative-max-step-drafts",
        "4",
        "--speculative-always",
    ]
    assert _engine_config(parser.parse_args(["engine"])).speculative.adaptive
    spec = _engine_config(parser.parse_args(["engine", *flags])).speculative
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        5,
        1,
        4,
    )
    assert spec.max_step_drafts == 4 and not spec.adaptive
    argv = _engine_argv(parser.parse_args(["serve", *flags]))
    assert _engine_config(parser.parse_args(["engine", *argv])).speculative == spec


@pytest.mark.parametrize("command", [["engine"], ["generate", "hi"], ["serve"]])
def test_weights_option_reaches_every_command(command):
    """Parsed by `engine` and `generate`, passed on by `serve` to its worker; fp8 runs on
    the Triton kernels (interpreted here: a CPU machine)."""
    parser = build_parser()
    assert _engine_config(parser.parse_args(command)).weights is WeightFormat.AUTO
    fp8 = ["--weights", "fp8", "--backend", "triton"]
    config = _engine_config(parser.parse_args([*command, *fp8]))
    assert config.weights is WeightFormat.FP8
    sixteen = _engine_config(parser.parse_args([*command, "--weights", "16bit"]))
    assert sixteen.weights is WeightFormat.SIXTEEN_BIT
    if command == ["serve"]:
        argv = _engine_argv(parser.parse_args(["serve", *fp8]))
        assert argv == ["--weights", "fp8", "--backend", "triton"]
        assert _engine_config(parser.parse_args(["engine", *argv])) == config


def test_fp8_weights_on_a_cpu_are_refused_before_any_model_loads():
    args = build_parser().parse_args(["engine", "--weights", "fp8", "--device", "cpu"])
    with pytest.raises(ConfigError, match="fp8 weights need the Triton kernels"):
        _engine_config(args)
