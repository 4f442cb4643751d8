import asyncio
import random
import time

import pytest
import redis.asyncio as aioredis

from policies.admission import (
    Admission,
    Decision,
    DenyReason,
    InvalidReservationError,
    LeaseState,
    StoreUnavailableError,
    tenant_keys,
)
from tenants.records import Policy
from tenants.store import connect

TENANT = "acme"


async def reserve(adm, policy, request_id, *, cost=10, kv=0, tenant=TENANT):
    return await adm.reserve(
        tenant, policy, request_id, prompt_tokens=cost, max_tokens=0, kv_tokens=kv
    )


async def snapshot(client, tenant=TENANT):
    """Every admission key of the tenant with its contents."""
    out = {}
    for role, key in tenant_keys(tenant).items():
        kind = (await client.type(key)).decode()
        if kind == "hash":
            out[role] = await client.hgetall(key)
        elif kind == "zset":
            out[role] = await client.zrange(key, 0, -1, withscores=True)
        elif kind == "string":
            out[role] = await client.get(key)
    return out


async def kv_in_flight(client, tenant=TENANT):
    return int(await client.get(tenant_keys(tenant)["kv"]) or 0)


@pytest.fixture
async def pooled_clients(store_server, redis_client):
    """Two more clients ("replicas") on the emptied database whose pools queue commands:
    redis-py's default pool raises MaxConnectionsError beyond 100 commands in flight."""
    clients = [
        aioredis.Redis(
            connection_pool=aioredis.BlockingConnectionPool.from_url(
                store_server.url, max_connections=32, timeout=10
            )
        )
        for _ in range(2)
    ]
    # open every connection now: a replica still connecting when a race starts would leave
    # all the early slots to the other one
    for client in clients:
        await asyncio.gather(*(client.ping() for _ in range(32)))
    yield clients
    for client in clients:
        await client.aclose()


# -- single outcomes -----------------------------------------------------------------------


async def test_allowed_request_reports_bucket_state(redis_client):
    adm = Admission(redis_client)
    policy = Policy(rpm=10, tpm=1000, max_concurrent=2, kv_budget_tokens=500)
    d = await adm.reserve(TENANT, policy, "r1", prompt_tokens=100, max_tokens=50, kv_tokens=200)
    assert d.allowed and d.reason is None and d.retry_after_s is None and not d.hard
    assert (d.requests.limit, d.requests.remaining) == (10, 9)
    assert d.requests.reset_s == pytest.approx(6.0, abs=0.01)  # one request at 10/min
    assert (d.tokens.limit, d.tokens.remaining) == (1000, 850)
    assert d.tokens.reset_s == pytest.approx(9.0, abs=0.01)  # 150 tokens at 1000/min
    assert await kv_in_flight(redis_client) == 200


async def test_unlimited_policy_admits_everything_and_reports_no_limits(redis_client):
    adm = Admission(redis_client)
    decisions = [await reserve(adm, Policy(), f"r{i}", cost=10**6, kv=10**6) for i in range(50)]
    assert all(d.allowed for d in decisions)
    assert all(d.requests is None and d.tokens is None for d in decisions)


async def test_rpm_denial(redis_client):
    adm = Admission(redis_client)
    policy = Policy(rpm=2)
    assert (await reserve(adm, policy, "a")).allowed
    assert (await reserve(adm, policy, "b")).allowed
    d = await reserve(adm, policy, "c")
    assert not d.allowed and d.reason is DenyReason.RPM and not d.hard
    assert 29.0 < d.retry_after_s <= 30.0  # one request refills in 30 s at 2/min
    assert d.requests.remaining == 0
    assert 59.0 < d.requests.reset_s <= 60.0
    assert d.tokens is None


async def test_tpm_denial_is_soft_when_the_bucket_can_refill(redis_client):
    adm = Admission(redis_client)
    policy = Policy(tpm=1200)  # 20 tokens/s
    assert (await reserve(adm, policy, "a", cost=1000)).tokens.remaining == 200
    d = await reserve(adm, policy, "b", cost=500)
    assert not d.allowed and d.reason is DenyReason.TPM and not d.hard
    assert d.retry_after_s == pytest.approx(15.0, abs=0.5)  # 300 missing tokens at 20/s
    assert d.tokens.remaining == 200


async def test_tpm_denial_is_hard_when_the_request_exceeds_capacity(redis_client):
    adm = Admission(redis_client)
    policy = Policy(rpm=5, tpm=1000)
    d = await adm.reserve(TENANT, policy, "big", prompt_tokens=600, max_tokens=401, kv_tokens=0)
    assert not d.allowed and d.reason is DenyReason.TPM and d.hard and d.retry_after_s is None
    assert d.requests.remaining == 5 and d.tokens.remaining == 1000
    exact = await adm.reserve(TENANT, policy, "fit", prompt_tokens=600, max_tokens=400, kv_tokens=0)
    assert exact.allowed and exact.tokens.remaining == 0


async def test_concurrency_denial_until_a_release(redis_client):
    adm = Admission(redis_client)
    policy = Policy(max_concurrent=2)
    assert (await reserve(adm, policy, "a")).allowed
    assert (await reserve(adm, policy, "b")).allowed
    d = await reserve(adm, policy, "c")
    assert not d.allowed and d.reason is DenyReason.CONCURRENCY and not d.hard
    assert d.retry_after_s == 1.0
    await adm.release(TENANT, "a", used_tokens=0)
    assert (await reserve(adm, policy, "c")).allowed


async def test_kv_budget_denial_soft_and_hard(redis_client):
    adm = Admission(redis_client, busy_retry_after_s=0.5)
    policy = Policy(kv_budget_tokens=1000)
    assert (await reserve(adm, policy, "a", kv=600)).allowed
    soft = await reserve(adm, policy, "b", kv=500)
    assert not soft.allowed and soft.reason is DenyReason.KV_BUDGET and not soft.hard
    assert soft.retry_after_s == 0.5
    hard = await reserve(adm, policy, "c", kv=1001)
    assert not hard.allowed and hard.reason is DenyReason.KV_BUDGET and hard.hard
    assert (await reserve(adm, policy, "d", kv=400)).allowed  # exactly fills the budget
    await adm.release(TENANT, "a", used_tokens=0)
    assert (await reserve(adm, policy, "b", kv=500)).allowed
    assert await kv_in_flight(redis_client) == 900


async def test_first_failing_limit_is_reported_hard_ones_first(redis_client):
    adm = Admission(redis_client)
    full = Policy(rpm=1, tpm=100, max_concurrent=1, kv_budget_tokens=100)
    assert (await reserve(adm, full, "a", cost=100, kv=100)).allowed  # exhausts every limit
    cases = [
        (full, DenyReason.RPM),
        (Policy(tpm=100, max_concurrent=1, kv_budget_tokens=100), DenyReason.TPM),
        (Policy(max_concurrent=1, kv_budget_tokens=100), DenyReason.CONCURRENCY),
        (Policy(kv_budget_tokens=100), DenyReason.KV_BUDGET),
    ]
    for policy, reason in cases:
        d = await reserve(adm, policy, "b", cost=100, kv=100)
        assert (d.allowed, d.reason, d.hard) == (False, reason, False)
    d = await reserve(adm, full, "c", cost=101, kv=0)  # rpm is empty too, but tpm can never fit
    assert (d.reason, d.hard) == (DenyReason.TPM, True)


async def test_denials_change_no_counter(redis_client):
    adm = Admission(redis_client)
    policy = Policy(rpm=2, tpm=1000, max_concurrent=2, kv_budget_tokens=500)
    await reserve(adm, policy, "a", cost=400, kv=200)
    await reserve(adm, policy, "b", cost=400, kv=200)
    before = await snapshot(redis_client)
    assert set(before) == {"req", "tok", "leases", "res", "kv"}
    no_rpm = Policy(tpm=1000, max_concurrent=2, kv_budget_tokens=500)
    denials = [
        await reserve(adm, policy, "c", cost=1),
        await reserve(adm, no_rpm, "d", cost=300),
        await reserve(adm, no_rpm, "e", cost=2000),
        await reserve(adm, Policy(max_concurrent=2), "f", cost=1),
        await reserve(adm, Policy(kv_budget_tokens=500), "g", cost=1, kv=101),
        await reserve(adm, Policy(kv_budget_tokens=500), "h", cost=1, kv=501),
    ]
    assert [(d.reason, d.hard) for d in denials] == [
        (DenyReason.RPM, False),
        (DenyReason.TPM, False),
        (DenyReason.TPM, True),
        (DenyReason.CONCURRENCY, False),
        (DenyReason.KV_BUDGET, False),
        (DenyReason.KV_BUDGET, True),
    ]
    assert await snapshot(redis_client) == before


# -- release, idempotency, refill -----------------------------------------------------------


async def test_release_credits_unused_tokens(redis_client):
    adm = Admission(redis_client)
    policy = Policy(tpm=1000)
    assert (await reserve(adm, policy, "a", cost=500)).tokens.remaining == 500
    await adm.release(TENANT, "a", used_tokens=150)
    remaining = (await reserve(adm, policy, "b", cost=10)).tokens.remaining
    assert 840 <= remaining <= 845  # 500 + 350 credited - 10, plus a little refill


async def test_release_never_credits_above_capacity(redis_client):
    adm = Admission(redis_client)
    policy = Policy(tpm=600)  # 10 tokens/s
    assert (await reserve(adm, policy, "a", cost=600)).tokens.remaining == 0
    await asyncio.sleep(0.3)  # ~3 tokens refill while the request runs
    await adm.release(TENANT, "a", used_tokens=0)
    assert (await reserve(adm, policy, "b", cost=1)).tokens.remaining == 599


async def test_release_is_idempotent(redis_client):
    adm = Admission(redis_client)
    policy = Policy(tpm=1000, max_concurrent=2)
    await reserve(adm, policy, "a", cost=500, kv=30)
    await reserve(adm, policy, "b", cost=400, kv=70)
    await adm.release(TENANT, "a", used_tokens=0)
    await adm.release(TENANT, "a", used_tokens=0)
    d = await reserve(adm, policy, "c", cost=1, kv=5)
    assert d.allowed and 599 <= d.tokens.remaining <= 603  # credited once, not twice
    assert not (await reserve(adm, policy, "d")).allowed  # b and c still hold both slots
    assert await kv_in_flight(redis_client) == 75


async def test_overrun_is_not_charged_and_unknown_release_is_a_no_op(redis_client):
    adm = Admission(redis_client)
    policy = Policy(tpm=1000)
    await reserve(adm, policy, "a", cost=100)
    await adm.release(TENANT, "a", used_tokens=500)
    await adm.release(TENANT, "never-reserved", used_tokens=0)
    assert 899 <= (await reserve(adm, policy, "b", cost=0)).tokens.remaining <= 902


async def test_reserve_is_idempotent_per_request_id(redis_client):
    adm = Admission(redis_client)
    policy = Policy(rpm=10, tpm=1000, max_concurrent=1, kv_budget_tokens=100)
    first = await reserve(adm, policy, "a", cost=100, kv=100)
    again = await reserve(adm, policy, "a", cost=100, kv=100)
    assert first.allowed and again.allowed
    assert again.requests.remaining == 9 and 900 <= again.tokens.remaining <= 901
    assert await kv_in_flight(redis_client) == 100
    assert (await reserve(adm, policy, "b", cost=1)).reason is DenyReason.CONCURRENCY
    await adm.release(TENANT, "a", used_tokens=100)
    assert (await reserve(adm, policy, "b", cost=1, kv=100)).allowed
    assert await kv_in_flight(redis_client) == 100


async def test_token_bucket_refills_over_time(redis_client):
    adm = Admission(redis_client)
    policy = Policy(tpm=600)  # 10 tokens/s
    assert (await reserve(adm, policy, "a", cost=600)).allowed
    denied = await reserve(adm, policy, "b", cost=5)
    assert denied.reason is DenyReason.TPM
    assert denied.retry_after_s == pytest.approx(0.5, abs=0.05)
    assert denied.tokens.reset_s == pytest.approx(60.0, abs=0.1)
    await asyncio.sleep(denied.retry_after_s + 0.05)
    assert (await reserve(adm, policy, "b", cost=5)).allowed


async def test_request_bucket_refills_over_time(redis_client):
    adm = Admission(redis_client)
    policy = Policy(rpm=120)  # 2 requests/s
    start = time.monotonic()
    num_allowed = 0
    while (d := await reserve(adm, policy, f"r{num_allowed}")).allowed:
        num_allowed += 1
    assert 120 <= num_allowed <= 121 + 2 * (time.monotonic() - start)
    assert d.reason is DenyReason.RPM and 0.0 < d.retry_after_s <= 0.5
    await asyncio.sleep(d.retry_after_s + 0.05)
    assert (await reserve(adm, policy, "late")).allowed


async def test_tenants_do_not_share_counters(redis_client):
    adm = Admission(redis_client)
    policy = Policy(rpm=1, max_concurrent=1)
    assert (await reserve(adm, policy, "a", tenant="t1")).allowed
    assert not (await reserve(adm, policy, "b", tenant="t1")).allowed
    assert (await reserve(adm, policy, "a", tenant="t2")).allowed


async def test_idle_state_expires_from_the_store(redis_client):
    adm = Admission(redis_client, lease_ttl_s=5.0)
    await reserve(adm, Policy(tpm=6000), "a", cost=50)  # 100 tokens/s: full again in 0.5 s
    keys = tenant_keys(TENANT)
    assert 0 < await redis_client.pttl(keys["tok"]) <= 1500
    for role in ("leases", "res"):
        assert 4000 < await redis_client.pttl(keys[role]) <= 6000


# -- races and replicas ---------------------------------------------------------------------

RACE_CASES = {
    # binding limit: (policy, tokens per request, kv per request, admitted, refill per s)
    "rpm": (Policy(rpm=50, tpm=100_000, max_concurrent=500), 10, 0, 50, 50 / 60),
    "tpm": (Policy(rpm=1000, tpm=1000, kv_budget_tokens=10**6), 30, 10, 33, 1000 / 60 / 30),
    "concurrency": (Policy(rpm=1000, tpm=100_000, max_concurrent=7), 10, 0, 7, 0.0),
    "kv_budget": (Policy(max_concurrent=500, kv_budget_tokens=1000), 10, 90, 11, 0.0),
}


@pytest.mark.parametrize("limit", list(RACE_CASES))
async def test_concurrent_reserves_never_exceed_the_limit(pooled_clients, limit):
    policy, cost, kv, admitted, refill_per_s = RACE_CASES[limit]
    adm = Admission(pooled_clients[0])
    start = time.monotonic()
    decisions = await asyncio.gather(
        *(reserve(adm, policy, f"r{i}", cost=cost, kv=kv) for i in range(200))
    )
    elapsed = time.monotonic() - start
    num_allowed = sum(d.allowed for d in decisions)
    assert admitted <= num_allowed <= admitted + int(refill_per_s * elapsed)
    assert {d.reason for d in decisions if not d.allowed} == {DenyReason(limit)}


@pytest.mark.parametrize("limit", ["tpm", "concurrency"])
async def test_two_replicas_share_the_limits(pooled_clients, limit):
    policy, cost, kv, admitted, refill_per_s = RACE_CASES[limit]
    replicas = [Admission(client) for client in pooled_clients]

    async def staggered(i: int) -> Decision:
        # a replica pipelines the calls of one loop turn; arriving in waves interleaves them
        await asyncio.sleep(i // 4 * 0.0005)
        return await reserve(replicas[i % 2], policy, f"r{i}", cost=cost, kv=kv)

    start = time.monotonic()
    decisions = await asyncio.gather(*(staggered(i) for i in range(400)))
    elapsed = time.monotonic() - start
    allowed_ids = [i for i, d in enumerate(decisions) if d.allowed]
    assert admitted <= len(allowed_ids) <= admitted + int(refill_per_s * elapsed)
    assert {i % 2 for i in allowed_ids} == {0, 1}  # both replicas won some


async def test_two_replicas_hammered_keep_concurrency_and_kv_within_limits(pooled_clients):
    policy = Policy(max_concurrent=5, kv_budget_tokens=1000)
    replicas = [Admission(client) for client in pooled_clients]
    rng = random.Random(7)
    held = {"requests": 0, "kv": 0, "max_requests": 0, "max_kv": 0, "admitted": 0}

    async def worker(worker_id: int) -> None:
        adm = replicas[worker_id % 2]
        for step in range(12):
            kv = rng.choice([100, 200, 300])
            request_id = f"w{worker_id}-{step}"
            if not (await reserve(adm, policy, request_id, kv=kv)).allowed:
                await asyncio.sleep(0.001)
                continue
            held["requests"] += 1
            held["kv"] += kv
            held["admitted"] += 1
            held["max_requests"] = max(held["max_requests"], held["requests"])
            held["max_kv"] = max(held["max_kv"], held["kv"])
            await asyncio.sleep(rng.uniform(0.0, 0.005))
            held["requests"] -= 1
            held["kv"] -= kv
            await adm.release(TENANT, request_id, used_tokens=0)

    await asyncio.gather(*(worker(i) for i in range(24)))
    assert held["max_requests"] <= 5 and held["max_kv"] <= 1000
    assert held["max_requests"] >= 3 and held["admitted"] >= 24  # the limits were contested
    assert await snapshot(pooled_clients[0]) == {}  # everything released, nothing left behind


# -- leases ---------------------------------------------------------------------------------


async def test_a_crashed_replicas_leases_expire(redis_client, pooled_clients):
    crashed = Admission(redis_client, lease_ttl_s=0.3)
    survivor = Admission(pooled_clients[0])
    policy = Policy(max_concurrent=2, kv_budget_tokens=1000)
    assert (await reserve(crashed, policy, "a", kv=500)).allowed
    assert (await reserve(crashed, policy, "b", kv=500)).allowed
    assert (await reserve(survivor, policy, "c", kv=100)).reason is DenyReason.CONCURRENCY
    await asyncio.sleep(0.4)
    assert (await reserve(survivor, policy, "c", kv=1000)).allowed  # both slots and KV freed
    assert await kv_in_flight(redis_client) == 1000
    await crashed.release(TENANT, "a", used_tokens=0)  # too late: changes nothing
    assert await kv_in_flight(redis_client) == 1000
    assert (await reserve(survivor, policy, "d", kv=1)).reason is DenyReason.KV_BUDGET


async def test_renew_keeps_a_long_stream_admitted(redis_client):
    adm = Admission(redis_client, lease_ttl_s=0.4)
    policy = Policy(max_concurrent=1)
    assert (await reserve(adm, policy, "stream")).allowed
    for _ in range(3):
        await asyncio.sleep(0.25)
        assert await adm.renew(TENANT, "stream") is LeaseState.RENEWED
    assert (await reserve(adm, policy, "other")).reason is DenyReason.CONCURRENCY
    await adm.release(TENANT, "stream", used_tokens=5)
    assert await adm.renew(TENANT, "stream") is LeaseState.GONE
    assert (await reserve(adm, policy, "other")).allowed


async def test_renew_after_expiry_restores_the_reservation(redis_client):
    adm = Admission(redis_client, lease_ttl_s=0.1)
    policy = Policy(max_concurrent=1, kv_budget_tokens=100)
    assert (await reserve(adm, policy, "a", kv=60)).allowed
    await asyncio.sleep(0.15)
    assert (await reserve(adm, policy, "probe", kv=1)).allowed  # "a" expired: purged
    await adm.release(TENANT, "probe", used_tokens=0)
    assert await kv_in_flight(redis_client) == 0
    assert await adm.renew(TENANT, "a") is LeaseState.RESTORED  # it is still running
    assert await kv_in_flight(redis_client) == 60
    assert (await reserve(adm, policy, "b", kv=1)).reason is DenyReason.CONCURRENCY
    await adm.release(TENANT, "a", used_tokens=0)
    assert await adm.renew(TENANT, "a") is LeaseState.GONE  # released: never restored
    assert await snapshot(redis_client) == {}


async def test_release_after_expiry_credits_the_unused_tokens_once(redis_client):
    adm = Admission(redis_client, lease_ttl_s=0.1)
    policy = Policy(tpm=1000)
    assert (await reserve(adm, policy, "a", cost=400)).allowed
    await asyncio.sleep(0.15)
    assert (await reserve(adm, policy, "b", cost=100)).allowed  # purges "a"
    await adm.release(TENANT, "b", used_tokens=100)
    before = (await reserve(adm, policy, "probe", cost=0)).tokens
    await adm.release(TENANT, "a", used_tokens=150)  # the gateway settles it late
    await adm.release(TENANT, "a", used_tokens=150)  # a retried release credits nothing more
    after = (await reserve(adm, policy, "probe2", cost=0)).tokens
    assert before is not None and after is not None
    assert 250 <= after.remaining - before.remaining <= 252  # refill over the gap: ~1 token


# -- store round trips and failures --------------------------------------------------------


async def test_one_round_trip_per_call_and_eval_fallback(redis_client, monkeypatch):
    adm = Admission(redis_client)
    await redis_client.script_flush()
    sent = []
    original = redis_client.execute_command

    async def counting(*args, **options):
        sent.append(args[0])
        return await original(*args, **options)

    monkeypatch.setattr(redis_client, "execute_command", counting)
    policy = Policy(rpm=10, tpm=1000, max_concurrent=2, kv_budget_tokens=100)
    assert (await reserve(adm, policy, "a")).allowed
    assert sent == ["EVALSHA", "EVAL"]  # the server did not know the script yet
    await adm.release(TENANT, "a", used_tokens=1)
    await adm.renew(TENANT, "a")
    sent.clear()
    assert (await reserve(adm, policy, "b")).allowed
    assert await adm.renew(TENANT, "b") is LeaseState.RENEWED
    await adm.release(TENANT, "b", used_tokens=1)
    assert sent == ["EVALSHA", "EVALSHA", "EVALSHA"]


async def test_a_burst_is_one_pipeline(redis_client):
    adm = Admission(redis_client)
    await redis_client.script_flush()
    policy = Policy(max_concurrent=5)

    async def burst(prefix: str) -> list[bool]:
        calls = (reserve(adm, policy, f"{prefix}{i}") for i in range(8))
        return [d.allowed for d in await asyncio.gather(*calls)]

    # the server does not know the scripts yet: NOSCRIPT inside the pipeline, then EVAL
    assert await burst("a") == [True] * 5 + [False] * 3  # atomic, in order
    await asyncio.gather(*(adm.release(TENANT, f"a{i}", used_tokens=0) for i in range(8)))
    assert await snapshot(redis_client) == {}
    sent = []
    original = redis_client.execute_command

    async def counting(*args, **options):
        sent.append(args[0])
        return await original(*args, **options)

    before = (await redis_client.info("stats"))["total_reads_processed"]
    redis_client.execute_command = counting
    assert await burst("b") == [True] * 5 + [False] * 3
    redis_client.execute_command = original
    after = (await redis_client.info("stats"))["total_reads_processed"]
    assert sent == []  # no single commands: one pipeline
    assert after - before <= 3  # the burst, and the INFO commands around it


async def test_unreachable_store_raises_quickly(private_store):
    client = connect(private_store.url, timeout=0.5)
    adm = Admission(client)
    assert (await reserve(adm, Policy(rpm=5), "a")).allowed
    private_store.kill()
    for call in (
        lambda: reserve(adm, Policy(rpm=5), "b"),
        lambda: adm.release(TENANT, "a", used_tokens=0),
        lambda: adm.renew(TENANT, "a"),
    ):
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            await call()
        assert time.monotonic() - start < 2.0
    await client.aclose()


async def test_invalid_arguments_are_typed_errors(redis_client):
    adm = Admission(redis_client)
    with pytest.raises(InvalidReservationError):
        await reserve(adm, Policy(), "a", cost=-1)
    with pytest.raises(InvalidReservationError):
        await reserve(adm, Policy(), "a", tenant="bad{tag}")
    with pytest.raises(InvalidReservationError):
        await reserve(adm, Policy(), "")
    with pytest.raises(InvalidReservationError):
        await adm.release(TENANT, "a", used_tokens=-5)
    with pytest.raises(InvalidReservationError):
        Admission(redis_client, lease_ttl_s=0)
