"""A worker process: one EngineCore served over a Unix or TCP socket.

Two threads, and one more for grammars. The asyncio thread owns the sockets: it decodes
frames into commands and writes outputs back. The engine thread owns the EngineCore: it
drains commands between steps, runs steps while there is work, and blocks when idle. A
request with a response format has its grammar compiled on the grammar thread and joins the
engine once it is ready, so no step waits for a compile. Requests are namespaced by
connection, so a client that disconnects has its requests aborted and its blocks freed.
A connection counts only once it has passed the fleet-secret handshake (engine/handshake.py),
within a bounded time and before any frame of it is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import signal
import socket
import ssl
import stat
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from engine.config import ConfigError
from engine.core import EngineCore
from engine.disagg import CheckedPages, PageImports, PrefillJobs, check_pages
from engine.fleet import (
    FleetConfig,
    KVEvent,
    KVTracker,
    Registration,
    WorkerRecord,
    connect_store,
    model_shape,
)
from engine.handshake import HandshakeRefusedError, accept_client, check_secret, server_tls_context
from engine.protocol import InvalidRequestError, RequestOutput
from engine.structured.backend import TokenMatcher
from engine.tokenizer import Tokenizer
from engine.wire import (
    Abort,
    Codec,
    FrameError,
    GetStats,
    GetTokenizer,
    Hello,
    Outputs,
    Pages,
    Ping,
    Pong,
    Prefill,
    PutPages,
    Rejected,
    StatsReply,
    Submit,
    TokenizerReply,
    ToWorker,
    parse_address,
    read_frame,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Command:
    conn_id: int
    msg: msgspec.Struct | _Compiled | CheckedPages | None  # None: the connection closed


@dataclass(frozen=True)
class _Compiled:
    """A submitted request whose grammar is compiled (or refused)."""

    submit: Submit
    matcher: TokenMatcher | InvalidRequestError


_STOP = _Command(-1, None)
_SAVE_POLL_S = 0.005  # how often a remote prefill waiting for its saves is looked at


@dataclass(frozen=True)
class ListenConfig:
    """Where a worker listens and whom it lets in.

    A Unix socket is created with mode 0600 (its directory, where the worker creates it,
    0700): file permissions are the protection, and the fleet secret is asked for too when
    one is set. A TCP listener always needs the secret, loopback included (every local user
    and container sharing the host's network reaches a loopback port). With a certificate
    and key, TCP runs inside TLS. A client has `handshake_timeout_s` to prove the secret.
    """

    address: str = "unix://.strata/engine.sock"
    secret: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    handshake_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        try:
            kind, _, _ = parse_address(self.address)
            if self.secret is not None:
                check_secret(self.secret)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key are given together")
        if kind == "unix" and self.tls_cert is not None:
            raise ConfigError("TLS is for TCP listeners; a Unix socket is protected by its mode")
        if kind == "tls" and self.tls_cert is None:
            raise ConfigError(f"{self.address} needs --tls-cert and --tls-key")
        if kind != "unix" and self.secret is None:
            raise ConfigError(
                f"refusing to listen on {self.address} without the fleet secret: anyone who "
                "reaches a TCP port could run requests as any tenant. Set "
                "STRATA_WORKER_SECRET (the same on the gateways), or listen on a unix:// socket"
            )
        if self.handshake_timeout_s <= 0:
            raise ConfigError("handshake_timeout_s must be positive")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


class Worker:
    def __init__(self, core: EngineCore, tokenizer_files: dict[str, bytes] | None = None) -> None:
        self.core = core
        self.tokenizer_files = tokenizer_files or {}  # what GetTokenizer answers
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._codec = Codec(ToWorker)
        self._next_conn = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._listen = ListenConfig()
        self._stopped = asyncio.Event()
        self._fleet: FleetConfig | None = None
        self._registration: Registration | None = None
        self._tracker: KVTracker | None = None
        # the engine thread's latest figures and loaded adapters, for the fleet
        self._load: tuple[dict[str, int], list[str]] = ({}, [])
        self._started_at = 0.0
        self._grammars = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiling: set[str] = set()  # request ids (with their connection's prefix)
        # disaggregated prefill (engine/disagg.py): prefills run here, pages taken in here
        self._prefills = PrefillJobs(core, self._post_pages)
        self.page_imports = PageImports()

    # -- asyncio side -------------------------------------------------------------------

    async def serve(
        self,
        listen: ListenConfig,
        ready: asyncio.Event | None = None,
        fleet: FleetConfig | None = None,
    ) -> None:
        """Serve until SIGTERM/SIGINT or `stop()`; raises if the engine thread died. With
        `fleet`, the worker also registers in the fleet's store and reports its KV blocks."""
        self._loop = asyncio.get_running_loop()
        self._listen = listen
        self._fleet = fleet
        self._started_at = time.time()
        address = listen.address
        kind, host, port = parse_address(address)
        if kind == "unix":
            server = await asyncio.start_unix_server(self._handle, sock=_bind_private_socket(host))
        else:
            tls: ssl.SSLContext | None = None
            if listen.tls_cert is not None and listen.tls_key is not None:
                tls = server_tls_context(listen.tls_cert, listen.tls_key)
            server = await asyncio.start_server(
                self._handle,
                host=host,
                port=port,
                ssl=tls,
                ssl_handshake_timeout=listen.handshake_timeout_s if tls else None,
            )
        self._thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        self._thread.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                self._loop.add_signal_handler(sig, self.stop)
        log.info(
            "engine worker serving %s on %s (%s%s)",
            self.core.model_id,
            address,
            "fleet secret required" if listen.secret else "no fleet secret",
            ", TLS" if listen.tls else "",
        )
        store = None
        if fleet is not None:
            store = connect_store(fleet.redis_url)
            self._tracker = KVTracker(fleet.worker_id)
            self._load = (self.core.load(), [])
            self._registration = Registration(store, fleet.secret, self._record)
            self._registration.start()
            log.info("registering as %s (%s) in the fleet", fleet.worker_id, fleet.advertise)
        if ready is not None:
            ready.set()
        async with server:
            await self._stopped.wait()
        if self._registration is not None:
            await self._registration.stop()
        if store is not None:
            await store.aclose()
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join, 10)
        self._grammars.shutdown(wait=False, cancel_futures=True)
        for writer in list(self._writers.values()):
            writer.close()
        if kind == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(host)
        if self._failed is not None:
            raise RuntimeError("engine thread failed") from self._failed

    def stop(self) -> None:
        self._stopped.set()

    def _record(self) -> WorkerRecord:
        """This worker's record for the fleet, with the engine thread's latest figures."""
        assert self._fleet is not None
        info, (load, adapters) = self.core.model_info(), self._load
        return WorkerRecord(
            worker_id=self._fleet.worker_id,
            address=self._fleet.advertise,
            model_id=info.model_id,
            shape=model_shape(info),
            max_model_len=info.max_model_len,
            kv_block_size=info.kv_block_size,
            cache_namespace=info.cache_namespace,
            role=self._fleet.role,
            adapters=adapters,
            max_num_seqs=self.core.config.scheduler.max_num_seqs,
            started_at=self._started_at,
            num_running=load.get("num_running", 0),
            num_waiting=load.get("num_waiting", 0),
            num_kv_blocks_used=load.get("num_kv_blocks_used", 0),
            num_kv_blocks_total=load.get("num_kv_blocks_total", 0),
        )

    def _post_events(self, events: list[KVEvent]) -> None:
        if self._registration is not None:
            self._registration.post(events)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self._listen.handshake_timeout_s):
                await accept_client(reader, writer, self._listen.secret)
        except (HandshakeRefusedError, TimeoutError, OSError) as exc:
            reason = str(exc) or "no proof of the fleet secret in time"
            log.warning("refused a connection from %s: %s", _peer(writer), reason)
            writer.close()
            return
        conn_id = self._next_conn
        self._next_conn += 1
        self._writers[conn_id] = writer
        writer.write(self._codec.encode(Hello(self.core.model_info())))
        try:
            while True:
                body = await read_frame(reader)
                if body is None:
                    break
                msg = self._codec.decode(body)
                if isinstance(msg, GetTokenizer):  # answered here: the engine is not needed
                    self._send(conn_id, TokenizerReply(msg.call_id, self.tokenizer_files))
                    continue
                if isinstance(msg, PutPages):  # checked off the engine thread, before the
                    # frames after it are read: they reach the engine in order
                    checked = await asyncio.to_thread(check_pages, self.core, msg.pages)
                    self._commands.put(_Command(conn_id, checked))
                    continue
                self._commands.put(_Command(conn_id, msg))
        except (FrameError, ConnectionError) as exc:
            log.warning("dropping connection %d: %s", conn_id, exc)
        finally:
            self._writers.pop(conn_id, None)
            self._commands.put(_Command(conn_id, None))
            writer.close()

    def _send(self, conn_id: int, msg: msgspec.Struct) -> None:
        writer = self._writers.get(conn_id)
        if writer is not None and not writer.is_closing():
            writer.write(self._codec.encode(msg))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_conn: dict[int, list[RequestOutput]] = defaultdict(list)
        for out in outputs:
            conn, _, client_id = out.request_id.partition("/")
            out.request_id = client_id
            by_conn[int(conn)].append(out)
        for conn_id, outs in by_conn.items():
            self._send(conn_id, Outputs(outs))

    def _post_pages(self, request_id: str, pages: Pages) -> None:
        conn, _, _ = request_id.partition("/")
        self._post(int(conn), pages)

    def _post(self, conn_id: int, msg: msgspec.Struct) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._send, conn_id, msg)

    # -- engine thread ------------------------------------------------------------------

    def _engine_loop(self) -> None:
        assert self._loop is not None
        poll_s = None if self._fleet is None else self._fleet.kv_poll_s
        next_poll = 0.0
        try:
            while True:
                idle = not self.core.has_unfinished()
                # a remote prefill waiting for its saves is polled at least every 5 ms
                saving = self._prefills.saving
                timeout = min(poll_s or _SAVE_POLL_S, _SAVE_POLL_S) if saving else poll_s
                if not self._drain(block=idle, timeout=timeout):
                    return
                outputs = self._prefills.settle(self.core.step())
                if saving:
                    self._prefills.poll()
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
                if poll_s is not None and time.monotonic() >= next_poll:
                    self._report()
                    next_poll = time.monotonic() + poll_s
        except BaseException as exc:
            log.exception("engine thread died")
            self._failed = exc
            self._loop.call_soon_threadsafe(self.stop)

    def _report(self) -> None:
        """The fleet's view of this engine: load figures, adapters and KV block events
        (on the engine thread, which owns the maps they are read from)."""
        assert self._tracker is not None and self._loop is not None
        lora = self.core.lora
        self._load = (self.core.load(), lora.loaded if lora is not None else [])
        events = self._tracker.poll(self.core.cached_block_hashes())
        if events:
            self._loop.call_soon_threadsafe(self._post_events, events)

    def _drain(self, block: bool, timeout: float | None = None) -> bool:
        """Apply queued commands (waiting up to `timeout` for the first when `block`);
        returns False when asked to stop."""
        while True:
            try:
                cmd = self._commands.get(block=block, timeout=timeout)
            except queue.Empty:
                return True
            block = False
            if cmd is _STOP:
                return False
            self._apply(cmd)

    def _apply(self, cmd: _Command) -> None:
        msg, prefix = cmd.msg, f"{cmd.conn_id}/"
        if msg is None:
            self._compiling = {r for r in self._compiling if not r.startswith(prefix)}
            aborted = [r for r in list(self.core.scheduler.requests) if r.startswith(prefix)]
            outs = [self.core.abort_request(rid) for rid in aborted]
            self._prefills.settle([o for o in outs if o is not None])  # forgotten: no reply
            self._prefills.forget(lambda rid: rid.startswith(prefix))
            if aborted:
                log.info("connection %d closed; aborted %d requests", cmd.conn_id, len(aborted))
        elif isinstance(msg, Submit) and msg.params.is_constrained:
            self._compiling.add(prefix + msg.request_id)
            future = self._grammars.submit(self.core.compile_grammar, msg.params)
            future.add_done_callback(lambda done: self._compiled(cmd.conn_id, msg, done))
        elif isinstance(msg, Submit | _Compiled):
            submit = msg.submit if isinstance(msg, _Compiled) else msg
            matcher: TokenMatcher | None = None
            try:
                if isinstance(msg, _Compiled):
                    if prefix + submit.request_id not in self._compiling:
                        return  # aborted, or its connection closed, while it compiled
                    self._compiling.discard(prefix + submit.request_id)
                    if isinstance(msg.matcher, InvalidRequestError):
                        raise msg.matcher
                    matcher = msg.matcher
                self.core.add_request(
                    prefix + submit.request_id,
                    submit.prompt_token_ids,
                    submit.params,
                    scheduling=submit.scheduling,
                    lora=submit.lora,
                    matcher=matcher,
                )
            except InvalidRequestError as exc:
                rejected = Rejected(submit.request_id, exc.code, str(exc), exc.param)
                self._post(cmd.conn_id, rejected)
        elif isinstance(msg, Prefill):
            try:
                self._prefills.start(prefix + msg.request_id, msg)
            except InvalidRequestError as exc:
                rejected = Rejected(msg.request_id, exc.code, str(exc), exc.param)
                self._post(cmd.conn_id, rejected)
        elif isinstance(msg, CheckedPages):
            self.page_imports.take(self.core, msg)
        elif isinstance(msg, Abort):
            self._compiling.difference_update(prefix + rid for rid in msg.request_ids)
            outs = [self.core.abort_request(prefix + rid) for rid in msg.request_ids]
            stopped = {prefix + rid for rid in msg.request_ids}
            self._prefills.forget(stopped.__contains__)
            done = self._prefills.settle([o for o in outs if o is not None])
            if done:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._dispatch, done)
        elif isinstance(msg, GetStats):
            stats = self.core.stats()
            stats.num_kv_pages_received = self.page_imports.num_taken
            stats.num_kv_pages_refused = self.page_imports.num_refused
            self._post(cmd.conn_id, StatsReply(msg.call_id, stats))
        elif isinstance(msg, Ping):
            # a ping also audits the KV bookkeeping: a leak shows up as unhealthy
            try:
                self.core.check_integrity()
            except AssertionError as exc:
                self._post(cmd.conn_id, Pong(msg.call_id, healthy=False, detail=str(exc)))
            else:
                self._post(cmd.conn_id, Pong(msg.call_id, healthy=True))

    def _compiled(self, conn_id: int, submit: Submit, done: Future[TokenMatcher]) -> None:
        """On the grammar thread: hand the compiled request to the engine thread."""
        if done.cancelled():
            return
        exc = done.exception()
        if exc is not None and not isinstance(exc, InvalidRequestError):
            log.error("compiling a grammar failed", exc_info=exc)
            exc = InvalidRequestError(f"response_format: {exc}", "response_format")
        matcher = exc if isinstance(exc, InvalidRequestError) else done.result()
        self._commands.put(_Command(conn_id, _Compiled(submit, matcher)))


def _bind_private_socket(path: str) -> socket.socket:
    """A Unix socket at `path`, mode 0600 from the moment it exists; the directories above it
    that are missing are created 0700, and a stale socket left by a dead worker is replaced."""
    directory = os.path.dirname(os.path.abspath(path))
    missing = []
    parent = directory
    while not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for created in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(created, 0o700)
    mode = os.stat(directory).st_mode
    if mode & 0o022 and not mode & stat.S_ISVTX:
        log.warning("%s is writable by other users: they can replace the socket", directory)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(umask)
    os.chmod(path, 0o600)
    return sock


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "the Unix socket"


def tokenizer_files(tokenizer: Tokenizer) -> dict[str, bytes]:
    """`tokenizer` as the files `Tokenizer.save` writes (for gateways: GetTokenizer)."""
    with tempfile.TemporaryDirectory(prefix="strata-tokenizer-") as directory:
        tokenizer.save(directory)
        return {name: (Path(directory) / name).read_bytes() for name in os.listdir(directory)}


def run_worker(
    core: EngineCore,
    listen: ListenConfig,
    fleet: FleetConfig | None = None,
    tokenizer: Tokenizer | None = None,
) -> None:
    """Serve `core` as `listen` says until a signal arrives (the `strata engine` command),
    registered in `fleet` when given, handing `tokenizer` to gateways that ask for it."""
    try:
        import uvloop  # noqa: PLC0415

        runner: asyncio.Runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        files = tokenizer_files(tokenizer) if tokenizer is not None else None
        try:
            runner.run(Worker(core, files).serve(listen, fleet=fleet))
        finally:
            core.close()
