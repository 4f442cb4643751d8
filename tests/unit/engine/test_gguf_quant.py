"""GGUF blocks kept quantized (engine/loader/gguf_quant.py): every kept type decodes into
the kernels' formats bit for bit against gguf-py's own numpy dequantization, on random
blocks and on the default model file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.kernels.cpu_quant import QuantFormat
from engine.loader.gguf_loader import read_gguf
from engine.loader.gguf_quant import KEPT, decode_blocks, read_kept_weights
from engine.model_specs import resolve_model_path

Q = GGMLQuantizationType
BLOCK_BYTES = {Q.Q8_0: (32, 34), Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q4_K: (256, 144)}


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int) -> np.ndarray:
    """Random bytes for an [n, k] tensor of `qtype` with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    per, size = BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(n * k // per, size), dtype=np.uint8)
    scale_bytes = 4 if qtype in (Q.Q4_1, Q.Q4_K) else 2
    halves = (rng.standard_normal((raw.shape[0], scale_bytes // 2)) * 0.01).astype(np.float16)
    raw[:, :scale_bytes] = halves.view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", list(KEPT))
def test_random_blocks_decode_bit_for_bit(qtype):
    n, k = 6, 512
    raw = random_blocks(qtype, n, k, seed=int(qtype))
    weight = decode_blocks(raw, qtype, n, k)
    assert weight.format is KEPT[qtype]
    ref = torch.from_numpy(dequantize(raw, qtype).reshape(n, k).astype(np.float32))
    assert torch.equal(weight.dequantize(), ref)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_floats_decode_bit_for_bit(qtype):
    floats = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    raw = quantize(floats, qtype)
    weight = decode_blocks(raw, qtype, 4, 256)
    assert torch.equal(weight.dequantize(), torch.from_numpy(dequantize(raw, qtype)))


def test_q4_0_and_q4_k_values_stay_in_4_bits():
    for qtype in (Q.Q4_0, Q.Q4_K):
        values, _, mins = decode_blocks(random_blocks(qtype, 2, 256, 3), qtype, 2, 256).unpacked()
        assert values.dtype == torch.uint8 and int(values.max()) <= 15 and mins is not None


def test_default_model_tensors_match_the_float_loader(strata_cache_dir):
    path = resolve_model_path("default")
    config, tensors = read_gguf(path, progress=False)
    names = {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    }
    types, kept = read_kept_weights(path, config, names)
    assert set(kept) == names
    assert types["model.embed_tokens.weight"] == Q.Q8_0
    assert kept["model.embed_tokens.weight"].format is QuantFormat.Q8
    assert kept["model.layers.0.self_attn.q_proj.weight"].format is QuantFormat.Q4
    for name in names:  # the float loader dequantizes (and un-permutes) the same values
        assert torch.equal(kept[name].dequantize(), tensors[name].float()), name
