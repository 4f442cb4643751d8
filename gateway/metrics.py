"""Prometheus metrics with per-tenant labels, on a registry owned by the app (no globals).

Names follow vLLM's where they overlap, prefixed `strata:` instead of `vllm:`.
"""

from __future__ import annotations

import functools
import time
from collections import Counter as Tally
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.protocol import EngineStats
from tenants.records import UsageRecord

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "strata:request_success",
            "Finished requests by model (its canonical id) and status",
            ["tenant", "model", "status"],
            registry=r,
        )
        self.rejections = Counter(
            "strata:request_rejected",
            "Requests refused at admission",
            ["tenant", "reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "strata:prompt_tokens", "Prompt tokens processed", ["tenant", "model"], registry=r
        )
        self.generation_tokens = Counter(
            "strata:generation_tokens", "Tokens generated", ["tenant", "model"], registry=r
        )
        self.unpriced = Counter(
            "strata:usage_unpriced_requests",
            "Requests exported at no cost because no price applies to their adapter or model",
            ["model"],
            registry=r,
        )
        self.ttft = Histogram(
            "strata:time_to_first_token_seconds",
            "Time to first token",
            ["tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "strata:inter_token_latency_seconds",
            "Mean time per output token",
            ["tenant"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "strata:e2e_request_latency_seconds",
            "End-to-end request latency",
            ["tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.store_bypass = Counter(
            "strata:store_unavailable_admissions",
            "Requests admitted without the store (fail_open)",
            ["tenant"],
            registry=r,
        )
        gauge = functools.partial(Gauge, registry=r)  # engine figures, set from their stats
        self.waiting = gauge("strata:num_requests_waiting", "Requests queued in the engines")
        self.running = gauge(
            "strata:num_requests_running",
            "Requests holding KV blocks in the engines (running, or loading their pages)",
        )
        self.loading = gauge(
            "strata:num_requests_loading_kv",
            "Running requests waiting outside the batch for their pages from host RAM or disk",
        )
        self.preemptions = gauge(
            "strata:num_preemptions", "Requests preempted for KV space since start"
        )
        self.kv_used = gauge("strata:kv_blocks_used", "KV-cache blocks in use")
        self.kv_total = gauge("strata:kv_blocks_total", "KV-cache blocks in the pools")
        self.kv_blocks = gauge(
            "strata:kv_blocks",
            "KV-cache blocks per tenant and tier (device, host, disk): held or cached",
            ["tenant", "tier"],
        )
        self.kv_hits = gauge(
            "strata:kv_cache_hit_blocks",
            "Prefix-cache hits since start, in blocks, by the tier each block came from",
            ["tier"],
        )
        self.kv_spilled = gauge(
            "strata:kv_spilled_blocks",
            "Cached KV pages moved down since start, by the tier they went to (host, disk)",
            ["tier"],
        )
        self.kv_dropped = gauge(
            "strata:kv_dropped_blocks",
            "Cached KV pages dropped since start because no tier below could keep them",
        )
        self.kv_write_errors = gauge(
            "strata:kv_disk_write_errors",
            "KV page writes to disk that failed since start (those pages were dropped)",
        )
        self.kv_read_ahead = gauge(
            "strata:kv_disk_read_ahead_bytes",
            "Bytes of KV pages read from disk for waiting requests, held in memory",
        )
        self.kv_checksum_failures = gauge(
            "strata:kv_disk_checksum_failures",
            "KV pages on disk that failed their checksum since start (served as misses)",
        )
        self.draft_tokens = gauge(
            "strata:spec_decode_draft_tokens",
            "Draft tokens proposed by speculative decoding since start",
        )
        self.accepted_draft_tokens = gauge(
            "strata:spec_decode_accepted_tokens",
            "Draft tokens the model agreed with (each one a decode step saved) since start",
        )
        self.kv_bytes_per_token = gauge(
            "strata:kv_cache_bytes_per_token",
            "KV-cache bytes per token (K and V, every layer, FP8 scales included)",
        )

    def rejected(self, tenant: str, reason: str) -> None:
        self.rejections.labels(tenant, reason).inc()

    def store_bypassed(self, tenant: str) -> None:
        self.store_bypass.labels(tenant).inc()

    def finished(self, rec: UsageRecord, first_token_at: float | None, started: float) -> None:
        t, model = rec.tenant_id, rec.model
        self.requests.labels(t, model, rec.status).inc()
        self.prompt_tokens.labels(t, model).inc(rec.prompt_tokens)
        self.generation_tokens.labels(t, model).inc(rec.completion_tokens)
        self.e2e.labels(t).observe(rec.e2e_ms / 1e3)
        if first_token_at is not None:
            self.ttft.labels(t).observe(first_token_at - started)
            if rec.completion_tokens > 1:
                decode = time.perf_counter() - first_token_at
                self.itl.labels(t).observe(decode / (rec.completion_tokens - 1))

    def set_engine(self, stats: Sequence[EngineStats]) -> None:
        """The engine workers' figures, summed over workers."""
        kv_blocks: Tally[tuple[str, str]] = Tally()
        hits: Tally[str] = Tally()
        spilled: Tally[str] = Tally()
        for s in stats:
            for tenant, tiers in s.kv_blocks_by_tenant.items():
                kv_blocks.update({(tenant, tier): n for tier, n in tiers.items()})
            hits.update(s.num_cache_hit_blocks)
            spilled.update(s.num_kv_spilled_blocks)
        self.kv_blocks.clear()  # tenants whose blocks are all gone drop out
        for (tenant, tier), n in kv_blocks.items():
            self.kv_blocks.labels(tenant, tier).set(n)
        for tier, n in hits.items():
            self.kv_hits.labels(tier).set(n)
        for tier, n in spilled.items():
            self.kv_spilled.labels(tier).set(n)
        total = {
            self.waiting: sum(s.num_waiting for s in stats),
            self.running: sum(s.num_running for s in stats),
            self.loading: sum(s.num_loading for s in stats),
            self.preemptions: sum(s.num_preemptions for s in stats),
            self.kv_used: sum(s.num_kv_blocks_used for s in stats),
            self.kv_total: sum(s.num_kv_blocks_total for s in stats),
            self.kv_dropped: sum(s.num_kv_dropped_blocks for s in stats),
            self.kv_write_errors: sum(s.num_kv_disk_write_errors for s in stats),
            self.kv_read_ahead: sum(s.kv_disk_read_ahead_bytes for s in stats),
            self.kv_checksum_failures: sum(s.num_kv_disk_checksum_failures for s in stats),
            self.draft_tokens: sum(s.num_draft_tokens for s in stats),
            self.accepted_draft_tokens: sum(s.num_accepted_draft_tokens for s in stats),
        }
        for gauge, n in total.items():
            gauge.set(n)
        self.kv_bytes_per_token.set(max((s.kv_bytes_per_token for s in stats), default=0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
