"""Read a llama.cpp GGUF file into HF-named torch tensors.

Every tensor is dequantized with `gguf.quants` (F32/F16/BF16 stay lossless; quantized types
become fp32) and reshaped to torch order (GGUF lists dimensions innermost first). The Q/K
row permutation that `convert_hf_to_gguf.py` applies to Llama-family checkpoints is undone,
so the result can be fed to `fuse_hf_weights` like any HF checkpoint.
"""

from __future__ import annotations

import os
import re
import sys

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor
from tqdm import tqdm

from engine.loader.base import ModelLoadError, check_tensors
from engine.loader.gguf_meta import PERMUTED_QK, gguf_architecture, gguf_config
from engine.model_config import ModelConfig

GGUF_MAGIC = b"GGUF"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_QUANT_SUFFIX_RE = re.compile(
    r"[.\-_](?:I?Q\d\w*|TQ\d\w*|MXFP4\w*|F16|F32|BF16)$", flags=re.IGNORECASE
)
ROPE_FREQS = "rope_freqs.weight"


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF Llama name of a GGUF tensor, or None for tensors the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match[2] not in _BLOCK_NAMES:
        return None
    return f"model.layers.{match[1]}.{_BLOCK_NAMES[match[2]]}.{match[3]}"


def is_gguf_file(path: str) -> bool:
    """True when `path` is a regular file starting with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def gguf_model_id(path: str) -> str:
    """A model id from the file name without its quantization suffix (`X.Q4_1.gguf` -> X)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    return _QUANT_SUFFIX_RE.sub("", stem) or stem


def can_dequantize(qtype: GGMLQuantizationType) -> bool:
    """Whether the installed `gguf.quants` knows how to dequantize `qtype`."""
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return True
    return isinstance(getattr(gguf.quants, qtype.name, None), type)


def open_gguf(path: str) -> GGUFReader:
    """Open a GGUF file read-only (memory-mapped); ModelLoadError if it is not one."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"model file {path} does not exist")
    if not is_gguf_file(path):
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes)")
    try:
        return GGUFReader(path, "r")
    except (ValueError, OSError, IndexError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def read_gguf(path: str, *, progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and HF-named tensors of a GGUF file.

    Checks the architecture and every tensor's type before dequantizing anything; raises
    ModelLoadError with one line for anything Strata cannot run.
    """
    reader = open_gguf(path)
    arch = gguf_architecture(reader, path)
    wanted: list[tuple[str, ReaderTensor]] = []
    rope_freqs: ReaderTensor | None = None
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None and t.name != ROPE_FREQS:
            continue
        if not can_dequantize(t.tensor_type):
            raise ModelLoadError(
                f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}"
            )
        if name is None:
            rope_freqs = t
        else:
            wanted.append((name, t))
    factors = None if rope_freqs is None else dequantize_tensor(rope_freqs).float().numpy()
    config = gguf_config(reader, path, factors)

    tensors: dict[str, torch.Tensor] = {}
    bar = tqdm(
        wanted,
        desc=f"dequantizing {os.path.basename(path)}",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
    )
    for name, t in bar:
        tensor = dequantize_tensor(t)
        if arch in PERMUTED_QK and ".self_attn.q_proj." in name:
            tensor = unpermute_qk(tensor, config.num_heads)
        elif arch in PERMUTED_QK and ".self_attn.k_proj." in name:
            tensor = unpermute_qk(tensor, config.num_kv_heads)
        tensors[name] = tensor
    bar.close()
    check_tensors(config, tensors, path)
    return config, tensors


def dequantize_tensor(t: ReaderTensor) -> torch.Tensor:
    """One GGUF tensor in torch order: F16/BF16 keep their dtype, everything else is fp32."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if t.tensor_type == GGMLQuantizationType.F16:
        return torch.from_numpy(np.array(t.data, dtype=np.float16).reshape(shape))
    if t.tensor_type == GGMLQuantizationType.BF16:
        raw = np.array(t.data).view(np.int16).reshape(shape)
        return torch.from_numpy(raw).view(torch.bfloat16)
    values = gguf.quants.dequantize(t.data, t.tensor_type)
    # dequantize may return a read-only view of the memory map (F32): copy it out
    values = np.array(values, dtype=np.float32, copy=not values.flags.writeable)
    return torch.from_numpy(values.reshape(shape))


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation of rows (a weight [H * D, in] or a bias [H * D]).

    llama.cpp interleaves each head's two rotary halves: its row layout is
    [head, D/2, 2] where HF's is [head, 2, D/2].
    """
    rest = weight.shape[1:]
    # weight: [H, D/2, 2, *rest] -> [H, 2, D/2, *rest]
    return weight.reshape(num_heads, -1, 2, *rest).transpose(1, 2).reshape(weight.shape)
