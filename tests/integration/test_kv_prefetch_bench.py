"""bench/kv_prefetch.py runs end to end on CPU (small shapes): the prefetch step really reads
its documents from host RAM, and the resident step from the device."""

from __future__ import annotations

import json

import pytest

from bench.kv_prefetch import main


@pytest.mark.parametrize(("load", "warmup"), [("sync", "0"), ("thread", "1")])
def test_quick_run_measures_both_steps_from_the_tiers_they_name(tmp_path, capsys, load, warmup):
    summary = main(["--quick", "--kv-load", load, "--warmup", warmup, "--out-dir", str(tmp_path)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert summary["loads"] == load
    tokens = 2 * 2 * 256  # repeats x batch x context: a warm-up round is not counted
    assert summary["cached_tokens"]["resident"] == {"device": tokens, "host": 0}
    assert summary["cached_tokens"]["prefetch"] == {"device": 0, "host": tokens}
    assert summary["step_ms"]["resident"] > 0 and summary["step_ms"]["prefetch"] > 0
    for step in ("resident", "prefetch"):  # each timed step split into its host phases
        phases = summary["phases_ms"][step]
        assert set(phases) == {"schedule", "issue", "forward", "finish"}
        assert phases["schedule"] > 0 and phases["forward"] > 0
        assert sum(phases.values()) - phases["issue"] <= summary["step_ms"][step] + 0.05
    (written,) = tmp_path.glob("kv_prefetch-cpu-*.json")
    assert json.loads(written.read_text())["ratio"] == summary["ratio"]


def test_profile_writes_both_steps_calls_and_trace_outside_the_figures(tmp_path, capsys):
    prof = tmp_path / "prof"
    summary = main(["--quick", "--out-dir", str(tmp_path), "--profile", str(prof)])
    tokens = 2 * 2 * 256  # the profiled third round is not counted
    assert summary["cached_tokens"]["prefetch"] == {"device": 0, "host": tokens}
    for step in ("resident", "prefetch"):
        assert "core.py" in (prof / f"{step}.pstats.txt").read_text()  # the engine's step
        assert json.loads((prof / f"{step}.trace.json").read_text())["traceEvents"]
        assert "Self CPU" in (prof / f"{step}.ops.txt").read_text()
