"""Prometheus metrics with per-tenant labels, on a registry owned by the app (no globals). The
replica counts requests, tokens and latencies itself; workers' figures and tenant names are
collected at scrape time from what was last handed over (`set_engine`, `set_tenant_names`).
Under `strata gateway --workers N` the processes share counters through prometheus_client's
multiprocess mode. Names follow vLLM's, prefixed `strata:`: docs/metrics.md.
"""

from __future__ import annotations

import math
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from engine.protocol import EngineStats
from tenants.records import UsageRecord

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class GatewayMetrics:
    """Every metric of one gateway replica, on its own registry. `process_index` is this
    process's place among the replica's processes; `shared_dir`, where they all keep their
    metrics (None: this process is the whole replica)."""

    def __init__(self, *, process_index: int = 0, shared_dir: str | None = None) -> None:
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
        self.failovers = Counter(
            "strata:request_failovers",
            "Requests moved to another worker after theirs failed before the first output",
            ["model"],
            registry=r,
        )
        self.disagg_prefills = Counter(
            "strata:disagg_prefills",
            "Prompts prefilled on a prefill worker for a decode worker, by outcome: sent (the "
            "pages reached the decode worker through the gateway), remote (they went through "
            "the remote KV tier) or failed (the decode worker computed it)",
            ["model", "outcome"],
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
        self.webhook_deliveries = Counter(
            "strata:webhook_deliveries",
            "Alert webhook delivery attempts: ok, retried (failed, tried again later) or "
            "failed (the last attempt failed: given up)",
            ["result"],
            registry=r,
        )
        self.alerts = Counter(
            "strata:alerts_raised",
            "Alerts raised by this replica (result raised), or not raised because the same "
            "alert was raised already, by any replica (result duplicate)",
            ["type", "result"],
            registry=r,
        )
        process = str(process_index)
        self.responses = Counter(
            "strata:gateway_responses",
            "HTTP responses sent (every route), by gateway process: 0 to N-1 under `strata "
            "gateway --workers N`",
            ["process"],
            registry=r,
        ).labels(process)
        self.starts = Counter(
            "strata:gateway_process_starts",
            "Starts of each gateway process (more than one: it died and was restarted)",
            ["process"],
            registry=r,
        ).labels(process)
        self.starts.inc()
        self.engine = _EngineCollector()
        self.tenant_info = _TenantInfoCollector()
        self.fleet = _FleetCollector(process)
        r.register(self.engine)
        r.register(self.tenant_info)
        r.register(self.fleet)
        self._exposed = r if shared_dir is None else self._shared_registry(shared_dir)

    def _shared_registry(self, shared_dir: str) -> CollectorRegistry:
        """The sums over every process's files in `shared_dir`, and this process's view of the
        workers and tenants (the same in each process: read from the workers and the store)."""
        if values.ValueClass is values.MutexValue:
            raise RuntimeError(
                "metrics shared between processes need PROMETHEUS_MULTIPROC_DIR in the "
                "environment before prometheus_client is imported"
            )
        exposed = CollectorRegistry()
        MultiProcessCollector(exposed, path=shared_dir)
        exposed.register(self.engine)
        exposed.register(self.tenant_info)
        exposed.register(self.fleet)
        return exposed

    def responded(self) -> None:
        self.responses.inc()

    def rejected(self, tenant: str, reason: str) -> None:
        self.rejections.labels(tenant, reason).inc()

    def failed_over(self, model: str) -> None:
        self.failovers.labels(model).inc()

    def disaggregated(self, model: str, outcome: str) -> None:
        self.disagg_prefills.labels(model, outcome).inc()

    def store_bypassed(self, tenant: str) -> None:
        self.store_bypass.labels(tenant).inc()

    def webhook_delivered(self, result: str) -> None:
        self.webhook_deliveries.labels(result).inc()

    def alert_raised(self, kind: str, result: str) -> None:
        self.alerts.labels(kind, result).inc()

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

    def set_engine(self, stats: Mapping[str, EngineStats]) -> None:
        """The engine workers' latest figures, by worker address (workers that did not answer
        are left out: their series go stale)."""
        self.engine.stats = dict(stats)

    def set_fleet(self, view: FleetView) -> None:
        """This process's view of the fleet, as of the scrape."""
        self.fleet.view = view

    def tenant_names_due(self, now: float) -> bool:
        """Whether the tenants' names are older than TENANT_NAMES_TTL_S (monotonic clock)."""
        return now - self.tenant_info.refreshed_at >= TENANT_NAMES_TTL_S

    def set_tenant_names(self, names: Mapping[str, str], now: float) -> None:
        """Tenant id -> name, for `strata:tenant_info` until the next refresh."""
        self.tenant_info.names = dict(names)
        self.tenant_info.refreshed_at = now

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self._exposed))


# How long a replica serves the tenants' names it last read before reading them again: one
# read of every tenant record at most this often, however often it is scraped.
TENANT_NAMES_TTL_S = 30.0


@dataclass(frozen=True)
class MetricSpec:
    """A metric yielded by a collector of this module, as the metrics reference lists it."""

    name: str  # a counter's without `_total`
    kind: Literal["counter", "gauge"]
    doc: str
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class _EngineFigure:
    spec: MetricSpec
    # one worker's value, or its values by tier when the metric has a `tier` label
    read: Callable[[EngineStats], float | Mapping[str, int]]


def _tiers(device: int, host: int, disk: int, *, present: EngineStats) -> dict[str, int]:
    """Values by tier, for the tiers the worker has (a host or disk pool of size 0 is none)."""
    have = {
        "device": True,
        "host": present.num_kv_host_blocks_total > 0,
        "disk": present.num_kv_disk_blocks_total > 0,
    }
    values = {"device": device, "host": host, "disk": disk}
    return {tier: n for tier, n in values.items() if have[tier]}


def _engine_figure(
    name: str,
    kind: Literal["counter", "gauge"],
    doc: str,
    read: Callable[[EngineStats], float | Mapping[str, int]],
    *,
    by_tier: bool = False,
) -> _EngineFigure:
    labels = ("worker", "tier") if by_tier else ("worker",)
    return _EngineFigure(MetricSpec(name, kind, doc, labels), read)


ENGINE_FIGURES = (
    _engine_figure(
        "strata:num_requests_waiting",
        "gauge",
        "Requests queued in the worker",
        lambda s: s.num_waiting,
    ),
    _engine_figure(
        "strata:num_requests_running",
        "gauge",
        "Requests holding KV blocks in the worker (running, or loading their pages)",
        lambda s: s.num_running,
    ),
    _engine_figure(
        "strata:num_requests_loading_kv",
        "gauge",
        "Running requests waiting outside the batch for their pages from host RAM or disk",
        lambda s: s.num_loading,
    ),
    _engine_figure(
        "strata:num_preemptions",
        "counter",
        "Requests preempted for KV space since the worker started",
        lambda s: s.num_preemptions,
    ),
    _engine_figure(
        "strata:kv_blocks_used",
        "gauge",
        "KV-cache blocks in use, by tier",
        lambda s: _tiers(
            s.num_kv_blocks_used, s.num_kv_host_blocks_used, s.num_kv_disk_blocks_used, present=s
        ),
        by_tier=True,
    ),
    _engine_figure(
        "strata:kv_blocks_capacity",
        "gauge",
        "KV-cache blocks in the pools, by tier",
        lambda s: _tiers(
            s.num_kv_blocks_total, s.num_kv_host_blocks_total, s.num_kv_disk_blocks_total, present=s
        ),
        by_tier=True,
    ),
    _engine_figure(
        "strata:kv_cache_hit_blocks",
        "counter",
        "Prefix-cache hits, in blocks, by the tier each block came from",
        lambda s: s.num_cache_hit_blocks,
        by_tier=True,
    ),
    _engine_figure(
        "strata:kv_spilled_blocks",
        "counter",
        "Cached KV pages moved down, by the tier they went to (host, disk)",
        lambda s: s.num_kv_spilled_blocks,
        by_tier=True,
    ),
    _engine_figure(
        "strata:kv_dropped_blocks",
        "counter",
        "Cached KV pages dropped because no tier below could keep them",
        lambda s: s.num_kv_dropped_blocks,
    ),
    _engine_figure(
        "strata:kv_remote_saved_pages",
        "counter",
        "KV pages the worker saved to the fleet's remote tier",
        lambda s: s.kv_remote.get("saved", 0),
    ),
    _engine_figure(
        "strata:kv_remote_save_dropped",
        "counter",
        "KV page saves to the remote tier dropped: the queue was full, the store down or failing",
        lambda s: s.kv_remote.get("save_dropped", 0),
    ),
    _engine_figure(
        "strata:kv_remote_rejected_pages",
        "counter",
        "KV pages from the remote tier with a wrong header or checksum (served as misses)",
        lambda s: s.kv_remote.get("rejected", 0),
    ),
    _engine_figure(
        "strata:kv_remote_load_timeouts",
        "counter",
        "Fetches from the remote tier that missed their deadline (the prompt was computed)",
        lambda s: s.kv_remote.get("load_timeouts", 0),
    ),
    _engine_figure(
        "strata:kv_remote_quota_evicted",
        "counter",
        "A tenant's pages in the remote tier evicted by its own saves, to keep to its quota",
        lambda s: s.kv_remote.get("quota_evicted", 0),
    ),
    _engine_figure(
        "strata:kv_disk_write_errors",
        "counter",
        "KV page writes to disk that failed (those pages were dropped)",
        lambda s: s.num_kv_disk_write_errors,
    ),
    _engine_figure(
        "strata:kv_disk_checksum_failures",
        "counter",
        "KV pages on disk that failed their checksum (served as misses)",
        lambda s: s.num_kv_disk_checksum_failures,
    ),
    _engine_figure(
        "strata:kv_disk_pages_recovered",
        "counter",
        "KV pages a worker's persistent disk tier indexed from an earlier run",
        lambda s: s.num_kv_disk_pages_recovered,
    ),
    _engine_figure(
        "strata:kv_disk_pages_rejected",
        "counter",
        "KV pages of an earlier run turned away (torn, garbage, another model's, or failing "
        "their checksum when read): misses",
        lambda s: s.num_kv_disk_pages_rejected,
    ),
    _engine_figure(
        "strata:kv_pages_received",
        "counter",
        "Prefilled KV pages a decode worker took from a prefill worker",
        lambda s: s.num_kv_pages_received,
    ),
    _engine_figure(
        "strata:kv_pages_refused",
        "counter",
        "Prefilled KV pages a decode worker refused (torn, corrupt or of another format: "
        "computed again)",
        lambda s: s.num_kv_pages_refused,
    ),
    _engine_figure(
        "strata:kv_disk_read_ahead_bytes",
        "gauge",
        "Bytes of KV pages read from disk for waiting requests, held in memory",
        lambda s: s.kv_disk_read_ahead_bytes,
    ),
    _engine_figure(
        "strata:spec_decode_num_draft_tokens",
        "counter",
        "Draft tokens proposed by speculative decoding",
        lambda s: s.num_draft_tokens,
    ),
    _engine_figure(
        "strata:spec_decode_num_accepted_tokens",
        "counter",
        "Draft tokens the model agreed with (each one a decode step saved)",
        lambda s: s.num_accepted_draft_tokens,
    ),
    _engine_figure(
        "strata:kv_cache_bytes_per_token",
        "gauge",
        "KV-cache bytes per token (K and V, every layer, FP8 scales included)",
        lambda s: s.kv_bytes_per_token,
    ),
)

# per tenant, summed over workers: tenants x tiers x workers would be too many series
KV_BLOCKS_BY_TENANT = MetricSpec(
    "strata:kv_blocks",
    "gauge",
    "KV-cache blocks per tenant and tier (device, host, disk), held or cached, summed over "
    "the replica's workers",
    ("tenant", "tier"),
)
KV_RESIDENCY = MetricSpec(
    "strata:kv_residency_byte_seconds",
    "counter",
    "KV cache each tenant has held per tier (device, host, disk) on each worker since the "
    "worker started, in byte-seconds, cached pages included: divide a rate by 2^30 x 3600 "
    "for GiB-hours",
    ("worker", "tenant", "tier"),
)

TENANT_INFO = MetricSpec(
    "strata:tenant_info",
    "gauge",
    "1 for every tenant, naming it: join on `tenant` to show names",
    ("tenant", "name"),
)

FLEET_REGISTRY_UP = MetricSpec(
    "strata:fleet_registry_up",
    "gauge",
    "1 while the gateway process reads the fleet registry, 0 while the store is out of reach "
    "and it routes on its last view (no series without a registry)",
    ("process",),
)
FLEET_WORKERS = MetricSpec(
    "strata:fleet_workers",
    "gauge",
    "Workers in the gateway process's view, by model and state (serving, drained, down)",
    ("process", "model", "state"),
)
FLEET_DROPPED = MetricSpec(
    "strata:fleet_dropped_messages",
    "counter",
    "Fleet messages the gateway process ignored since it started, by reason: "
    "invalid_record (a registry record that does not verify), malformed_event, "
    "unknown_worker (KV events of a worker not in its view)",
    ("process", "reason"),
)

COLLECTED_METRICS = (
    *(f.spec for f in ENGINE_FIGURES),
    KV_BLOCKS_BY_TENANT,
    KV_RESIDENCY,
    TENANT_INFO,
    FLEET_REGISTRY_UP,
    FLEET_WORKERS,
    FLEET_DROPPED,
)


@dataclass(frozen=True)
class FleetView:
    """What a gateway process's metrics say of its fleet view."""

    registry_up: bool | None  # None: no registry (only --engine workers)
    workers: Mapping[tuple[str, str], int]  # (model id, state) -> how many
    dropped: Mapping[str, int]  # reason -> messages ignored since the process started


def _family(spec: MetricSpec) -> CounterMetricFamily | GaugeMetricFamily:
    kind = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
    return kind(spec.name, spec.doc, labels=spec.labels)


class _EngineCollector:
    """The workers' figures as of the last `GatewayMetrics.set_engine`."""

    def __init__(self) -> None:
        self.stats: dict[str, EngineStats] = {}

    def collect(self) -> Iterator[Metric]:
        for figure in ENGINE_FIGURES:
            family = _family(figure.spec)
            for worker, stats in sorted(self.stats.items()):
                value = figure.read(stats)
                if isinstance(value, Mapping):
                    for tier, n in sorted(value.items()):
                        family.add_metric([worker, tier], n)
                else:
                    family.add_metric([worker], value)
            yield family
        by_tenant: Tally[tuple[str, str]] = Tally()
        for stats in self.stats.values():
            for tenant, tiers in stats.kv_blocks_by_tenant.items():
                by_tenant.update({(tenant, tier): n for tier, n in tiers.items()})
        family = _family(KV_BLOCKS_BY_TENANT)
        for (tenant, tier), n in sorted(by_tenant.items()):
            family.add_metric([tenant, tier], n)
        yield family
        residency = _family(KV_RESIDENCY)
        for worker, stats in sorted(self.stats.items()):
            for tenant, held in sorted(stats.kv_byte_seconds_by_tenant.items()):
                for tier, byte_seconds in sorted(held.items()):
                    residency.add_metric([worker, tenant, tier], byte_seconds)
        yield residency


class _TenantInfoCollector:
    """`strata:tenant_info{tenant, name} 1` for the names of the last refresh."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}
        self.refreshed_at = -math.inf

    def collect(self) -> Iterator[Metric]:
        family = _family(TENANT_INFO)
        for tenant_id, name in sorted(self.names.items()):
            family.add_metric([tenant_id, name], 1)
        yield family


class _FleetCollector:
    """This process's view of the fleet as of the last `GatewayMetrics.set_fleet`, labelled
    with the process (each process of a replica has its own view and counts)."""

    def __init__(self, process: str) -> None:
        self.process = process
        self.view: FleetView | None = None

    def collect(self) -> Iterator[Metric]:
        if self.view is None:
            return
        p = self.process
        if self.view.registry_up is not None:
            up = _family(FLEET_REGISTRY_UP)
            up.add_metric([p], 1 if self.view.registry_up else 0)
            yield up
        workers = _family(FLEET_WORKERS)
        for (model, state), n in sorted(self.view.workers.items()):
            workers.add_metric([p, model, state], n)
        yield workers
        dropped = _family(FLEET_DROPPED)
        for reason, n in sorted(self.view.dropped.items()):
            dropped.add_metric([p, reason], n)
        yield dropped


class _WithoutCreated:
    """A registry's metrics without the `_created` samples prometheus_client adds to counters
    and histograms (a timestamp series per child that no dashboard reads)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            created = family.name + "_created"
            family.samples = [s for s in family.samples if s.name != created]
            yield family
