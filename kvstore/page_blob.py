"""A KV page as one self-describing blob, for pages that leave their worker: the page's
bytes, then the disk tier's header (kvstore/disk_page.py) naming its block hash, owner,
format and the payload's CRC-32. A blob that is torn, corrupt or of another format is
refused whole (`PageBlobError`): the receiver treats its block as a miss, never as KV.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

from kvstore.disk_page import HEADER_NBYTES, HeaderError, PageFormat, pack_header, unpack_header


class PageBlobError(ValueError):
    """A blob that cannot stand for a page of this format: says why."""


@dataclass(frozen=True)
class PageBlob:
    """A checked blob: the page's block hash, its owner (tenant) and its bytes."""

    key: bytes
    owner: str
    payload: memoryview


def pack_page(page_format: PageFormat, key: bytes, owner: str, payload: bytes) -> bytes:
    """`payload` (one page as the device pool reads it out) followed by its header."""
    header = pack_header(page_format, key, owner, len(payload), zlib.crc32(payload), time.time_ns())
    return payload + header


def unpack_page(blob: bytes, page_format: PageFormat, page_nbytes: int) -> PageBlob:
    """The page in `blob`, checked: its header against this worker's format and page size,
    its payload against the header's CRC-32. Raises PageBlobError."""
    if len(blob) != page_nbytes + HEADER_NBYTES:
        raise PageBlobError(f"a page blob of {len(blob)} bytes, not {page_nbytes + HEADER_NBYTES}")
    view = memoryview(blob)
    try:
        header = unpack_header(view[page_nbytes:], page_format, page_nbytes)
    except HeaderError as exc:
        raise PageBlobError(str(exc)) from None
    payload = view[:page_nbytes]
    if zlib.crc32(payload) != header.payload_crc:
        raise PageBlobError("page checksum mismatch")
    return PageBlob(header.key, header.owner, payload)
