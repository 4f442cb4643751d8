"""Types that cross the engine boundary: sampling parameters, requests, outputs, stats.

Everything here is a msgspec Struct so the same objects travel in-process and as msgpack
frames between the gateway's `EngineClient` and a worker process.
"""

from __future__ import annotations

import enum

import msgspec

from engine.structured import SchemaError, precheck

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries in one request's logit_bias (OpenAI's limit)


class InvalidRequestError(ValueError):
    """A request the engine refuses: bad sampling parameters, too-long prompt, bad token ids.
    `param` names the request field at fault, where there is one."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The worker died or the connection dropped while the request was in flight."""

    code = "engine_dead"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, end-of-turn, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the client went away or asked to stop
    ERROR = "error"  # the engine failed this request


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-request decoding options with OpenAI semantics.

    `temperature == 0` is greedy. `top_k is None` disables top-k. `seed` makes sampling
    reproducible for this request regardless of what else shares its batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # score the prompt: the logprob of every prompt token after the first, given the tokens
    # before it, with this many top alternatives per position (vLLM's `prompt_logprobs`;
    # OpenAI's `echo` with `logprobs`). With it, max_tokens may be 0: score, generate nothing.
    prompt_logprobs: int | None = None
    # added to the logits of these token ids before sampling (greedy included); -100 bans a
    # token, 100 all but forces it. The logprobs reported are the model's own.
    logit_bias: dict[int, float] | None = None
    # EOS and the stop token ids cannot end the request before this many tokens, and stop
    # strings are looked for only in the text that follows them
    min_tokens: int = 0
    # the output must be JSON text matching this JSON Schema, given as JSON text
    # (docs/structured-output.md says what is supported); '{"type": "object"}' is any object.
    # Generation ends as soon as the value is complete.
    json_schema: str | None = None
    # or text of this Lark grammar (llguidance's dialect: `%json {...}` embeds a schema)
    grammar: str | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field (token ids are range-checked
        only when `vocab_size` is given)."""

        def bad(param: str, rule: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {rule}", param=param)

        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise bad("max_tokens", "must be at least 1 (0 only when scoring the prompt)")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be between 0 and 100")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise bad("top_k", "must be at least 1 (or omitted)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be between -2 and 2")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be between -2 and 2")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "must be in (0, 10]")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise bad(name, f"must be between 0 and {MAX_LOGPROBS}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "must be between 0 and max_tokens")
        if self.logit_bias:
            limit_ids = vocab_size if vocab_size is not None else 2**31
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} tokens")
            if any(not 0 <= t < limit_ids for t in self.logit_bias):
                raise bad("logit_bias", "keys must be valid token ids")
            if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
                raise bad("logit_bias", "values must be between -100 and 100")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed", "must fit in 64 bits")
        if any(not s for s in self.stop):
            raise bad("stop", "strings must be non-empty")
        limit = vocab_size if vocab_size is not None else 2**31
        if any(not 0 <= t < limit for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be valid token ids")
        try:  # the cheap checks: the grammar itself is compiled off any loop, once
            precheck(self.json_schema, self.grammar)
        except SchemaError as exc:
            raise InvalidRequestError(f"response_format: {exc}", "response_format") from None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_constrained(self) -> bool:
        """Whether a response format or grammar constrains the output."""
        return self.json_schema is not None or self.grammar is not None


class Scheduling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Who a request runs for and how much of the engine it deserves.

    `priority` orders classes of work (lower runs first). Within a priority, the `fair`
    policy shares the engine between `tenant`s in proportion to their `weight`.
    `cache_salt` is part of every prefix-cache key: requests reuse each other's KV only
    when their salts are equal (the gateway sets it from the tenant record).
    `kv_host_tokens`, `kv_disk_tokens` and `kv_remote_tokens` cap the tenant's cached KV in
    host RAM, on disk and in the remote tier (None: no cap of its own; 0: none in that
    tier); the latest request's caps apply.
    """

    priority: int = 0
    tenant: str = ""
    weight: float = 1.0
    cache_salt: str = ""
    kv_host_tokens: int | None = None
    kv_disk_tokens: int | None = None
    kv_remote_tokens: int | None = None

    def validate(self) -> None:
        if not 0.0 < self.weight <= 1e6:
            raise InvalidRequestError("weight must be in (0, 1e6]")
        for name in ("kv_host_tokens", "kv_disk_tokens", "kv_remote_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidRequestError(f"{name} must not be negative")


class LoRARequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Serve a request through this adapter: a PEFT directory on the worker's filesystem,
    identified by name and registration version (a new version is a different adapter)."""

    name: str
    version: int = 1
    path: str

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A token's logprob (the sampled token, or a prompt token being scored) and the top-n
    alternatives at its position (ids and logprobs)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class RequestOutput(msgspec.Struct, kw_only=True, array_like=True):
    """New tokens for one request since its previous output; final when finish_reason is set."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended the request, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    # of num_cached_tokens, those whose KV was copied back from host RAM, from disk or from
    # the remote tier (the rest were still in device memory)
    num_cached_host_tokens: int = 0
    num_cached_disk_tokens: int = 0
    num_cached_remote_tokens: int = 0
    # with SamplingParams.prompt_logprobs: prompt tokens 1.. scored since the last output (all
    # of them arrive with the request's first output)
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineStats(msgspec.Struct, kw_only=True):
    num_waiting: int
    num_running: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    kv_block_size: int
    kv_cache_dtype: str = ""  # storage of the pages, e.g. "bfloat16" or "float8_e4m3fn"
    kv_bytes_per_token: int = 0  # K and V of every layer, scales included
    num_kv_blocks_cached: int = 0  # device blocks findable by the prefix cache
    num_kv_host_blocks_total: int = 0
    num_kv_host_blocks_used: int = 0
    num_kv_disk_blocks_total: int = 0
    num_kv_disk_blocks_used: int = 0
    kv_disk_read_ahead_bytes: int = 0  # buffers of disk pages read for waiting requests
    num_kv_disk_checksum_failures: int = 0  # disk pages that failed their check: misses
    # pages a persistent disk tier found from an earlier run: indexed, and turned away
    # (torn, garbage or another model's, at the scan or when their checksum failed)
    num_kv_disk_pages_recovered: int = 0
    num_kv_disk_pages_rejected: int = 0
    # prefix-cache hits since start, in blocks, by the tier each block came from
    num_cache_hit_blocks: dict[str, int] = msgspec.field(default_factory=dict)
    # blocks per tenant per tier ("device", "host", "disk"): held by its requests or cached
    kv_blocks_by_tenant: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    instance: str = ""  # this run of the engine: the totals since start are its own
    # KV held per tenant per tier since start, in byte-seconds (cached pages included): what
    # a bill for KV kept warm charges
    kv_byte_seconds_by_tenant: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    num_preemptions: int
    num_loading: int = 0  # of num_running: waiting outside the batch for their pages to load
    # cached pages moved down since start, by the tier they went to ("host", "disk"); pages
    # dropped because no tier below could keep them; writes to disk that failed (dropped)
    num_kv_spilled_blocks: dict[str, int] = msgspec.field(default_factory=dict)
    num_kv_dropped_blocks: int = 0
    num_kv_disk_write_errors: int = 0
    # the remote tier since start, in pages: saved, saves dropped (queue full, store down),
    # values rejected (wrong header or checksum: misses), fetches timed out, and pages of a
    # tenant evicted by this worker's saves to keep the tenant within its quota; and the
    # saves queued now ("pending")
    kv_remote: dict[str, int] = msgspec.field(default_factory=dict)
    # prefilled pages a decode worker was sent (engine/disagg.py): taken into its tiers,
    # and refused (torn, corrupt or of another format: misses)
    num_kv_pages_received: int = 0
    num_kv_pages_refused: int = 0
    num_steps: int
    num_generated_tokens: int
    # speculative decoding since start: draft tokens proposed, and those the model agreed with
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


class ModelInfo(msgspec.Struct, kw_only=True):
    """What a worker serves; sent on connect so the client can validate and tokenize."""

    model_id: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    kv_block_size: int
    kv_bytes_per_token: int  # K and V of every layer, at the pool's storage dtype
    dtype: str
    device: str
    kv_cache_dtype: str = ""
    # the decoder's shapes (what a LoRA adapter must fit) and the engine's adapter slots
    hidden_size: int = 0
    intermediate_size: int = 0
    num_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    max_loras: int = 0
    max_lora_rank: int = 0
    prefix_caching: bool = True  # whether requests reuse each other's prompt KV
    cache_namespace: str = ""  # the root of its prefix-cache chains (engine/block_hash.py)
    model_spec: str = ""  # what it was started with: 'default', a file, synthetic:<preset>
    role: str = "both"  # both, prefill or decode (engine/config.py WorkerRole)
    # a digest naming its remote KV tier's store (kvstore/remote.py `store_id`), or "": a
    # prefill worker and a decode worker with the same one pass pages through the store
    kv_remote_id: str = ""
