"""PEFT adapters: loading, scaling, and a clear one-line rejection of everything we cannot
serve."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.lora.adapter import TARGET_MODULES, AdapterError, load_adapter
from engine.model_config import ModelConfig
from tests.lora_files import write_adapter as write_files

CONFIG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


def write_adapter(root: Path, **kw) -> Path:
    return write_files(root, CONFIG, **kw)


def test_a_peft_adapter_loads_with_its_scaling_folded_into_b(tmp_path):
    root = write_adapter(tmp_path / "support-bot")
    adapter = load_adapter(root, CONFIG)
    assert adapter.name == "support-bot" and adapter.rank == 8
    assert adapter.target_modules == frozenset(TARGET_MODULES)
    assert len(adapter.weights) == CONFIG.num_layers * len(TARGET_MODULES)
    assert adapter.scaling == 16 / 8
    from safetensors.torch import load_file

    raw = load_file(str(root / "adapter_model.safetensors"))
    b = raw["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    torch.testing.assert_close(adapter.weights[1, "down_proj"].b, b * 2.0)
    assert adapter.weights[0, "q_proj"].a.shape == (8, CONFIG.hidden_size)
    assert adapter.nbytes > 0


def test_rslora_scales_by_the_square_root_of_the_rank(tmp_path):
    root = write_adapter(tmp_path / "rs", rank=16, settings={"use_rslora": True})
    assert load_adapter(root, CONFIG).scaling == pytest.approx(16 / math.sqrt(16))


def test_target_modules_may_be_a_regex(tmp_path):
    root = write_adapter(
        tmp_path / "attn",
        modules=("q_proj", "v_proj"),
        settings={"target_modules": r".*\.(q_proj|v_proj)"},
    )
    assert load_adapter(root, CONFIG).target_modules == {"q_proj", "v_proj"}


def bad(tmp_path: Path, **kw) -> str:
    with pytest.raises(AdapterError) as err:
        load_adapter(write_adapter(tmp_path / "bad", **kw), CONFIG)
    message = str(err.value)
    assert "\n" not in message and message.startswith("bad: ")
    return message


def test_invalid_adapters_are_rejected_with_one_clear_line(tmp_path):
    assert "outside 1-64" in bad(tmp_path, rank=65)
    assert "use_dora" in bad(tmp_path, settings={"use_dora": True})
    assert "bias" in bad(tmp_path, settings={"bias": "all"})
    assert "not supported" in bad(tmp_path, settings={"target_modules": ["embed_tokens"]})
    wrong = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(8, 31),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(32, 8),
    }
    assert "needs A (8, 32)" in bad(tmp_path, modules=("q_proj",), tensors=wrong)
    lonely = {"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.ones(8, 32)}
    assert "not its pair" in bad(tmp_path, modules=("up_proj",), tensors=lonely)
    deep = {
        "base_model.model.model.layers.7.mlp.up_proj.lora_A.weight": torch.ones(8, 32),
        "base_model.model.model.layers.7.mlp.up_proj.lora_B.weight": torch.ones(48, 8),
    }
    assert "layer 7" in bad(tmp_path, modules=("up_proj",), tensors=deep)
    head = {"base_model.model.lm_head.lora_A.weight": torch.ones(8, 32)}
    assert "unsupported tensor" in bad(tmp_path, tensors=head)
    nan = {
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.full((8, 32), math.nan),
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": torch.ones(48, 8),
    }
    assert "non-finite" in bad(tmp_path, modules=("up_proj",), tensors=nan)


def test_missing_or_corrupt_files_are_rejected(tmp_path):
    root = write_adapter(tmp_path / "broken")
    (root / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(AdapterError, match="corrupt or unreadable"):
        load_adapter(root, CONFIG)
    (root / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match=r"no adapter_model\.safetensors"):
        load_adapter(root, CONFIG)
    (root / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="unreadable"):
        load_adapter(root, CONFIG)
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        load_adapter(tmp_path / "nowhere", CONFIG)
