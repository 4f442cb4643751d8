"""bench/kv_tiers.py and bench/rag_longdoc.py run end to end on CPU (small shapes): every
path moves its bytes, and the long-document workload is served from every tier, with and
without a stream running alongside. Neither leaves a file behind, in the temporary directory
or in a disk path it is given."""

from __future__ import annotations

import json

from bench import kv_tiers, rag_longdoc


def test_kv_tiers_quick_run_times_every_path(tmp_path, capsys):
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "keep").write_text("the user's")
    summary = kv_tiers.main(["--quick", "--disk-path", str(disk), "--out-dir", str(tmp_path)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert [p.name for p in disk.iterdir()] == ["keep"], "only the run's own files are gone"
    paths = {"device_to_host", "host_to_device", "host_to_disk", "disk_to_host"}
    assert set(summary["gb_per_s"]) == paths and min(summary["gb_per_s"].values()) > 0
    assert summary["disk_to_host_serial_gb_per_s"] > 0
    assert summary["host_to_disk_caller_us_per_page"] > 0  # the scheduler's share of a write
    (written,) = tmp_path.glob("kv_tiers-cpu-*.json")
    assert json.loads(written.read_text())["gb_per_s"] == summary["gb_per_s"]


def test_rag_longdoc_small_run_hits_every_tier_and_leaves_nothing(
    tmp_path, capsys, strata_cache_dir, empty_tempdir
):
    shape = [
        "--quick",
        "--docs",
        "4",
        "--doc-tokens",
        "128",
        "--questions",
        "2",
        "--device-docs",
        "1.5",
        "--host-docs",
        "1",
    ]
    # no --disk-path: the disk tier's directory goes in the temporary directory
    summary = rag_longdoc.main(
        [*shape, "--cache-dir", str(strata_cache_dir), "--out-dir", str(tmp_path)]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert not list(empty_tempdir.iterdir()), "the disk tier's directory is gone"
    assert min(summary["hit_rate"].values()) > 0, "the device, host and disk tiers all served"
    for name in ("tiers", "recompute"):
        run = summary["with_stream"][name]
        assert run["ttft_p50_ms"] > 0
        assert 0 < run["stream_gap_ms"]["p50"] <= run["stream_gap_ms"]["max"]
    (written,) = tmp_path.glob("rag_longdoc-cpu-*.json")
    assert json.loads(written.read_text())["speedup"] == summary["speedup"]


def test_kv_admit_quick_times_admissions_whose_every_page_comes_from_host(tmp_path, capsys):
    from bench.kv_admit import main as admit

    summary = admit(["--quick", "--out-dir", str(tmp_path)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert summary["pages_per_round"] == 2 * 512 // 16
    assert summary["host_hits"] == 3 * summary["pages_per_round"]  # every round, every page
    best, median = summary["us_per_page"]["best"], summary["us_per_page"]["median"]
    assert 0 < best <= median
    (written,) = tmp_path.glob("kv_admit-cpu-*.json")
    assert len(json.loads(written.read_text())["round_ms"]) == 3
