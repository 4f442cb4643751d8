"""bench/cpu_attention.py runs on CPU (quick shapes) for both builds and every page format."""

from __future__ import annotations

import json

from bench.cpu_attention import PAGES, main


def test_quick_run_times_every_build_shape_and_page_format(tmp_path, capsys, strata_cache_dir):
    record = main(["--quick", "--cache-dir", str(strata_cache_dir), "--out-dir", str(tmp_path)])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["ms"]) == {"native", "portable"}
    points = {f"{shape}/{page}" for shape in ("prefill", "decode") for page in PAGES}
    for times in summary["ms"].values():
        assert set(times) == points
        assert all(ms > 0 for ms in times.values())
    assert record["shapes"]["prefill"]["prefill"] and not record["shapes"]["decode"]["prefill"]
    (written,) = tmp_path.glob("cpu_attention-cpu-*.json")
    assert json.loads(written.read_text())["ms"] == summary["ms"]
