"""bench/gemv_sweep.py runs on CPU (small shapes, Triton's interpreter): every shape timed
through cuBLAS's stand-in and each configuration, checked against it, and the best one named."""

from __future__ import annotations

import json

from bench.gemv_sweep import main, shapes


def test_quick_sweep_times_every_shape_and_configuration(tmp_path, capsys):
    record = main(["--quick", "--out-dir", str(tmp_path)])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["best_config"] in {"n8/k64/w4", "n8/k128/w4"}
    assert set(record["shapes"]) == set(shapes("tiny")) == set(summary["of_copy"])
    for row in record["shapes"].values():
        assert [p["config"] for p in row["triton"]] == ["n8/k64/w4", "n8/k128/w4"]
        assert all(p["ms"] > 0 and p["rel_error"] < 2e-2 for p in row["triton"])
        assert row["best"] == min(row["triton"], key=lambda p: p["ms"])["config"]
    per_step = {name: n for name, (_, _, n) in shapes("tiny").items()}
    assert (
        per_step["lm_head"] == 1 and per_step["qkv_proj"] == record["shapes"]["o_proj"]["per_step"]
    )
    (written,) = tmp_path.glob("gemv_sweep-cpu-*.json")
    assert json.loads(written.read_text())["best_config"] == summary["best_config"]
