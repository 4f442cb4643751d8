"""The fleet-secret handshake a worker and its client run on every connection before the first
frame (mutual HMAC-SHA256 challenge-response over fresh nonces; the secret never crosses the
wire), and the TLS contexts of both ends. Protocol and threat model: docs/design/fleet.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import ssl
from dataclasses import dataclass, field

from engine.protocol import EngineDeadError

MAGIC = b"STRATA\x00\x01"  # protocol name and handshake version
NONCE_BYTES = 32
MAC_BYTES = 32
MIN_SECRET_CHARS = 32
OPEN, SECRET = 0, 1
ACCEPTED, REFUSED = b"\x01", b"\x00"
CHALLENGE_BYTES = len(MAGIC) + 1 + NONCE_BYTES
PROOF_BYTES = len(MAGIC) + NONCE_BYTES + MAC_BYTES
_CLIENT_LABEL = b"strata fleet client proof\x00"
_WORKER_LABEL = b"strata fleet worker proof\x00"


class FleetSecretError(EngineDeadError):
    """The worker and its client do not share the fleet secret (the message never holds it).
    `reason` is the message without the worker's address, fit for /ready."""

    reason = "the fleet secret does not match"

    def __init__(self, address: str, detail: str = "") -> None:
        super().__init__(f"{self.reason} ({address}){detail}")
        self.address = address


class SecretRefusedError(FleetSecretError):
    """The worker refused this client's proof: a wrong secret, or none where one is needed."""

    code = "fleet_secret_refused"
    reason = "worker refused the fleet secret"


class WorkerUnprovenError(FleetSecretError):
    """The worker could not prove it holds the secret: an impostor, or a worker started
    without one. No frame is sent to it."""

    code = "fleet_secret_unproven"
    reason = "worker failed to prove the fleet secret"


class HandshakeRefusedError(Exception):
    """Worker side: a connection that did not prove the secret (the reason is for the log)."""


def check_secret(secret: str) -> None:
    """Raises ValueError for a secret too short to resist guessing (without echoing it)."""
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"the worker secret (STRATA_WORKER_SECRET) must be at least {MIN_SECRET_CHARS} "
            "characters; generate one with: python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'"
        )


@dataclass(frozen=True)
class ClientAuth:
    """What a client proves and trusts: the fleet secret (None: it connects only to open
    workers on Unix sockets) and, for `tls://` addresses, the CA file that signs the workers'
    certificates (None: the system's CAs)."""

    secret: str | None = field(default=None, repr=False)
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        if self.secret is not None:
            check_secret(self.secret)


def _mac(secret: str, label: bytes, worker_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), label + worker_nonce + client_nonce, hashlib.sha256).digest()


async def accept_client(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: str | None
) -> None:
    """Worker side: challenge the client and check its proof. Reads exactly PROOF_BYTES and
    no frame; raises HandshakeRefusedError (after telling the client) for a wrong proof. The
    caller bounds the time this may take."""
    worker_nonce = secrets.token_bytes(NONCE_BYTES)
    writer.write(MAGIC + bytes([OPEN if secret is None else SECRET]) + worker_nonce)
    if secret is None:
        return
    try:
        proof = await reader.readexactly(PROOF_BYTES)
    except asyncio.IncompleteReadError:
        raise HandshakeRefusedError("closed before proving the fleet secret") from None
    magic, client_nonce = proof[: len(MAGIC)], proof[len(MAGIC) : -MAC_BYTES]
    expected = _mac(secret, _CLIENT_LABEL, worker_nonce, client_nonce)
    if magic != MAGIC or not hmac.compare_digest(proof[-MAC_BYTES:], expected):
        writer.write(REFUSED)
        raise HandshakeRefusedError("wrong fleet secret proof")
    writer.write(ACCEPTED + _mac(secret, _WORKER_LABEL, worker_nonce, client_nonce))


async def prove_to_worker(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, auth: ClientAuth, address: str
) -> None:
    """Client side: answer the worker's challenge and check the worker's own proof. Raises
    SecretRefusedError, WorkerUnprovenError, or EngineDeadError for a peer that does not
    speak this protocol. The caller bounds the time this may take."""
    try:
        challenge = await reader.readexactly(CHALLENGE_BYTES)
    except asyncio.IncompleteReadError:
        raise EngineDeadError(f"engine at {address} closed the connection at once") from None
    mode, worker_nonce = challenge[len(MAGIC)], challenge[len(MAGIC) + 1 :]
    if challenge[: len(MAGIC)] != MAGIC or mode not in (OPEN, SECRET):
        raise EngineDeadError(f"{address} does not speak this version of the worker protocol")
    if mode == OPEN:
        if auth.secret is not None:
            raise WorkerUnprovenError(address, ": it asks for no secret")
        return
    if auth.secret is None:
        raise SecretRefusedError(address, ": it needs one and none is set (STRATA_WORKER_SECRET)")
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    proof = _mac(auth.secret, _CLIENT_LABEL, worker_nonce, client_nonce)
    writer.write(MAGIC + client_nonce + proof)
    try:
        verdict = await reader.readexactly(1)
    except asyncio.IncompleteReadError:
        raise SecretRefusedError(address) from None
    if verdict != ACCEPTED:
        raise SecretRefusedError(address)
    try:
        worker_proof = await reader.readexactly(MAC_BYTES)
    except asyncio.IncompleteReadError:
        raise WorkerUnprovenError(address) from None
    expected = _mac(auth.secret, _WORKER_LABEL, worker_nonce, client_nonce)
    if not hmac.compare_digest(worker_proof, expected):
        raise WorkerUnprovenError(address)


def server_tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A worker's TLS context (TLS 1.2 or later) from a PEM certificate chain and key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def client_tls_context(ca_file: str | None) -> ssl.SSLContext:
    """A client's TLS context: the worker's certificate must chain to `ca_file` (else the
    system's CAs) and name the host the address gives."""
    context = ssl.create_default_context(cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
