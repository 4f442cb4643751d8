"""The disk tier's page layout: each slot holds a page's bytes, then, in its last
`HEADER_NBYTES`, a header naming the page (block hash, owner), the pages it can stand for
(model, cache namespace, KV dtype and geometry) and its payload's length and CRC-32.

A restarted worker reads the headers to rebuild its index (kvstore/disk_recovery.py).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

ALIGN = 4096  # O_DIRECT offsets, sizes and buffers are multiples of this
HEADER_NBYTES = 512
MAGIC = b"STRATAKV"
VERSION = 1
_MAX_KEY = 32
_MAX_OWNER = 128
_MAX_DTYPE = 24
# magic, version, key length, owner length, payload bytes, payload CRC-32, write sequence,
# model digest, namespace digest, KV dtype, layout (layers, KV heads, head dim, block size),
# key, owner; then the CRC-32 of all of that
_FIELDS = struct.Struct(f"<8sHHHQIQ16s16s{_MAX_DTYPE}s4I{_MAX_KEY}s{_MAX_OWNER}s")
_CRC = struct.Struct("<I")
assert _FIELDS.size + _CRC.size <= HEADER_NBYTES


def disk_slot_nbytes(page_nbytes: int) -> int:
    """Bytes one page takes on disk: its bytes and its header, rounded up for O_DIRECT."""
    return -(-(page_nbytes + HEADER_NBYTES) // ALIGN) * ALIGN


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclass(frozen=True)
class PageFormat:
    """What the pages of one worker are: only pages written under an equal format are
    taken back after a restart. `namespace` is the engine's part of the prefix-cache chain
    root (model and KV dtype); the tenant's salt and the adapter are in each block hash."""

    model_id: str = ""
    namespace: str = ""
    kv_dtype: str = ""
    layout: tuple[int, int, int, int] = (0, 0, 0, 0)  # layers, KV heads, head dim, block size

    def __post_init__(self) -> None:
        assert len(self.kv_dtype.encode()) <= _MAX_DTYPE, "KV dtype name too long"


@dataclass(frozen=True)
class PageHeader:
    """A header read back from disk."""

    key: bytes
    owner: str
    payload_nbytes: int
    payload_crc: int
    sequence: int  # when it was written (ns since the epoch): newer pages are more recent


class HeaderError(ValueError):
    """A header that is not one of ours, torn, or written for another format."""


def pack_header(
    page_format: PageFormat,
    key: bytes,
    owner: str,
    payload_nbytes: int,
    payload_crc: int,
    sequence: int,
) -> bytes:
    """The `HEADER_NBYTES` bytes naming one page. An owner too long to fit is stored as
    none (the page then counts for no tenant after a restart)."""
    assert len(key) <= _MAX_KEY, "block hash too long"
    owner_bytes = owner.encode()
    if len(owner_bytes) > _MAX_OWNER:
        owner_bytes = b""
    fields = _FIELDS.pack(
        MAGIC,
        VERSION,
        len(key),
        len(owner_bytes),
        payload_nbytes,
        payload_crc,
        sequence,
        _digest(page_format.model_id),
        _digest(page_format.namespace),
        page_format.kv_dtype.encode(),
        *page_format.layout,
        key,
        owner_bytes,
    )
    body = fields + _CRC.pack(zlib.crc32(fields))
    return body + bytes(HEADER_NBYTES - len(body))


def is_blank(raw: bytes | memoryview) -> bool:
    """Whether a header region was never written (a fresh file reads as zeros)."""
    return not any(raw[: len(MAGIC)])


def unpack_header(raw: bytes | memoryview, page_format: PageFormat, page_nbytes: int) -> PageHeader:
    """The header in `raw` (`HEADER_NBYTES` long), checked against this worker's format and
    page size. Raises HeaderError saying why it cannot be used."""
    fields = bytes(raw[: _FIELDS.size])
    (crc,) = _CRC.unpack_from(raw, _FIELDS.size)
    if fields[: len(MAGIC)] != MAGIC:
        raise HeaderError("not a page header")
    if zlib.crc32(fields) != crc:
        raise HeaderError("header checksum mismatch")
    (
        _,
        version,
        key_len,
        owner_len,
        payload_nbytes,
        payload_crc,
        sequence,
        model,
        namespace,
        dtype,
        *layout,
        key,
        owner,
    ) = _FIELDS.unpack(fields)
    if version != VERSION:
        raise HeaderError(f"page format version {version}")
    if payload_nbytes != page_nbytes:
        raise HeaderError(f"page of {payload_nbytes} bytes, not {page_nbytes}")
    if model != _digest(page_format.model_id) or namespace != _digest(page_format.namespace):
        raise HeaderError("page of another model or cache namespace")
    if dtype.rstrip(b"\0").decode(errors="replace") != page_format.kv_dtype:
        raise HeaderError("page of another KV dtype")
    if tuple(layout) != page_format.layout:
        raise HeaderError("page of another KV layout")
    if key_len > _MAX_KEY or owner_len > _MAX_OWNER:
        raise HeaderError("header lengths out of range")
    return PageHeader(
        key=key[:key_len],
        owner=owner[:owner_len].decode(errors="replace"),
        payload_nbytes=payload_nbytes,
        payload_crc=payload_crc,
        sequence=sequence,
    )
