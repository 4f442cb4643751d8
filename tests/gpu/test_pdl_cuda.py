"""Programmatic dependent launch (engine/kernels/triton_pdl.py) on a Hopper GPU or newer:
kernels launched to start early give the bits of plain launches, one after another in a CUDA
graph too, and an FP8 engine launches its kernels so unless `--no-pdl` says otherwise."""

from __future__ import annotations

import pytest
import torch

from engine.attention.paged import SeqSlice
from engine.attention.triton_backend import load_triton_kernels, pdl_supported
from engine.llm import LLM
from engine.model.fp8_weights import Fp8Linear, quantize_weight
from engine.model.triton_layers import TritonRMSNorm, TritonRotary
from tests.gpu.engines import fp8_config

CUDA = torch.device("cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not pdl_supported(CUDA),
        reason="needs a GPU with programmatic dependent launch (compute capability 9.0+)",
    ),
]
HIDDEN, INTER = 4096, 14336  # Llama-3-8B's MLP


def _mlp_chain(x, residual, norm_w, gate_up, down, *, pdl: bool, layers: int = 4):
    """`layers` times: add + RMSNorm, the gate_up GEMV with its activation, the down GEMV;
    each kernel reads what the one before wrote."""
    fused = load_triton_kernels(CUDA, "triton_fused")
    fp8 = load_triton_kernels(CUDA, "triton_fp8_linear")
    for _ in range(layers):
        h, residual = fused.add_rms_norm(x, residual, norm_w, 1e-5, pdl=pdl)
        a = fp8.fp8_gemv(h, *gate_up, silu_mul=True, pdl=pdl)
        x = fp8.fp8_gemv(a, *down, pdl=pdl)
    return fused.add_rms_norm(x, residual, norm_w, 1e-5, pdl=pdl)


def test_kernels_started_early_keep_the_bits_of_plain_launches_in_a_graph():
    gen = torch.Generator(CUDA).manual_seed(0)

    def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randn(n, k, generator=gen, device=CUDA) / k**0.5
        return quantize_weight(w.to(torch.bfloat16))

    gate_up, down = weight(2 * INTER, HIDDEN), weight(HIDDEN, INTER)
    norm_w = (1 + 0.1 * torch.randn(HIDDEN, generator=gen, device=CUDA)).to(torch.bfloat16)
    x = torch.randn(1, HIDDEN, generator=gen, device=CUDA).to(torch.bfloat16)
    residual = torch.randn(1, HIDDEN, generator=gen, device=CUDA).to(torch.bfloat16)
    with torch.inference_mode():
        plain = _mlp_chain(x, residual, norm_w, gate_up, down, pdl=False)
        early = _mlp_chain(x, residual, norm_w, gate_up, down, pdl=True)
        _mlp_chain(x, residual, norm_w, gate_up, down, pdl=True)  # compiled before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _mlp_chain(x, residual, norm_w, gate_up, down, pdl=True)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    for got in (early, captured):
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
    assert plain[0].abs().max() > 0.1


def _launch_flags(llm: LLM) -> set[bool]:
    runner = llm.core.runner
    kinds = (Fp8Linear, TritonRMSNorm, TritonRotary)
    flags = {m.pdl for m in runner.model.modules() if isinstance(m, kinds)}
    return flags | {runner.attn.pdl}


def test_an_fp8_engine_starts_kernels_early_unless_told_not_to():
    """Its decode step of 3 sequences, run eagerly with every kernel launched to start early
    and with plain launches, gives the same bits; replayed from its graph, within bf16
    rounding (attention splits differ there)."""
    llm = LLM(fp8_config())
    assert _launch_flags(llm) == {True}
    runner = llm.core.runner
    contexts = [40, 300, 777]
    slices, first = [], 0
    for c in contexts:
        need = -(-c // llm.core.pool.spec.block_size)
        slices.append(SeqSlice(1, c - 1, list(range(first, first + need))))
        first += need
    args = ([5, 900, 4000], [c - 1 for c in contexts], slices, [0] * 3)
    graphs = runner.graphs
    with torch.inference_mode():
        replayed = runner.forward(*args).float().clone()
        runner.graphs = None
        try:
            early = runner.forward(*args).float().clone()
            for module in [*runner.model.modules(), runner.attn]:
                if hasattr(module, "pdl"):
                    module.pdl = False
            plain = runner.forward(*args).float()
        finally:
            runner.graphs = graphs
    assert torch.equal(early, plain)
    assert ((replayed - plain).norm() / plain.norm()).item() < 1e-2
    del llm, runner, graphs
    assert _launch_flags(LLM(fp8_config(pdl=False))) == {False}
