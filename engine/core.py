"""EngineCore: the synchronous heart of a worker. add / abort / step, nothing else.

One `step()` schedules, runs one batched forward, samples, appends tokens, applies the stop
rules that need only token ids (EOS, end-of-turn, stop token ids, max_tokens, context
length), and returns one `RequestOutput` per request that produced something. Text-level
work (detokenization, stop strings) belongs to whoever holds the tokenizer.
"""

from __future__ import annotations

import logging
import tempfile
import time
import uuid
from collections.abc import Collection
from pathlib import Path

import torch

from engine.attention.triton_backend import load_triton_kernels, use_pdl
from engine.block_manager import BlockManager
from engine.config import CacheConfig, ConfigError, EngineConfig
from engine.kernels.cpu import CpuKernels
from engine.lora.layers import LoRAManager, apply_lora
from engine.model.llama import LlamaForCausalLM
from engine.model.native_cpu import NativeDecoderLayer
from engine.model_runner import ModelRunner
from engine.protocol import (
    EngineStats,
    FinishReason,
    InvalidRequestError,
    LoRARequest,
    ModelInfo,
    RequestOutput,
    SamplingParams,
    Scheduling,
)
from engine.request import Request
from engine.sampler import rewind_draws
from engine.scheduler import Scheduler
from engine.speculative import accept
from engine.structured import SchemaError
from engine.structured.backend import GrammarCompiler, TokenMatcher, Vocabulary
from engine.structured.compilers import make_compiler
from kvstore.base import KVCacheSpec, ResidencyMeter
from kvstore.connector import TierConnector
from kvstore.device_pool import DeviceKVPool
from kvstore.disk import PageFormat, disk_slot_nbytes
from kvstore.remote import RemoteConfig, RemoteKVTier, store_id
from kvstore.tiers import KVOffloader, Tier, TieredKVStore

log = logging.getLogger(__name__)
# how often a step samples the pages each tenant holds, for the KV residency meter
RESIDENCY_SAMPLE_S = 1.0


class EngineCore:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: EngineConfig,
        *,
        model_id: str,
        eos_token_ids: frozenset[int],
        kernels: CpuKernels | None = None,
        triton: bool = False,
        vocabulary: Vocabulary | None = None,
    ) -> None:
        """`kernels`: native CPU kernels for attention (the model's own modules are swapped
        by `engine.model.native_cpu.apply_native_cpu` before the core is built).
        `triton`: attention on the Triton kernels instead (engine/attention/triton_backend.py).
        `vocabulary`: the tokenizer's tokens (`Vocabulary.of`); without it, requests with
        a response format are refused.
        """
        mc = model.config
        self.model_config = mc
        self.config = config
        self.model_id = model_id
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.eos_token_ids = eos_token_ids
        self.vocab_size = mc.vocab_size
        self.grammars: GrammarCompiler | None = None
        if vocabulary is not None:
            self.grammars = make_compiler(config.grammar_backend, vocabulary.padded(mc.vocab_size))
        spec = KVCacheSpec(
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            config.cache.block_size,
            config.cache.storage_dtype(self.dtype, self.device),
        )
        num_blocks = config.cache.num_blocks or spec.num_blocks_for(
            config.cache.kv_cache_memory_bytes
        )
        if num_blocks < 2:
            raise ValueError(
                f"the KV budget fits {num_blocks} blocks of {spec.bytes_per_block} bytes; "
                "raise kv_cache_memory_bytes"
            )
        self.pool = DeviceKVPool(
            spec, num_blocks, self.device, config.cache.kv_load, config.cache.kv_host_reads
        )
        cache_namespace = f"{model_id}|{spec.dtype}"
        page_format = PageFormat(
            model_id=model_id,
            namespace=cache_namespace,
            kv_dtype=_dtype_name(spec.dtype),
            layout=(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size),
        )
        self.page_format = page_format  # pages from other workers are checked against it
        self.tiers = _lower_tiers(config.cache, spec, self.device, page_format)
        self.block_manager = BlockManager(
            num_blocks,
            spec.block_size,
            enable_caching=config.cache.enable_prefix_caching,
            connector=None
            if self.tiers is None
            else TierConnector(
                KVOffloader(self.pool, self.tiers),
                publish_on_commit=config.cache.remote_save == "prefill",
            ),
        )
        limit = config.scheduler.max_model_len or mc.max_position_embeddings
        self.max_model_len = min(limit, mc.max_position_embeddings, num_blocks * spec.block_size)
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_manager,
            self.max_model_len,
            cache_namespace=cache_namespace,
            speculative=config.speculative,
        )
        self.lora: LoRAManager | None = None
        self._parked: dict[str, Request] = {}  # request id -> request waiting for its adapter
        lora_batch = None
        if config.lora.max_loras:
            fused = any(isinstance(layer, NativeDecoderLayer) for layer in model.layers)
            self.lora = LoRAManager(config.lora, mc, self.dtype, self.device, b_transposed=fused)
            ops = load_triton_kernels(self.device, "triton_lora") if triton else None
            lora_batch = apply_lora(model, self.lora, ops)
        self.runner = ModelRunner(
            model,
            self.pool,
            self.device,
            seed=config.seed,
            kernels=kernels,
            lora=lora_batch,
            triton=triton,
            eos_token_ids=eos_token_ids,
            pdl=use_pdl(config.pdl, triton, self.device),
        )
        if triton and not config.enforce_eager:  # adapters too: they run on the Triton kernels
            self.runner.use_decode_graphs(
                min(config.cuda_graph_max_batch, config.scheduler.max_num_seqs),
                self.max_model_len,
            )
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.residency = ResidencyMeter(spec.bytes_per_block, time.monotonic())
        self.instance = uuid.uuid4().hex  # this run of the engine: its totals start at zero
        self.num_draft_tokens = 0  # proposed by speculative decoding
        self.num_accepted_draft_tokens = 0  # of those, the ones the model agreed with
        # with spill-ahead: the most blocks one step can claim (a full token budget plus
        # one per sequence) are kept saved below the device
        sc = config.scheduler
        self.spill_watermark = 0
        if config.cache.spill_ahead:
            self.spill_watermark = min(
                num_blocks, -(-sc.max_num_batched_tokens // spec.block_size) + sc.max_num_seqs
            )

    # -- requests -----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        scheduling: Scheduling | None = None,
        lora: LoRARequest | None = None,
        matcher: TokenMatcher | None = None,
    ) -> None:
        """Queue a request (through adapter `lora` if given). Raises InvalidRequestError and
        changes nothing if it is bad. A request with a response format takes `matcher`
        (from `compile_grammar`, run where it holds up no step) or compiles one here."""
        if request_id in self.scheduler.requests or request_id in self._parked:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens including at least one generated token"
            )
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        params.validate(self.vocab_size)
        sched = scheduling or Scheduling()
        sched.validate()
        if params.is_constrained and matcher is None:
            matcher = self.compile_grammar(params)
        if self.tiers is not None:
            bs = self.pool.spec.block_size
            self.tiers.set_allowance(
                sched.tenant,
                None if sched.kv_host_tokens is None else sched.kv_host_tokens // bs,
                None if sched.kv_disk_tokens is None else sched.kv_disk_tokens // bs,
            )
            if self.tiers.remote is not None:
                tokens = sched.kv_remote_tokens
                self.tiers.remote.set_quota(
                    sched.tenant, None if tokens is None else tokens // bs * self.tiers.page_nbytes
                )
        slot: int | None = 0
        if lora is not None:
            if self.lora is None:
                raise InvalidRequestError("this engine serves no adapters (max_loras is 0)")
            lora = self.lora.check(lora)
            slot = self.lora.ready_slot(lora)
        request = Request(
            request_id,
            prompt_token_ids,
            params,
            priority=sched.priority,
            tenant=sched.tenant,
            weight=sched.weight,
            cache_salt=sched.cache_salt,
            device=self.device,
            lora_slot=slot or 0,
            lora_key="" if lora is None else lora.key,
        )
        request.matcher = matcher
        if slot is None:  # waits, outside the scheduler, for its adapter's weights
            assert self.lora is not None and lora is not None
            self.lora.start_load(lora)
            self._parked[request_id] = request
            return
        self.scheduler.add_request(request)

    def compile_grammar(self, params: SamplingParams) -> TokenMatcher:
        """A fresh matcher of the request's response format or grammar, ending where its
        stop tokens may. Touches no engine state, so it may run on any thread (the worker
        runs it beside the step loop). Raises InvalidRequestError."""
        if self.grammars is None:
            raise InvalidRequestError(
                "this engine has no vocabulary to constrain output with", "response_format"
            )
        stops = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.eos_token_ids
        try:
            return self.grammars.matcher(params.json_schema, params.grammar, stops)
        except SchemaError as exc:
            raise InvalidRequestError(f"response_format: {exc}", "response_format") from None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request now and free its blocks; None if it is not in flight."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            request = self._parked.pop(request_id, None)
            if request is None:
                return None
            self.scheduler.add_request(request)  # finished through the scheduler, as usual
        self.scheduler.finish_request(request, FinishReason.ABORT)
        return self._output(request)

    def has_unfinished(self) -> bool:
        return bool(self._parked) or self.scheduler.has_unfinished()

    def _admit_loaded_adapters(self) -> list[RequestOutput]:
        """Requests whose adapter is now in a slot join the scheduler; those whose adapter
        failed to load finish with the error."""
        if self.lora is None or not self._parked:
            return []
        in_use = {r.lora_slot for r in self.scheduler.requests.values()}
        ready, failed = self.lora.finish_loads(in_use)
        outputs = []
        for rid, request in list(self._parked.items()):
            if request.lora_key in ready:
                request.lora_slot = ready[request.lora_key]
            elif request.lora_key not in failed:
                continue
            del self._parked[rid]
            self.scheduler.add_request(request)
            if request.lora_key in failed:
                outputs.append(self._fail(request, failed[request.lora_key]))
        return outputs

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Advance every schedulable request by one step; returns their new outputs."""
        if self.tiers is not None:
            self.tiers.adopt_recovered()  # disk pages of an earlier run, as they are indexed
        self._meter_residency(RESIDENCY_SAMPLE_S)
        outputs = self._admit_loaded_adapters()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self._parked and not outputs:
                assert self.lora is not None
                self.lora.wait(0.005)  # nothing to run until an adapter's weights are read
            elif not outputs:
                self.block_manager.wait_below(0.005)  # or until pages are read from disk
            return outputs
        try:
            started = time.perf_counter()
            self.pool.loads.issue()  # the copies run while the step's inputs are prepared
            # the step waits for the loads into its requests' blocks only: those of requests
            # waiting outside the batch for their pages run on
            self.pool.loads.need(sched.load_tickets)
            result = self.runner.execute(sched)
            # the step has waited for its page loads (kvstore/transfer.py) on the device;
            # the host waits too before any block is freed. A failed load fails the step.
            self.pool.loads.finish()
            seconds = time.perf_counter() - started
        except (RuntimeError, ValueError, IndexError) as exc:
            # a failed forward cannot be pinned on one request: fail this step's batch only
            log.exception("model step failed; failing %d requests", len(sched.scheduled))
            try:
                self.pool.loads.finish()  # no block freed below may still be receiving pages
            except Exception:
                log.exception("a KV page load failed")
            # pages that never arrived: their blocks must not serve later prompts
            self.block_manager.uncache(self.pool.loads.take_failed())
            failures = [
                self._fail(s.request, f"engine step failed: {exc}") for s in sched.scheduled
            ]
            return outputs + failures
        self.num_steps += 1
        # each request's new tokens: its sampled one, then any drafts the model agreed with
        new_tokens = [[token_id] for token_id in result.token_ids]
        rejected: dict[str, int] = {}
        for i, (drafts, verified) in enumerate(zip(result.drafts, result.verified, strict=True)):
            if drafts:
                request = result.requests[i]
                new_tokens[i] = accept(new_tokens[i][0], drafts, verified)
                accepted = len(new_tokens[i]) - 1
                rejected[request.request_id] = len(drafts) - accepted
                state = result.draw_states.get(request.request_id)
                if state is not None:  # draws for the refused drafts' rows never happened
                    assert request.generator is not None
                    rewind_draws(request.generator, state, accepted)
                self.num_draft_tokens += len(drafts)
                self.num_accepted_draft_tokens += accepted
        self.scheduler.advance(sched, rejected)
        gate = self.scheduler.draft_gate
        if gate is not None and all(
            s.num_new_tokens - len(s.draft_token_ids) == 1 for s in sched.scheduled
        ):  # a decode step: what it cost, with or without drafts, and what it produced
            gate.record(
                len(sched.scheduled),
                seconds,
                sum(map(len, new_tokens)),
                drafted=any(s.draft_token_ids for s in sched.scheduled),
            )
        for request, scores in result.prompt_logprobs:
            request.prompt_logprobs.extend(scores)
        for request, tokens, logprob in zip(
            result.requests, new_tokens, result.logprobs, strict=True
        ):
            if request.params.max_tokens == 0:  # the prompt is scored; it generates nothing
                self.scheduler.finish_request(request, FinishReason.LENGTH)
                outputs.append(self._output(request))
                continue
            matcher = request.matcher
            if matcher is not None and matcher.stuck:
                outputs.append(
                    self._fail(
                        request,
                        "no token can continue the response format (its grammar ran out of "
                        "its step budget)",
                    )
                )
                continue
            if logprob is not None:
                request.pending_logprobs.append(logprob)
            for token_id in tokens:  # up to the first that ends the request
                request.append_token(token_id)
                self.num_generated_tokens += 1
                if matcher is not None:
                    matcher.accept(token_id)
                if matcher is not None and matcher.is_final:  # the value is complete
                    self.scheduler.finish_request(request, FinishReason.STOP)
                    break
                if self.scheduler.check_stop(request, self.eos_token_ids):
                    break
            outputs.append(self._output(request))
        # save the pages the next step's allocations may reuse, while nothing waits on them
        self.block_manager.spill_ahead(self.spill_watermark)
        return outputs

    def _fail(self, request: Request, message: str) -> RequestOutput:
        self.scheduler.finish_request(request, FinishReason.ERROR)
        out = self._output(request)
        out.error = message
        return out

    def _output(self, request: Request) -> RequestOutput:
        start = request.num_prompt_tokens + request.num_emitted_tokens
        new_ids = request.all_token_ids[start:]
        request.num_emitted_tokens += len(new_ids)
        logprobs = request.pending_logprobs or None
        request.pending_logprobs = []
        prompt_logprobs = request.prompt_logprobs[request.num_emitted_prompt_logprobs :] or None
        request.num_emitted_prompt_logprobs = len(request.prompt_logprobs)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            new_logprobs=logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_cached_host_tokens=request.num_cached_host_tokens,
            num_cached_disk_tokens=request.num_cached_disk_tokens,
            num_cached_remote_tokens=request.num_cached_remote_tokens,
            num_output_tokens=request.num_output_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    # -- introspection ------------------------------------------------------------------

    def _meter_residency(self, every_s: float = 0.0) -> None:
        """Sample the pages each tenant holds per tier, at most once in `every_s`."""
        now = time.monotonic()
        if self.residency.since_sample(now) >= every_s:
            self.residency.sample(self._blocks_by_tenant(), now)

    def stats(self) -> EngineStats:
        self._meter_residency()
        bm = self.block_manager
        host = None if self.tiers is None else self.tiers.host
        disk = None if self.tiers is None else self.tiers.disk
        return EngineStats(
            num_waiting=self.scheduler.num_waiting + len(self._parked),
            num_running=self.scheduler.num_running,
            num_kv_blocks_total=bm.num_blocks,
            num_kv_blocks_used=bm.num_used_blocks,
            num_kv_blocks_free=bm.num_free_blocks,
            kv_block_size=bm.block_size,
            kv_cache_dtype=_dtype_name(self.pool.spec.dtype),
            kv_bytes_per_token=self.pool.spec.bytes_per_token,
            num_kv_blocks_cached=bm.num_cached_blocks,
            num_kv_host_blocks_total=0 if host is None else host.num_blocks,
            num_kv_host_blocks_used=0 if host is None else host.num_used,
            num_kv_disk_blocks_total=0 if disk is None else disk.num_blocks,
            num_kv_disk_blocks_used=0 if disk is None else disk.num_used,
            kv_disk_read_ahead_bytes=0 if disk is None else disk.num_prefetch_bytes,
            num_kv_disk_checksum_failures=0 if disk is None else disk.num_checksum_failures,
            num_kv_disk_pages_recovered=0 if disk is None else disk.num_recovered,
            num_kv_disk_pages_rejected=0 if disk is None else disk.num_rejected,
            kv_blocks_by_tenant=self._blocks_by_tenant(),
            instance=self.instance,
            kv_byte_seconds_by_tenant={
                tenant: dict(tiers) for tenant, tiers in self.residency.byte_seconds.items()
            },
            num_cache_hit_blocks={
                Tier.DEVICE.value: bm.num_hit_blocks,
                Tier.HOST.value: bm.num_tier_hit_blocks[Tier.HOST],
                Tier.DISK.value: bm.num_tier_hit_blocks[Tier.DISK],
                Tier.REMOTE.value: bm.num_tier_hit_blocks[Tier.REMOTE],
            },
            kv_remote=self._remote_stats(),
            num_preemptions=self.scheduler.num_preemptions,
            num_loading=len(self.scheduler.loading),
            num_kv_spilled_blocks={}
            if self.tiers is None
            else {tier.value: n for tier, n in self.tiers.num_spilled.items()},
            num_kv_dropped_blocks=0 if self.tiers is None else self.tiers.num_dropped,
            num_kv_disk_write_errors=0 if disk is None else disk.num_write_errors,
            num_steps=self.num_steps,
            num_generated_tokens=self.num_generated_tokens,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_draft_tokens=self.num_accepted_draft_tokens,
        )

    def _remote_stats(self) -> dict[str, int]:
        remote = None if self.tiers is None else self.tiers.remote
        if remote is None:
            return {}
        remote.reap()
        return {
            "saved": remote.num_saved,
            "save_dropped": remote.num_save_dropped,
            "rejected": remote.num_rejected,
            "load_timeouts": remote.num_load_timeouts,
            "quota_evicted": remote.num_quota_evicted,
            "pending": remote.num_pending,
        }

    def _blocks_by_tenant(self) -> dict[str, dict[str, int]]:
        by_tenant = {
            t: {Tier.DEVICE.value: n} for t, n in self.block_manager.blocks_by_owner().items()
        }
        if self.tiers is not None:
            for tenant, tiers in self.tiers.pages_by_owner().items():
                by_tenant.setdefault(tenant, {}).update(tiers)
        return by_tenant

    def model_info(self) -> ModelInfo:
        mc = self.model_config
        return ModelInfo(
            model_id=self.model_id,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=sorted(self.eos_token_ids),
            kv_block_size=self.block_manager.block_size,
            kv_bytes_per_token=self.pool.spec.bytes_per_token,
            dtype=_dtype_name(self.dtype),
            device=str(self.device),
            kv_cache_dtype=_dtype_name(self.pool.spec.dtype),
            hidden_size=mc.hidden_size,
            intermediate_size=mc.intermediate_size,
            num_layers=mc.num_layers,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            max_loras=self.config.lora.max_loras,
            max_lora_rank=self.config.lora.max_lora_rank,
            prefix_caching=self.config.cache.enable_prefix_caching,
            cache_namespace=self.scheduler.cache_namespace,
            model_spec=self.config.model,
            role=self.config.role.value,
            kv_remote_id=""
            if self.tiers is None or self.tiers.remote is None
            else store_id(self.tiers.remote.config.url),
        )

    def cached_block_hashes(self) -> dict[str, Collection[bytes]]:
        """The prefix-cache block hashes held in each tier (device, host, disk), for the
        fleet's KV index (engine/fleet.py). Views of live maps: read them on this thread."""
        out: dict[str, Collection[bytes]] = {Tier.DEVICE.value: self.block_manager.cached_hashes()}
        if self.tiers is not None:
            if self.tiers.host is not None:
                out[Tier.HOST.value] = self.tiers.host.slots.keys()
            if self.tiers.disk is not None:
                out[Tier.DISK.value] = self.tiers.disk.slots.keys()
            if self.tiers.remote is not None:
                out[Tier.REMOTE.value] = self.tiers.remote.owners.of.keys()
        return out

    def load(self) -> dict[str, int]:
        """A few cheap figures of how busy the engine is, for the fleet's heartbeat."""
        bm = self.block_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting + len(self._parked),
            "num_kv_blocks_used": bm.num_used_blocks,
            "num_kv_blocks_total": bm.num_blocks,
        }

    def close(self) -> None:
        """Let go of the tiers' files, once the writes under way are done (a persistent disk
        tier then holds every page it took)."""
        if self.tiers is not None:
            self.tiers.close()

    def check_integrity(self) -> None:
        """Assert the block manager's invariants and that only live requests own blocks."""
        self.block_manager.check_integrity()
        live = set(self.scheduler.requests)
        for rid in self.block_manager.owner_ids():
            assert rid in live, f"finished request {rid!r} still owns blocks"
        for req in [*self.scheduler.running, *self.scheduler.loading]:
            need = self.block_manager.blocks_for_tokens(req.num_computed_tokens)
            assert len(self.block_manager.block_table(req.request_id)) >= need


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _lower_tiers(
    cache: CacheConfig, spec: KVCacheSpec, device: torch.device, page_format: PageFormat
) -> TieredKVStore | None:
    """Host and disk tiers for prefix-cache pages, as configured (None when there are none,
    or when prefix caching is off and they would hold nothing). With a `--kv-disk-path`
    the disk tier's file persists there; without, it is an unlinked temporary file."""
    if not (cache.host_memory_bytes or cache.disk_bytes or cache.remote_url):
        return None
    if not cache.enable_prefix_caching:
        log.warning("KV host and disk tiers hold prefix-cache pages; caching is off, so none")
        return None
    page = spec.bytes_per_block
    remote = None
    if cache.remote_url is not None:
        if cache.remote_url == "embedded":
            raise ConfigError("--kv-remote-url embedded needs `strata serve`, which starts it")
        remote_config = RemoteConfig(cache.remote_url, timeout_s=cache.remote_timeout_ms / 1000)
        remote = RemoteKVTier(remote_config, page_format, page)
    store = TieredKVStore(
        page,
        host_blocks=cache.host_memory_bytes // page,
        disk_blocks=cache.disk_bytes // disk_slot_nbytes(page),
        disk_dir=Path(cache.disk_path)
        if cache.disk_path
        else Path(tempfile.gettempdir()) / "strata-kv",
        disk_persistent=bool(cache.disk_path),
        page_format=page_format,
        pin=device.type == "cuda",
        remote=remote,
    )
    return store if store.enabled else None
