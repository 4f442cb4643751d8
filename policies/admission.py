"""Admission control shared by every gateway replica: one atomic Lua script reserves a
request's rate, token, concurrency and KV-budget allowances, its key's own limits and its
worst-case cost against the tenant's and the key's budgets as a lease; renewals keep a long
request's lease alive, and a release returns what it did not use and turns the real cost
into spend. Key layout and semantics are in docs/design/admission-and-ledger.md.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from policies.admission_scripts import RELEASE, RENEW, RESERVE
from policies.budgets import BudgetHold
from tenants.records import KeyLimits, Policy


class StoreUnavailableError(RuntimeError):
    """The store could not be reached; the caller applies the policy's fail mode."""


class InvalidReservationError(ValueError):
    """A reserve/release argument that can never be valid (negative counts, bad ids)."""


class LeaseState(enum.Enum):
    """What a renewal found: the lease live (renewed), expired and brought back (restored,
    counting against concurrency and the KV budget again), or settled already (gone)."""

    RENEWED = 1
    RESTORED = 2
    GONE = 0


class DenyReason(enum.StrEnum):
    RPM = "rpm"
    TPM = "tpm"
    CONCURRENCY = "concurrency"
    KV_BUDGET = "kv_budget"
    KEY_RPM = "key_rpm"
    KEY_TPM = "key_tpm"
    KEY_CONCURRENCY = "key_concurrency"
    TENANT_BUDGET = "tenant_budget"
    KEY_BUDGET = "key_budget"


@dataclass(frozen=True, slots=True)
class BucketState:
    """One rate-limit dimension: `remaining` is after this request when it was allowed;
    `reset_s` is the time until the bucket is full again."""

    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    """An admission verdict. `retry_after_s` is None when allowed or when `hard` (the
    request does not fit the policy or what is left of a budget); `requests`/`tokens` are
    the tenant's, None when unlimited; `budget_left_nanos` is what the refusing budget
    had left."""

    allowed: bool
    reason: DenyReason | None
    retry_after_s: float | None
    hard: bool
    requests: BucketState | None
    tokens: BucketState | None
    budget_left_nanos: int | None = None


@dataclass(frozen=True, slots=True)
class Charge:
    """What a reservation holds against budgets: the worst-case cost in nano-dollars and
    the tenant's and the key's budget for the current period (None: no budget)."""

    cost_nanos: int = 0
    tenant_budget: BudgetHold | None = None
    key_budget: BudgetHold | None = None


class _Script:
    """A Lua script known by its SHA-1; the server learns it on first use (EVAL)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()


_Call = tuple[_Script, list[str], list[Any], "asyncio.Future[Any]"]


class _ScriptRunner:
    """Runs script calls, pipelining those made in the same event-loop iteration.

    A burst of concurrent requests then costs the store one write and one wake-up instead
    of one each; a lone call waits for nothing (the flush runs on the loop's next turn).
    Each script stays atomic on the server. Steady state is EVALSHA; a server that does not
    know a script yet gets EVAL, which also caches it.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._pending: list[_Call] = []
        self._flushing: set[asyncio.Task[None]] = set()

    async def __call__(self, script: _Script, keys: list[str], args: list[Any]) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((script, keys, args, fut))
        if len(self._pending) == 1:
            loop.call_soon(self._flush)
        return await fut

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def _run(self, batch: list[_Call]) -> None:
        try:
            if len(batch) == 1:
                script, keys, args, _ = batch[0]
                replies: list[Any] = [await self._one(script, keys, args)]
            else:
                async with self.client.pipeline(transaction=False) as pipe:
                    for script, keys, args, _ in batch:
                        pipe.evalsha(script.sha, len(keys), *keys, *args)
                    replies = await pipe.execute(raise_on_error=False)
                for i, (script, keys, args, _) in enumerate(batch):
                    if isinstance(replies[i], redis_errors.NoScriptError):
                        replies[i] = await self.client.eval(script.source, len(keys), *keys, *args)
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
            error = StoreUnavailableError(f"admission store unreachable: {exc}")
            replies = [error] * len(batch)
        except Exception as exc:  # the callers see it, one by one
            replies = [exc] * len(batch)
        for (*_, fut), reply in zip(batch, replies, strict=True):
            if fut.done():
                continue  # the caller was cancelled; the lease (if any) expires on its own
            if isinstance(reply, BaseException):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)

    async def _one(self, script: _Script, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.client.evalsha(script.sha, len(keys), *keys, *args)
        except redis_errors.NoScriptError:
            return await self.client.eval(script.source, len(keys), *keys, *args)


def tenant_keys(tenant_id: str) -> dict[str, str]:
    """The store keys of one tenant's admission state, by role."""
    if not tenant_id or "{" in tenant_id or "}" in tenant_id:
        raise InvalidReservationError("tenant_id must be non-empty and free of '{' and '}'")
    base = f"strata:rl:{{{tenant_id}}}:"
    return {role: base + role for role in ("req", "tok", "leases", "res", "kv", "lapsed")}


def key_scope_keys(tenant_id: str, key_id: str | None) -> dict[str, str]:
    """The store keys of one API key's own buckets and leases (in its tenant's hash slot),
    and the tenant's hash of its keys' last-use times (unix microseconds)."""
    base = f"strata:rl:{{{tenant_id}}}:"
    scope = f"{base}key:{key_id or '-'}:"
    keys = {role: scope + role for role in ("req", "tok", "leases")}
    keys["used"] = base + "keyused"
    return keys


BUDGET_EVENTS = "strata:events:budget"


def _marks(hold: BudgetHold | None) -> str:
    return "" if hold is None else ",".join(map(str, hold.thresholds))


def _num(value: int | None) -> str:
    return "" if value is None else str(value)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bucket(limit: int | None, remaining: Any, reset: Any) -> BucketState | None:
    if limit is None:
        return None
    return BucketState(limit=limit, remaining=int(remaining), reset_s=float(reset))


class Admission:
    """Reserve-then-reconcile admission over a shared store; holds no state of its own.

    `lease_ttl_s` bounds how long a reservation counts against concurrency and the KV
    budget without `renew`; `busy_retry_after_s` is the retry estimate for concurrency and
    KV-budget denials.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        lease_ttl_s: float = 120.0,
        busy_retry_after_s: float = 1.0,
    ) -> None:
        if lease_ttl_s <= 0 or busy_retry_after_s <= 0:
            raise InvalidReservationError("lease_ttl_s and busy_retry_after_s must be positive")
        self.redis = redis
        self.lease_ttl_s = lease_ttl_s
        self.lease_ttl_us = round(lease_ttl_s * 1_000_000)
        self.busy_retry_after_s = busy_retry_after_s
        self._run = _ScriptRunner(redis)
        self._reserve = _Script(RESERVE)
        self._release = _Script(RELEASE)
        self._renew = _Script(RENEW)

    async def reserve(
        self,
        tenant_id: str,
        policy: Policy,
        request_id: str,
        *,
        prompt_tokens: int,
        max_tokens: int,
        kv_tokens: int,
        key_id: str | None = None,
        key_limits: KeyLimits | None = None,
        charge: Charge | None = None,
    ) -> Decision:
        """Check every limit of `policy`, of the key's `key_limits` and of the budgets in
        `charge` and, only if all pass, take one request from the request buckets,
        `prompt_tokens + max_tokens` from the token buckets, a lease of `kv_tokens`, a
        concurrency slot and `charge.cost_nanos` from each budget (one store round trip),
        and note the key's last use. A denial changes no counter. A request id that already
        holds a lease is allowed again without a second charge. Hard denials (the request
        exceeds a capacity, or what is left of a budget) are reported before any other;
        otherwise the order is rpm, tpm, key_rpm, key_tpm, concurrency, key_concurrency,
        kv_budget. Raises StoreUnavailableError."""
        if min(prompt_tokens, max_tokens, kv_tokens) < 0:
            raise InvalidReservationError("token counts must not be negative")
        if not request_id:
            raise InvalidReservationError("request_id must not be empty")
        charge = charge or Charge()
        if charge.cost_nanos < 0:
            raise InvalidReservationError("cost_nanos must not be negative")
        limits = key_limits or KeyLimits()
        keys = tenant_keys(tenant_id)
        scope = key_scope_keys(tenant_id, key_id)
        tb, kb = charge.tenant_budget, charge.key_budget
        args = [
            _num(policy.rpm),
            _num(policy.tpm),
            _num(policy.max_concurrent),
            _num(policy.kv_budget_tokens),
            request_id,
            prompt_tokens + max_tokens,
            kv_tokens,
            self.lease_ttl_us,
            f"{self.busy_retry_after_s:.6f}",
            _num(limits.rpm),
            _num(limits.tpm),
            _num(limits.max_concurrent),
            key_id or "",
            charge.cost_nanos,
            "" if tb is None else tb.limit_nanos,
            "" if kb is None else kb.limit_nanos,
            _num(None if tb is None else tb.expire_at_ms),
            _num(None if kb is None else kb.expire_at_ms),
        ]
        budget_keys = [
            keys["req"] if tb is None else tb.key,  # placeholders are never touched
            keys["req"] if kb is None else kb.key,
        ]
        script_keys = [
            *keys.values(),
            scope["req"],
            scope["tok"],
            scope["leases"],
            *budget_keys,
            scope["used"],
        ]
        reply = await self._run(self._reserve, script_keys, args)
        allowed, reason, retry, hard = int(reply[0]) == 1, _text(reply[1]), reply[2], reply[3]
        left = reply[8] if len(reply) > 8 else None
        return Decision(
            allowed=allowed,
            reason=None if allowed else DenyReason(reason),
            retry_after_s=float(retry) if retry else None,
            hard=int(hard) == 1,
            requests=_bucket(policy.rpm, reply[4], reply[5]),
            tokens=_bucket(policy.tpm, reply[6], reply[7]),
            budget_left_nanos=int(left) if left else None,
        )

    async def release(
        self,
        tenant_id: str,
        request_id: str,
        *,
        used_tokens: int,
        key_id: str | None = None,
        cost_nanos: int = 0,
        charge: Charge | None = None,
    ) -> None:
        """End the request's lease: free its concurrency slots, KV tokens and budget holds,
        credit `charged - used_tokens` back to the token buckets (never above capacity; an
        overrun is not charged) and add `cost_nanos`, the real cost, to the spend of the
        budgets it held; a soft threshold of `charge`'s budgets that this crosses is
        appended to the `strata:events:budget` stream. A lease that expired is settled the
        same way (its slots, KV and holds were freed when it expired). Idempotent:
        releasing an unknown or released lease does nothing. One store round trip. Raises
        StoreUnavailableError."""
        if used_tokens < 0 or cost_nanos < 0:
            raise InvalidReservationError("used_tokens and cost_nanos must not be negative")
        charge = charge or Charge()
        keys = tenant_keys(tenant_id)
        scope = key_scope_keys(tenant_id, key_id)
        lease_keys = [
            keys["tok"],
            keys["leases"],
            keys["res"],
            keys["kv"],
            keys["lapsed"],
            scope["tok"],
            scope["leases"],
            BUDGET_EVENTS,
        ]
        tb, kb = charge.tenant_budget, charge.key_budget
        args = [
            request_id,
            used_tokens,
            cost_nanos,
            "" if tb is None else tb.limit_nanos,
            _marks(tb),
            "" if kb is None else kb.limit_nanos,
            _marks(kb),
            tenant_id,
            key_id or "",
        ]
        await self._run(self._release, lease_keys, args)

    async def renew(self, tenant_id: str, request_id: str, key_id: str | None = None) -> LeaseState:
        """Push the lease deadline to now + lease_ttl_s (running requests call this well
        within the TTL). A lease that expired before it could be renewed (the store was
        out of reach) is restored with its reservation; a released one stays gone.
        One store round trip. Raises StoreUnavailableError."""
        keys = tenant_keys(tenant_id)
        scope = key_scope_keys(tenant_id, key_id)
        lease_keys = [keys["leases"], keys["res"], keys["kv"], keys["lapsed"], scope["leases"]]
        reply = await self._run(self._renew, lease_keys, [request_id, self.lease_ttl_us])
        return LeaseState(int(reply))
