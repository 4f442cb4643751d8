"""bench/decode_metadata.py runs on CPU (small shapes) and reports every shape it built, and
both ways of staging a graph step's inputs."""

from __future__ import annotations

import json

from bench import decode_metadata


def test_decode_metadata_quick_run_times_the_block_table_both_ways(tmp_path, capsys):
    summary = decode_metadata.main(["--quick", "--out-dir", str(tmp_path)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert list(summary["block_table_us"]) == ["8x512"] and summary["block_table_us"]["8x512"] > 0
    (written,) = tmp_path.glob("decode_metadata-cpu-*.json")
    (row,) = json.loads(written.read_text())["rows"]
    assert row["row_by_row_us"] > 0 and row["slot_indices_us"] > 0
    # graph inputs staged both ways (checked equal inside the run), each timed
    ways = {"graph_inputs", "graph_inputs_new", "graph_inputs_moved", "per_buffer"}
    assert set(summary["graph_inputs_us"]["8x512"]) == ways
    assert all(row[f"{k}_us"] > 0 for k in ways)
