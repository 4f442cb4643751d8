"""The `strata` command as users run it: a real subprocess, real model, real sockets."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import time

import pytest

from engine.client import EngineClient
from engine.handshake import ClientAuth
from engine.protocol import SamplingParams


def strata(*args: str, cache_dir, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, STRATA_CACHE_DIR=str(cache_dir), STRATA_LOG_LEVEL="WARNING")
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


CAPITAL = (
    '{"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}'
)


@pytest.mark.parametrize("extra", [[], ["--kv-cache-dtype", "fp8_e4m3", "--json-schema", CAPITAL]])
def test_generate_chat_answers_paris(strata_cache_dir, extra):
    done = strata(
        "generate",
        "--chat",
        "What is the capital of France?",
        "--max-tokens",
        "40",
        *extra,
        cache_dir=strata_cache_dir,
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    if "--json-schema" in extra:
        assert json.loads(done.stdout) == {"capital": "Paris"}


def test_sampled_generation_is_reproducible_with_a_seed(strata_cache_dir):
    args = (
        "generate",
        "Once upon a time",
        "--max-tokens",
        "12",
        "--temperature",
        "0.9",
        "--seed",
        "11",
    )
    first = strata(*args, cache_dir=strata_cache_dir)
    second = strata(*args, cache_dir=strata_cache_dir)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    assert first.stdout.strip()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "/nonexistent/model.gguf"], "not found"),
        (["--model", "synthetic:nope"], "synthetic"),
        (["--dtype", "float8"], "dtype"),
        (["--weights", "fp8", "--device", "cpu"], "fp8 weights need the Triton kernels"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--json-schema", '{"type": "array", "uniqueItems": true}'], "'uniqueItems' is not"),
        (["--json-schema", "@/nonexistent/schema.json"], "cannot read"),
    ],
)
def test_bad_input_gives_one_clear_line(strata_cache_dir, args, needle):
    done = strata("generate", "hi", *args, cache_dir=strata_cache_dir, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("strata: error:")
    assert needle in lines[0]


def test_commands_that_load_no_model_start_without_torch(strata_cache_dir, tmp_path):
    """`--help`, the admin and usage commands, and a rejected sampling option answer in a
    fraction of a second: none of them imports torch (a second and a half on its own)."""
    probe = (
        "import sys\n"
        "from gateway.cli import main\n"
        "for argv in {argvs!r}:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as stop:\n"
        "        print(stop.code, file=sys.stderr)\n"
        "print('torch' in sys.modules)\n"
    )
    argvs = [
        ["--help"],
        ["admin", "tenants", "list"],
        ["usage", "export", "--tenant", "acme"],
        ["generate", "hi", "--max-tokens", "0"],
    ]
    env = dict(os.environ, STRATA_CACHE_DIR=str(strata_cache_dir))
    env.pop("STRATA_ADMIN_TOKEN", None)
    done = subprocess.run(  # elsewhere than the checkout: `make serve` leaves .strata/ there
        [sys.executable, "-c", probe.format(argvs=argvs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False", done.stdout
    assert "no admin token" in done.stderr
    assert "max_tokens" in done.stderr


def test_non_gguf_file_gives_one_clear_line(strata_cache_dir, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("not a model")
    done = strata("generate", "hi", "--model", str(fake), cache_dir=strata_cache_dir)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "GGUF" in done.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_worker_over_tcp(strata_cache_dir):
    address = f"tcp://127.0.0.1:{free_port()}"
    secret = secrets.token_urlsafe(32)  # a TCP listener needs the fleet secret
    env = dict(
        os.environ,
        STRATA_CACHE_DIR=str(strata_cache_dir),
        STRATA_LOG_LEVEL="WARNING",
        STRATA_WORKER_SECRET=secret,
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "engine",
            "--model",
            "synthetic:tiny",
            "--listen",
            address,
            "--num-kv-blocks",
            "32",
        ],
        env=env,
    )
    try:
        client = EngineClient(address, connect_timeout=1.0, auth=ClientAuth(secret=secret))

        async def run() -> list[int]:
            deadline = time.monotonic() + 60
            while True:
                try:
                    await client.connect()
                    break
                except Exception:
                    assert proc.poll() is None, "worker exited"
                    assert time.monotonic() < deadline, "worker did not come up"
                    await asyncio.sleep(0.1)
            params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
            tokens = [
                t
                async for out in client.generate("r", [1, 2, 3], params)
                for t in out.new_token_ids
            ]
            stats = await client.stats()
            assert stats.num_kv_blocks_used == 0
            await client.close()
            return tokens

        assert len(asyncio.run(run())) == 5
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0  # SIGTERM is a clean shutdown
