"""Admission control shared by every gateway replica: one atomic Lua script reserves a
request's rate, token, concurrency and KV-budget allowances as a lease, renewals keep a long
request's lease alive, and a release returns what it did not use. Key layout and semantics
are in docs/design/admission-and-ledger.md.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from tenants.records import Policy


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
    request can never fit the policy); `requests`/`tokens` are None when unlimited."""

    allowed: bool
    reason: DenyReason | None
    retry_after_s: float | None
    hard: bool
    requests: BucketState | None
    tokens: BucketState | None


# -- Lua -----------------------------------------------------------------------------------

_PRELUDE = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_us = string.format('%.0f', now)

local function parse_res(r)
  local sp = string.find(r, ' ', 1, true)
  return tonumber(string.sub(r, 1, sp - 1)), tonumber(string.sub(r, sp + 1))
end

local function add_kv(kv_key, delta)
  if redis.call('INCRBY', kv_key, delta) <= 0 then redis.call('DEL', kv_key) end
end

local LAPSED_KEEP_MS = 86400000

local function purge(lease_key, res_key, kv_key, lapsed)
  local expired = redis.call('ZRANGEBYSCORE', lease_key, '-inf', now_us)
  if #expired == 0 then return end
  local kv = 0
  for _, id in ipairs(expired) do
    local r = redis.call('HGET', res_key, id)
    if r then
      local _, k = parse_res(r)
      kv = kv + k
      redis.call('HDEL', res_key, id)
      redis.call('HSET', lapsed, id, r)
    end
  end
  redis.call('PEXPIRE', lapsed, LAPSED_KEEP_MS)
  redis.call('ZREMRANGEBYSCORE', lease_key, '-inf', now_us)
  add_kv(kv_key, -kv)
end

local function expire_leases(lease_key, res_key, kv_key)
  local last = redis.call('ZRANGE', lease_key, -1, -1, 'WITHSCORES')
  if #last == 0 then return end
  local at_ms = string.format('%.0f', math.floor(tonumber(last[2]) / 1000) + 1000)
  redis.call('PEXPIREAT', lease_key, at_ms)
  redis.call('PEXPIREAT', res_key, at_ms)
  redis.call('PEXPIREAT', kv_key, at_ms)
end

-- tokens in the bucket now (a missing bucket is full)
local function level(key, cap)
  local v = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens, ts = tonumber(v[1]), tonumber(v[2])
  if tokens == nil or ts == nil then return cap end
  local elapsed = math.max(now - ts, 0)
  return math.min(cap, tokens + elapsed * cap / 60000000)
end

local function store(key, cap, tokens)
  redis.call('HSET', key, 'tokens', string.format('%.17g', tokens),
             'ts', now_us, 'cap', cap)
  local to_full_ms = (cap - tokens) * 60000 / cap
  redis.call('PEXPIRE', key, string.format('%.0f', math.ceil(to_full_ms) + 1000))
end

local function seconds_to_fill(cap, tokens, target)
  return string.format('%.6f', math.max(target - tokens, 0) * 60 / cap)
end
"""

_RESERVE = (
    _PRELUDE
    + """
local req_key, tok_key, lease_key, res_key, kv_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lapsed = KEYS[6]
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local max_conc, kv_budget = tonumber(ARGV[3]), tonumber(ARGV[4])
local id, cost, kv_tokens = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local lease_us, busy_retry = tonumber(ARGV[8]), ARGV[9]
local eps = 1e-9

purge(lease_key, res_key, kv_key, lapsed)
local req = rpm and level(req_key, rpm)
local tok = tpm and level(tok_key, tpm)

local function verdict(ok, reason, retry, hard, r, k)
  local out = {ok, reason, retry, hard, false, false, false, false}
  if rpm then out[5], out[6] = math.floor(r + eps), seconds_to_fill(rpm, r, rpm) end
  if tpm then out[7], out[8] = math.floor(k + eps), seconds_to_fill(tpm, k, tpm) end
  return out
end

if redis.call('ZSCORE', lease_key, id) then
  return verdict(1, '', '', 0, req, tok)
end
if tpm and cost > tpm then return verdict(0, 'tpm', '', 1, req, tok) end
if kv_budget and kv_tokens > kv_budget then return verdict(0, 'kv_budget', '', 1, req, tok) end
if rpm and req + eps < 1 then
  return verdict(0, 'rpm', seconds_to_fill(rpm, req, 1), 0, req, tok)
end
if tpm and tok + eps < cost then
  return verdict(0, 'tpm', seconds_to_fill(tpm, tok, cost), 0, req, tok)
end
if max_conc and redis.call('ZCARD', lease_key) >= max_conc then
  return verdict(0, 'concurrency', busy_retry, 0, req, tok)
end
if kv_budget and (tonumber(redis.call('GET', kv_key)) or 0) + kv_tokens > kv_budget then
  return verdict(0, 'kv_budget', busy_retry, 0, req, tok)
end

local charged = 0
if rpm then req = math.max(req - 1, 0); store(req_key, rpm, req) end
if tpm then tok = math.max(tok - cost, 0); store(tok_key, tpm, tok); charged = cost end
redis.call('ZADD', lease_key, string.format('%.0f', now + lease_us), id)
redis.call('HSET', res_key, id, charged .. ' ' .. kv_tokens)
add_kv(kv_key, kv_tokens)
expire_leases(lease_key, res_key, kv_key)
return verdict(1, '', '', 0, req, tok)
"""
)

_RELEASE = (
    _PRELUDE
    + """
local tok_key, lease_key, res_key, kv_key, lapsed = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id, used = ARGV[1], tonumber(ARGV[2])
purge(lease_key, res_key, kv_key, lapsed)
local r = redis.call('HGET', res_key, id)
redis.call('ZREM', lease_key, id)
local charged, kv
if r then
  redis.call('HDEL', res_key, id)
  charged, kv = parse_res(r)
  add_kv(kv_key, -kv)
else
  r = redis.call('HGET', lapsed, id)
  if not r then return 0 end
  redis.call('HDEL', lapsed, id)
  charged, kv = parse_res(r)
end
local credit = charged - used
local cap = tonumber(redis.call('HGET', tok_key, 'cap'))
if credit > 0 and cap then store(tok_key, cap, math.min(cap, level(tok_key, cap) + credit)) end
return 1
"""
)

_RENEW = (
    _PRELUDE
    + """
local lease_key, res_key, kv_key, lapsed = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, deadline = ARGV[1], string.format('%.0f', now + tonumber(ARGV[2]))
purge(lease_key, res_key, kv_key, lapsed)
local state = 1
if not redis.call('ZSCORE', lease_key, id) then
  local r = redis.call('HGET', lapsed, id)
  if not r then return 0 end
  redis.call('HDEL', lapsed, id)
  redis.call('HSET', res_key, id, r)
  local _, kv = parse_res(r)
  add_kv(kv_key, kv)
  state = 2
end
redis.call('ZADD', lease_key, deadline, id)
expire_leases(lease_key, res_key, kv_key)
return state
"""
)


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
        self._reserve = _Script(_RESERVE)
        self._release = _Script(_RELEASE)
        self._renew = _Script(_RENEW)

    async def reserve(
        self,
        tenant_id: str,
        policy: Policy,
        request_id: str,
        *,
        prompt_tokens: int,
        max_tokens: int,
        kv_tokens: int,
    ) -> Decision:
        """Check every limit of `policy` and, only if all pass, take one request from the
        request bucket, `prompt_tokens + max_tokens` from the token bucket and a lease of
        `kv_tokens` (one store round trip). A denial changes no counter. A request id that
        already holds a lease is allowed again without a second charge. Hard denials (the
        request exceeds a capacity) are reported before any other; otherwise the order is
        rpm, tpm, concurrency, kv_budget. Raises StoreUnavailableError."""
        if min(prompt_tokens, max_tokens, kv_tokens) < 0:
            raise InvalidReservationError("token counts must not be negative")
        if not request_id:
            raise InvalidReservationError("request_id must not be empty")
        keys = tenant_keys(tenant_id)
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
        ]
        reply = await self._run(self._reserve, list(keys.values()), args)
        allowed, reason, retry, hard = int(reply[0]) == 1, _text(reply[1]), reply[2], reply[3]
        return Decision(
            allowed=allowed,
            reason=None if allowed else DenyReason(reason),
            retry_after_s=float(retry) if retry else None,
            hard=int(hard) == 1,
            requests=_bucket(policy.rpm, reply[4], reply[5]),
            tokens=_bucket(policy.tpm, reply[6], reply[7]),
        )

    async def release(self, tenant_id: str, request_id: str, *, used_tokens: int) -> None:
        """End the request's lease: free its concurrency slot and KV tokens and credit
        `charged - used_tokens` back to the token bucket (never above capacity; an overrun
        is not charged). A lease that expired is settled the same way (its slot and KV were
        freed when it expired). Idempotent: releasing an unknown or released lease does
        nothing. One store round trip. Raises StoreUnavailableError."""
        if used_tokens < 0:
            raise InvalidReservationError("used_tokens must not be negative")
        keys = tenant_keys(tenant_id)
        lease_keys = [keys["tok"], keys["leases"], keys["res"], keys["kv"], keys["lapsed"]]
        await self._run(self._release, lease_keys, [request_id, used_tokens])

    async def renew(self, tenant_id: str, request_id: str) -> LeaseState:
        """Push the lease deadline to now + lease_ttl_s (running requests call this well
        within the TTL). A lease that expired before it could be renewed (the store was
        out of reach) is restored with its reservation; a released one stays gone.
        One store round trip. Raises StoreUnavailableError."""
        keys = tenant_keys(tenant_id)
        lease_keys = [keys["leases"], keys["res"], keys["kv"], keys["lapsed"]]
        reply = await self._run(self._renew, lease_keys, [request_id, self.lease_ttl_us])
        return LeaseState(int(reply))
