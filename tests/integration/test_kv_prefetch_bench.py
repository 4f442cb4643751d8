"""bench/kv_prefetch.py runs end to end on CPU (small shapes): the prefetch step really reads
its documents from host RAM, and the resident step from the device."""

from __future__ import annotations

import json

import pytest

from bench.kv_prefetch import main


@pytest.mark.parametrize("load", ["sync", "thread"])
def test_quick_run_measures_both_steps_from_the_tiers_they_name(tmp_path, capsys, load):
    summary = main(["--quick", "--kv-load", load, "--out-dir", str(tmp_path)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert summary["loads"] == load
    tokens = 2 * 2 * 256  # repeats x batch x context
    assert summary["cached_tokens"]["resident"] == {"device": tokens, "host": 0}
    assert summary["cached_tokens"]["prefetch"] == {"device": 0, "host": tokens}
    assert summary["step_ms"]["resident"] > 0 and summary["step_ms"]["prefetch"] > 0
    (written,) = tmp_path.glob("kv_prefetch-cpu-*.json")
    assert json.loads(written.read_text())["ratio"] == summary["ratio"]
