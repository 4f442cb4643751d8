"""Fixtures that start real engine worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


class WorkerProcess:
    """`strata engine` in a subprocess, listening on a Unix socket."""

    def __init__(self, sock: Path, args: list[str], cache_dir: Path) -> None:
        self.sock = sock
        self.address = f"unix://{sock}"
        self.args = args
        self.cache_dir = cache_dir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> None:
        if self.sock.exists():
            self.sock.unlink()
        env = dict(os.environ, STRATA_CACHE_DIR=str(self.cache_dir), STRATA_LOG_LEVEL="WARNING")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "engine", "--listen", self.address, *self.args],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while not self.sock.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError("worker did not come up")
            time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("strata-cache")


@pytest.fixture
def tiny_worker(tmp_path: Path, model_cache_dir: Path) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(
        tmp_path / "engine.sock",
        [
            "--model",
            "synthetic:tiny",
            "--num-kv-blocks",
            "64",
            "--block-size",
            "4",
            "--dtype",
            "float32",
        ],
        model_cache_dir,
    )
    worker.start()
    yield worker
    worker.stop()
