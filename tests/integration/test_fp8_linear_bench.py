"""bench/fp8_linear.py runs on CPU (small shapes, Triton's interpreter): every shape and row
count timed for 16-bit and FP8 weights, each candidate checked against the dequantized
product, and the fastest named."""

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
            assert point["fp8_ms"] > 0 and point["cublas_ms"] > 0
            assert ("triton_gemv_ms" in point) == (rows == 1)
            # interpreted: each kernel's first candidate (the GEMV's at one row only)
            kernels = {name.split()[0] for name in point["candidates_ms"]}
            assert kernels == ({"gemv", "gemm"} if rows == 1 else {"gemm"})
            assert point["fp8_ms"] == min(point["candidates_ms"].values())
            assert point["candidates_ms"][point["fp8_tiles"]] == point["fp8_ms"]
    assert set(summary["fp8_vs_16bit_step_products"]) == {"1 rows", "5 rows"}
    assert set(summary["best_tiles"]) == {"1 rows", "5 rows"}
    (written,) = tmp_path.glob("fp8_linear-cpu-*.json")
    assert json.loads(written.read_text())["best_tiles"] == summary["best_tiles"]
