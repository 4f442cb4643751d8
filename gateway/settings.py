"""The only place environment variables are read."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.handshake import ClientAuth, check_secret
from gateway.webhooks import AlertConfig


def cache_dir() -> str:
    """Where dequantized weights are cached: $STRATA_CACHE_DIR, else ~/.cache/strata."""
    explicit = os.environ.get("STRATA_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "strata")


def log_level() -> str:
    return os.environ.get("STRATA_LOG_LEVEL", "INFO").upper()


def json_logs() -> bool:
    """Whether logs are JSON lines ($STRATA_LOG_FORMAT=json, the default) or plain text."""
    return os.environ.get("STRATA_LOG_FORMAT", "json") == "json"


def data_dir() -> str:
    return os.environ.get("STRATA_DATA_DIR", ".strata")


def worker_secret() -> str | None:
    """The fleet secret workers and gateways prove to each other: $STRATA_WORKER_SECRET."""
    return os.environ.get("STRATA_WORKER_SECRET") or None


def strata_url() -> str | None:
    """The gateway `strata admin` talks to: $STRATA_URL."""
    return os.environ.get("STRATA_URL") or None


def admin_token() -> str | None:
    """The operator's admin token: $STRATA_ADMIN_TOKEN."""
    return os.environ.get("STRATA_ADMIN_TOKEN") or None


def redis_url() -> str | None:
    """The shared store: $STRATA_REDIS_URL (a worker registers in it when set)."""
    return os.environ.get("STRATA_REDIS_URL") or None


ROUTING_POLICIES = ("kv_aware", "least_loaded", "round_robin")
# how a prefill worker's pages reach a decode worker (docs/design/disaggregation.md)
DISAGG_TRANSPORTS = ("auto", "gateway", "remote")


@dataclass(frozen=True)
class GatewaySettings:
    """What one gateway replica needs. Built by `from_env` at the entry point, or directly."""

    model: str = "default"  # the default model: its id (or the spec its workers were started with)
    # other names of served models, each `alias=model` (model: an id, or `default`)
    model_aliases: tuple[str, ...] = ()
    routing: str = "kv_aware"  # how a request's worker is chosen: kv_aware, least_loaded, ...
    # a prompt with at least this many tokens to compute on a decode worker is prefilled on
    # a prefill worker (docs/design/disaggregation.md)
    disagg_min_prompt_tokens: int = 512
    # how the prefilled pages reach the decode worker: through this gateway, through the
    # remote KV tier both workers share, or auto (the tier when both report the same one)
    disagg_transport: str = "auto"
    engine_addresses: tuple[str, ...] = ()
    redis_url: str | None = None  # None: the caller runs an embedded store
    admin_token: str | None = None
    metrics_token: str | None = None  # when set, /metrics asks for it as a bearer token
    data_dir: str = ".strata"
    # the fleet secret the engine workers ask for (never logged, never in a repr)
    worker_secret: str | None = field(default=None, repr=False)
    worker_tls_ca: str | None = None  # CA file for tls:// workers (None: the system's CAs)
    cache_dir: str = field(default_factory=cache_dir)
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 2 * 1024 * 1024
    lease_ttl_s: float = 300.0
    auth_cache_ttl_s: float = 10.0
    # how often the workers' KV residency totals are recorded for billing
    kv_residency_interval_s: float = 60.0
    json_logs: bool = True
    # set by `strata gateway --workers N` in each of its processes: which one this is
    # (0..N-1, the `process` label of its metrics), and the directory where the N processes
    # keep their metrics, so that a scrape answered by any of them reads their sums
    process_index: int = 0
    metrics_dir: str | None = None
    alerts: AlertConfig = field(default_factory=AlertConfig)  # webhook delivery and backoff

    def __post_init__(self) -> None:
        if self.process_index < 0:
            raise ValueError("process_index must be at least 0")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ValueError("the admin token must be at least 16 characters")
        if not 1 <= self.port <= 65535:
            raise ValueError("port must be in 1..65535")
        for spec in self.model_aliases:
            alias, eq, target = spec.partition("=")
            if not (eq and alias.strip() and target.strip()):
                raise ValueError(f"a model alias is written alias=model, not {spec!r}")
        if self.disagg_min_prompt_tokens < 1:
            raise ValueError("disagg_min_prompt_tokens must be at least 1")
        if self.disagg_transport not in DISAGG_TRANSPORTS:
            raise ValueError(f"disagg_transport must be one of {', '.join(DISAGG_TRANSPORTS)}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}")
        if self.worker_secret is not None:
            check_secret(self.worker_secret)

    def alias_targets(self) -> dict[str, str]:
        """The operator's aliases: alias -> the model id (or `default`) it names."""
        out = {}
        for spec in self.model_aliases:
            alias, _, target = (part.strip() for part in spec.partition("="))
            out[alias] = target
        return out

    @property
    def worker_auth(self) -> ClientAuth:
        """What this gateway proves to its engine workers and trusts them with."""
        return ClientAuth(secret=self.worker_secret, tls_ca=self.worker_tls_ca)

    @classmethod
    def from_env(cls, **overrides: object) -> GatewaySettings:
        """Environment first (STRATA_*), then explicit overrides (CLI flags) win."""
        env = os.environ
        values: dict[str, object] = {
            "model": env.get("STRATA_MODEL", "default"),
            "redis_url": redis_url(),
            "admin_token": admin_token(),
            "metrics_token": env.get("STRATA_METRICS_TOKEN") or None,
            "data_dir": data_dir(),
            "worker_secret": worker_secret(),
            "worker_tls_ca": env.get("STRATA_WORKER_TLS_CA") or None,
            "host": env.get("STRATA_HOST", "127.0.0.1"),
            "port": int(env.get("STRATA_PORT", "8000")),
            "json_logs": json_logs(),
            "routing": env.get("STRATA_ROUTING", "kv_aware"),
            "disagg_transport": env.get("STRATA_DISAGG_TRANSPORT", "auto"),
        }
        disagg = env.get("STRATA_DISAGG_MIN_PROMPT_TOKENS", "")
        if disagg:
            try:
                values["disagg_min_prompt_tokens"] = int(disagg)
            except ValueError:
                raise ValueError("STRATA_DISAGG_MIN_PROMPT_TOKENS must be an integer") from None
        aliases = env.get("STRATA_MODEL_ALIASES", "")
        if aliases:
            values["model_aliases"] = tuple(a.strip() for a in aliases.split(",") if a.strip())
        engines = env.get("STRATA_ENGINE_URLS", "")
        if engines:
            values["engine_addresses"] = tuple(a.strip() for a in engines.split(",") if a.strip())
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
