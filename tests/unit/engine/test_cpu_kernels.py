"""Native CPU kernels against torch references, in fp32 and bf16, for every build: `native`
(AVX-512 paths on an AVX-512 CPU), `avx2` (the AVX2 + FMA paths, where the CPU has them) and
`portable` (the scalar fallbacks)."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from engine.attention.paged import PagedAttention, SeqSlice
from engine.kernels.cpu import (
    CpuKernels,
    cpu_isa_levels,
    kernel_dir,
    load_cpu_kernels,
    pair_rows,
)
from engine.kernels.cpu_quant import QuantFormat, QuantWeight, quantize
from engine.model.llama import RMSNorm, RotaryEmbedding, SiluAndMul
from engine.model_config import ModelConfig
from kvstore.base import KVCacheSpec
from kvstore.device_pool import DeviceKVPool
from kvstore.fp8 import quantize_fp8

DTYPES = [torch.float32, torch.bfloat16]
# tolerance per storage dtype: bf16 results may differ by a rounding step
ATOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module", params=["native", "avx512", "avx2", "portable"])
def kernels(request, strata_cache_dir) -> CpuKernels:
    if request.param in ("avx512", "avx2") and request.param not in cpu_isa_levels():
        pytest.skip(f"this CPU has no {request.param}")
    k = load_cpu_kernels(str(strata_cache_dir), arch=request.param)
    assert k is not None, "the C kernels must build on the test machine"
    return k


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 40])  # 40: a tail the vector loop does not cover
def test_rms_norm_with_and_without_residual(kernels, dtype, hidden):
    x = torch.randn(7, hidden, generator=gen()).to(dtype)
    res = torch.randn(7, hidden, generator=gen(1)).to(dtype)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.rand(hidden, generator=gen(2)).to(dtype)
    ref_out, ref_sum = norm(x, res.clone())
    out, summed = kernels.rms_norm(x, res, norm.weight.data, 1e-5)
    assert summed is res  # the residual stream is updated in place
    assert torch.equal(summed, ref_sum)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=ATOL[dtype], rtol=1e-2)
    out, passthrough = kernels.rms_norm(x, None, norm.weight.data, 1e-5)
    assert passthrough is x
    torch.testing.assert_close(out.float(), norm(x)[0].float(), atol=ATOL[dtype], rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 24])
def test_rope_in_place_on_strided_views(kernels, dtype, head_dim):
    cfg = ModelConfig(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        max_position_embeddings=512,
        rope_theta=10000.0,
    )
    rope = RotaryEmbedding(cfg)
    t = 9
    qkv = torch.randn(t, (4 + 2 + 2) * head_dim, generator=gen()).to(dtype)
    q = qkv[:, : 4 * head_dim].view(t, 4, head_dim)
    k = qkv[:, 4 * head_dim : 6 * head_dim].view(t, 2, head_dim)
    positions = torch.tensor([0, 1, 2, 100, 200, 300, 400, 500, 511])
    ref_q, ref_k = rope(positions, q.clone().float(), k.clone().float())
    v_before = qkv[:, 6 * head_dim :].clone()
    kernels.rope_(q, k, positions, rope.cos, rope.sin)
    torch.testing.assert_close(q.float(), ref_q, atol=ATOL[dtype], rtol=1e-2)
    torch.testing.assert_close(k.float(), ref_k, atol=ATOL[dtype], rtol=1e-2)
    assert torch.equal(qkv[:, 6 * head_dim :], v_before)  # V untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(kernels, dtype):
    gate_up = (4 * torch.randn(5, 2 * 1536 + 2 * 8, generator=gen())).to(dtype)
    ref = SiluAndMul()(gate_up.float())
    torch.testing.assert_close(
        kernels.silu_mul(gate_up).float(), ref, atol=ATOL[dtype] * 4, rtol=2e-2
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_scatters_rows_into_slots(kernels, dtype):
    pages = torch.zeros(2, 6, 4, 3, 8, dtype=dtype)  # K/V, blocks, block, heads, dim
    qkv = torch.randn(5, 3 * 8 * 3, generator=gen()).to(dtype)
    k = qkv[:, 24:48].view(5, 3, 8)
    v = qkv[:, 48:].view(5, 3, 8)
    slots = torch.tensor([3, 22, 7, 0, 15])
    kernels.kv_write(k, v, pages[0], pages[1], slots)
    flat_k, flat_v = pages[0].view(-1, 3, 8), pages[1].view(-1, 3, 8)
    assert torch.equal(flat_k[slots], k)
    assert torch.equal(flat_v[slots], v)
    others = torch.ones(24, dtype=torch.bool)
    others[slots] = False
    assert not flat_k[others].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (32, 8, 128, 16), (4, 4, 64, 8), (12, 1, 48, 32), (6, 2, 64, 4)],
)
def test_paged_decode_matches_torch(kernels, dtype, heads, kv_heads, head_dim, block_size):
    spec = KVCacheSpec(1, kv_heads, head_dim, block_size, dtype)
    pool = DeviceKVPool(spec, 96, torch.device("cpu"))
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen()))
    perm = torch.randperm(96, generator=gen(1)).tolist()
    lengths = [1, 2, 15, 16, 17, 33, 100, 150]
    seqs, start = [], 0
    for n in lengths:
        blocks = -(-n // block_size)
        seqs.append(SeqSlice(1, n - 1, perm[start : start + blocks]))
        start += blocks
    reference = PagedAttention(pool, heads)  # torch path
    ctx = reference.build_context(seqs)
    assert ctx.decode is not None
    q = torch.randn(len(seqs), heads + 2 * kv_heads, head_dim, generator=gen(2)).to(dtype)
    q = q[:, :heads]  # strided rows, as when q is a view into the qkv projection
    k_pages, v_pages = pool.layer(0)
    expected = reference._attend(q.unsqueeze(1), 0, ctx.decode)
    got = kernels.paged_decode(
        q, k_pages, v_pages, ctx.decode.block_table, ctx.decode.seq_lens, head_dim**-0.5
    )
    torch.testing.assert_close(got.float(), expected.float(), atol=ATOL[dtype], rtol=2e-2)


@pytest.mark.parametrize("page_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_paged_decode_rows_do_not_depend_on_the_batch(kernels, page_dtype):
    """A large batch is split into runs of sequences per thread (each warming the next one's
    pages); every sequence's output is bit-identical to attending it alone."""
    spec = KVCacheSpec(1, 3, 64, 16, page_dtype)
    pool = DeviceKVPool(spec, 400, torch.device("cpu"))
    if page_dtype == torch.bfloat16:
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen()))
    else:
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen()).to(page_dtype))
        pool.scales.copy_(torch.rand(pool.scales.shape, generator=gen(3)) + 0.5)
    lengths = torch.randint(1, 120, (40,), generator=gen(1)).tolist()
    perm = torch.randperm(400, generator=gen(2)).tolist()
    seqs, start = [], 0
    for n in lengths:
        blocks = -(-n // 16)
        seqs.append(SeqSlice(1, n - 1, perm[start : start + blocks]))
        start += blocks
    ctx = PagedAttention(pool, 9).build_context(seqs)
    assert ctx.decode is not None
    q = torch.randn(len(seqs), 9, 64, generator=gen(4)).bfloat16()
    k_pages, v_pages = pool.layer(0)
    extra = {}
    if page_dtype != torch.bfloat16:
        k_scales, v_scales = pool.layer_scales(0)  # type: ignore[misc]
        extra = {"k_scales": k_scales, "v_scales": v_scales}
    table, lens = ctx.decode.block_table, ctx.decode.seq_lens
    batched = kernels.paged_decode(q, k_pages, v_pages, table, lens, 0.125, **extra)
    for i in range(len(seqs)):
        alone = kernels.paged_decode(
            q[i : i + 1], k_pages, v_pages, table[i : i + 1], lens[i : i + 1], 0.125, **extra
        )
        assert torch.equal(batched[i : i + 1], alone), f"sequence {i} depends on its batch"


def test_paged_decode_reads_every_fp8_value_exactly(kernels):
    """One cached token: each query head's output is its V row times the row's scale, so
    the kernel's reading of every e4m3fn byte (subnormals, signed zeros, the largest values)
    must equal torch's exactly. The two NaN encodings are never stored."""
    values = torch.arange(256, dtype=torch.uint8)
    values[[0x7F, 0xFF]] = 0
    pages = torch.zeros(2, 1, 16, 2, 128, dtype=torch.uint8)  # K and V, 1 block, 2 KV heads
    pages[1, 0, 0] = values.view(2, 128)
    pages = pages.view(torch.float8_e4m3fn)
    scales = torch.ones(2, 1, 16, 2)
    q = torch.randn(1, 2, 128, generator=gen())
    out = kernels.paged_decode(
        q,
        pages[0],
        pages[1],
        torch.zeros(1, 1, dtype=torch.int64),
        torch.ones(1, dtype=torch.int32),
        0.1,
        k_scales=scales[0],
        v_scales=scales[1],
    )
    want = values.view(torch.float8_e4m3fn).float()
    assert torch.equal(out.view(-1), want)  # -0.0 comes out +0.0: a sum that starts at 0


def reference_attention(q, k_pages, v_pages, table, lens, scale):
    """Each row's attention in fp64 over its first `lens[i]` keys: [B, H * D]."""
    _, block, kv_heads, head_dim = k_pages.shape
    heads = q.shape[1]
    out = []
    for i in range(q.shape[0]):
        length = int(lens[i])
        slots = (table[i, :, None] * block + torch.arange(block)).flatten()[:length]
        k = k_pages.reshape(-1, kv_heads, head_dim)[slots].double()
        v = v_pages.reshape(-1, kv_heads, head_dim)[slots].double()
        qi = q[i].double().view(kv_heads, heads // kv_heads, head_dim)
        probs = (torch.einsum("hgd,lhd->hgl", qi, k) * scale).softmax(-1)
        out.append(torch.einsum("hgl,lhd->hgd", probs, v).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [
        (9, 3, 64, 16),
        (8, 2, 128, 16),
        (4, 4, 64, 8),
        (12, 2, 64, 32),
        (6, 2, 64, 4),
        (6, 3, 48, 16),
    ],
)
def test_prefill_rows_match_fp64_and_each_row_alone(kernels, heads, kv_heads, head_dim, block_size):
    """A prefill step's rows (a row per token; one prompt's rows share their blocks, and the
    kernel takes them in tiles) next to decode rows: every row is close to fp64 attention and
    bit-identical to attending it alone, whatever its tile."""
    spec = KVCacheSpec(1, kv_heads, head_dim, block_size, torch.bfloat16)
    pool = DeviceKVPool(spec, 256, torch.device("cpu"))
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen()))
    perm = torch.randperm(256, generator=gen(1)).tolist()
    # decodes, a whole prompt of odd length, a chunk after 21 cached tokens, a 1-token prompt
    shapes = [(1, 40), (1, 7), (1, 130), (333, 0), (50, 21), (1, 0)]
    seqs, start = [], 0
    for query_len, context_len in shapes:
        blocks = -(-(query_len + context_len) // block_size)
        seqs.append(SeqSlice(query_len, context_len, perm[start : start + blocks]))
        start += blocks
    rows = PagedAttention(pool, heads, kernels=kernels).build_context(seqs).rows
    assert rows is not None
    table, lens = rows.block_table, rows.seq_lens
    q = torch.randn(len(lens), heads, head_dim, generator=gen(2)).bfloat16()
    k_pages, v_pages = pool.layer(0)
    scale = head_dim**-0.5
    got = kernels.paged_decode(q, k_pages, v_pages, table, lens, scale)
    expected = reference_attention(q, k_pages, v_pages, table, lens, scale)
    torch.testing.assert_close(got.double(), expected, atol=8e-3, rtol=2e-2)
    for i in range(len(lens)):
        alone = kernels.paged_decode(
            q[i : i + 1], k_pages, v_pages, table[i : i + 1], lens[i : i + 1], scale
        )
        assert torch.equal(got[i : i + 1], alone), f"row {i} depends on its batch"


def has_packed_linear(kernels: CpuKernels, dtype: torch.dtype) -> bool:
    return kernels.has_bf16_linear if dtype == torch.bfloat16 else kernels.has_f32_linear


def packed_bf16_linear(
    kernels: CpuKernels, g: torch.Generator, n_out: int, k_in: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A bf16 weight [n_out, k_in], packed, and a bias; None (after checking the build
    refuses to pack it) where the build has no packed bf16 linear."""
    weight = (torch.randn(n_out, k_in, generator=g) / 8).bfloat16()
    if not has_packed_linear(kernels, torch.bfloat16):
        assert not kernels.can_pack(weight)
        return None
    return weight, kernels.pack(weight), torch.randn(n_out, generator=g).bfloat16()


@pytest.mark.parametrize("m", [1, 5, 6, 7, 64])
@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32,) * 2],
)
def test_packed_linear_matches_fp32_matmul(kernels, m, dtype, out_dtype):
    weight = torch.randn(192, 96, generator=gen()).to(dtype)
    bias = torch.randn(192, generator=gen(1)).to(dtype)
    x = torch.randn(m, 96, generator=gen(2)).to(dtype)
    if not has_packed_linear(kernels, dtype):
        assert not kernels.can_pack(weight)
        return
    assert kernels.can_pack(weight)
    assert not kernels.can_pack(weight[:100])  # N not a multiple of the 64-column panel
    packed = kernels.pack(weight)
    ref = F.linear(x.float(), weight.float(), bias.float())
    for b, r in ((bias, ref), (None, ref - bias.float())):
        got = kernels.linear_packed(x, packed, b, 192, out_dtype)
        assert got.dtype == out_dtype
        atol = 1e-3 if out_dtype == torch.float32 else 0.1
        torch.testing.assert_close(got.float(), r, atol=atol, rtol=1e-2)


def test_the_library_is_built_once_even_by_loaders_starting_together(tmp_path, monkeypatch):
    """Workers starting together on a fresh machine share one build (a file lock), and later
    loads compile nothing."""
    commands: list[list[str]] = []
    run = subprocess.run

    def recording(cmd, *args, **kwargs):
        commands.append(cmd)
        return run(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", recording)
    with ThreadPoolExecutor(2) as pool:
        loads = list(pool.map(lambda _: load_cpu_kernels(str(tmp_path), arch="portable"), "ab"))
    assert all(k is not None for k in loads)
    assert sum("-shared" in cmd for cmd in commands) == 1, "linked once"
    assert len(list(kernel_dir(str(tmp_path)).glob("strata-cpu-*.so"))) == 1

    def compile_again(*args, **kwargs):
        raise AssertionError(f"compiled again: {args}")

    monkeypatch.setattr(subprocess, "run", compile_again)
    assert load_cpu_kernels(str(tmp_path), arch="portable") is not None


def test_a_failing_compiler_leaves_the_engine_on_torch_ops(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(shutil, "which", lambda name: "/bin/false")
    assert load_cpu_kernels(str(tmp_path)) is None
    assert "native CPU kernels unavailable" in caplog.text
    # nothing half-built is left, only the build lock
    assert [p.name for p in kernel_dir(str(tmp_path)).iterdir()] == [".build.lock"]


@pytest.mark.parametrize("m", [1, 2, 3, 9])
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_over_a_long_k(kernels, m, dtype):
    """K = 1100: several chunks of x widened at a time on AVX2, and a tail of each."""
    weight = torch.randn(128, 1100, generator=gen()).to(dtype)
    x = torch.randn(m, 1100, generator=gen(2)).to(dtype)
    if not has_packed_linear(kernels, dtype):
        return
    got = kernels.linear_packed(x, kernels.pack(weight), None, 128, torch.float32)
    ref = F.linear(x.float(), weight.float())
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_rows_do_not_depend_on_batch_mates(kernels, dtype):
    weight = torch.randn(128, 64, generator=gen()).to(dtype)
    if not has_packed_linear(kernels, dtype):  # such CPUs keep torch's linear
        assert not kernels.can_pack(weight)
        return
    packed = kernels.pack(weight)
    x = torch.randn(13, 64, generator=gen(1)).to(dtype)
    whole = kernels.linear_packed(x, packed, None, 128, torch.float32)
    for i in range(13):
        alone = kernels.linear_packed(x[i : i + 1].contiguous(), packed, None, 128, torch.float32)
        assert torch.equal(alone[0], whole[i])


def test_argmax_matches_torch_including_ties(kernels):
    logits = torch.randn(6, 1000, generator=gen())
    logits[1, 17] = logits[1, 900] = 50.0  # tie: the first index wins
    logits[2] = -3.0  # all equal
    logits[3, 999] = 99.0  # max in the scalar tail
    assert torch.equal(kernels.argmax(logits), logits.argmax(-1))
    small = torch.randn(3, 7, generator=gen(1))
    assert torch.equal(kernels.argmax(small), small.argmax(-1))


def fp8_inputs(tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows that exercise every rounding case: ordinary values, an all-zero row, a row whose
    values fall in e4m3's subnormal range after scaling, and exact ties."""
    x = torch.randn(tokens, kv_heads, head_dim, generator=gen(5)) * 3
    x[0, 0] = 0.0
    x[1, 0] = 1e-4
    x[1, 0, 0] = 448.0  # the rest of the row scales below 2^-6
    x[2, 0] = torch.arange(head_dim) * 0.0625 - 2  # halfway points between e4m3 values
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_kv_write_stores_the_bytes_torch_stores(kernels, dtype):
    spec = KVCacheSpec(1, 3, 64, 16, torch.float8_e4m3fn)
    native, reference = (DeviceKVPool(spec, 4, torch.device("cpu")) for _ in range(2))
    k = fp8_inputs(10, 3, 64, dtype)
    v = -fp8_inputs(10, 3, 64, dtype).flip(0)
    slots = torch.tensor([3, 0, 63, 17, 5, 40, 41, 9, 22, 30])
    k_pages, v_pages = native.layer(0)
    k_scales, v_scales = native.layer_scales(0)  # type: ignore[misc]
    kernels.kv_write(
        k, v, k_pages, v_pages, slots, k_scales=k_scales, v_scales=v_scales, rotate_keys=True
    )
    attn = PagedAttention(reference, 6)  # torch path
    assert attn.rotate_keys
    ref_scales = reference.layer_scales(0)
    assert ref_scales is not None
    attn._write(k, reference.layer(0)[0], ref_scales[0], slots, rotate=True)
    attn._write(v, reference.layer(0)[1], ref_scales[1], slots)
    assert torch.equal(native.kv.view(torch.uint8), reference.kv.view(torch.uint8))
    assert torch.equal(native.scales, reference.scales)
    assert native.scales.view(-1, 3)[3, 0] == 1.0  # the all-zero row
    plain_values, _ = quantize_fp8(k)  # keys were rotated: not the plain quantization
    stored = native.kv[0, 0].view(-1, 3, 64)[slots]
    assert not torch.equal(stored.view(torch.uint8), plain_values.view(torch.uint8))
    assert torch.equal(native.kv[0, 1].view(-1, 3, 64)[slots].float(), quantize_fp8(v)[0].float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (32, 8, 128, 16), (12, 1, 48, 32), (6, 2, 64, 4)],
)
def test_fp8_paged_decode_matches_torch(kernels, dtype, heads, kv_heads, head_dim, block_size):
    spec = KVCacheSpec(1, kv_heads, head_dim, block_size, torch.float8_e4m3fn)
    pool = DeviceKVPool(spec, 96, torch.device("cpu"))
    attn = PagedAttention(pool, heads)  # torch path: quantizes on write, dequantizes on read
    slots = torch.arange(96 * block_size)
    for which in range(2):
        rows = torch.randn(len(slots), kv_heads, head_dim, generator=gen(which)) * 2
        scales = pool.layer_scales(0)
        assert scales is not None
        rotate = which == 0 and attn.rotate_keys  # keys only, power-of-two widths only
        attn._write(rows.to(dtype), pool.layer(0)[which], scales[which], slots, rotate=rotate)
    perm = torch.randperm(96, generator=gen(1)).tolist()
    seqs, start = [], 0
    for n in [1, 2, 15, 16, 17, 33, 100, 150]:
        blocks = -(-n // block_size)
        seqs.append(SeqSlice(1, n - 1, perm[start : start + blocks]))
        start += blocks
    ctx = attn.build_context(seqs)
    assert ctx.decode is not None
    q = torch.randn(len(seqs), heads + 2 * kv_heads, head_dim, generator=gen(2)).to(dtype)
    q = q[:, :heads]
    expected = attn._attend(q.unsqueeze(1), 0, ctx.decode)
    k_pages, v_pages = pool.layer(0)
    k_scales, v_scales = pool.layer_scales(0)  # type: ignore[misc]
    assert attn.rotate_keys == (head_dim != 48)
    got = kernels.paged_decode(
        q,
        k_pages,
        v_pages,
        ctx.decode.block_table,
        ctx.decode.seq_lens,
        head_dim**-0.5,
        k_scales=k_scales,
        v_scales=v_scales,
        rotated_keys=attn.rotate_keys,
    )
    torch.testing.assert_close(got.float(), expected.float(), atol=ATOL[dtype], rtol=2e-2)


def test_lora_update_matches_the_torch_path(kernels):
    """csrc/lora.h against LoRALinear's BGMV arithmetic: the same rounding points (h and the
    update rounded to bf16), so results agree to accumulation order."""
    g = gen(11)
    slots_n, rows, k_in, n_out, t = 5, 48, 200, 136, 9  # odd widths: the scalar tails run too
    ends = (40, 88, 136)  # three modules, like qkv: 16 rows each, B block-diagonal
    a = (torch.randn(slots_n, rows, k_in, generator=g) / 8).bfloat16()
    b = torch.zeros(slots_n, n_out, rows, dtype=torch.bfloat16)
    for p, (start, end) in enumerate(zip((0, *ends[:-1]), ends, strict=True)):
        block = torch.randn(slots_n, end - start, 16, generator=g) / 8
        b[:, start:end, 16 * p : 16 * (p + 1)] = block.bfloat16()
    a[0], b[0] = 0, 0
    x = torch.randn(t, k_in, generator=g).bfloat16()
    y = torch.randn(t, n_out, generator=g).bfloat16()
    slots = torch.tensor([0, 1, 4, 4, 0, 2, 3, 1, 0], dtype=torch.int32)
    h = torch.bmm(a[slots.long()], x.unsqueeze(-1))
    want = y + torch.bmm(b[slots.long()], h).squeeze(-1)
    got = y.clone()
    kernels.lora(x, a, pair_rows(b.transpose(1, 2)), slots, got, ends)
    assert torch.equal(got[slots == 0], y[slots == 0]), "base tokens are untouched"
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(got, y)


@pytest.mark.parametrize("rank", [7, 16])
def test_lora_expand_sums_rows_in_order_bit_for_bit(kernels, rank):
    """The expand adds h[r] B[r] for r ascending in fp32, whichever instructions do it (a pair
    of rows per bf16 dot product, two FMAs per pair, scalar tails): against that sum computed
    row by row in torch, with h made exact (each row of A picks one element of x). An odd rank
    sits in an even number of rows, the last one zero, as the engine's slots hold it."""
    g = gen(12)
    slots_n, k_in, t = 4, 96, 12
    ends = (128, 208, 232)  # 64-column blocks, a 16-column tail, a scalar tail
    per = rank + rank % 2  # rows per module
    rows, n_out = 3 * per, ends[-1]
    used = torch.tensor([r % per < rank for r in range(rows)])
    a = torch.zeros(slots_n, rows, k_in, dtype=torch.bfloat16)
    picks = torch.randint(0, k_in, (slots_n, rows), generator=g)
    a.scatter_(2, picks.unsqueeze(-1), 1.0)
    bt = (torch.randn(slots_n, rows, n_out, generator=g) / 4).bfloat16()
    a[:, ~used], bt[:, ~used] = 0, 0
    x = torch.randn(t, k_in, generator=g).bfloat16()
    y = torch.randn(t, n_out, generator=g).bfloat16()
    # tokens sharing an adapter run together, up to four: groups of 4 + 1, 3, 2 and 1
    slots = torch.tensor([1, 3, 0, 2, 1, 3, 1, 1, 1, 2, 0, 3], dtype=torch.int32)
    want = y.clone()
    for i, s in enumerate(slots.tolist()):
        if s == 0:
            continue
        h = x[i].float()[picks[s]]  # exact: one product per dot
        for p, (start, end) in enumerate(zip((0, *ends[:-1]), ends, strict=True)):
            acc = torch.zeros(end - start)
            for r in range(p * per, p * per + rank):
                acc = acc + h[r] * bt[s, r, start:end].float()  # exact products, fp32 sums
            want[i, start:end] = (y[i, start:end].float() + acc.bfloat16().float()).bfloat16()
    got = y.clone()
    kernels.lora(x, a, pair_rows(bt), slots, got, ends)
    assert torch.equal(got, want)


def test_lora_update_of_a_token_does_not_depend_on_its_batch(kernels):
    """Tokens that share an adapter are updated together (shared loads of A and B): each
    token's result equals its update alone, bit for bit, whatever its batch mates."""
    g = gen(13)
    slots_n, rows, k_in, n_out = 4, 32, 200, 320  # two modules of 16 rows, like gate/up
    ends = (160, 320)
    a = (torch.randn(slots_n, rows, k_in, generator=g) / 8).bfloat16()
    bt = pair_rows((torch.randn(slots_n, rows, n_out, generator=g) / 8).bfloat16())
    slots = torch.tensor([1, 2, 1, 1, 0, 3, 1, 2, 1, 1, 3], dtype=torch.int32)
    x = torch.randn(len(slots), k_in, generator=g).bfloat16()
    y = torch.randn(len(slots), n_out, generator=g).bfloat16()
    batch = y.clone()
    kernels.lora(x, a, bt, slots, batch, ends)
    for i in range(len(slots)):
        alone = y[i : i + 1].clone()
        kernels.lora(x[i : i + 1], a, bt, slots[i : i + 1], alone, ends)
        assert torch.equal(batch[i], alone[0]), i
    assert not torch.equal(batch, y)


@pytest.mark.parametrize("tokens", [4, 32, 100, 200])
@pytest.mark.parametrize("adapters", ["mixed", "distinct", "shared", "none"])
@pytest.mark.parametrize("weights", ["packed", "q4", "q8"])
def test_a_projection_with_its_update_equals_the_linear_then_the_update(
    kernels, tokens, adapters, weights
):
    """The decoder layer's projection kernel (csrc/layer.h): in a decode batch (up to 128
    tokens) each thread updates its groups of tokens in phases between its items of the
    product, into a scratch delta added once the product is complete (packed bf16 weights
    from 4 row blocks on; q4 weights on the many-rows 8-bit path); otherwise the update
    follows the product. Either way: the bits of the linear, then the update alone."""
    g = gen(14)
    slots_n, k_in, ends = 41, 192, (192, 256, 320)  # like qkv: three modules of 16 rows
    rows, n_out = 48, ends[-1]
    if weights == "packed":
        if (made := packed_bf16_linear(kernels, g, n_out, k_in)) is None:
            return
        _, weight, bias = made
    else:
        fmt = QuantFormat.Q4 if weights == "q4" else QuantFormat.Q8
        weight = quantize((torch.randn(n_out, k_in, generator=g) / 8).bfloat16(), fmt)
        bias = torch.randn(n_out, generator=g).bfloat16()
    a = (torch.randn(slots_n, rows, k_in, generator=g) / 8).bfloat16()
    bt = pair_rows((torch.randn(slots_n, rows, n_out, generator=g) / 8).bfloat16())
    a[0], bt[0] = 0, 0
    slots = {
        "mixed": torch.randint(0, 12, (tokens,), generator=g),  # repeats and base tokens
        "distinct": torch.arange(tokens) % (slots_n - 1) + 1,
        "shared": torch.full((tokens,), 7),
        "none": torch.zeros(tokens, dtype=torch.int64),
    }[adapters].int()
    x = torch.randn(tokens, k_in, generator=g).bfloat16()
    if isinstance(weight, QuantWeight):
        want = kernels.quant.linear(x, weight, bias, torch.bfloat16)
    else:
        want = kernels.linear_packed(x, weight, bias, n_out, torch.bfloat16)
    base = want.clone()
    kernels.lora(x, a, bt, slots, want, ends)
    got = kernels.linear_lora(x, weight, bias, a, bt, slots, ends)
    assert torch.equal(got, want)
    assert torch.equal(got[slots == 0], base[slots == 0])
    assert torch.equal(got, base) == (adapters == "none")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_a_row_of_the_packed_linear_does_not_depend_on_its_batch(kernels, out_dtype):
    """Every batch size takes the same sums in the same order, whichever path its rows take
    (csrc/linear.h: on AVX2 a batch of 4 rows or more runs on panels widened to fp32 once):
    a row's output is the same bits alone and in batches of 3, 5, 24, 37 and 200."""
    g = gen(21)
    n_out, k_in = 192, 320
    if (made := packed_bf16_linear(kernels, g, n_out, k_in)) is None:
        return
    weight, packed, bias = made
    x = torch.randn(200, k_in, generator=g).bfloat16()
    alone = torch.cat([kernels.linear_packed(r[None], packed, bias, n_out, out_dtype) for r in x])
    for rows in (3, 5, 24, 37, 200):
        got = kernels.linear_packed(x[:rows], packed, bias, n_out, out_dtype)
        assert torch.equal(got, alone[:rows]), rows
    torch.testing.assert_close(
        alone.float(), x.float() @ weight.float().T + bias.float(), atol=0.05, rtol=0.02
    )
