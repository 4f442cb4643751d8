"""Engine configuration: one frozen dataclass per concern, validated on construction.

`EngineConfig` composes the runtime options the operator chooses; it is built once at the
entry point and handed down in pieces. Each field declares its command-line option
(engine/options.py). A checkpoint's architecture is `ModelConfig` (engine/model_config.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.options import GIB, InUnits, not_an_option, option

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


class CpuIsa(enum.Enum):
    """The instruction level the native CPU kernels are built for (engine/kernels/cpu.py).
    `auto`: the best this CPU has. `avx512`: the AVX-512 paths (AVX512-BF16 dot products
    where the CPU has them). `avx2`: the AVX2 + FMA paths. `portable`: the scalar C paths.
    A level above the CPU's is refused; a lower one runs, to compare levels on one machine."""

    AUTO = "auto"
    AVX512 = "avx512"
    AVX2 = "avx2"
    PORTABLE = "portable"


class WeightFormat(enum.Enum):
    """How the projections' weights are held. `fastest` (the default): `auto` where the native
    CPU kernels multiply quantized weights faster than 16-bit ones (x86 CPUs without
    AVX512-BF16, where the integer dot products win at every batch size), else `16bit`
    (engine/factory.py: fastest_weights). `auto`: as the checkpoint holds them: on the
    native CPU backend a GGUF's Q8_0, Q4_0, Q4_1 and Q4_K weights stay quantized (other
    block types become q8), float ones are in the compute dtype. `16bit`: in the compute
    dtype (`dtype`). `q8` / `q4`: every projection quantized at load in blocks of 32 (int8
    with a scale; 4-bit with a scale and a min), the LM head in q8, multiplied with integer
    dot products by the native CPU kernels (engine/model/quant_weights.py); elsewhere the
    quantized values are dequantized into the compute dtype. `fp8`: the decoder's
    projections, and an LM head not tied to the embedding table, in float8_e4m3fn with a
    float32 scale per output row (engine/model/fp8_weights.py), their products by the
    Triton kernels (engine/kernels/triton_fp8_linear.py): CUDA devices only, or a CPU under
    `KernelBackend.TRITON` (interpreted, for tests)."""

    FASTEST = "fastest"
    AUTO = "auto"
    SIXTEEN_BIT = "16bit"
    Q8 = "q8"
    Q4 = "q4"
    FP8 = "fp8"


class GrammarBackend(enum.Enum):
    """The grammar engine behind structured output (engine/structured): llguidance, or
    xgrammar (JSON Schemas only), kept for comparison (docs/structured-output.md)."""

    LLGUIDANCE = "llguidance"
    XGRAMMAR = "xgrammar"


class WorkerRole(enum.Enum):
    """What a worker does with requests (docs/design/disaggregation.md). `both`: everything.
    `prefill`: computes long prompts' KV pages for decode workers (and serves whole
    requests only when no other worker can). `decode`: runs requests, taking the pages of
    long prompts from a prefill worker into its host tier first."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


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
    """Resolve a dtype option; `auto` is bf16 here. On a CPU with the native kernels the
    engine resolves `auto` by measurement instead (engine/kernels/cpu_dtype.py)."""
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


KV_LOADS = ("auto", "sync", "thread", "stream")
KV_HOST_READS = ("auto", "kernel", "copy")
KV_REMOTE_SAVES = ("prefill", "evict")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV pool: `num_blocks` pages of `block_size` tokens, sized once at startup.

    When `num_blocks` is None the pool takes `kv_cache_memory_bytes`. Pages evicted from the
    prefix cache move down to the tiers below the pool (kvstore/tiers.py), when sized.
    """

    block_size: int = option(16, "--block-size", "tokens per KV block")
    kv_cache_memory_bytes: int = option(
        1 << 30,
        "--kv-cache-gb",
        "memory for the paged KV pool, in GiB",
        unit=InUnits(1 << 30, at_least=1),
    )
    num_blocks: int | None = option(
        None, "--num-kv-blocks", "exact KV pool size in blocks (overrides --kv-cache-gb)"
    )
    enable_prefix_caching: bool = option(
        True, "--no-prefix-caching", "do not reuse the KV of full blocks shared by earlier prompts"
    )
    kv_cache_dtype: KVCacheDtype | None = option(
        None,
        "--kv-cache-dtype",
        "KV page storage: auto (the compute dtype) or fp8_e4m3 (FP8 values with a scale "
        "per token and KV head); default fp8_e4m3 on CUDA, auto elsewhere",
    )
    host_memory_bytes: int = option(
        0,
        "--kv-host-gb",
        "host RAM (pinned on CUDA) for prefix-cache pages evicted from the device, in GiB",
        unit=GIB,
    )
    disk_bytes: int = option(
        0,
        "--kv-disk-gb",
        "disk space for prefix-cache pages evicted from host RAM, in GiB",
        unit=GIB,
    )
    disk_path: str | None = option(
        None,
        "--kv-disk-path",
        "directory that keeps the disk tier's page file across restarts (one file per "
        "worker; pages left there are found again); default: an unlinked file in the "
        "system temp directory",
    )
    # BlockManager.spill_ahead: it pays where those copies overlap compute; with synchronous
    # copies it only moves them, and it keeps the most recently freed pages in host RAM
    # rather than the most recently evicted
    spill_ahead: bool = option(
        False,
        "--kv-spill-ahead",
        "save cooling prefix-cache pages to the host tier between steps, before their "
        "blocks are reused",
    )
    kv_load: str = option(
        "auto",
        "--kv-load",
        "how pages come back from host RAM and disk: layer by layer on a CUDA stream "
        "(stream, CuPy where installed), on a worker thread (thread) or before the step "
        "(sync); auto: stream on CUDA, sync elsewhere",
        choices=KV_LOADS,
    )
    remote_url: str | None = option(
        None,
        "--kv-remote-url",
        "a Redis-protocol store (redis://, rediss://, unix://) shared by the fleet as a KV "
        "tier below host RAM and disk: pages saved there by one worker are hits on the "
        "others; `embedded` (strata serve): a valkey-server of its own, sized by "
        "--kv-remote-gb",
    )
    remote_memory_bytes: int = option(
        1 << 30,
        "--kv-remote-gb",
        "with --kv-remote-url embedded: the store's memory (maxmemory, least recently used "
        "pages evicted), in GiB",
        unit=InUnits(1 << 30, at_least=1 << 20),
    )
    remote_timeout_ms: int = option(
        1000,
        "--kv-remote-timeout-ms",
        "the most a fetch from the remote tier (and each store call) may take; a slower "
        "fetch is a miss, and the prompt is computed",
    )
    remote_save: str = option(
        "prefill",
        "--kv-remote-save",
        "which pages go to the remote tier: every full block once it is computed, written "
        "behind (prefill), or only pages leaving host RAM (evict)",
        choices=KV_REMOTE_SAVES,
    )
    kv_host_reads: str = option(
        "auto",
        "--kv-host-reads",
        "on a CUDA stream, how pages in host RAM are read: by a Triton kernel over PCIe "
        "(kernel) or by CuPy copies on the copy engines, a few per layer for runs of "
        "neighbouring pages (copy); auto: kernel",
        choices=KV_HOST_READS,
    )

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
        if self.kv_load not in KV_LOADS:
            raise ConfigError(f"kv_load must be one of {', '.join(KV_LOADS)}")
        if self.kv_host_reads not in KV_HOST_READS:
            raise ConfigError(f"kv_host_reads must be one of {', '.join(KV_HOST_READS)}")
        if self.remote_save not in KV_REMOTE_SAVES:
            raise ConfigError(f"remote_save must be one of {', '.join(KV_REMOTE_SAVES)}")
        if self.remote_timeout_ms <= 0:
            raise ConfigError("remote_timeout_ms must be positive")
        if self.remote_url is not None and not self.remote_url.startswith(
            ("redis://", "rediss://", "unix://", "embedded")
        ):
            raise ConfigError("kv_remote_url must be a redis://, rediss:// or unix:// URL")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences and tokens per step, and context length."""

    max_num_seqs: int = option(128, "--max-num-seqs", "most sequences one step runs")
    max_num_batched_tokens: int = option(
        2048, "--max-num-batched-tokens", "token budget of one step (prefill chunk size)"
    )
    max_model_len: int | None = option(
        None,
        "--max-model-len",
        "most tokens of a sequence, prompt and output (default: the model's context)",
    )
    policy: SchedulingPolicy = option(
        SchedulingPolicy.FAIR,
        "--scheduling-policy",
        "fair: priority, then weighted fair share between tenants (default)",
    )
    # each page costs the scheduler bookkeeping before the step can start; a request over
    # more is admitted alone
    max_loaded_blocks_per_step: int = option(
        512,
        "--max-loaded-blocks-per-step",
        "while requests run, KV pages from host RAM or disk one step may admit",
    )

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

    num_speculative_tokens: int = option(
        0,
        "--speculative-tokens",
        "draft tokens per step for greedy requests, looked up in their own context "
        "(prompt-lookup speculative decoding; 0, the default, turns it off)",
    )
    prompt_lookup_max: int = option(
        4, "--prompt-lookup-max", "longest suffix looked up for drafts, in tokens"
    )
    prompt_lookup_min: int = option(
        2, "--prompt-lookup-min", "shortest suffix looked up for drafts, in tokens"
    )
    max_step_drafts: int = option(
        8,
        "--speculative-max-step-drafts",
        "draft tokens per step, shared by the running requests (none once more run)",
    )
    adaptive: bool = option(
        True,
        "--speculative-always",
        "draft whenever a request can be drafted for, instead of only while drafted "
        "steps are measured to produce more tokens per second than plain ones",
    )

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
    largest rank a slot takes; `adapter_dir`, where set, is the only directory adapters load
    from (a worker always sets it; None, in-process use, trusts the caller's paths)."""

    max_loras: int = option(
        0, "--max-loras", "LoRA adapter slots served at once, from one batch (0: no adapters)"
    )
    max_lora_rank: int = option(16, "--max-lora-rank", "largest adapter rank (1-64)")
    adapter_dir: str | None = option(
        None,
        "--adapter-dir",
        "the only directory adapters are loaded from, symlinks and '..' resolved "
        "(default for workers: adapters/ in the data directory, where uploads are kept)",
    )

    def __post_init__(self) -> None:
        if self.max_loras < 0:
            raise ConfigError("max_loras must not be negative")
        if not 1 <= self.max_lora_rank <= 64:
            raise ConfigError("max_lora_rank must be in 1-64")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, composed once by the entry point. Its fields and those
    of its parts are the options of `strata engine`, `serve` and `generate` (engine/options.py)."""

    model: str = option(
        "default",
        "--model",
        "'default' (SmolLM2-135M-Instruct), a .gguf file, an HF directory, or synthetic:<preset>",
    )
    dtype: str = option(
        "auto",
        "--dtype",
        "auto (bf16; on a CPU with the native kernels, bf16 or float32, whichever its "
        "linears run faster), bfloat16, float16 or float32",
    )
    device: str = option("auto", "--device", "auto, cpu, cuda, cuda:N")
    seed: int = not_an_option(
        0,
        "`strata engine --seed` sets it; `generate --seed` seeds sampling instead, and "
        "`serve` starts its worker with the default",
    )
    num_threads: int | None = option(None, "--threads", "torch intra-op threads")
    cache_dir: str | None = option(
        None,
        "--cache-dir",
        "where dequantized weights are cached (default: $STRATA_CACHE_DIR or ~/.cache/strata)",
    )
    backend: KernelBackend = option(
        KernelBackend.AUTO,
        "--backend",
        "auto: native kernels on CPU, Triton on CUDA; torch: torch ops only; "
        "triton: force the Triton kernels (interpreted on CPU, slow)",
    )
    cpu_isa: CpuIsa = option(
        CpuIsa.AUTO,
        "--cpu-isa",
        "instruction level of the native CPU kernels: auto (the best this CPU has), avx512, "
        "avx2 or portable (scalar C)",
    )
    enforce_eager: bool = option(  # engine/cuda_graphs.py
        False,
        "--enforce-eager",
        "run decode steps eagerly instead of replaying captured CUDA graphs",
    )
    pdl: bool = option(  # engine/kernels/triton_pdl.py
        True,
        "--no-pdl",
        "launch the Triton kernels one after another instead of letting each start while "
        "the one before finishes (programmatic dependent launch, on Hopper GPUs and newer)",
    )
    cuda_graph_max_batch: int = option(
        256,
        "--cuda-graph-max-batch",
        "largest decode batch replayed from a captured CUDA graph (Triton backend; at "
        "most --max-num-seqs); larger batches run eagerly",
    )
    gemv: GemvKernel = option(
        GemvKernel.AUTO,
        "--gemv",
        "one-token steps' products on CUDA: auto (per weight shape, whichever of cuBLAS "
        "and Triton's GEMV timed faster at start), cublas, or triton",
    )
    weights: WeightFormat = option(
        WeightFormat.FASTEST,
        "--weights",
        "the projections' weights: fastest (the default: auto on x86 CPUs without "
        "AVX512-BF16, where integer products are the fastest, else 16bit), 16bit (the "
        "--dtype), auto (as the model file holds them: a GGUF's Q8_0/Q4_0/Q4_1/Q4_K "
        "weights stay quantized on the native CPU backend, a third of the memory), "
        "q8 or q4 (quantized at load in blocks of 32, integer products on the native CPU "
        "backend, dequantized elsewhere), or fp8 (e4m3 with a scale per output channel, "
        "quantized at load; CUDA only)",
    )
    grammar_backend: GrammarBackend = option(
        GrammarBackend.LLGUIDANCE,
        "--grammar-backend",
        "the grammar engine that constrains structured output and tool calls: llguidance, "
        "or xgrammar (JSON Schemas only; an optional extra, for comparison)",
    )
    role: WorkerRole = option(
        WorkerRole.BOTH,
        "--role",
        "what this worker does: both (prefill and decode), prefill (long prompts' KV "
        "pages, for decode workers) or decode (takes those pages; needs --kv-host-gb)",
    )
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads <= 0:
            raise ConfigError("num_threads must be positive")
        if self.cuda_graph_max_batch < 1:
            raise ConfigError("cuda_graph_max_batch must be positive")
        if self.role is WorkerRole.DECODE and self.cache.host_memory_bytes == 0:
            raise ConfigError(
                "a decode worker takes prefilled KV pages into host RAM: give it --kv-host-gb"
            )
        device = resolve_device(self.device)
        parse_dtype(self.dtype)
        if self.weights is WeightFormat.FP8:
            triton = self.backend is KernelBackend.TRITON or (
                self.backend is KernelBackend.AUTO and device.type == "cuda"
            )
            if not triton:
                raise ConfigError(
                    "fp8 weights need the Triton kernels: a CUDA device, or backend triton "
                    f"(interpreted on a CPU, for tests); here device {device.type}, "
                    f"backend {self.backend.value}"
                )

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
