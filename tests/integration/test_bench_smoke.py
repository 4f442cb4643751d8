"""Every benchmark without a test of its own runs end to end in its smallest form: it prints
its summary as the last line, writes a result that names the machine, and leaves nothing in
the temporary directory. (Figures are not checked against any bound: a shared CI machine's
speed is no property of the code.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import (
    engine_throughput,
    fleet,
    gateway_overhead,
    kv_fp8_quality,
    lora,
    prompt_scoring,
    speculative,
)
from bench.common import instruction_level
from bench.llamacpp_peer import available as llamacpp_available


def published(name: str, summary: dict, out: str, out_dir: Path) -> dict[str, Any]:
    """The record the run wrote, after checking that its summary was the last line printed
    and that the record says where and when it ran."""
    assert json.loads(out.strip().splitlines()[-1]) == summary
    (written,) = out_dir.glob(f"{name}-cpu-*.json")
    record = json.loads(written.read_text())
    assert record["benchmark"] == name
    assert record["machine"]["cpu"] and record["machine"]["cores"] > 0
    assert record["instruction_level"] == instruction_level()
    assert record["device"].startswith("cpu") and record["date"]
    return record


def _throughput_args(tmp_path: Path, cache_dir: Path, *extra: str) -> list[str]:
    return [
        "--quick",
        "--device",
        "cpu",
        "--batches",
        "1,2",
        "--prompt-len",
        "16",
        "--new-tokens",
        "8",
        "--prefill-len",
        "32",
        "--kv-cache-gb",
        "0.01",
        "--cache-dir",
        str(cache_dir),
        "--out-dir",
        str(tmp_path),
        *extra,
    ]


def test_engine_throughput_quick_run_measures_both_engines(
    tmp_path, capsys, strata_cache_dir, empty_tempdir
):
    summary = engine_throughput.main(
        _throughput_args(tmp_path, strata_cache_dir, "--model", "synthetic:tiny")
    )
    record = published("engine_throughput", summary, capsys.readouterr().out, tmp_path)
    assert set(summary["strata_tok_s"]) == set(summary["hf_tok_s"]) == {"1", "2"}
    assert min(summary["strata_tok_s"].values()) > 0 and min(summary["hf_tok_s"].values()) > 0
    assert set(summary["ratio"]) == {"1", "2"}
    assert "ratio_vs_llamacpp" not in summary, "llama.cpp runs only when asked for"
    assert set(summary["prefill_tok_s"]) == {"strata"} and summary["prefill_tok_s"]["strata"] > 0
    assert record["synthetic_weights"] and record["new_tokens"] == 8
    assert record["peers"] == ["transformers"] and record["prefill_len"] == 32
    assert set(record["rounds"]) == {"1", "2", "prefill_32"}
    assert not list(empty_tempdir.iterdir())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--peer", "vllm"], "--peer: unknown engine 'vllm'"),
        (["--peer", "llama.cpp", "--model", "synthetic:tiny"], "--peer llama.cpp runs a GGUF"),
    ],
)
def test_engine_throughput_refuses_a_peer_it_cannot_run(
    tmp_path, capsys, strata_cache_dir, extra, message
):
    with pytest.raises(SystemExit) as exc:
        engine_throughput.main(_throughput_args(tmp_path, strata_cache_dir, *extra))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "no result written"


@pytest.mark.skipif(
    not llamacpp_available(),
    reason="llama-cpp-python is not installed: `make bench-peers` builds it",
)
def test_engine_throughput_quick_run_against_llamacpp_on_the_same_gguf(
    tmp_path, capsys, strata_cache_dir, empty_tempdir
):
    summary = engine_throughput.main(
        _throughput_args(tmp_path, strata_cache_dir, "--model", "default", "--peer", "llama.cpp")
    )
    record = published("engine_throughput", summary, capsys.readouterr().out, tmp_path)
    assert summary["hf_tok_s"] == {}, "transformers was not asked for"
    assert set(summary["llamacpp_tok_s"]) == set(summary["ratio_vs_llamacpp"]) == {"1", "2"}
    assert min(summary["llamacpp_tok_s"].values()) > 0
    assert set(summary["prefill_tok_s"]) == {"strata", "llamacpp"}
    assert summary["prefill_ratio_vs_llamacpp"] > 0
    assert record["llamacpp_mode"] == "batched" and record["llamacpp_version"]
    assert record["gguf"].endswith(".gguf") and record["peers"] == ["llama.cpp"]
    assert not list(empty_tempdir.iterdir())


def test_prompt_scoring_quick_run_scores_like_transformers(
    tmp_path, capsys, strata_cache_dir, empty_tempdir
):
    summary = prompt_scoring.main(
        [
            "--quick",
            "--model",
            "synthetic:tiny",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--prompts",
            "2",
            "--prompt-len",
            "16",
            "--cache-dir",
            str(strata_cache_dir),
            "--out-dir",
            str(tmp_path),
        ]
    )
    record = published("prompt_scoring", summary, capsys.readouterr().out, tmp_path)
    assert summary["strata_tok_s"] > 0 and summary["hf_tok_s"] > 0
    assert summary["max_abs_logprob_diff"] < 1e-3  # fp32: the same scores
    assert record["prompts"] == 2 and record["repeats"] == 1
    assert not list(empty_tempdir.iterdir())


def test_speculative_quick_run_gives_the_same_tokens(
    tmp_path, capsys, strata_cache_dir, empty_tempdir
):
    summary = speculative.main(
        [
            "--quick",
            "--model",
            "synthetic:tiny",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--batches",
            "1",
            "--doc-tokens",
            "64",
            "--max-tokens",
            "8",
            "--cache-dir",
            str(strata_cache_dir),
            "--out-dir",
            str(tmp_path),
        ]
    )
    record = published("speculative", summary, capsys.readouterr().out, tmp_path)
    assert set(summary["speedup"]) == {"rag/1", "chat/1"}
    assert summary["identical_outputs"], "greedy speculative decoding changes no token (fp32)"
    assert set(record["step_cost_by_rows"]) == {"1x5", "8x2"}
    assert not list(empty_tempdir.iterdir())


def test_lora_quick_run_serves_every_adapter_count_and_removes_the_adapters(
    tmp_path, capsys, strata_cache_dir, empty_tempdir
):
    summary = lora.main(
        [
            "--quick",
            "--model",
            "synthetic:tiny",
            "--requests",
            "4",
            "--prompt-tokens",
            "8",
            "--new-tokens",
            "4",
            "--rank",
            "4",
            "--cache-dir",
            str(strata_cache_dir),
            "--out-dir",
            str(tmp_path),
        ]
    )
    record = published("lora", summary, capsys.readouterr().out, tmp_path)
    names = {"base", "base_lora_engine", "1", "8", "32"}
    assert set(summary["tok_s"]) == names and min(summary["tok_s"].values()) > 0
    assert set(summary["ratio_vs_base"]) == names - {"base"}
    assert record["new_tokens"] == 4 and record["repeats"] == 1
    assert not list(empty_tempdir.iterdir()), "the adapters' directory is gone"


def test_kv_fp8_quality_quick_run_scores_both_page_formats(
    tmp_path, capsys, strata_cache_dir, empty_tempdir
):
    summary = kv_fp8_quality.main(
        [
            "--quick",
            "--tokens",
            "64",
            "--prompts",
            "1",
            "--max-tokens",
            "4",
            "--window",
            "64",
            "--chunk",
            "32",
            "--cache-dir",
            str(strata_cache_dir),
            "--out-dir",
            str(tmp_path),
        ]
    )
    record = published("kv_fp8_quality", summary, capsys.readouterr().out, tmp_path)
    assert summary["perplexity"]["16bit"] > 1 and summary["perplexity"]["fp8"] > 1
    assert summary["kv_bytes_ratio"] < 1  # FP8 pages are smaller, scales included
    assert record["runs"]["fp8_e4m3"]["scored_tokens"] == 64
    assert not list(empty_tempdir.iterdir())


def test_gateway_overhead_quick_run_removes_the_store_and_socket(
    tmp_path, capsys, strata_cache_dir, empty_tempdir, monkeypatch
):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(strata_cache_dir))  # the worker's weights
    summary = gateway_overhead.main(
        [
            "--quick",
            "--concurrency",
            "1",
            "--requests",
            "24",  # 12 through the gateway alone: enough CPU ticks (10 ms) to count
            "--model",
            "synthetic:tiny",
            "--gateway-workers",
            "2",
            "--out-dir",
            str(tmp_path),
        ]
    )
    record = published("gateway_overhead", summary, capsys.readouterr().out, tmp_path)
    assert set(summary["overhead_ms"]) == set(summary["rps"]) == {"1"}
    assert summary["overhead_ms"]["1"]["p50"] > 0
    assert summary["rps"]["1"]["direct"] > 0 and summary["rps"]["1"]["gateway"] > 0
    assert record["requests_per_level"] == 24
    assert record["model"] == "synthetic:tiny" and record["gateway_workers"] == 2
    # the gateway's processes count in its CPU time
    assert record["cpu_ms_per_request"]["1"]["gateway"]["gateway"] > 0
    assert not list(empty_tempdir.iterdir()), (
        "the store's files, the socket and the gateway's metrics directory are gone"
    )


def test_fleet_quick_run_sends_one_stream_through_every_policy(
    tmp_path, capsys, strata_cache_dir, empty_tempdir
):
    summary = fleet.main(
        [
            "--quick",
            "--model",
            "synthetic:tiny",
            "--dtype",
            "float32",
            "--workers",
            "2",
            "--tenants",
            "2",
            "--docs-per-tenant",
            "2",
            "--doc-tokens",
            "64",
            "--requests",
            "8",
            "--worker-docs",
            "2",
            "--concurrency",
            "2",
            "--max-tokens",
            "2",
            "--ideal",
            "analytic",
            "--cache-dir",
            str(strata_cache_dir),
            "--out-dir",
            str(tmp_path),
        ]
    )
    record = published("fleet", summary, capsys.readouterr().out, tmp_path)
    policies = {"kv_aware", "least_loaded", "round_robin"}
    assert set(summary["ttft_p50_ms"]) == policies
    assert set(summary["hit_rate"]) == policies | {"ideal"}
    assert all(0 <= rate <= 1 for rate in summary["hit_rate"].values())
    assert summary["speedup_vs_least_loaded"] > 0
    runs = record["runs"]
    assert summary["hit_rate"]["ideal"] == record["ideal_hit_rate_analytic"] > 0
    assert set(runs) == policies and {len(run["requests"]) for run in runs.values()} == {8}
    assert len({run["prompt_tokens"] for run in runs.values()}) == 1, "the same stream each time"
    assert not list(empty_tempdir.iterdir()), "the store's files and the ledgers are gone"
