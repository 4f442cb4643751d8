"""GGUF metadata -> ModelConfig, including llama.cpp's ways of storing RoPE scaling."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType

from engine.config import ConfigError
from engine.loader.base import ModelLoadError
from engine.model.llama import rope_inv_freq
from engine.model_config import ModelConfig, RopeScaling

# general.architecture -> ModelConfig.architecture. llama.cpp writes "llama" for Mistral;
# "mistral" is accepted as the same network (and maps to "llama" so a cached copy, whose
# config.json says LlamaForCausalLM, reads back identical).
SUPPORTED_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
# architectures whose Q/K rows convert_hf_to_gguf permutes (and whose loader must undo it)
PERMUTED_QK = frozenset({"llama", "mistral"})


def read_field(reader: GGUFReader, key: str) -> Any:
    """A scalar metadata value (str, int, float or bool), or None when the key is absent.

    Arrays come back as their length (e.g. the number of tokenizer tokens).
    """
    field = reader.fields.get(key)
    if field is None or not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        return len(field.data)
    part = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    if part.size != 1:
        return part.tolist()
    if part.dtype == np.float32:
        # the shortest decimal that round-trips the float32: 1e-5, not 9.999999747378752e-06
        return float(str(part[0]))
    return part.item()


def _required(reader: GGUFReader, key: str, path: str) -> Any:
    value = read_field(reader, key)
    if value is None:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {key}")
    return value


def gguf_architecture(reader: GGUFReader, path: str) -> str:
    """`general.architecture`, checked against the families Strata runs."""
    arch = read_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; Strata runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} GGUF files"
        )
    return str(arch)


def gguf_config(reader: GGUFReader, path: str, rope_freqs: np.ndarray | None = None) -> ModelConfig:
    """Build the ModelConfig of a GGUF file from its metadata and tensor names.

    `rope_freqs` is the content of a `rope_freqs.weight` tensor when the file has one
    (llama.cpp stores Llama 3.1+ RoPE scaling that way instead of metadata keys).
    """
    arch = gguf_architecture(reader, path)
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ModelLoadError(f"{path}: GGUF file has no token_embd.weight tensor")
    hidden = int(_required(reader, f"{arch}.embedding_length", path))
    num_heads = int(_required(reader, f"{arch}.attention.head_count", path))
    num_kv_heads = int(read_field(reader, f"{arch}.attention.head_count_kv") or num_heads)
    head_dim = int(
        read_field(reader, f"{arch}.attention.key_length")
        or read_field(reader, f"{arch}.rope.dimension_count")
        or hidden // num_heads
    )
    rope_dim = read_field(reader, f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ModelLoadError(f"{path}: partial rotary embeddings ({rope_dim} of {head_dim})")
    vocab = read_field(reader, f"{arch}.vocab_size") or int(names["token_embd.weight"].shape[1])
    theta = float(read_field(reader, f"{arch}.rope.freq_base") or 10000.0)
    try:
        return ModelConfig(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(_required(reader, f"{arch}.feed_forward_length", path)),
            num_layers=int(_required(reader, f"{arch}.block_count", path)),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(read_field(reader, f"{arch}.context_length") or 4096),
            rms_norm_eps=float(
                read_field(reader, f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5
            ),
            rope_theta=theta,
            rope_scaling=_rope_scaling(
                reader, arch, path, head_dim=head_dim, theta=theta, rope_freqs=rope_freqs
            ),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            architecture=SUPPORTED_ARCHITECTURES[arch],
        )
    except ConfigError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def _rope_scaling(
    reader: GGUFReader,
    arch: str,
    path: str,
    *,
    head_dim: int,
    theta: float,
    rope_freqs: np.ndarray | None,
) -> RopeScaling | None:
    kind = read_field(reader, f"{arch}.rope.scaling.type")
    factor = read_field(reader, f"{arch}.rope.scaling.factor")
    orig = read_field(reader, f"{arch}.rope.scaling.original_context_length")
    if rope_freqs is not None:
        if kind not in (None, "none"):
            raise ModelLoadError(f"{path}: both rope_freqs and {kind!r} rope scaling are set")
        scaling = llama3_scaling_from_freqs(rope_freqs, head_dim, theta, int(orig or 8192))
        if scaling is None and not np.allclose(rope_freqs, 1.0):
            raise ModelLoadError(f"{path}: rope_freqs do not follow Llama 3 RoPE scaling")
        return scaling
    if kind in (None, "none") or (kind == "linear" and float(factor or 1.0) == 1.0):
        return None
    if kind != "linear":
        raise ModelLoadError(f"{path}: unsupported rope scaling type {kind!r}")
    return RopeScaling(kind="linear", factor=float(factor))


def llama3_scaling_from_freqs(
    factors: np.ndarray, head_dim: int, theta: float, original_max_position: int
) -> RopeScaling | None:
    """Recover llama3 RoPE scaling from llama.cpp's per-frequency divisors.

    `factors[i]` divides inverse frequency i: 1 for short wavelengths, `factor` for long
    ones, a blend in between. The blend is linear in 1/wavelength, which pins down
    `low_freq_factor` and `high_freq_factor` for the given original context length. Returns
    None when every factor is 1 or when no llama3 scaling reproduces the factors.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape[0] != head_dim // 2:
        return None
    factor = float(factors.max())
    if math.isclose(factor, 1.0, rel_tol=1e-6):
        return None
    inv_freq = rope_inv_freq(head_dim, theta, None).numpy()
    wavelen = 2 * math.pi / inv_freq
    mid = (factors > 1.0 + 1e-5) & (factors < factor * (1.0 - 1e-5))
    low, high = 1.0, 4.0
    if mid.sum() >= 2:
        smooth = (1.0 / factors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(original_max_position / wavelen[mid], smooth, 1)
        low = round(float(-intercept / slope), 4)
        high = round(low + float(1.0 / slope), 4)
    try:
        scaling = RopeScaling(
            kind="llama3",
            factor=round(factor, 4),
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=original_max_position,
        )
    except ConfigError:
        return None
    rebuilt = rope_inv_freq(head_dim, theta, scaling)
    target = torch.from_numpy(inv_freq / factors)
    if not torch.allclose(rebuilt, target, rtol=1e-4, atol=0.0):
        return None
    return scaling
