"""bench/gpu_decode.py runs end to end on CPU (small shapes) and reports what it promises."""

from __future__ import annotations

import json

from bench.gpu_decode import main


def test_quick_run_reports_every_shape(tmp_path, capsys):
    record = main(["--quick", "--profile", "--out-dir", str(tmp_path)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert set(summary) == {"device", "tok_s", "hbm_fraction", "hf_tok_s", "ratio_vs_hf"}
    for kv in ("fp8", "bf16"):
        assert set(summary["tok_s"][kv]) == {"b1/c64", "b4/c64"}
        assert all(v > 0 for v in summary["tok_s"][kv].values())
        assert all(0 < f < 1 for f in summary["hbm_fraction"][kv].values())
    assert set(summary["hf_tok_s"]) == {"b1/c64", "b4/c64"}
    assert (
        record["engine"]["fp8"]["kv_bytes_per_token"]
        < record["engine"]["bf16"]["kv_bytes_per_token"]
    )
    assert record["weights"] == "random (seeded), real shapes"
    # Triton's GEMV is a CUDA-only choice: on CPU every product stays with torch's matmul
    products = record["engine"]["fp8"]["one_token_products"]
    assert set(products) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert set(products.values()) == {"cublas"}
    # --profile: every point, the step's largest ops first
    assert set(record["profiles"]) == {f"{kv}/b{b}/c64" for kv in ("fp8", "bf16") for b in (1, 4)}
    for prof in record["profiles"].values():
        times = [k["us_per_step"] for k in prof["kernels"]]
        assert times == sorted(times, reverse=True) and times[0] > 0
        assert any("mm" in k["name"] for k in prof["kernels"]), "the projections' matmuls"
    (written,) = tmp_path.glob("gpu_decode-cpu-*.json")
    assert json.loads(written.read_text())["tok_s"] == summary["tok_s"]
