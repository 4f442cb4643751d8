"""Who a worker lets in, and whom a client trusts: real worker processes on real sockets, the
fleet secret proved both ways before any frame, private Unix sockets, TCP refused without a
secret, TLS, and adapters loaded only from the worker's adapter directory."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.client import EngineClient
from engine.handshake import (
    CHALLENGE_BYTES,
    MAGIC,
    PROOF_BYTES,
    SECRET,
    ClientAuth,
    SecretRefusedError,
    WorkerUnprovenError,
)
from engine.model_specs import PRESETS
from engine.protocol import EngineDeadError, InvalidRequestError, LoRARequest, SamplingParams
from engine.wire import Codec, Submit, ToWorker
from tests.integration.conftest import (
    TINY_WORKER,
    GatewayServer,
    WorkerProcess,
    _free_port,
    gateway_settings,
)
from tests.lora_files import write_adapter

FLEET_SECRET = secrets.token_urlsafe(32)
FLEET = ClientAuth(secret=FLEET_SECRET)

SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory) -> Path:
    """adapters/good and, outside the adapter directory, an equally valid outside/evil, with
    ways back to it from inside: a symlink and a `..` path."""
    root = tmp_path_factory.mktemp("adapters")
    write_adapter(root / "adapters" / "good", PRESETS["tiny"], rank=4, seed=1)
    write_adapter(root / "outside" / "evil", PRESETS["tiny"], rank=4, seed=2)
    (root / "adapters" / "link").symlink_to(root / "outside" / "evil", target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def fleet_worker(tmp_path_factory, strata_cache_dir, adapter_root):
    """A worker on loopback TCP that asks for the fleet secret and serves adapters."""
    worker = WorkerProcess(
        tmp_path_factory.mktemp("fleet") / "unused.sock",
        [
            *TINY_WORKER,
            "--max-loras",
            "1",
            "--max-lora-rank",
            "8",
            "--adapter-dir",
            str(adapter_root / "adapters"),
        ],
        strata_cache_dir,
        address=f"tcp://127.0.0.1:{_free_port()}",
        env={"STRATA_WORKER_SECRET": FLEET_SECRET},
    )
    worker.start()
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def open_worker(tmp_path_factory, strata_cache_dir):
    """A worker on a Unix socket, no secret, in directories it creates itself."""
    root = tmp_path_factory.mktemp("open")
    worker = WorkerProcess(root / "private" / "run" / "engine.sock", TINY_WORKER, strata_cache_dir)
    worker.start()
    yield worker
    worker.stop()


async def tokens(client: EngineClient, rid: str, lora: LoRARequest | None = None) -> list[int]:
    return [
        t
        async for out in client.generate(rid, [1, 2, 3], SHORT, lora=lora)
        for t in out.new_token_ids
    ]


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the peer sends until it closes, and how long that took."""
    sock.settimeout(timeout)
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


async def test_a_client_without_the_secret_is_refused_before_any_frame_is_read(fleet_worker):
    host, port = "127.0.0.1", int(fleet_worker.address.rpartition(":")[2])
    frame = Codec(ToWorker).encode(
        Submit("raw", [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
    )
    assert len(frame) > PROOF_BYTES
    with (
        socket.create_connection((host, port)) as silent,
        socket.create_connection((host, port)) as eager,
    ):
        eager.sendall(frame)  # a well-formed Submit instead of a proof
        data, _ = await asyncio.to_thread(read_until_closed, eager, 10.0)
        # the worker's challenge and its refusal, then the connection closed: no Hello,
        # no output, so the Submit was never read as a frame
        assert data[: len(MAGIC)] == MAGIC
        assert data[len(MAGIC)] == SECRET
        assert len(data) == CHALLENGE_BYTES + 1
        # while a client that says nothing waits out its time, the fleet is served
        client = EngineClient(fleet_worker.address, auth=FLEET)
        assert len(await tokens(client, "real")) == 4
        assert (await client.stats()).num_running == 0  # "raw" never ran
        data, waited = await asyncio.to_thread(read_until_closed, silent, 15.0)
        assert len(data) == CHALLENGE_BYTES
        assert waited < 10.0
        assert await client.health()
        await client.close()


async def test_a_wrong_or_missing_secret_is_refused_and_never_echoed(fleet_worker):
    wrong = secrets.token_urlsafe(32)
    with pytest.raises(SecretRefusedError, match="worker refused the fleet secret") as err:
        await EngineClient(fleet_worker.address, auth=ClientAuth(secret=wrong)).connect()
    assert wrong not in str(err.value)
    assert FLEET_SECRET not in str(err.value)
    with pytest.raises(SecretRefusedError, match="none is set"):
        await EngineClient(fleet_worker.address).connect()
    client = EngineClient(fleet_worker.address, auth=FLEET)
    assert (await client.connect()).model_id == "synthetic:tiny"
    await client.close()


async def test_a_worker_that_cannot_prove_the_secret_gets_no_frame(tmp_path):
    """An impostor that takes any proof and answers with noise: the client refuses it and
    sends it nothing after its own proof."""
    received = bytearray()

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(MAGIC + bytes([SECRET]) + secrets.token_bytes(32))
        received.extend(await reader.readexactly(PROOF_BYTES))
        writer.write(b"\x01" + secrets.token_bytes(32))
        received.extend(await reader.read())  # until the client closes
        writer.close()

    server = await asyncio.start_unix_server(impostor, path=str(tmp_path / "impostor.sock"))
    async with server:
        client = EngineClient(f"unix://{tmp_path / 'impostor.sock'}", auth=FLEET)
        with pytest.raises(WorkerUnprovenError, match="worker failed to prove the fleet secret"):
            await client.connect()
        await asyncio.sleep(0.2)
    assert len(received) == PROOF_BYTES
    assert FLEET_SECRET.encode() not in received


async def test_a_unix_socket_is_private_and_its_open_worker_no_fleet_member(open_worker):
    sock = open_worker.sock
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(sock.parent.parent.stat().st_mode) == 0o700
    with pytest.raises(WorkerUnprovenError, match="asks for no secret"):
        await EngineClient(open_worker.address, auth=FLEET).connect()
    client = EngineClient(open_worker.address)  # no secret on either side: the file mode
    assert len(await tokens(client, "local")) == 4
    await client.close()


def start_engine(listen: str, cache_dir: Path, *extra: str, secret: str | None = None):
    env = dict(os.environ, STRATA_CACHE_DIR=str(cache_dir), STRATA_LOG_LEVEL="WARNING")
    env.pop("STRATA_WORKER_SECRET", None)
    if secret is not None:
        env["STRATA_WORKER_SECRET"] = secret
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "engine", "--listen", listen, *TINY_WORKER, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("host", "secret", "needle"),
    [
        ("0.0.0.0", None, "without the fleet secret"),
        ("127.0.0.1", None, "without the fleet secret"),
        ("127.0.0.1", "too-short-" * 3, "at least 32 characters"),
    ],
)
def test_a_tcp_listener_without_a_good_secret_refuses_to_start(
    strata_cache_dir, host, secret, needle
):
    done = start_engine(f"tcp://{host}:{_free_port()}", strata_cache_dir, secret=secret)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("strata: error:")
    assert needle in lines[0]
    assert "STRATA_WORKER_SECRET" in lines[0]
    if secret is not None:
        assert secret not in done.stderr


@pytest.fixture
def tls_worker(tmp_path, strata_cache_dir):
    """A worker serving TCP inside TLS, with a self-signed certificate for 127.0.0.1."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl binary is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=strata-worker",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    worker = WorkerProcess(
        tmp_path / "unused.sock",
        [*TINY_WORKER, "--tls-cert", str(cert), "--tls-key", str(key)],
        strata_cache_dir,
        address=f"tcp://127.0.0.1:{_free_port()}",
        env={"STRATA_WORKER_SECRET": FLEET_SECRET},
    )
    worker.start()
    yield worker, cert
    worker.stop()


async def test_tls_round_trip_with_the_fleet_secret(tls_worker):
    worker, cert = tls_worker
    port = worker.address.rpartition(":")[2]
    tls = f"tls://127.0.0.1:{port}"
    client = EngineClient(tls, auth=ClientAuth(secret=FLEET_SECRET, tls_ca=str(cert)))
    assert len(await tokens(client, "tls")) == 4
    await client.close()
    # the certificate must chain to the configured CA; plain TCP gets nowhere
    with pytest.raises(EngineDeadError, match="certificate verify failed"):
        await EngineClient(tls, auth=FLEET).connect()
    plain = EngineClient(f"tcp://127.0.0.1:{port}", auth=FLEET, connect_timeout=2.0)
    with pytest.raises(EngineDeadError):
        await plain.connect()


async def test_adapters_load_only_from_the_adapter_directory(fleet_worker, adapter_root):
    client = EngineClient(fleet_worker.address, auth=FLEET)
    adapters, evil = adapter_root / "adapters", adapter_root / "outside" / "evil"
    escapes = [str(evil), str(adapters / ".." / "outside" / "evil"), str(adapters / "link")]
    for i, path in enumerate(escapes):
        lora = LoRARequest(name=f"escape{i}", path=path)
        with pytest.raises(InvalidRequestError, match="outside this worker's adapter directory"):
            await tokens(client, f"escape{i}", lora)
    good = LoRARequest(name="good", path=str(adapters / "good"))
    assert len(await tokens(client, "good", good)) == 4
    assert await client.health()  # the worker stays up and consistent
    await client.close()


def test_the_gateway_reports_a_worker_that_fails_the_secret_and_serves_through_the_rest(
    store_server, strata_cache_dir, fleet_worker, open_worker, adapter_root, caplog
):
    settings = dataclasses.replace(
        gateway_settings(
            store_server.url,
            fleet_worker,
            strata_cache_dir,
            model="synthetic:tiny",
            worker_secret=FLEET_SECRET,
        ),
        engine_addresses=(fleet_worker.address, open_worker.address),
    )
    server = GatewayServer(settings)
    with caplog.at_level(logging.WARNING, logger="engine.client"):
        server.start()
        try:
            _, key = server.new_tenant()
            auth = {"authorization": f"Bearer {key}"}
            with httpx.Client(base_url=server.url, timeout=60) as http:
                ready = http.get("/ready")
                assert ready.status_code == 200, ready.text
                assert ready.json()["engine_errors"] == ["worker failed to prove the fleet secret"]
                body = {"model": "default", "prompt": "hi", "max_tokens": 3, "temperature": 0}
                done = http.post("/v1/completions", json=body, headers=auth)
                assert done.status_code == 200, done.text
                with server.admin() as admin:
                    outside = str(adapter_root / "outside" / "evil")
                    created = admin.post("/admin/adapters/", json={"name": "evil", "path": outside})
                    assert created.status_code == 201, created.text
                refused = http.post("/v1/completions", json={**body, "model": "evil"}, headers=auth)
                assert refused.status_code == 400, refused.text
                assert "adapter directory" in refused.json()["error"]["message"]
                assert outside not in refused.text
        finally:
            server.stop()
    assert "worker failed to prove the fleet secret" in caplog.text
    assert FLEET_SECRET not in caplog.text
