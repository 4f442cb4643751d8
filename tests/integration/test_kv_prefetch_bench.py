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


@pytest.mark.parametrize("load", ["sync", "thread"])
def test_busy_run_measures_questions_arriving_beside_decoding_requests(tmp_path, capsys, load):
    """`--running`: the questions' pages come from host RAM in the prefetch rounds and from
    the device in the resident ones. Synchronous loads are there when the question is
    admitted, so it joins the batch at once; the worker thread's may keep it waiting
    outside the batch for a step or more."""
    summary = main(["--quick", "--running", "2", "--kv-load", load, "--out-dir", str(tmp_path)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    tokens = 2 * 2 * 256  # repeats x batch x context
    assert summary["running"] == 2 and summary["loads"] == load
    assert summary["cached_tokens"]["resident"] == {"device": tokens, "host": 0}
    assert summary["cached_tokens"]["prefetch"] == {"device": 0, "host": tokens}
    busy = summary["busy"]
    assert all(v > 0 for v in busy["step_ms"].values())
    assert all(v > 0 for v in busy["ttft_ms"].values())
    assert busy["ratio"] == round(busy["step_ms"]["prefetch"] / busy["step_ms"]["resident"], 3)
    if load == "sync":
        assert busy["steps_waited"] == 0
    (written,) = tmp_path.glob("kv_prefetch-cpu-*.json")
    record = json.loads(written.read_text())
    assert len(record["rounds_ms"]["prefetch"]) == 2 and record["busy"] == busy
