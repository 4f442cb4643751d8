"""bench/kv_shared_cross.py runs end to end on CPU at a small shape: worker B's answers
come from the remote tier with the tokens of a recompute, and the run leaves nothing in the
temporary directory (its valkey-server's files included)."""

from __future__ import annotations

import json

from bench import kv_shared_cross


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
