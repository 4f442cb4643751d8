"""GGUF weights kept quantized: Q8_0, Q4_0, Q4_1 and Q4_K blocks rewritten, value for
value, into the q8 / q4 formats of the native kernels (engine/kernels/cpu_quant.py).

Every block maps exactly: Q8_0 is q8 (w = d q); Q4_0 is q4 with m = 8 d (w = d (q - 8));
Q4_1 is q4 with m = -min (w = d q + min); each 32-wide sub-block of a Q4_K super-block is
q4 with d = d_super sc and m = dmin_super min_sc, products that fp32 holds exactly. Q/K rows
are un-permuted as the float loader does (gguf_loader.unpermute_qk).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import Q4_K

from engine.kernels.cpu_quant import BLOCK, QuantFormat, QuantWeight
from engine.loader.gguf_loader import hf_tensor_name, open_gguf, unpermute_qk
from engine.loader.gguf_meta import PERMUTED_QK, gguf_architecture
from engine.model_config import ModelConfig

# the GGUF block types that stay quantized, and the format each one becomes
KEPT: dict[GGMLQuantizationType, QuantFormat] = {
    GGMLQuantizationType.Q8_0: QuantFormat.Q8,
    GGMLQuantizationType.Q4_0: QuantFormat.Q4,
    GGMLQuantizationType.Q4_1: QuantFormat.Q4,
    GGMLQuantizationType.Q4_K: QuantFormat.Q4,
}
_FLOAT_TYPES = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
)


def is_quantized_type(qtype: GGMLQuantizationType) -> bool:
    """A block-quantized GGUF type (anything but F32/F16/BF16)."""
    return qtype not in _FLOAT_TYPES


def decode_blocks(raw: np.ndarray, qtype: GGMLQuantizationType, n: int, k: int) -> QuantWeight:
    """The bytes of an [n, k] tensor of a KEPT type -> the same values as a QuantWeight."""
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
    if qtype == GGMLQuantizationType.Q8_0:
        b = blocks.reshape(n, k // BLOCK, 34)
        d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = b[..., 2:].copy().view(np.int8).reshape(n, k)
        return QuantWeight.q8(torch.from_numpy(q), torch.from_numpy(d))
    if qtype == GGMLQuantizationType.Q4_K:
        return _decode_q4_k(blocks, n, k)
    size = 18 if qtype == GGMLQuantizationType.Q4_0 else 20
    assert qtype in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1), qtype
    b = blocks.reshape(n, k // BLOCK, size)
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == GGMLQuantizationType.Q4_0:
        m = d * np.float32(8)
    else:
        m = -b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., size - 16 :]  # [n, blocks, 16]: value j low nibble, j + 16 high
    values = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(n, k)
    return QuantWeight.q4(torch.from_numpy(values), torch.from_numpy(d), torch.from_numpy(m))


def _decode_q4_k(blocks: np.ndarray, n: int, k: int) -> QuantWeight:
    supers = blocks.reshape(-1, 144)  # d, dmin (fp16), 12 bytes of 6-bit scales, 128 of values
    d = supers[:, :2].copy().view(np.float16).astype(np.float32)  # [S, 1]
    dmin = supers[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(supers[:, 4:16])  # [S, 8] each
    scales = d * sc.astype(np.float32)
    mins = dmin * mn.astype(np.float32)
    # 4 chunks of 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones
    shifts = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qs = supers[:, 16:].reshape(-1, 4, 1, 32) >> shifts
    values = (qs & 15).reshape(n, k)
    sub = k // BLOCK
    return QuantWeight.q4(
        torch.from_numpy(np.ascontiguousarray(values)),
        torch.from_numpy(scales.reshape(n, sub)),
        torch.from_numpy(mins.reshape(n, sub)),
    )


def tensor_weight(t: ReaderTensor) -> QuantWeight:
    """One GGUF tensor of a KEPT type, in torch order [out, in]."""
    n, k = (int(d) for d in reversed(t.shape.tolist()))
    return decode_blocks(t.data, t.tensor_type, n, k)


def read_kept_weights(
    path: str, config: ModelConfig, names: set[str]
) -> tuple[dict[str, GGMLQuantizationType], dict[str, QuantWeight]]:
    """Every tensor's GGUF type by HF name, and the tensors among `names` whose type is
    KEPT, decoded (Q/K rows un-permuted for the architectures whose converter permutes)."""
    reader = open_gguf(path)
    arch = gguf_architecture(reader, path)
    types: dict[str, GGMLQuantizationType] = {}
    kept: dict[str, QuantWeight] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        types[name] = t.tensor_type
        if name not in names or t.tensor_type not in KEPT:
            continue
        weight = tensor_weight(t)
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
        for part, num_heads in heads.items():
            if arch in PERMUTED_QK and f".self_attn.{part}." in name:
                rows = unpermute_qk(weight.rows, num_heads).contiguous()
                weight = QuantWeight(weight.format, rows, weight.in_features)
        kept[name] = weight
    return types, kept
