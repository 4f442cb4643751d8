"""The kernel that loads pages from host-tier rows in place (kvstore/triton_load.py), run
under Triton's interpreter: each layer's K and V rows, values and FP8 scales, land at their
blocks bit for bit, and nothing else in the pool changes; values and scales go in one
launch where their rows are of one word size, else in one launch each (3-byte FP8 rows)."""

from __future__ import annotations

import pytest
import torch

from kvstore.base import KVCacheSpec
from kvstore.device_pool import DeviceKVPool
from tests.triton_marks import INTERPRETED

pytestmark = INTERPRETED


@pytest.mark.parametrize(
    "spec",
    [
        KVCacheSpec(3, 2, 16, 4, torch.float8_e4m3fn),
        KVCacheSpec(2, 1, 3, 1, torch.float8_e4m3fn),
        KVCacheSpec(2, 1, 3, 1, torch.bfloat16),
    ],
    ids=["fp8", "fp8-3-byte-rows", "bf16-6-byte-rows"],
)
def test_rows_land_at_their_blocks_layer_by_layer(spec):
    from kvstore import triton_load
    from kvstore.transfer import _page_layout

    pool = DeviceKVPool(spec, 12, torch.device("cpu"), load_mode="sync")
    reference = DeviceKVPool(spec, 12, torch.device("cpu"), load_mode="sync")
    g = torch.Generator().manual_seed(0)
    host = torch.randint(0, 120, (9, spec.bytes_per_block), generator=g, dtype=torch.uint8)
    slots, blocks = [4, 0, 8, 5], [11, 3, 0, 6]
    reference.write_pages(blocks, [host[s] for s in slots])
    slots_t, blocks_t = torch.tensor(slots), torch.tensor(blocks)
    layers = [pool.layer_parts(layer) for layer in range(spec.num_layers)]
    reader = triton_load.HostRowReader(host, _page_layout(pool), layers)
    for layer in range(spec.num_layers):
        reader.load_layer(layer, slots_t, blocks_t)
        for got, want in zip(pool.layer_parts(layer), reference.layer_parts(layer), strict=True):
            assert torch.equal(got, want), layer  # the loaded blocks, and zeros elsewhere
        if layer + 1 < spec.num_layers:  # later layers are still untouched
            assert not pool.layer_parts(layer + 1)[0].any()
