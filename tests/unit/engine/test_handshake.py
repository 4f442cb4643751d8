"""The fleet-secret handshake between two in-process stream ends (a socket pair), the
listener's configuration rules, and the adapter directory's bounds."""

from __future__ import annotations

import asyncio
import secrets
import socket
from pathlib import Path

import pytest

from engine.config import ConfigError
from engine.handshake import (
    MAGIC,
    PROOF_BYTES,
    ClientAuth,
    HandshakeRefusedError,
    SecretRefusedError,
    WorkerUnprovenError,
    accept_client,
    prove_to_worker,
)
from engine.lora.adapter import AdapterPathError, resolve_under
from engine.worker import ListenConfig

A, B = secrets.token_urlsafe(32), secrets.token_urlsafe(32)


async def handshake(worker_secret: str | None, client_secret: str | None):
    """Both ends of one handshake; returns what each raised (None: it passed)."""
    left, right = socket.socketpair()
    w_reader, w_writer = await asyncio.open_connection(sock=left)
    c_reader, c_writer = await asyncio.open_connection(sock=right)

    async def worker() -> BaseException | None:
        try:
            await accept_client(w_reader, w_writer, worker_secret)
        except HandshakeRefusedError as exc:
            return exc
        finally:
            w_writer.close()
        return None

    async def client() -> BaseException | None:
        try:
            await prove_to_worker(c_reader, c_writer, ClientAuth(secret=client_secret), "test")
        except Exception as exc:
            return exc
        finally:
            c_writer.close()
        return None

    async with asyncio.timeout(5):
        return await asyncio.gather(worker(), client())


async def test_the_same_secret_passes_both_ways():
    assert await handshake(A, A) == [None, None]
    assert await handshake(None, None) == [None, None]


async def test_a_different_or_missing_secret_is_refused_by_the_worker():
    worker, client = await handshake(A, B)
    assert isinstance(worker, HandshakeRefusedError)
    assert isinstance(client, SecretRefusedError)
    _, client = await handshake(A, None)
    assert isinstance(client, SecretRefusedError)
    assert A not in str(client)


async def test_a_client_with_a_secret_refuses_a_worker_that_asks_for_none():
    _, client = await handshake(None, A)
    assert isinstance(client, WorkerUnprovenError)


async def streams() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, socket.socket]:
    """One end as asyncio streams, the other a raw non-blocking socket."""
    left, right = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=left)
    right.setblocking(False)
    return reader, writer, right


async def test_a_recorded_proof_does_not_pass_a_fresh_challenge():
    """Whoever records a genuine handshake cannot replay the client's proof: every
    connection's challenge is a fresh nonce."""
    loop = asyncio.get_running_loop()
    w_reader, w_writer, w_raw = await streams()
    c_reader, c_writer, c_raw = await streams()
    worker = asyncio.create_task(accept_client(w_reader, w_writer, A))
    client = asyncio.create_task(prove_to_worker(c_reader, c_writer, ClientAuth(A), "x"))
    challenge = await loop.sock_recv(w_raw, 4096)  # relayed, and the client's proof recorded
    await loop.sock_sendall(c_raw, challenge)
    proof = await loop.sock_recv(c_raw, 4096)
    await loop.sock_sendall(w_raw, proof)
    await loop.sock_sendall(c_raw, await loop.sock_recv(w_raw, 4096))
    await asyncio.gather(worker, client)  # the genuine handshake passed
    assert len(proof) == PROOF_BYTES

    reader, writer, raw = await streams()
    replayed = asyncio.create_task(accept_client(reader, writer, A))
    assert (await loop.sock_recv(raw, 4096)).startswith(MAGIC)
    await loop.sock_sendall(raw, proof)
    with pytest.raises(HandshakeRefusedError):
        await replayed
    for end in (w_writer, c_writer, writer):
        end.close()
    for end in (w_raw, c_raw, raw):
        end.close()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"address": "tcp://0.0.0.0:7000"}, "without the fleet secret"),
        ({"address": "tcp://127.0.0.1:7000"}, "without the fleet secret"),
        ({"address": "tcp://127.0.0.1:7000", "secret": "short"}, "at least 32"),
        ({"address": "tls://127.0.0.1:7000", "secret": A}, "--tls-cert"),
        ({"address": "tcp://127.0.0.1:7000", "secret": A, "tls_cert": "c.pem"}, "together"),
        ({"address": "unix:///run/e.sock", "tls_cert": "c", "tls_key": "k"}, "Unix socket"),
    ],
)
def test_listener_rules(kwargs, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        ListenConfig(**kwargs)
    assert "short" not in str(err.value)


def test_a_listener_config_never_shows_its_secret():
    listen = ListenConfig(address="tcp://0.0.0.0:7000", secret=A)
    assert A not in repr(listen)
    assert A not in repr(ClientAuth(secret=A))
    assert ListenConfig(address="unix:///run/e.sock").secret is None


def test_adapter_paths_stay_under_the_adapter_directory(tmp_path: Path):
    root = tmp_path / "adapters"
    (root / "good").mkdir(parents=True)
    (tmp_path / "adapters-evil").mkdir()
    (root / "link").symlink_to(tmp_path / "adapters-evil", target_is_directory=True)
    assert resolve_under(str(root / "good"), str(root), "good") == str((root / "good").resolve())
    for escape in (
        tmp_path / "adapters-evil",  # a sibling whose name starts like the root's
        root / ".." / "adapters-evil",
        root / "link",
        Path("/etc"),
    ):
        with pytest.raises(AdapterPathError, match="outside") as err:
            resolve_under(str(escape), str(root), "x")
        assert str(tmp_path) not in str(err.value)
