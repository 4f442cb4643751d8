"""A checkpoint's architecture: `ModelConfig`, read from GGUF metadata, an HF `config.json`,
or a synthetic preset, and its RoPE scaling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ConfigError


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `llama3` rescales long wavelengths; `linear` divides positions."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("llama3", "linear"):
            raise ConfigError(f"unsupported rope scaling type {self.kind!r}")
        if self.factor <= 0:
            raise ConfigError("rope scaling factor must be positive")

    @classmethod
    def from_hf(cls, raw: dict[str, Any] | None) -> RopeScaling | None:
        if not raw:
            return None
        kind = raw.get("rope_type", raw.get("type", "default"))
        if kind == "default":
            return None
        return cls(
            kind=kind,
            factor=float(raw.get("factor", 1.0)),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    architecture: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError("head_dim must be even for rotary embeddings")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        per_layer = attn + 3 * h * i + 2 * h
        embeddings = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` an HF checkpoint of this architecture carries."""
        out: dict[str, Any] = {
            "architectures": [
                "Qwen2ForCausalLM" if self.architecture == "qwen2" else "LlamaForCausalLM"
            ],
            "model_type": "qwen2" if self.architecture == "qwen2" else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
        }
        rs = self.rope_scaling
        if rs is not None:
            out["rope_scaling"] = {
                "rope_type": rs.kind,
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
            }
        return out

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Read an HF `config.json`; raises ConfigError for architectures we do not run."""
        archs = raw.get("architectures") or [raw.get("model_type", "")]
        arch = str(archs[0]).lower()
        supported = {
            "llamaforcausallm": "llama",
            "mistralforcausallm": "mistral",
            "qwen2forcausallm": "qwen2",
            "llama": "llama",
            "mistral": "mistral",
            "qwen2": "qwen2",
        }
        if arch not in supported:
            raise ConfigError(
                f"unsupported architecture {archs[0]!r}; Strata runs Llama, Mistral and Qwen2"
            )
        family = supported[arch]
        # transformers >= 5 nests rope settings under `rope_parameters`
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden // num_heads
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=RopeScaling.from_hf(rope),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", family == "qwen2")),
            architecture=family,
        )
