"""A worker process: one EngineCore served over a Unix or TCP socket.

Two threads, and one more for grammars. The asyncio thread owns the sockets: it decodes
frames into commands and writes outputs back. The engine thread owns the EngineCore: it
drains commands between steps, runs steps while there is work, and blocks when idle. A
request with a response format has its grammar compiled on the grammar thread and joins the
engine once it is ready, so no step waits for a compile. Requests are namespaced by
connection, so a client that disconnects has its requests aborted and its blocks freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import signal
import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from engine.core import EngineCore
from engine.protocol import InvalidRequestError, RequestOutput
from engine.structured.backend import TokenMatcher
from engine.wire import (
    Abort,
    Codec,
    FrameError,
    GetStats,
    Hello,
    Outputs,
    Ping,
    Pong,
    Rejected,
    StatsReply,
    Submit,
    ToWorker,
    parse_address,
    read_frame,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Command:
    conn_id: int
    msg: msgspec.Struct | _Compiled | None  # None: the connection closed


@dataclass(frozen=True)
class _Compiled:
    """A submitted request whose grammar is compiled (or refused)."""

    submit: Submit
    matcher: TokenMatcher | InvalidRequestError


_STOP = _Command(-1, None)


class Worker:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._codec = Codec(ToWorker)
        self._next_conn = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._stopped = asyncio.Event()
        self._grammars = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiling: set[str] = set()  # request ids (with their connection's prefix)

    # -- asyncio side -------------------------------------------------------------------

    async def serve(self, address: str, ready: asyncio.Event | None = None) -> None:
        """Serve until SIGTERM/SIGINT or `stop()`; raises if the engine thread died."""
        self._loop = asyncio.get_running_loop()
        kind, host, port = parse_address(address)
        if kind == "unix":
            _prepare_socket_path(host)
            server = await asyncio.start_unix_server(self._handle, path=host)
        else:
            server = await asyncio.start_server(self._handle, host=host, port=port)
        self._thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        self._thread.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                self._loop.add_signal_handler(sig, self.stop)
        log.info("engine worker serving %s on %s", self.core.model_id, address)
        if ready is not None:
            ready.set()
        async with server:
            await self._stopped.wait()
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

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn_id = self._next_conn
        self._next_conn += 1
        self._writers[conn_id] = writer
        writer.write(self._codec.encode(Hello(self.core.model_info())))
        try:
            while True:
                body = await read_frame(reader)
                if body is None:
                    break
                self._commands.put(_Command(conn_id, self._codec.decode(body)))
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

    def _post(self, conn_id: int, msg: msgspec.Struct) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._send, conn_id, msg)

    # -- engine thread ------------------------------------------------------------------

    def _engine_loop(self) -> None:
        assert self._loop is not None
        try:
            while True:
                idle = not self.core.has_unfinished()
                if not self._drain(block=idle):
                    return
                outputs = self.core.step()
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as exc:
            log.exception("engine thread died")
            self._failed = exc
            self._loop.call_soon_threadsafe(self.stop)

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; returns False when asked to stop."""
        while True:
            try:
                cmd = self._commands.get(block=block, timeout=None)
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
            for rid in aborted:
                self.core.abort_request(rid)
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
        elif isinstance(msg, Abort):
            self._compiling.difference_update(prefix + rid for rid in msg.request_ids)
            outs = [self.core.abort_request(prefix + rid) for rid in msg.request_ids]
            done = [o for o in outs if o is not None]
            if done:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._dispatch, done)
        elif isinstance(msg, GetStats):
            self._post(cmd.conn_id, StatsReply(msg.call_id, self.core.stats()))
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


def _prepare_socket_path(path: str) -> None:
    """Create the socket's directory and remove a stale socket left by a dead worker."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def run_worker(core: EngineCore, address: str) -> None:
    """Serve `core` on `address` until a signal arrives (the `strata engine` command)."""
    try:
        import uvloop  # noqa: PLC0415

        runner: asyncio.Runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        runner.run(Worker(core).serve(address))
