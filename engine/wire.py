"""Frames between `EngineClient` and a worker: 4-byte big-endian length + msgpack body.

Bodies are a tagged union of msgspec Structs, so one decoder handles every message and an
unknown or malformed frame is a clean `msgspec.DecodeError`, never a crash.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgspec

from engine.protocol import (
    EngineStats,
    LoRARequest,
    ModelInfo,
    RequestOutput,
    SamplingParams,
    Scheduling,
)

MAX_FRAME_BYTES = 256 * 1024 * 1024
_HEADER = struct.Struct(">I")


# -- client -> worker ----------------------------------------------------------------------


class Submit(msgspec.Struct, tag="submit"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    scheduling: Scheduling = msgspec.field(default_factory=Scheduling)
    lora: LoRARequest | None = None


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class GetStats(msgspec.Struct, tag="get_stats"):
    call_id: int


class Ping(msgspec.Struct, tag="ping"):
    call_id: int


class GetTokenizer(msgspec.Struct, tag="get_tokenizer"):
    call_id: int


class Prefill(msgspec.Struct, tag="prefill"):
    """Compute the KV of the prompt's full blocks that a decode worker's hit may use (all
    but a last token) and send them back as `Pages` (engine/disagg.py). With `remote`, make
    sure they are in the worker's remote tier instead and send back only their number (or
    the pages after all, when the store did not take them)."""

    request_id: str
    prompt_token_ids: list[int]
    scheduling: Scheduling = msgspec.field(default_factory=Scheduling)
    lora: LoRARequest | None = None
    remote: bool = False


class PutPages(msgspec.Struct, tag="put_pages"):
    """Prefilled KV pages for the host tier, each a page in flight (engine/disagg.py); taken
    in before any request sent after them on the connection."""

    pages: list[bytes]


# -- worker -> client ----------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello"):
    info: ModelInfo


class Outputs(msgspec.Struct, tag="outputs"):
    outputs: list[RequestOutput]


class Rejected(msgspec.Struct, tag="rejected"):
    request_id: str
    code: str
    message: str
    param: str | None = None  # the request field at fault, if one is


class StatsReply(msgspec.Struct, tag="stats_reply"):
    call_id: int
    stats: EngineStats


class Pong(msgspec.Struct, tag="pong"):
    call_id: int
    healthy: bool
    detail: str = ""


class Pages(msgspec.Struct, tag="pages"):
    """Pages of a `Prefill`, in order; `last` on the final frame. `error` says why a
    prefill ended without (all of) them. `saved`: of a `remote` prefill, the pages in the
    remote tier (on the last frame; all of them when no page is sent)."""

    request_id: str
    pages: list[bytes]
    last: bool = False
    error: str | None = None
    saved: int = 0


class TokenizerReply(msgspec.Struct, tag="tokenizer_reply"):
    """The worker's tokenizer and chat template as the files `Tokenizer.save` writes, so a
    gateway tokenizes exactly as the model expects without a copy of the model."""

    call_id: int
    files: dict[str, bytes]


ToWorker = Submit | Abort | GetStats | Ping | GetTokenizer | Prefill | PutPages
ToClient = Hello | Outputs | Rejected | StatsReply | Pong | TokenizerReply | Pages


class FrameError(Exception):
    """A frame that is too large or cannot be decoded."""


class Codec:
    """Encoder/decoder pair for one direction of the stream."""

    def __init__(self, incoming: Any) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec: msgspec.msgpack.Decoder = msgspec.msgpack.Decoder(incoming)

    def encode(self, msg: msgspec.Struct) -> bytes:
        body = self._enc.encode(msg)
        return _HEADER.pack(len(body)) + body

    def decode(self, body: bytes) -> msgspec.Struct:
        try:
            msg: msgspec.Struct = self._dec.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise FrameError(f"bad frame: {exc}") from exc
        return msg


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """One frame body, or None on a clean EOF between frames."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise FrameError("connection closed mid-header") from exc
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {size} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise FrameError("connection closed mid-frame") from exc


def parse_address(address: str) -> tuple[str, str, int]:
    """`unix:///path` -> ("unix", path, 0); `tcp://host:port` -> ("tcp", host, port);
    `tls://host:port` -> ("tls", host, port), TCP inside TLS."""
    if address.startswith("unix://"):
        path = address.removeprefix("unix://")
        if not path:
            raise ValueError("unix address needs a path: unix:///run/strata/engine.sock")
        return "unix", path, 0
    for kind in ("tcp", "tls"):
        if address.startswith(f"{kind}://"):
            host, sep, port = address.removeprefix(f"{kind}://").rpartition(":")
            if not sep or not port.isdigit():
                raise ValueError(f"{kind} address needs host:port, got {address!r}")
            return kind, host.strip("[]") or "127.0.0.1", int(port)
    raise ValueError(f"address must start with unix://, tcp:// or tls://, got {address!r}")
