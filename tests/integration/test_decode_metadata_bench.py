"""bench/decode_metadata.py runs on CPU (small shapes) and reports every shape it built."""

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
