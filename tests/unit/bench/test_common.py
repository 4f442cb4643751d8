"""bench/common.py: scratch directories leave nothing behind, the instruction level read
from CPU flags, --quick defaults that given options override, peers held to AVX2."""

from __future__ import annotations

import argparse
import json
import tempfile

import pytest

from bench import common
from bench.common import instruction_level, machine_info, parse_args, publish, scratch_dir


def test_scratch_dir_removes_what_was_made_inside_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with scratch_dir("strata-x-") as path:
        assert path.parent == tmp_path and path.name.startswith("strata-x-")
        (path / "strata-kv").mkdir()  # what the disk tier makes
        (path / "strata-kv" / "pages").write_bytes(b"x")
    assert not list(tmp_path.iterdir())


def test_scratch_dir_is_removed_on_an_error_too(tmp_path):
    def failed_run() -> None:
        with scratch_dir("strata-x-", tmp_path) as path:
            (path / "file").write_text("x")
            raise RuntimeError("the run failed")

    with pytest.raises(RuntimeError, match="the run failed"):
        failed_run()
    assert not list(tmp_path.iterdir())


def test_scratch_dir_under_a_given_path_removes_only_its_own(tmp_path):
    under = tmp_path / "disk"  # made when missing
    with scratch_dir("strata-x-", under) as path:
        assert path.parent == under
        (under / "keep").write_text("the user's")
    assert [p.name for p in under.iterdir()] == ["keep"]


@pytest.mark.parametrize(
    ("flags", "arch", "level"),
    [
        ({"sse4_2", "avx2", "avx512f", "avx512_bf16"}, "x86_64", "avx512_bf16"),
        ({"sse4_2", "avx2", "avx512f", "avx512vl"}, "x86_64", "avx512"),
        ({"sse4_1", "sse4_2", "avx", "avx2", "fma"}, "x86_64", "avx2"),
        ({"sse4_1", "sse4_2"}, "x86_64", "sse4"),
        ({"sse2"}, "x86_64", "other"),
        ({"fp", "asimd", "bf16"}, "aarch64", "aarch64"),
    ],
)
def test_instruction_level_is_the_widest_the_flags_name(flags, arch, level):
    assert instruction_level(flags, arch) == level


def test_every_record_names_the_instruction_level():
    import torch

    assert machine_info(torch.device("cpu"))["instruction_level"] == instruction_level()


def test_quick_defaults_yield_to_given_options():
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--quick", action="store_true")
    assert vars(parse_args(ap, [], docs=4, tokens=512)) == {
        "docs": 8,
        "tokens": 2048,
        "quick": False,
    }
    args = parse_args(ap, ["--quick", "--docs", "2"], docs=4, tokens=512)
    assert (args.docs, args.tokens) == (2, 512)


def test_publish_prints_the_summary_last(tmp_path, capsys):
    path = publish(str(tmp_path), "x", {"device": "cpu (test)", "a": 1}, {"b": 2})
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"wrote {path}", '{"b": 2}']
    assert json.loads(path.read_text()) == {"device": "cpu (test)", "a": 1}
    assert path.name.startswith("x-cpu-")


def test_avx2_runs_hold_the_peers_to_avx2_on_an_avx512_cpu(tmp_path):
    """`--cpu-isa avx2` reruns the bench with torch (so transformers) and llama.cpp held to
    AVX2 where the CPU has AVX-512; elsewhere, or once held, there is nothing to do."""
    lib = tmp_path / "lib"
    env = common.avx2_peer_env({"PATH": "/bin"}, flags={"avx2", "avx512f"}, lib=lib)
    assert env is not None and env["PATH"] == "/bin"
    assert all(env[k] == v for k, v in common.AVX2_ENV.items())
    assert "LLAMA_CPP_LIB_PATH" not in env  # no AVX2 build of llama.cpp yet
    lib.mkdir()
    (lib / "libllama.so").write_bytes(b"")
    env = common.avx2_peer_env({}, flags={"avx2", "avx512f"}, lib=lib)
    assert env is not None and env["LLAMA_CPP_LIB_PATH"] == str(lib)
    assert common.peers_held_to_avx2(env)
    assert common.avx2_peer_env(env, flags={"avx2", "avx512f"}, lib=lib) is None  # held
    assert common.avx2_peer_env({}, flags={"avx2", "fma"}, lib=lib) is None  # no AVX-512
    assert common.peers_isa(env)["transformers"] == "avx2"
    assert common.peers_isa({})["transformers"] == common.instruction_level()
