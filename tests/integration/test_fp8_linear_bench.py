"""bench/fp8_linear.py runs on CPU (small shapes, Triton's interpreter): every shape and row
count timed for 16-bit and FP8 weights, checked against the dequantized product, and each
tile sweep's best named."""

from __future__ import annotations

import json

from bench.fp8_linear import main
from bench.gemv_sweep import shapes


def test_quick_run_times_every_shape_row_count_and_tile(tmp_path, capsys):
    record = main(["--quick", "--out-dir", str(tmp_path)])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(record["shapes"]) == set(shapes("tiny"))
    for row in record["shapes"].values():
        assert set(row["rows"]) == {1, 5}
        for rows, point in row["rows"].items():
            assert point["fp8_ms"] > 0 and point["cublas_ms"] > 0 and point["rel_error"] < 1e-2
            assert ("triton_gemv_ms" in point) == (rows == 1)
        assert list(row["gemv_tiles"]) == ["n8/k128/w4"]
        assert list(row["gemm_tiles_64_rows"]) == ["m16/n32/k64/w4/s2"]
    assert set(summary["fp8_vs_16bit_step_products"]) == {"1 rows", "5 rows"}
    assert summary["best_tiles"] == {"gemv_tiles": "n8/k128/w4",
                                     "gemm_tiles_64_rows": "m16/n32/k64/w4/s2"}  # fmt: skip
    (written,) = tmp_path.glob("fp8_linear-cpu-*.json")
    assert json.loads(written.read_text())["best_tiles"] == summary["best_tiles"]
