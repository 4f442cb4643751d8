"""The compiled Triton kernels at Llama-3-8B attention shapes against the torch backend on
the same GPU, and the engine's captured decode graphs (with and without adapters) against
eager decode.

Tolerances: 32-bit outputs to 1e-4; bf16 outputs (values of order 1, 8 mantissa bits) to
3e-2 absolute; FP8 pages must hold the very bytes and scales the torch path writes.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.paged import PagedAttention, SeqSlice
from engine.attention.triton_backend import TritonPagedAttention, load_triton_kernels
from engine.config import (
    CacheConfig,
    EngineConfig,
    GemvKernel,
    KernelBackend,
    KVCacheDtype,
    LoRAConfig,
)
from engine.cuda_graphs import batch_ladder
from engine.evaluate import greedy_agreement
from engine.llm import LLM
from engine.lora.batch import LoRABatch
from engine.lora.layers import LoRALinear
from engine.lora.synthetic import write_random_adapter
from engine.model.llama import LlamaForCausalLM, RMSNorm, RotaryEmbedding, SiluAndMul
from engine.model.triton_layers import (
    PROJECTIONS,
    TritonLinear,
    TritonRMSNorm,
    TritonRotary,
    TritonSiluMul,
    apply_triton_layers,
)
from engine.model_config import ModelConfig
from engine.protocol import LoRARequest, SamplingParams
from kvstore.base import KVCacheSpec
from kvstore.device_pool import DeviceKVPool

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
H, HKV, D, BS = 32, 8, 128, 16
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _pools(page_dtype, num_blocks=2048):
    spec = KVCacheSpec(1, HKV, D, BS, page_dtype)
    return DeviceKVPool(spec, num_blocks, CUDA), DeviceKVPool(spec, num_blocks, CUDA)


@pytest.mark.parametrize(
    ("dtype", "page_dtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float8_e4m3fn),
        (torch.float32, torch.float32),
    ],
)
def test_attention_and_write_match_the_torch_backend(dtype, page_dtype):
    gen = torch.Generator().manual_seed(0)
    pools = _pools(page_dtype)
    blocks = iter(torch.randperm(2048, generator=gen).tolist())
    # long decodes (split-K), a short one, and a 512-token chunk after a 1,000-token prefix
    shapes = [(4095, 1), (2047, 1), (17, 1), (1000, 512), (0, 300)]
    seqs = [SeqSlice(q, c, [next(blocks) for _ in range(-(-(c + q) // BS))]) for c, q in shapes]
    ref = PagedAttention(pools[0], H)
    tri = TritonPagedAttention(pools[1], H)
    cached = [SeqSlice(s.context_len, 0, s.block_table) for s in seqs if s.context_len]
    n = sum(s.query_len for s in cached)
    k, v = (torch.randn(n, HKV, D, generator=gen).to(CUDA, dtype) for _ in range(2))
    ref.forward(0, torch.zeros(n, H, D, device=CUDA, dtype=dtype), k, v, ref.build_context(cached))
    tri.forward(0, torch.zeros(n, H, D, device=CUDA, dtype=dtype), k, v, tri.build_context(cached))
    assert torch.equal(pools[0].kv.view(torch.uint8), pools[1].kv.view(torch.uint8))
    if pools[0].scales is not None:
        assert torch.equal(pools[0].scales, pools[1].scales)
    t = sum(q for _, q in shapes)
    q = torch.randn(t, H, D, generator=gen).to(CUDA, dtype)
    k, v = (torch.randn(t, HKV, D, generator=gen).to(CUDA, dtype) for _ in range(2))
    want = ref.forward(0, q, k, v, ref.build_context(seqs))
    ctx = tri.build_context(seqs)
    assert ctx.num_splits > 1, "long contexts at a small batch are split"
    got = tri.forward(0, q, k, v, ctx)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("tokens", [1, 64, 600])  # one decode, a batch, a prefill chunk
def test_fused_layers_match_the_torch_modules(tokens):
    ops = load_triton_kernels(CUDA, "triton_fused")
    gen = torch.Generator().manual_seed(1)
    bf16 = torch.bfloat16
    norm = RMSNorm(4096, 1e-5).to(CUDA, bf16)
    x, res = (torch.randn(tokens, 4096, generator=gen).to(CUDA, bf16) for _ in range(2))
    want, want_res = norm(x, res)
    got, got_res = TritonRMSNorm(norm, ops)(x, res)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    gate_up = torch.randn(tokens, 2 * 14336, generator=gen).to(CUDA, bf16)
    torch.testing.assert_close(
        TritonSiluMul(ops)(gate_up), SiluAndMul()(gate_up), atol=3e-2, rtol=3e-2
    )
    # q and k as the model passes them: views into the fused QKV output, rotated in one launch
    cfg = ModelConfig(
        vocab_size=16,
        hidden_size=H * D,
        intermediate_size=8,
        num_layers=1,
        num_heads=H,
        num_kv_heads=HKV,
        head_dim=D,
        max_position_embeddings=8192,
    )
    rope = RotaryEmbedding(cfg).to(CUDA)
    qkv = torch.randn(tokens, (H + 2 * HKV) * D, generator=gen).to(CUDA, bf16)
    q, k = qkv[:, : H * D].view(tokens, H, D), qkv[:, H * D : (H + HKV) * D].view(tokens, HKV, D)
    positions = torch.randint(0, 8192, (tokens,), generator=gen).to(CUDA)
    for got, want in zip(
        TritonRotary(rope, ops)(positions, q, k), rope(positions, q, k), strict=True
    ):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_fp8_write_of_a_decode_step_stores_the_torch_paths_bytes(tokens):
    """The write's tile and warps follow the step's size: each stores the same bytes."""
    pools = _pools(torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(6)
    blocks = iter(torch.randperm(2048, generator=gen).tolist())
    contexts = torch.randint(0, 200, (tokens,), generator=gen).tolist()
    seqs = [SeqSlice(1, c, [next(blocks) for _ in range(-(-(c + 1) // BS))]) for c in contexts]
    q = torch.zeros(tokens, H, D, device=CUDA, dtype=torch.bfloat16)
    k, v = (torch.randn(tokens, HKV, D, generator=gen).to(CUDA, torch.bfloat16) for _ in range(2))
    for attn in (PagedAttention(pools[0], H), TritonPagedAttention(pools[1], H)):
        attn.forward(0, q, k, v, attn.build_context(seqs))
    assert torch.equal(pools[0].kv.view(torch.uint8), pools[1].kv.view(torch.uint8))
    assert torch.equal(pools[0].scales, pools[1].scales)


def test_gemv_matches_cublas_at_real_shapes():
    """Llama-3-8B's projections and LM head, one token, bf16: within bf16 rounding of the
    cuBLAS product (both sum in fp32)."""
    ops = load_triton_kernels(CUDA, "triton_gemv")
    gen = torch.Generator().manual_seed(2)
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(CUDA, torch.bfloat16)
        x = torch.randn(1, k, generator=gen).to(CUDA, torch.bfloat16)
        torch.testing.assert_close(ops.gemv(x, w), x @ w.T, atol=2e-2, rtol=2e-2)


def test_the_gemv_engine_follows_the_cublas_engine_at_batch_one(strata_cache_dir):
    """fp32 weights and fp32 pages: FP8 pages could round the two engines' tiny differences
    in K and V apart (the products are checked at bf16 above)."""
    prompt = "The capital of France is"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = {}
    for gemv in (GemvKernel.CUBLAS, GemvKernel.TRITON):
        cfg = EngineConfig(
            dtype="float32",
            device="cuda",
            cache_dir=str(strata_cache_dir),
            backend=KernelBackend.TRITON,
            gemv=gemv,
            cache=CacheConfig(kv_cache_dtype=KVCacheDtype.AUTO),
        )
        llm = LLM(cfg)
        runs[gemv] = llm.generate([prompt], params)[0].token_ids
    assert runs[GemvKernel.TRITON] == runs[GemvKernel.CUBLAS]


def test_auto_gemv_times_each_shape_and_keeps_cublas_unless_triton_wins():
    """A synthetic Llama-3-8B layer stack (4 layers): each projection and the LM head gets
    the kernel that ran faster, and the swapped modules answer like cuBLAS."""
    cfg = ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=4,
        num_heads=H,
        num_kv_heads=HKV,
        head_dim=D,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    with torch.device(CUDA):
        model = LlamaForCausalLM(cfg).to(CUDA, torch.bfloat16)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    x = torch.randn(1, 4096, device=CUDA, dtype=torch.bfloat16)
    want = model.layers[0].qkv_proj(x)
    choice = apply_triton_layers(model, gemv=GemvKernel.AUTO)
    assert set(choice) == {*PROJECTIONS, "lm_head"} and set(choice.values()) <= {"cublas", "triton"}
    for name in PROJECTIONS:
        swapped = isinstance(getattr(model.layers[3], name), TritonLinear)
        assert swapped == (choice[name] == "triton")
    assert isinstance(model.lm_head, TritonLinear) == (choice["lm_head"] == "triton")
    torch.testing.assert_close(model.layers[0].qkv_proj(x), want, atol=2e-2, rtol=2e-2)


def test_graph_replay_follows_eager_decode(strata_cache_dir):
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4, 5,"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    runs = {}
    for eager in (False, True):
        cfg = EngineConfig(
            dtype="bfloat16",
            device="cuda",
            cache_dir=str(strata_cache_dir),
            backend=KernelBackend.TRITON,
            enforce_eager=eager,
        )
        llm = LLM(cfg)
        graphs = llm.core.runner.graphs
        if eager:
            assert graphs is None
        else:
            assert graphs is not None
            assert sorted(graphs.graphs) == batch_ladder(graphs.max_batch)
        runs[eager] = [c.token_ids for c in llm.generate(prompts, params)]
    # padded batches run their matmuls at other sizes: equal up to bf16 rounding
    assert greedy_agreement(runs[True], runs[False]).token_rate > 0.9


def test_lora_graph_replay_follows_eager_decode(strata_cache_dir, tmp_path):
    """Base and adapter requests in one batch (8 requests: the graph of size 8 runs without
    padding rows); the LoRA kernels are captured in the decode graphs."""
    prompts = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "1, 2, 3, 4, 5,",
        "Once upon a time",
    ] * 2
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    runs = {}
    for eager in (False, True):
        cfg = EngineConfig(
            dtype="bfloat16",
            device="cuda",
            cache_dir=str(strata_cache_dir),
            backend=KernelBackend.TRITON,
            enforce_eager=eager,
            lora=LoRAConfig(max_loras=4, max_lora_rank=16),
        )
        llm = LLM(cfg)
        graphs = llm.core.runner.graphs
        if eager:
            assert graphs is None
        else:
            assert graphs is not None and graphs.lora is not None
            assert sorted(graphs.graphs) == batch_ladder(graphs.max_batch)
        adapters = [
            LoRARequest(
                name=f"a{i}",
                path=str(
                    write_random_adapter(tmp_path / f"a{i}", llm.core.model_config, rank=16, seed=i)
                ),
            )
            for i in range(4)
        ]
        # the adapters loaded first: the batch is the same at every step of both runs
        llm.generate(prompts[:4], SamplingParams(max_tokens=1), lora=adapters)
        loras = [None] * 4 + adapters  # each prompt through the base model and an adapter
        runs[eager] = [c.token_ids for c in llm.generate(prompts, params, lora=loras)]
    assert runs[False][:4] != runs[False][4:], "the adapters change the tokens"
    # bf16: the graphs' kernels may round differently from eager launches
    assert greedy_agreement(runs[True], runs[False]).token_rate >= 0.95


def test_a_decode_step_is_queued_without_any_host_sync(strata_cache_dir):
    llm = LLM(EngineConfig(dtype="bfloat16", device="cuda", cache_dir=str(strata_cache_dir)))
    core = llm.core
    params = [SamplingParams(max_tokens=8), SamplingParams(temperature=0.8, top_p=0.9, top_k=20)]
    for i, p in enumerate(params):
        core.add_request(f"r{i}", llm.encode("The capital of France is"), p)
    core.step()  # the prefill
    step = core.scheduler.schedule()
    assert all(s.num_new_tokens == 1 for s in step.scheduled)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = core.runner.launch(step)  # graph replay, logits, sampling
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = launched.out
    assert out is not None and len(out.token_ids.tolist()) == len(launched.sampled) == 2


@pytest.mark.parametrize("num_tokens", [32, 600])
def test_lora_kernels_match_the_torch_path(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    slots, rows, fan_in, fan_out = 33, 48, 2048, 3072  # qkv of Llama-3.2-1B, rank 16
    a = (torch.randn(slots, rows, fan_in, generator=gen) / 16).to(CUDA, torch.bfloat16)
    b = (torch.randn(slots, fan_out, rows, generator=gen) / 16).to(CUDA, torch.bfloat16)
    a[0], b[0] = 0, 0
    base = torch.nn.Linear(fan_in, fan_out, bias=False).to(CUDA, torch.bfloat16)
    x = torch.randn(num_tokens, fan_in, generator=gen).to(CUDA, torch.bfloat16)
    token_slots = torch.randint(0, slots, (num_tokens,), generator=gen).tolist()
    outs = []
    for ops in (None, load_triton_kernels(CUDA, "triton_lora")):
        batch = LoRABatch(ops)
        batch.set(token_slots, CUDA)
        with torch.inference_mode():
            outs.append(LoRALinear(base, a, b, batch)(x).float())
    torch.testing.assert_close(outs[1], outs[0], atol=3e-2, rtol=3e-2)


def test_fp8_write_of_a_padded_head_dim_matches_the_torch_path():
    """head_dim 24 runs in 32 lanes: the masked lanes must not reach the row maximum."""
    spec = KVCacheSpec(1, 2, 24, BS, torch.float8_e4m3fn)
    pools = [DeviceKVPool(spec, 8, CUDA) for _ in range(2)]
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(40, 2, 24, generator=gen).to(CUDA, torch.bfloat16) for _ in range(2))
    seqs = [SeqSlice(40, 0, [3, 1, 6, 0, 2, 7, 4, 5][: -(-40 // BS)])]
    q = torch.randn(40, 4, 24, generator=gen).to(CUDA, torch.bfloat16)
    for attn in (PagedAttention(pools[0], 4), TritonPagedAttention(pools[1], 4)):
        attn.forward(0, q, k, v, attn.build_context(seqs))
    assert torch.equal(pools[0].kv.view(torch.uint8), pools[1].kv.view(torch.uint8))
    assert torch.equal(pools[0].scales, pools[1].scales)
