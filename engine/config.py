"""Engine configuration: one frozen dataclass per concern, validated on construction.

`ModelConfig` describes a checkpoint's architecture (read from GGUF metadata, an HF
`config.json`, or a synthetic preset). `EngineConfig` composes the runtime options the
operator chooses; it is built once at the entry point and handed down in pieces.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class ConfigError(ValueError):
    """An option or checkpoint description that the engine cannot run."""


class ModelLoadError(Exception):
    """A model that cannot be loaded; the message is one line, fit to show a CLI user."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class SchedulingPolicy(enum.Enum):
    """Order in which waiting requests are admitted and running ones are preempted."""

    FCFS = "fcfs"
    PRIORITY = "priority"
    FAIR = "fair"  # priority, then weighted fair share between tenants


class KernelBackend(enum.Enum):
    """`auto`: Strata's native CPU kernels on CPU devices (where they build), the Triton
    attention kernels on CUDA (where Triton is installed), torch ops for the rest.
    `torch`: torch ops only. `native`: require the native CPU kernels. `triton`: require the
    Triton kernels (on a CPU device they run under Triton's interpreter: slow, for tests)."""

    AUTO = "auto"
    TORCH = "torch"
    NATIVE = "native"
    TRITON = "triton"


class GemvKernel(enum.Enum):
    """The product of a one-token step's projections and LM head (CUDA, Triton backend).
    `cublas`: cuBLAS, as every other step. `triton`: the Triton GEMV kernel
    (engine/kernels/triton_gemv.py). `auto`: per weight shape, whichever of the two runs
    faster in a CUDA graph on the engine's own weights, timed once at start."""

    AUTO = "auto"
    CUBLAS = "cublas"
    TRITON = "triton"


class GrammarBackend(enum.Enum):
    """The grammar engine behind structured output (engine/structured): llguidance, or
    xgrammar (JSON Schemas only), kept for comparison (docs/structured-output.md)."""

    LLGUIDANCE = "llguidance"
    XGRAMMAR = "xgrammar"


class KVCacheDtype(enum.Enum):
    """Storage of KV pages. `auto`: the model's compute dtype. `fp8_e4m3`: float8_e4m3fn
    values with a float32 scale per (token, KV head), about half the bytes of 16-bit pages."""

    AUTO = "auto"
    FP8_E4M3 = "fp8_e4m3"


# option -> torch dtype name. torch is imported where a dtype or device is resolved, not
# with this module: the command line parses options, and its admin commands run, without it.
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def parse_dtype(name: str) -> torch.dtype:
    """Resolve a dtype option; `auto` is bf16 everywhere (fast on AVX512-BF16 CPUs and GPUs)."""
    import torch  # noqa: PLC0415

    if name == "auto":
        return torch.bfloat16
    try:
        dtype: torch.dtype = getattr(torch, _DTYPES[name])
    except KeyError:
        raise ConfigError(
            f"unknown dtype {name!r}; expected one of auto, {', '.join(_DTYPES)}"
        ) from None
    return dtype


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


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV pool: `num_blocks` pages of `block_size` tokens, sized once at startup.

    When `num_blocks` is None the pool takes `kv_cache_memory_bytes`.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: KVCacheDtype | None = None  # None: fp8_e4m3 on CUDA, auto elsewhere
    # tiers below the device pool for prefix-cache pages (kvstore/tiers.py); 0 = none
    host_memory_bytes: int = 0
    disk_bytes: int = 0
    disk_path: str | None = None  # a directory; default: the system's temporary directory
    # save cooling prefix-cache pages to the host tier between steps, ahead of the
    # allocations that reuse their blocks (BlockManager.spill_ahead). It pays where those
    # copies overlap compute; with synchronous copies it only moves them, and it keeps the
    # most recently freed pages in host RAM rather than the most recently evicted.
    spill_ahead: bool = False
    # how pages come back from those tiers (kvstore/transfer.py): "auto" (a CUDA stream,
    # layer by layer, on GPU; synchronous on CPU), "sync", "thread" or "stream"
    kv_load: str = "auto"
    # on a CUDA stream, how host tier rows are read in place: "kernel" (a Triton kernel over
    # PCIe), "copy" (CuPy 2-D copies by runs of slots, on the copy engines) or "auto" (kernel)
    kv_host_reads: str = "auto"

    def storage_dtype(self, compute: torch.dtype, device: torch.device) -> torch.dtype:
        """The dtype KV pages are stored in, for a model computing in `compute`."""
        import torch  # noqa: PLC0415

        choice = self.kv_cache_dtype
        if choice is None:
            choice = KVCacheDtype.FP8_E4M3 if device.type == "cuda" else KVCacheDtype.AUTO
        return compute if choice is KVCacheDtype.AUTO else torch.float8_e4m3fn

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError("block_size must be a positive power of two")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError("the KV pool needs at least 2 blocks")
        if self.kv_cache_memory_bytes <= 0:
            raise ConfigError("kv_cache_memory_bytes must be positive")
        if self.host_memory_bytes < 0 or self.disk_bytes < 0:
            raise ConfigError("KV host and disk tier sizes must not be negative")
        if self.kv_load not in ("auto", "sync", "thread", "stream"):
            raise ConfigError("kv_load must be auto, sync, thread or stream")
        if self.kv_host_reads not in ("auto", "kernel", "copy"):
            raise ConfigError("kv_host_reads must be auto, kernel or copy")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences and tokens per step, and context length."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    policy: SchedulingPolicy = SchedulingPolicy.FAIR
    # while requests run, the pages from host RAM or disk that one step may admit (each
    # costs the scheduler bookkeeping before the step can start); a request over more is
    # admitted alone
    max_loaded_blocks_per_step: int = 512

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ConfigError("max_num_seqs must be positive")
        if self.max_loaded_blocks_per_step <= 0:
            raise ConfigError("max_loaded_blocks_per_step must be positive")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError("max_num_batched_tokens must be positive")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError("max_model_len must be positive")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup speculative decoding (engine/speculative.py): up to
    `num_speculative_tokens` drafts per request and step (0 disables it), taken after the
    latest earlier occurrence of the sequence's last `prompt_lookup_max` ..
    `prompt_lookup_min` tokens, for greedy requests.

    A step takes at most `max_step_drafts` drafts, shared equally by the running requests:
    a step of few rows costs about the same as a step of one (the weights are read once),
    but past a few rows it is bound by compute, and a refused draft then costs as much as a
    real token. So with 8, one running request gets 4 drafts, four get 2 each, and nine or
    more get none.

    `adaptive`: draft only while it pays, as measured on this machine and load
    (engine/speculative.py, `DraftGate`); off, every draftable request is drafted for."""

    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    max_step_drafts: int = 8
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ConfigError("num_speculative_tokens must be in 0-16")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16")
        if self.max_step_drafts < 1:
            raise ConfigError("max_step_drafts must be positive")


@dataclass(frozen=True)
class LoRAConfig:
    """Adapter slots: how many adapters the device holds at once (0 disables LoRA) and the
    largest rank a slot takes."""

    max_loras: int = 0
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.max_loras < 0:
            raise ConfigError("max_loras must not be negative")
        if not 1 <= self.max_lora_rank <= 64:
            raise ConfigError("max_lora_rank must be in 1-64")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, composed once by the entry point."""

    model: str = "default"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    num_threads: int | None = None
    cache_dir: str | None = None
    backend: KernelBackend = KernelBackend.AUTO
    # decode steps from captured CUDA graphs (Triton backend only; engine/cuda_graphs.py)
    enforce_eager: bool = False
    cuda_graph_max_batch: int = 256
    # one-token steps' projections: cuBLAS, Triton's GEMV, or per shape the faster (CUDA)
    gemv: GemvKernel = GemvKernel.AUTO
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # the grammar engine that constrains output to response formats and tool calls
    grammar_backend: GrammarBackend = GrammarBackend.LLGUIDANCE

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads <= 0:
            raise ConfigError("num_threads must be positive")
        if self.cuda_graph_max_batch < 1:
            raise ConfigError("cuda_graph_max_batch must be positive")
        resolve_device(self.device)
        parse_dtype(self.dtype)

    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)


def resolve_device(name: str) -> torch.device:
    import torch  # noqa: PLC0415

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"unknown device {name!r}") from exc
