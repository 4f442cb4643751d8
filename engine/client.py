"""EngineClient: the async client the gateway uses to talk to one worker.

Many requests are multiplexed over one connection. A background reader routes each frame to
the request (or call) waiting for it. When the connection drops, every in-flight request
fails with EngineDeadError; the next call reconnects, so a restarted worker is picked up.
Each connection first passes the fleet-secret handshake (engine/handshake.py) both ways: no
frame goes to a worker that has not proved the secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, Callable

import msgspec

from engine.handshake import ClientAuth, FleetSecretError, client_tls_context, prove_to_worker
from engine.protocol import (
    EngineDeadError,
    EngineStats,
    InvalidRequestError,
    LoRARequest,
    ModelInfo,
    RequestOutput,
    SamplingParams,
    Scheduling,
)
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
    ToClient,
    TokenizerReply,
    parse_address,
    read_frame,
)

log = logging.getLogger(__name__)

_Item = RequestOutput | Pages | BaseException


class EngineClient:
    def __init__(
        self, address: str, *, connect_timeout: float = 5.0, auth: ClientAuth | None = None
    ) -> None:
        kind, _, _ = parse_address(address)  # fail fast on a malformed address
        self.address = address
        self.connect_timeout = connect_timeout
        self.auth = auth or ClientAuth()
        self._tls = client_tls_context(self.auth.tls_ca) if kind == "tls" else None
        self.info: ModelInfo | None = None
        # called (on the event loop) when an open connection ends, unless `close` ended it
        self.on_disconnect: Callable[[str], None] | None = None
        self._closing = False
        # why the latest connection attempt failed (None once one succeeds)
        self.last_error: EngineDeadError | None = None
        self._codec = Codec(ToClient)
        self._reader_task: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._outbox: list[bytes] = []  # frames written together on the loop's next turn
        self._streams: dict[str, asyncio.Queue[_Item]] = {}
        self._calls: dict[int, asyncio.Future[msgspec.Struct]] = {}
        self._call_ids = itertools.count()
        self._connect_lock = asyncio.Lock()

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def connect(self) -> ModelInfo:
        """Connect (or reconnect) and return what the worker serves."""
        async with self._connect_lock:
            if self.connected and self.info is not None:
                return self.info
            try:
                reader, writer, info = await self._open()
            except EngineDeadError as exc:
                if isinstance(exc, FleetSecretError) and str(exc) != str(self.last_error):
                    log.error("%s", exc)
                self.last_error = exc
                raise
            self.last_error = None
            self.info = info
            self._writer = writer
            self._reader_task = asyncio.create_task(self._read_loop(reader))
            return info

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, ModelInfo]:
        """A connection that passed the handshake, and the model its Hello announced."""
        kind, host, port = parse_address(self.address)
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self.connect_timeout):
                if kind == "unix":
                    reader, writer = await asyncio.open_unix_connection(host)
                else:
                    reader, writer = await asyncio.open_connection(host, port, ssl=self._tls)
                await prove_to_worker(reader, writer, self.auth, self.address)
                body = await read_frame(reader)
            hello = self._codec.decode(body) if body is not None else None
            if not isinstance(hello, Hello):
                raise EngineDeadError(f"engine at {self.address} did not greet")
        except BaseException as exc:
            if writer is not None:
                writer.close()
            if isinstance(exc, OSError | TimeoutError | FrameError):
                raise EngineDeadError(f"cannot reach engine at {self.address}: {exc}") from exc
            raise
        return reader, writer, hello.info

    async def close(self) -> None:
        self._closing = True
        self._flush()
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
        self._fail_all(EngineDeadError("client closed"))

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        scheduling: Scheduling | None = None,
        lora: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit and stream outputs until the final one.

        Raises InvalidRequestError if the worker rejects the request and EngineDeadError
        if the worker goes away. Leaving the iteration early aborts the request.
        """
        stream = await self._open_stream(request_id)
        finished = False
        try:
            self._send(
                Submit(request_id, list(prompt_token_ids), params, scheduling or Scheduling(), lora)
            )
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if isinstance(item, Pages):
                    continue
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.connected:
                self._send(Abort([request_id]))

    async def _open_stream(self, request_id: str) -> asyncio.Queue[_Item]:
        """Connect, and register the queue the replies for `request_id` go to."""
        await self.connect()
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        stream: asyncio.Queue[_Item] = asyncio.Queue()
        self._streams[request_id] = stream
        return stream

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        scheduling: Scheduling | None = None,
        lora: LoRARequest | None = None,
        remote: bool = False,
    ) -> AsyncGenerator[Pages, None]:
        """Have a prefill worker compute the prompt's KV pages (engine/disagg.py) and yield
        the replies as they arrive, each a batch of page blobs; the last one says how many
        pages are in the worker's remote tier, with `remote` (which asks it to put them
        there rather than send them).

        Raises InvalidRequestError if the worker rejects it, EngineDeadError if the worker
        goes away or the prefill fails. Leaving the iteration early aborts it."""
        stream = await self._open_stream(request_id)
        finished = False
        try:
            ids = list(prompt_token_ids)
            self._send(Prefill(request_id, ids, scheduling or Scheduling(), lora, remote))
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if not isinstance(item, Pages):
                    continue
                finished = item.last
                if item.error is not None:
                    raise EngineDeadError(f"prefill failed: {item.error}")
                if item.pages or item.last:
                    yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.connected:
                self._send(Abort([request_id]))

    async def put_pages(self, pages: list[bytes]) -> None:
        """Send prefilled page blobs for the worker's tiers: they are taken in before any
        request submitted after this call. Raises EngineDeadError."""
        await self.connect()
        self._send(PutPages(pages))

    async def abort(self, request_id: str) -> None:
        if self.connected:
            self._send(Abort([request_id]))

    async def stats(self) -> EngineStats:
        reply = await self._call(GetStats(next(self._call_ids)))
        assert isinstance(reply, StatsReply)
        return reply.stats

    async def tokenizer_files(self, timeout: float = 30.0) -> dict[str, bytes]:
        """The worker's tokenizer, as the files `Tokenizer.save` writes."""
        async with asyncio.timeout(timeout):
            reply = await self._call(GetTokenizer(next(self._call_ids)))
        assert isinstance(reply, TokenizerReply)
        return reply.files

    async def health(self, timeout: float = 5.0) -> bool:
        """True when the worker answers a ping within `timeout` seconds."""
        try:
            async with asyncio.timeout(timeout):
                reply = await self._call(Ping(next(self._call_ids)))
        except (EngineDeadError, TimeoutError):
            return False
        return isinstance(reply, Pong) and reply.healthy

    # -- internals ----------------------------------------------------------------------

    def _send(self, msg: msgspec.Struct) -> None:
        if not self.connected:
            raise EngineDeadError(f"engine at {self.address} is not connected")
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(self._codec.encode(msg))

    def _flush(self) -> None:
        """One write for every frame queued in this loop iteration, so a burst of requests
        reaches the worker together (one wake-up, one scheduling step)."""
        frames, self._outbox = self._outbox, []
        if frames and self.connected:
            assert self._writer is not None
            self._writer.writelines(frames)

    async def _call(self, msg: GetStats | Ping | GetTokenizer) -> msgspec.Struct:
        await self.connect()
        fut: asyncio.Future[msgspec.Struct] = asyncio.get_running_loop().create_future()
        self._calls[msg.call_id] = fut
        try:
            self._send(msg)
            return await fut
        finally:
            self._calls.pop(msg.call_id, None)

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        reason = "engine worker closed the connection"
        try:
            while True:
                body = await read_frame(reader)
                if body is None:
                    break
                self._route(self._codec.decode(body))
        except (FrameError, ConnectionError) as exc:
            reason = f"engine connection failed: {exc}"
        finally:
            if self._writer is not None:
                self._writer.close()
            self._writer = None
            self._fail_all(EngineDeadError(reason))
            if self.on_disconnect is not None and not self._closing:
                self.on_disconnect(reason)

    def _route(self, msg: msgspec.Struct) -> None:
        if isinstance(msg, Outputs):
            for out in msg.outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(out)
        elif isinstance(msg, Pages):
            stream = self._streams.get(msg.request_id)
            if stream is not None:
                stream.put_nowait(msg)
        elif isinstance(msg, Rejected):
            stream = self._streams.get(msg.request_id)
            if stream is not None:
                stream.put_nowait(InvalidRequestError(msg.message, param=msg.param))
        elif isinstance(msg, StatsReply | Pong | TokenizerReply):
            fut = self._calls.get(msg.call_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _fail_all(self, exc: EngineDeadError) -> None:
        for stream in self._streams.values():
            stream.put_nowait(exc)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(exc)
        if self._streams:
            log.warning("%s; failing %d in-flight requests", exc, len(self._streams))
