"""bench/gpu_decode.py runs end to end on CPU (small shapes) and reports what it promises."""

from __future__ import annotations

import json

from bench.gpu_decode import main
from engine.loader import PRESETS
from engine.model.triton_layers import PROJECTIONS


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
    # (or the native kernels, where they run the model)
    products = record["engine"]["fp8"]["one_token_products"]
    assert set(products) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert len(set(products.values())) == 1 and set(products.values()) <= {"cublas", "native"}
    # --profile: every point, the step's largest ops first
    assert set(record["profiles"]) == {f"{kv}/b{b}/c64" for kv in ("fp8", "bf16") for b in (1, 4)}
    for prof in record["profiles"].values():
        times = [k["us_per_step"] for k in prof["kernels"]]
        assert times == sorted(times, reverse=True) and times[0] > 0
        if set(products.values()) == {"cublas"}:  # torch runs the projections
            assert any("mm" in k["name"] for k in prof["kernels"]), "the projections' matmuls"
    (written,) = tmp_path.glob("gpu_decode-cpu-*.json")
    assert json.loads(written.read_text())["tok_s"] == summary["tok_s"]


def test_fp8_weights_run_beside_16bit_ones_and_report_their_step_ratio(tmp_path, capsys):
    """`--weights 16bit,fp8`: one engine of each in the run (FP8 weights interpreted here),
    their points under their own names, and FP8's step time over 16-bit's per point."""
    argv = [
        "--quick",
        "--weights",
        "16bit,fp8",
        "--kv",
        "fp8",
        "--batches",
        "1",
        "--steps",
        "2",
        "--skip-hf",
        "--out-dir",
        str(tmp_path),
    ]
    record = main(argv)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["tok_s"]) == {"fp8", "fp8w-fp8"}
    steps = record["step_ms"]
    want = round(steps["fp8w-fp8"]["b1/c64"] / steps["fp8"]["b1/c64"], 3)
    assert summary["fp8_weights_step_ratio"] == {"fp8/b1/c64": want}
    assert record["fp8_weights_step_ratio"] == summary["fp8_weights_step_ratio"]
    engines = record["engine"]
    assert engines["fp8"]["weights"] == "16bit" and engines["fp8w-fp8"]["weights"] == "fp8"
    products = engines["fp8w-fp8"]["one_token_products"]
    # synthetic:tiny ties its LM head to the embeddings: it stays 16-bit
    assert products == {**dict.fromkeys(PROJECTIONS, "triton-fp8"), "lm_head": "cublas"}
    # the interpreter's tiles: no timing at start off CUDA
    assert engines["fp8w-fp8"]["fp8_plans"] == dict.fromkeys(PROJECTIONS, "1-1: gemv n64/k2048/w4")
    assert engines["fp8"]["fp8_plans"] == {}
    # a byte per projection weight and 4 per output row; 16-bit embeddings (the LM head)
    # and norms
    c = PRESETS["tiny"]
    h, i = c.hidden_size, c.intermediate_size
    rows = c.q_size + 2 * c.kv_size + h + 2 * i + h
    fp8 = c.num_layers * (h * (c.q_size + 2 * c.kv_size + 2 * i) + c.q_size * h + i * h)
    sixteen = 2 * (c.vocab_size * h + (2 * c.num_layers + 1) * h)
    assert engines["fp8w-fp8"]["weight_bytes_read"] == fp8 + 4 * c.num_layers * rows + sixteen
    assert set(record["batch1_step_vs_weight_streaming_limit"]) == {"fp8/c64", "fp8w-fp8/c64"}
