"""Records the store holds and the admin API exchanges: tenants, policies, keys, adapters,
prices and usage. One msgspec Struct per shape, named `X` / `XCreate` / `XUpdate` on a shared
base, validated on construction where a bad value could reach the engine or a bill.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Literal

import msgspec

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


class RecordError(ValueError):
    """A record field that fails validation; the message names the field."""


class Base(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


def check_name(value: str, field: str) -> str:
    if not _NAME.fullmatch(value):
        raise RecordError(
            f"{field} must be 1-128 characters of letters, digits, '.', '_', ':' or '-', "
            "starting with a letter or digit"
        )
    return value


# -- budgets -------------------------------------------------------------------------------


BudgetPeriod = Literal["day", "month", "none"]
NANOS_PER_USD = 1_000_000_000
# counters are compared in the store's Lua (doubles): exact up to 2**53 nano-dollars ($9M)
MAX_BUDGET_USD = Decimal(1_000_000)


def usd_to_nanos(value: Decimal, field: str) -> int:
    """Whole nano-dollars of a dollar amount; RecordError naming `field` for a negative,
    non-finite, too large or over-precise value (more than 9 decimal places)."""
    if not value.is_finite() or value < 0 or value > MAX_BUDGET_USD:
        raise RecordError(f"{field} must be a dollar amount between 0 and {MAX_BUDGET_USD}")
    nanos = value * NANOS_PER_USD
    if nanos != nanos.to_integral_value():
        raise RecordError(f"{field} must have at most 9 decimal places")
    return int(nanos)


def nanos_to_usd(nanos: int) -> str:
    """A nano-dollar amount as a plain decimal dollar string, exact, with at least two
    decimals: 1500000000 -> '1.50', 27000 -> '0.000027'."""
    sign = "-" if nanos < 0 else ""
    whole, frac = divmod(abs(nanos), NANOS_PER_USD)
    digits = f"{frac:09d}".rstrip("0").ljust(2, "0")
    return f"{sign}{whole}.{digits}"


class Budget(Base):
    """A spend cap in dollars (exact: a JSON number or a decimal string, at most 9 decimal
    places) per UTC `period` (`none`: lifetime). Admission reserves each request's
    worst-case cost against it; `thresholds` are percentages of `limit_usd` whose crossing
    by settled spend is recorded once per period in the budget event stream."""

    limit_usd: Decimal
    period: BudgetPeriod = "month"
    thresholds: list[int] = msgspec.field(default_factory=lambda: [50, 80, 100])

    def __post_init__(self) -> None:
        usd_to_nanos(self.limit_usd, "limit_usd")
        if self.period not in ("day", "month", "none"):
            raise RecordError("period must be one of day, month, none")
        if len(self.thresholds) > 16:
            raise RecordError("thresholds: at most 16 percentages")
        for pct in self.thresholds:
            if isinstance(pct, bool) or not 1 <= pct <= 1000:
                raise RecordError("thresholds must be whole percentages between 1 and 1000")
        self.thresholds = sorted(set(self.thresholds))

    @property
    def limit_nanos(self) -> int:
        return usd_to_nanos(self.limit_usd, "limit_usd")


# -- policy --------------------------------------------------------------------------------


StoreFailMode = Literal["fail_open", "fail_closed"]
# the numeric limits of a Policy: positive integers, or None for unlimited
LIMIT_FIELDS = (
    "rpm",
    "tpm",
    "max_concurrent",
    "max_tokens",
    "max_context_tokens",
    "kv_budget_tokens",
)


class Policy(Base):
    """A tenant's limits. `None` means unlimited / unrestricted for that field.

    rpm/tpm are token buckets refilled continuously (capacity = the per-minute figure);
    tpm is charged prompt + max_tokens at admission and credited back what went unused.
    `kv_budget_tokens` caps KV-cache tokens held at once by the tenant's in-flight requests.
    `kv_host_tokens`, `kv_disk_tokens` and `kv_remote_tokens` cap the tenant's prefix-cache
    KV kept in the engine's host-RAM and disk tiers and in the fleet's remote tier (0: none
    there).
    `priority` (lower is more urgent) and `weight` (fair share) are passed to the engine.
    """

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    max_tokens: int | None = None
    max_context_tokens: int | None = None
    kv_budget_tokens: int | None = None
    kv_host_tokens: int | None = None
    kv_disk_tokens: int | None = None
    kv_remote_tokens: int | None = None
    allowed_models: list[str] | None = None
    allowed_adapters: list[str] | None = None
    priority: int = 0
    weight: float = 1.0
    on_store_unavailable: StoreFailMode = "fail_closed"
    # tenants naming the same namespace share prefix-cache blocks (e.g. a public system
    # prompt); otherwise a tenant's cache is keyed by its own secret salt
    shared_cache_namespace: str | None = None

    def __post_init__(self) -> None:
        for field in LIMIT_FIELDS:
            value = getattr(self, field)
            if value is not None and value < 1:
                raise RecordError(f"{field} must be a positive integer or null")
        for field in ("kv_host_tokens", "kv_disk_tokens", "kv_remote_tokens"):
            value = getattr(self, field)
            if value is not None and value < 0:
                raise RecordError(f"{field} must be a non-negative integer or null")
        if not 0.0 < self.weight <= 1000.0:
            raise RecordError("weight must be in (0, 1000]")
        if not -1000 <= self.priority <= 1000:
            raise RecordError("priority must be between -1000 and 1000")
        if self.shared_cache_namespace is not None:
            check_name(self.shared_cache_namespace, "shared_cache_namespace")
        for field in ("allowed_models", "allowed_adapters"):
            for name in getattr(self, field) or ():
                check_name(name, field)

    def allows_model(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models

    def allows_adapter(self, adapter: str) -> bool:
        return self.allowed_adapters is None or adapter in self.allowed_adapters


class PolicyView(Base):
    """A policy as the admin API shows it: the record plus figures derived from the model."""

    policy: Policy
    kv_bytes_per_token: int
    kv_budget_bytes: int | None


class PolicyPatch(Base):
    """PATCH body: only the fields present change (msgspec.UNSET = not given)."""

    rpm: int | msgspec.UnsetType | None = msgspec.UNSET
    tpm: int | msgspec.UnsetType | None = msgspec.UNSET
    max_concurrent: int | msgspec.UnsetType | None = msgspec.UNSET
    max_tokens: int | msgspec.UnsetType | None = msgspec.UNSET
    max_context_tokens: int | msgspec.UnsetType | None = msgspec.UNSET
    kv_budget_tokens: int | msgspec.UnsetType | None = msgspec.UNSET
    kv_host_tokens: int | msgspec.UnsetType | None = msgspec.UNSET
    kv_disk_tokens: int | msgspec.UnsetType | None = msgspec.UNSET
    kv_remote_tokens: int | msgspec.UnsetType | None = msgspec.UNSET
    allowed_models: list[str] | msgspec.UnsetType | None = msgspec.UNSET
    allowed_adapters: list[str] | msgspec.UnsetType | None = msgspec.UNSET
    priority: int | msgspec.UnsetType = msgspec.UNSET
    weight: float | msgspec.UnsetType = msgspec.UNSET
    on_store_unavailable: StoreFailMode | msgspec.UnsetType = msgspec.UNSET
    shared_cache_namespace: str | msgspec.UnsetType | None = msgspec.UNSET

    def apply(self, policy: Policy) -> Policy:
        """A new, validated Policy with this patch applied (raises RecordError)."""
        changes = {
            f: getattr(self, f)
            for f in self.__struct_fields__
            if getattr(self, f) is not msgspec.UNSET
        }
        return msgspec.structs.replace(policy, **changes)


# -- tenants -------------------------------------------------------------------------------


class Tenant(Base):
    id: str
    name: str
    created_at: float
    policy: Policy
    disabled: bool = False
    # secret salt mixed into prefix-cache keys so tenants never share KV (engine side)
    cache_salt: str = ""
    budget: Budget | None = None  # spend cap in dollars per period (see Budget)


class TenantView(Base):
    """A tenant as the admin API shows it: everything but its cache salt, which is secret."""

    id: str
    name: str
    created_at: float
    policy: Policy
    disabled: bool = False

    @classmethod
    def of(cls, tenant: Tenant) -> TenantView:
        return cls(
            id=tenant.id,
            name=tenant.name,
            created_at=tenant.created_at,
            policy=tenant.policy,
            disabled=tenant.disabled,
        )


class TenantCreate(Base):
    name: str
    id: str | None = None  # generated when absent
    policy: Policy = msgspec.field(default_factory=Policy)

    def __post_init__(self) -> None:
        check_name(self.name, "name")
        if self.id is not None:
            check_name(self.id, "id")


class TenantUpdate(Base):
    name: str | msgspec.UnsetType = msgspec.UNSET
    disabled: bool | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if isinstance(self.name, str):
            check_name(self.name, "name")


# -- API keys ------------------------------------------------------------------------------

MAX_METADATA_ENTRIES = 32


class KeyLimits(Base):
    """One key's own limits, enforced within its tenant's (both must admit a request):
    `None` leaves a field to the tenant's policy alone."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    allowed_models: list[str] | None = None
    allowed_adapters: list[str] | None = None

    def __post_init__(self) -> None:
        for field in ("rpm", "tpm", "max_concurrent"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise RecordError(f"limits.{field} must be a positive integer or null")
        for field in ("allowed_models", "allowed_adapters"):
            for name in getattr(self, field) or ():
                check_name(name, f"limits.{field}")

    def allows_model(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models

    def allows_adapter(self, adapter: str) -> bool:
        return self.allowed_adapters is None or adapter in self.allowed_adapters


def check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise RecordError(f"metadata: at most {MAX_METADATA_ENTRIES} entries")
    for name, value in metadata.items():
        if not 1 <= len(name) <= 64 or len(value) > 512:
            raise RecordError("metadata: names of 1-64 characters, values up to 512")


class ApiKey(Base):
    """A key as listings show it: never the secret, only a short prefix to recognise it.
    `limits`, `budget` and `metadata` (free-form strings) are the operator's."""

    id: str
    tenant_id: str
    prefix: str
    name: str
    created_at: float
    expires_at: float | None = None
    revoked_at: float | None = None
    limits: KeyLimits | None = None
    budget: Budget | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)

    def is_active(self, now: float) -> bool:
        if self.revoked_at is not None and self.revoked_at <= now:
            return False
        return self.expires_at is None or now < self.expires_at


class ApiKeyCreated(Base):
    """Returned once, at creation or rotation: the only time the secret is visible."""

    key: ApiKey
    secret: str


class KeyCreate(Base):
    name: str = "default"
    expires_at: float | None = None  # unix seconds
    expires_in_s: float | None = None
    limits: KeyLimits | None = None
    budget: Budget | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_name(self.name, "name")
        if self.expires_in_s is not None and self.expires_in_s <= 0:
            raise RecordError("expires_in_s must be positive")
        check_metadata(self.metadata)


class KeyUpdate(Base):
    """PATCH body for a key: only the fields present change (null clears limits)."""

    name: str | msgspec.UnsetType = msgspec.UNSET
    limits: KeyLimits | msgspec.UnsetType | None = msgspec.UNSET
    metadata: dict[str, str] | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if isinstance(self.name, str):
            check_name(self.name, "name")
        if isinstance(self.metadata, dict):
            check_metadata(self.metadata)


class KeyRotate(Base):
    """Issue a new key; the old one keeps working for `grace_seconds` (0 = revoke now)."""

    grace_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.grace_seconds <= 30 * 86400:
            raise RecordError("grace_seconds must be between 0 and 30 days")


# -- adapters and prices -------------------------------------------------------------------


class Adapter(Base):
    """A registered LoRA adapter version. `allowed_tenants=None` means every tenant."""

    name: str
    version: int
    path: str
    base_model: str
    created_at: float
    allowed_tenants: list[str] | None = None


class AdapterCreate(Base):
    name: str
    path: str
    allowed_tenants: list[str] | None = None
    base_model: str | None = None  # the served model it adapts (default: the default model)

    def __post_init__(self) -> None:
        check_name(self.name, "name")


class Price(Base):
    """Price per 1M tokens for a model, an adapter, or one version of an adapter
    (`name@version`), in dollars. `effective_at` (unix seconds) is when it takes effect;
    a model's prices form a history, and a request is charged at the one in force when it
    was admitted (None: in force since before any usage)."""

    model: str
    prompt_per_m: float = 0.0
    cached_per_m: float = 0.0
    completion_per_m: float = 0.0
    effective_at: float | None = None

    def __post_init__(self) -> None:
        name, at, version = self.model.partition("@")
        check_name(name, "model")
        if at and not (version.isdigit() and version.isascii() and int(version) >= 1):
            raise RecordError("model: an adapter version is written name@N, N from 1")
        if not all(
            map(math.isfinite, (self.prompt_per_m, self.cached_per_m, self.completion_per_m))
        ):
            raise RecordError("prices must be finite numbers")
        if min(self.prompt_per_m, self.cached_per_m, self.completion_per_m) < 0:
            raise RecordError("prices must not be negative")
        if self.effective_at is not None and not math.isfinite(self.effective_at):
            raise RecordError("effective_at must be a finite unix time")


# -- usage ---------------------------------------------------------------------------------


UsageStatus = Literal["ok", "stop", "length", "cancelled", "error"]


class UsageRecord(Base):
    """One request, as billed. `request_id` is the response id (chatcmpl-… / cmpl-…).
    `model` is the canonical id of the base model that served it (never an alias); an
    adapter request also names the adapter and the version that ran."""

    request_id: str
    tenant_id: str
    key_id: str
    model: str
    adapter: str | None = None
    adapter_version: int | None = None
    user: str | None = None
    endpoint: str = "chat.completions"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_host_tokens: int = 0  # of cached_tokens, KV copied back from host RAM
    cached_disk_tokens: int = 0  # and from disk
    completion_tokens: int = 0
    status: UsageStatus = "ok"
    ttft_ms: float | None = None
    e2e_ms: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    # what it cost at the prices in force when it was admitted, in nano-dollars (each
    # part rounded up to a whole one); None: no price applied, or recorded before costs were
    cost_prompt_nanos: int | None = None
    cost_cached_nanos: int | None = None
    cost_completion_nanos: int | None = None

    @property
    def cost_nanos(self) -> int | None:
        if self.cost_prompt_nanos is None:
            return None
        return (
            self.cost_prompt_nanos
            + (self.cost_cached_nanos or 0)
            + (self.cost_completion_nanos or 0)
        )
