"""bench/kv_shared.py runs end to end on CPU with the tiny synthetic model: a restarted
worker serves the documents from disk with the tokens a recompute gives, and the long
prompts of the disagg scenario are prefilled on the prefill worker with the tokens of a
colocated run. It leaves nothing in the temporary directory."""

from __future__ import annotations

import json

from bench import kv_shared


def test_kv_shared_small_run_reports_every_scenario(
    tmp_path, capsys, strata_cache_dir, empty_tempdir
):
    shape = ["--quick", "--model", "synthetic:tiny", "--dtype", "float32"]
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
