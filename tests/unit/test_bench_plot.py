"""bench/plot.py draws every plot of docs/img/ from the committed results."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from bench import plot

ROOT = Path(__file__).resolve().parents[2]


def test_every_plot_finds_its_results_and_draws_the_committed_images(tmp_path: Path) -> None:
    results = plot.load_results(ROOT / "bench/results")
    for name, draw in plot.PLOTS.items():
        fig = draw(results)
        assert all(ax.axison for ax in fig.axes), f"{name}: a panel has no result"
        plt.close(fig)
    first, second = tmp_path / "a", tmp_path / "b"
    assert plot.main(["--out", str(first)]) == 0
    written = sorted(p.name for p in first.glob("*.png"))
    assert written == sorted(p.name for p in (ROOT / "docs/img").glob("*.png"))
    plot.main(["--out", str(second)])  # the same results draw the same bytes
    for name in written:
        data = (first / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert data == (second / name).read_bytes(), name


def test_machine_kind_comes_from_the_recorded_instruction_level_before_the_file_name() -> None:
    epyc = {"device": "cpu (AMD EPYC)", "machine": {"cpu": "AMD EPYC", "cores": 2}}
    assert plot.machine_kind("lora-cpu-20261123T044842Z", epyc) == plot.AVX512
    assert plot.machine_kind("cpu_attention-cpu-20261126T182544Z", epyc) == plot.AVX2
    recorded = {**epyc, "instruction_level": "avx2"}
    assert plot.machine_kind("lora-cpu-20270101T000000Z", recorded) == plot.AVX2
    xeon = {"device": "cpu (Intel(R) Xeon(R))", "machine": {"cpu": "Intel(R) Xeon(R)"}}
    assert plot.machine_kind("kv_admit-cpu-20261126T164856Z", xeon) == plot.H100_HOST
    assert plot.machine_kind("x", {"device": plot.H100}) == plot.H100


def test_the_cpu_throughput_panel_takes_runs_of_the_cpus_own_build_only() -> None:
    run = {"isa": "avx512", "weights": "16bit", "hf_tok_s": {"1": 20.0}}
    assert plot._native_peer_run(run)
    assert plot._native_peer_run({"hf_tok_s": {"1": 20.0}})  # records before isa and weights
    assert not plot._native_peer_run({**run, "isa": "avx2"})  # --cpu-isa avx2
    assert not plot._native_peer_run({**run, "weights": "auto"})
    assert not plot._native_peer_run({**run, "hf_tok_s": {}})  # --skip-hf
