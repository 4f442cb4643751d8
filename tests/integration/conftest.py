"""Fixtures that start real engine worker processes, and an empty temporary directory for
runs that must leave nothing behind."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest


@pytest.fixture
def empty_tempdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh directory as the system's temporary directory (`tempfile`'s, and `TMPDIR`
    for child processes), to see what a run leaves there; removed afterwards. Its path is
    short: Unix sockets made under it must fit in 108 bytes.

    torch._dynamo makes torch's own compile cache (`torchinductor_<user>/`) in the temporary
    directory when it is first imported (transformers imports it), so it is imported before
    the switch: what a run leaves is then its own, whichever test runs first."""
    import torch._dynamo  # noqa: F401

    path = Path(tempfile.mkdtemp(prefix="strata-t-"))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    monkeypatch.setenv("TMPDIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class WorkerProcess:
    """`strata engine` in a subprocess, listening on a Unix socket (or on `address`, a TCP
    one), with `env` added to its environment (the fleet secret, say)."""

    def __init__(
        self,
        sock: Path,
        args: list[str],
        cache_dir: Path,
        *,
        address: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.sock = sock
        self.address = address or f"unix://{sock}"
        self.args = args
        self.cache_dir = cache_dir
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> None:
        if self.sock.exists():
            self.sock.unlink()
        env = dict(os.environ, STRATA_CACHE_DIR=str(self.cache_dir), STRATA_LOG_LEVEL="WARNING")
        env.pop("STRATA_WORKER_SECRET", None)
        env.pop("STRATA_REDIS_URL", None)  # a worker registers in a fleet only when asked
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "engine", "--listen", self.address, *self.args],
            env={**env, **self.env},
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while not self._listening():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError("worker did not come up")
            time.sleep(0.05)

    def _listening(self) -> bool:
        if self.address.startswith("unix://"):
            return self.sock.exists()
        host, _, port = self.address.split("://")[1].rpartition(":")
        with socket.socket() as probe:
            return probe.connect_ex((host, int(port))) == 0

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


# a worker of the tiny synthetic model, small enough to start in a second
TINY_WORKER = [
    "--model",
    "synthetic:tiny",
    "--num-kv-blocks",
    "64",
    "--block-size",
    "4",
    "--dtype",
    "float32",
]


@pytest.fixture
def tiny_worker(tmp_path: Path, strata_cache_dir: Path) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(tmp_path / "engine.sock", TINY_WORKER, strata_cache_dir)
    worker.start()
    yield worker
    worker.stop()


ADMIN_TOKEN = "test-admin-token-0123456789"


class GatewayServer:
    """The real app under uvicorn on a free port, in a thread with its own event loop."""

    def __init__(self, settings) -> None:
        import uvicorn

        from gateway.app import create_app

        self.settings = settings
        self.port = _free_port()
        config = uvicorn.Config(
            create_app(settings),
            host="127.0.0.1",
            port=self.port,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the gateway failed to start")
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
        )

    def new_tenant(self, **policy: object) -> tuple[str, str]:
        """A fresh tenant with `policy`; returns (tenant_id, api key secret)."""
        with self.admin() as client:
            name = f"t{uuid.uuid4().hex[:12]}"
            tenant = client.post("/admin/tenants/", json={"name": name, "policy": policy})
            assert tenant.status_code == 201, tenant.text
            tid = tenant.json()["id"]
            key = client.post(f"/admin/tenants/{tid}/keys", json={"name": "test"})
            assert key.status_code == 201, key.text
            return tid, key.json()["secret"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def smollm2_worker(tmp_path_factory, strata_cache_dir) -> Iterator[WorkerProcess]:
    """The real default model (bf16) in a worker process shared by the gateway tests, with
    speculative decoding on, always: every greedy request through the gateway is drafted
    for, whatever drafts earn on this machine."""
    spec = ["--speculative-tokens", "4", "--speculative-always"]
    worker = WorkerProcess(
        tmp_path_factory.mktemp("worker") / "engine.sock",
        ["--model", "default", "--kv-cache-gb", "0.5", *spec],
        strata_cache_dir,
    )
    worker.start()
    yield worker
    worker.stop()


def gateway_settings(store_url: str, worker: WorkerProcess, cache_dir: Path, **kw):
    import tempfile

    from gateway.settings import GatewaySettings

    kw.setdefault("data_dir", tempfile.mkdtemp(prefix="strata-gateway-"))
    return GatewaySettings(
        redis_url=store_url,
        engine_addresses=() if worker is None else (worker.address,),
        admin_token=ADMIN_TOKEN,
        cache_dir=str(cache_dir),
        json_logs=False,
        **kw,
    )


@pytest.fixture(scope="module")
def gateway(store_server, smollm2_worker, strata_cache_dir) -> Iterator[GatewayServer]:
    server = GatewayServer(gateway_settings(store_server.url, smollm2_worker, strata_cache_dir))
    server.start()
    yield server
    server.stop()


class GatewayProcess:
    """`strata gateway` as its own process (for tests that kill it), on a free port."""

    def __init__(
        self, store_url: str, worker: WorkerProcess, cache_dir: Path, data_dir: Path, *extra: str
    ) -> None:
        self.port = _free_port()
        self.args = [
            sys.executable,
            "-m",
            "gateway.cli",
            "gateway",
            "--engine",
            worker.address,
            "--redis-url",
            store_url,
            "--port",
            str(self.port),
            "--cache-dir",
            str(cache_dir),
            "--data-dir",
            str(data_dir),
            *extra,
        ]
        self.env = dict(
            os.environ,
            STRATA_ADMIN_TOKEN=ADMIN_TOKEN,
            STRATA_LOG_LEVEL="WARNING",
            STRATA_LOG_FORMAT="console",
        )
        self.env.pop("STRATA_WORKER_SECRET", None)  # its workers ask for none
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> None:
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway did not start")
            time.sleep(0.1)

    def signal(self, signum: int, timeout: float = 60.0) -> int:
        """Send `signum` and wait for the process to end; returns its exit code."""
        assert self.proc is not None
        self.proc.send_signal(signum)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
        )

    new_tenant = GatewayServer.new_tenant


@pytest.fixture(scope="module")
def tiny_gateway(store_server, strata_cache_dir, tmp_path_factory) -> Iterator[GatewayServer]:
    """The real app over HTTP, in front of one `synthetic:tiny` worker: for tests of the
    gateway's own behaviour, where the model is not the point."""
    worker = WorkerProcess(
        tmp_path_factory.mktemp("tiny") / "engine.sock", TINY_WORKER, strata_cache_dir
    )
    worker.start()
    server = GatewayServer(gateway_settings(store_server.url, worker, strata_cache_dir))
    try:
        server.start()
        yield server
        server.stop()
    finally:
        worker.stop()
