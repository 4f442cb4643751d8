"""The KV benchmarks run end to end on CPU at small shapes and leave nothing in the temporary
directory: bench/kv_shared_cross.py, where worker B's answers come from the remote tier
with the tokens of a recompute (its valkey-server's files go too); bench/kv_shared.py with
the tiny synthetic model, where a restarted worker serves the documents from disk with the
tokens a recompute gives, and the long prompts of the disagg scenario are prefilled on the
prefill worker with the tokens of a colocated run."""

from __future__ import annotations

import json

from bench import kv_shared, kv_shared_cross


def test_cross_worker_small_run_serves_b_from_the_remote_tier(
    tmp_path, capsys, strata_cache_dir, empty_tempdir
):
    shape = ["--quick", "--docs", "2", "--doc-tokens", "128", "--questions", "1"]
    summary = kv_shared_cross.main(
        [*shape, "--cache-dir", str(strata_cache_dir), "--out-dir", str(tmp_path)]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert not list(empty_tempdir.iterdir()), "the store's directory is gone"
    assert summary["tokens_identical"]
    assert summary["remote_hit_rate"] > 0.5  # every full block of each document
    assert summary["remote_loads"]["rejected"] == summary["remote_loads"]["load_timeouts"] == 0
    assert summary["remote_saves"]["saved"] >= 2 * 128 // 16
    assert set(summary["ttft_p50_ms"]) == {"remote", "recompute"}
    (written,) = tmp_path.glob("kv_shared_cross-cpu-*.json")
    assert json.loads(written.read_text())["speedup"] == summary["speedup"]


def test_kv_shared_small_run_reports_every_scenario(
    tmp_path, capsys, strata_cache_dir, empty_tempdir
):
    shape = ["--quick", "--scenarios", "restart,disagg", "--model", "synthetic:tiny"]
    shape += ["--dtype", "float32"]
    shape += ["--docs", "2", "--doc-tokens", "128", "--disk-gb", "0.01"]
    shape += ["--streams", "2", "--stream-tokens", "16", "--long-prompts", "2"]
    shape += ["--long-every-s", "0.2", "--disagg-min-prompt-tokens", "64"]
    summary = kv_shared.main(
        [*shape, "--cache-dir", str(strata_cache_dir), "--out-dir", str(tmp_path)]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert not list(empty_tempdir.iterdir()), "the run's scratch directory is gone"
    restart = summary["restart"]
    assert restart["tokens_identical"]
    assert restart["disk_hit_blocks"] >= 2 * 128 // 16  # every document came back from disk
    assert restart["speedup"] > 0
    disagg = summary["disagg"]
    assert disagg["tokens_identical"]
    assert disagg["colocated"]["long_prompt_cached_tokens"] == 0
    # each long prompt's full blocks before its last token came from the prefill worker
    assert disagg["disaggregated"]["long_prompt_cached_tokens"] >= 2 * 128
    assert disagg["itl_p99_ratio"] > 0
    (written,) = tmp_path.glob("kv_shared-cpu-*.json")
    assert json.loads(written.read_text())["results"] == summary
