"""The Triton kernels against the torch backend (PagedAttention), run under Triton's
interpreter on CPU: the fused K/V write stores the same bytes, and paged attention (decode
with split-K, chunked prefill over cached pages, GQA, FP8 pages) gives the same outputs."""

from __future__ import annotations

import pytest
import torch

from engine.attention.paged import PagedAttention, SeqSlice
from engine.attention.triton_backend import (
    TritonPagedAttention,
    TritonUnavailableError,
    load_triton_kernels,
)
from kvstore.base import KVCacheSpec
from kvstore.device_pool import DeviceKVPool
from tests.triton_marks import INTERPRETED

pytestmark = INTERPRETED

FP8 = torch.float8_e4m3fn
BS = 4
CPU = torch.device("cpu")
# (tolerance of outputs against the torch path) by (compute dtype, page dtype)
TOLERANCE = {
    (torch.float32, torch.float32): 1e-5,
    (torch.float32, FP8): 1e-5,
    (torch.bfloat16, torch.bfloat16): 2e-2,
    (torch.bfloat16, FP8): 4e-2,
}


def make_pools(page_dtype, hkv, d, num_blocks=128):
    spec = KVCacheSpec(1, hkv, d, BS, page_dtype)
    return DeviceKVPool(spec, num_blocks, CPU), DeviceKVPool(spec, num_blocks, CPU)


def same_pools(a: DeviceKVPool, b: DeviceKVPool) -> bool:
    values = torch.equal(a.kv.view(torch.uint8), b.kv.view(torch.uint8))
    return values and (a.scales is None or torch.equal(a.scales, b.scales))


def fill_contexts(ref: PagedAttention, pools, seqs, dtype, gen):
    """Write each sequence's cached context through the torch path into both pools."""
    cached = [SeqSlice(s.context_len, 0, s.block_table) for s in seqs if s.context_len]
    if not cached:
        return
    total = sum(s.query_len for s in cached)
    hkv, d = ref.num_kv_heads, ref.head_dim
    k = torch.randn(total, hkv, d, generator=gen).to(dtype)
    v = torch.randn(total, hkv, d, generator=gen).to(dtype)
    ref.forward(
        0, torch.zeros(total, ref.num_heads, d, dtype=dtype), k, v, ref.build_context(cached)
    )
    pools[1].kv.copy_(pools[0].kv)
    if pools[0].scales is not None:
        pools[1].scales.copy_(pools[0].scales)


def run_step(dtype, page_dtype, h, hkv, d, shapes, *, splits=1, block_n=16, seed=0):
    """Both backends over the same pools and inputs; returns (torch out, triton out, pools)."""
    gen = torch.Generator().manual_seed(seed)
    pools = make_pools(page_dtype, hkv, d)
    blocks = iter(torch.randperm(128, generator=gen).tolist())
    seqs = [
        SeqSlice(q_len, ctx_len, [next(blocks) for _ in range(-(-(ctx_len + q_len) // BS))])
        for ctx_len, q_len in shapes
    ]
    ref = PagedAttention(pools[0], h)
    tri = TritonPagedAttention(pools[1], h, num_splits=splits, block_n=block_n)
    fill_contexts(ref, pools, seqs, dtype, gen)
    t = sum(q for _, q in shapes)
    q = torch.randn(t, h, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    expected = ref.forward(0, q, k, v, ref.build_context(seqs))
    got = tri.forward(0, q, k, v, tri.build_context(seqs))
    return expected, got, pools


# every dtype pairing on GQA 2; GQA 3 (a padded group) and MHA with an odd head_dim on the
# two pairings that differ most (16-bit pages, FP8 pages): the interpreter is slow
_DTYPES = list(TOLERANCE)
_MIXED_CASES = [
    *[(dtype, page_dtype, 4, 2, 16) for dtype, page_dtype in _DTYPES],
    (*_DTYPES[0], 6, 2, 32),
    (*_DTYPES[-1], 8, 8, 24),
]


@pytest.mark.parametrize(("dtype", "page_dtype", "h", "hkv", "d"), _MIXED_CASES)
def test_mixed_step_matches_torch_backend(dtype, page_dtype, h, hkv, d):
    # decodes (one of them at position 0), a prefill from scratch, prefill chunks after a
    # cached prefix, and a chunk longer than one tile (tokens_per_tile = 64 // group)
    shapes = [(7, 1), (30, 1), (0, 1), (0, 9), (5, 3), (21, 40)]
    expected, got, pools = run_step(dtype, page_dtype, h, hkv, d, shapes, splits=2)
    tol = TOLERANCE[(dtype, page_dtype)]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    assert same_pools(*pools), "the fused write stores the same bytes as the torch path"


@pytest.mark.parametrize("page_dtype", [torch.float32, FP8])
def test_split_k_merges_to_the_unsplit_result(page_dtype):
    # decodes over 13, 1 and 4 KV tiles of 16 (some splits empty); then prefill tiles: a
    # drafted step's 5 tokens after 120 cached, 3 after 40, and 9 from scratch (their early
    # rows see nothing in the later splits)
    shapes = [(200, 1), (3, 1), (63, 1), (120, 5), (40, 3), (0, 9)]
    expected, one, _ = run_step(torch.float32, page_dtype, 4, 2, 16, shapes, splits=1)
    torch.testing.assert_close(one, expected, atol=1e-5, rtol=1e-4)
    for splits in (2, 4, 16):
        _, split, _ = run_step(torch.float32, page_dtype, 4, 2, 16, shapes, splits=splits)
        torch.testing.assert_close(split, one, atol=2e-6, rtol=1e-5)


def test_fp8_keys_are_rotated_only_for_power_of_two_widths():
    for d, rotated in ((32, True), (24, False)):
        tri = TritonPagedAttention(make_pools(FP8, 2, d)[1], 4)
        assert tri.rotate_keys is rotated
        _, _, pools = run_step(torch.float32, FP8, 4, 2, d, [(0, 5)])
        assert same_pools(*pools)


@pytest.mark.parametrize("num_tokens", [1, 2, 5, 16, 21])
def test_fp8_write_of_any_step_size_stores_the_torch_paths_bytes(num_tokens):
    """The write's tile follows the step's token count (one row for a single decode, up to
    16): every size stores the same bytes and scales, keys rotated or not."""
    for d in (32, 24):
        _, _, pools = run_step(torch.float32, FP8, 4, 2, d, [(3, 1)] * num_tokens)
        assert same_pools(*pools)


def test_write_skips_padding_slots():
    kernels = load_triton_kernels(CPU)
    for page_dtype in (torch.float32, FP8):
        pool = make_pools(page_dtype, 2, 16)[0]
        k_pages, v_pages = pool.layer(0)
        k_scales, v_scales = pool.layer_scales(0) or (None, None)
        k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
        slots = torch.tensor([5, -1, 9])
        kernels.kv_write(k, v, k_pages, v_pages, slots, k_scales, v_scales)
        rows = pool.kv[0, 0].view(-1, 2, 16).float()
        written = rows.abs().sum(dim=(1, 2)) > 0
        assert written.nonzero().flatten().tolist() == [5, 9]


def test_decode_splits_fill_the_gpu_but_never_exceed_the_context():
    tri = TritonPagedAttention(make_pools(torch.float32, 8, 16)[1], 32, block_n=64)
    tri.num_sms = 132  # an H100's SM count: splitting only matters on a GPU
    assert tri.decode_splits(1, 32_768) == 16  # 8 programs for batch 1: split the most
    assert tri.decode_splits(1, 100) == 2  # only two KV tiles to split
    assert tri.decode_splits(16, 2048) == 4  # 128 programs unsplit: two waves need 4
    assert tri.decode_splits(64, 2048) == 1
    # prefill tiles: a drafted step's tile over a long context splits as a decode does; a
    # long chunk's many tiles fill the GPU unsplit
    assert tri.tile_splits(1, 32_768) == 16
    assert tri.tile_splits(32, 4096) == 2
    assert tri.tile_splits(128, 32_768) == 1
    tri.fixed_splits = 8
    assert tri.decode_splits(64, 2048) == 8 and tri.tile_splits(128, 32_768) == 8


def test_kernels_loaded_for_the_interpreter_refuse_a_gpu():
    with pytest.raises(TritonUnavailableError, match="TRITON_INTERPRET=0"):
        load_triton_kernels(torch.device("cuda"))
