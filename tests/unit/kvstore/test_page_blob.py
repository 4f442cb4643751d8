"""Pages in flight between workers: a blob round-trips, and a torn, truncated or foreign
blob is refused, never taken as KV."""

from __future__ import annotations

import pytest

from kvstore.disk_page import PageFormat
from kvstore.page_blob import PageBlobError, pack_page, unpack_page

FORMAT = PageFormat("model-a", "model-a|float32", "float32", (2, 1, 8, 4))
PAYLOAD = bytes(range(256)) * 2
KEY = b"k" * 16


def test_a_blob_round_trips_with_its_key_and_owner():
    page = unpack_page(pack_page(FORMAT, KEY, "tenant-1", PAYLOAD), FORMAT, len(PAYLOAD))
    assert (page.key, page.owner, bytes(page.payload)) == (KEY, "tenant-1", PAYLOAD)


def test_a_torn_payload_is_refused():
    blob = bytearray(pack_page(FORMAT, KEY, "", PAYLOAD))
    blob[3] ^= 0x40
    with pytest.raises(PageBlobError, match="checksum"):
        unpack_page(bytes(blob), FORMAT, len(PAYLOAD))


def test_a_truncated_blob_is_refused():
    blob = pack_page(FORMAT, KEY, "", PAYLOAD)
    with pytest.raises(PageBlobError, match="bytes"):
        unpack_page(blob[:-1], FORMAT, len(PAYLOAD))


@pytest.mark.parametrize(
    "other",
    [
        PageFormat("model-b", "model-b|float32", "float32", (2, 1, 8, 4)),
        PageFormat("model-a", "model-a|float32", "bfloat16", (2, 1, 8, 4)),
        PageFormat("model-a", "model-a|float32", "float32", (2, 2, 8, 4)),
    ],
    ids=["model", "dtype", "layout"],
)
def test_a_page_of_another_format_is_refused(other):
    with pytest.raises(PageBlobError, match="another"):
        unpack_page(pack_page(other, KEY, "", PAYLOAD), FORMAT, len(PAYLOAD))
