"""Budgets, per-key limits, live spend and prices with effective times, through two real
gateway replicas on one real store and a real `synthetic:tiny` worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal

import httpx
import pytest

from tenants.ledger import Ledger
from tenants.store import connect
from tests.integration.conftest import GatewayServer, WorkerProcess, gateway_settings

MODEL = "synthetic:tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, strata_cache_dir) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(
        tmp_path_factory.mktemp("tiny") / "engine.sock",
        ["--model", MODEL, "--num-kv-blocks", "256", "--block-size", "4", "--dtype", "float32"],
        strata_cache_dir,
    )
    worker.start()
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def replicas(store_server, tiny, strata_cache_dir) -> Iterator[list[GatewayServer]]:
    """Two gateway replicas on one store and one worker."""
    servers = [
        GatewayServer(gateway_settings(store_server.url, tiny, strata_cache_dir, model=MODEL))
        for _ in range(2)
    ]
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
async def ledger(store_server) -> AsyncIterator[Ledger]:
    client = connect(store_server.url)
    yield Ledger(client)
    await client.aclose()


def set_price(gw: GatewayServer, **price: object) -> dict:
    with gw.admin() as admin:
        r = admin.put("/admin/prices/", json={"model": MODEL, **price})
    assert r.status_code == 200, r.text
    return r.json()


def completion(max_tokens: int = 4, prompt: str = "Hello there", **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


async def post_all(url: str, key: str, bodies: list[dict]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        return await asyncio.gather(
            *(
                client.post("/v1/completions", json=b, headers={"authorization": f"Bearer {key}"})
                for b in bodies
            )
        )


def post(gw: GatewayServer, key: str, body: dict, path: str = "/v1/completions"):
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        return http.post(path, json=body, headers={"authorization": f"Bearer {key}"})


def get(gw: GatewayServer, key: str, path: str, **params):
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        return http.get(path, params=params, headers={"authorization": f"Bearer {key}"})


def cost_of(usage: dict, prompt: int = 1, cached: int = 0, completion: int = 2) -> int:
    """Nano-dollars of a response's usage at rates in dollars per 1M tokens."""
    num_cached = usage["prompt_tokens_details"]["cached_tokens"]
    return (
        (usage["prompt_tokens"] - num_cached) * prompt
        + num_cached * cached
        + usage["completion_tokens"] * completion
    ) * 1000


def nanos(usd: str) -> int:
    return int(Decimal(usd) * 1_000_000_000)


async def ledger_records(ledger: Ledger, tenant_id: str, num: int, timeout: float = 20.0):
    """The tenant's ledger records once `num` have been written (the writer is async)."""
    deadline = time.monotonic() + timeout
    while await ledger.count(tenant_id, 0, time.time() + 10) < num:
        assert time.monotonic() < deadline, "the ledger records did not arrive"
        await asyncio.sleep(0.05)
    return [r async for r in ledger.iter_records(tenant_id, 0, time.time() + 10)]


def budget_of(gw: GatewayServer, path: str) -> dict:
    with gw.admin() as admin:
        r = admin.get(path)
    assert r.status_code == 200, r.text
    return r.json()


def key_id_of(gw: GatewayServer, tenant_id: str) -> str:
    with gw.admin() as admin:
        return admin.get(f"/admin/tenants/{tenant_id}/keys").json()[0]["id"]


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    return body["error"]


# -- budgets ---------------------------------------------------------------------------------


async def test_two_replicas_never_spend_past_a_budget(replicas, ledger):
    first, second = replicas
    set_price(first, prompt_per_m=1.0, completion_per_m=2.0)  # 1 and 2 nano-dollars a token
    tid, key = first.new_tenant()
    with first.admin() as admin:
        r = admin.put(
            f"/admin/tenants/{tid}/budget",
            json={"limit_usd": "0.0005", "period": "day", "thresholds": [50, 100]},
        )
    assert r.status_code == 200, r.text
    assert r.json()["remaining_usd"] == "0.0005"
    # each request may cost up to 11 prompt + 8 x 2 = 27 micro-dollars: 2 x 40 of them
    # could cost 2160, four times the budget
    bodies = [completion(max_tokens=8)] * 40
    a, b = await asyncio.gather(post_all(first.url, key, bodies), post_all(second.url, key, bodies))
    responses = a + b
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == 80
    assert ok and refused
    for r in refused:
        err = error_of(r)
        assert (err["type"], err["code"]) == ("insufficient_quota", "tenant_budget_exceeded")
    records = await ledger_records(ledger, tid, len(ok))
    recorded = sum(r.cost_nanos for r in records)
    assert recorded == sum(cost_of(r.json()["usage"]) for r in ok)
    status = budget_of(second, f"/admin/tenants/{tid}/budget")
    assert nanos(status["spent_usd"]) == recorded <= 500_000
    assert status["reserved_usd"] == "0.00"  # every reservation was settled
    assert nanos(status["remaining_usd"]) == 500_000 - recorded
    # crossing 50% was recorded once, for this tenant and period
    with first.admin() as admin:
        events = [e for e in admin.get("/admin/budget-events").json() if e["tenant_id"] == tid]
    assert [e["threshold_pct"] for e in events if e["threshold_pct"] == 50] == [50]
    assert all(e["scope"] == "tenant" and e["period"] == status["period"] for e in events)


def test_a_request_over_budget_is_refused_with_what_it_needs_and_what_is_left(replicas):
    gw = replicas[0]
    set_price(gw, prompt_per_m=1.0, completion_per_m=2.0)
    tid, key = gw.new_tenant()
    with gw.admin() as admin:
        assert admin.put(f"/admin/tenants/{tid}/budget", json={"limit_usd": 0.00002}).is_success
    r = post(gw, key, completion(max_tokens=8))  # up to 11 + 16 = 27 micro-dollars
    assert r.status_code == 429
    err = error_of(r)
    assert (err["type"], err["code"]) == ("insufficient_quota", "tenant_budget_exceeded")
    assert "$0.000027" in err["message"] and "has $0.00002 left" in err["message"]
    assert "this month" in err["message"]
    assert post(gw, key, completion(max_tokens=4)).status_code == 200  # 19 fits
    # a key's own budget refuses within the tenant's
    key_id = key_id_of(gw, tid)
    with gw.admin() as admin:
        admin.delete(f"/admin/tenants/{tid}/budget")
        r = admin.put(
            f"/admin/keys/{key_id}/budget", json={"limit_usd": "0.00001", "period": "none"}
        )
        assert r.status_code == 200, r.text
    r = post(gw, key, completion(max_tokens=1))  # 13 micro-dollars against 10
    err = error_of(r)
    assert (r.status_code, err["code"]) == (429, "key_budget_exceeded")
    assert "this API key's budget of $0.00001 " in err["message"]
    with gw.admin() as admin:
        assert admin.delete(f"/admin/keys/{key_id}/budget").status_code == 204
    assert post(gw, key, completion(max_tokens=1)).status_code == 200


async def test_settlement_releases_the_unused_reservation(replicas, ledger):
    gw = replicas[1]
    # cached prompt tokens cost nothing: a repeated prompt costs less than its reservation
    set_price(gw, prompt_per_m=1.0, cached_per_m=0.0, completion_per_m=2.0)
    tid, key = gw.new_tenant()
    prompt = "The same long prompt, forty bytes long.."
    body = completion(max_tokens=2, prompt=prompt)
    worst = (len(prompt) + 1 + 2 * 2) * 1000  # every prompt token at the prompt rate (+ BOS)
    with gw.admin() as admin:
        admin.put(f"/admin/tenants/{tid}/budget", json={"limit_usd": f"{2 * worst - 1}e-9"})
    first = post(gw, key, body)
    assert first.status_code == 200
    second = post(gw, key, body)
    assert second.status_code == 200, second.text  # fits only if the first's surplus came back
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    records = await ledger_records(ledger, tid, 2)
    assert records[1].cost_nanos is not None and records[1].cost_nanos < worst
    status = budget_of(gw, f"/admin/tenants/{tid}/budget")
    assert nanos(status["spent_usd"]) == sum(r.cost_nanos for r in records)
    assert status["reserved_usd"] == "0.00"


# -- spend -------------------------------------------------------------------------------------


async def test_spend_equals_the_sum_of_the_ledger(replicas, ledger):
    gw, other = replicas
    set_price(gw, prompt_per_m=0.5, completion_per_m=1.5)
    tid, key = gw.new_tenant()
    with gw.admin() as admin:
        second_key = admin.post(f"/admin/tenants/{tid}/keys", json={"name": "two"}).json()
    await post_all(gw.url, key, [completion(max_tokens=3)] * 3)
    await post_all(other.url, second_key["secret"], [completion(max_tokens=5)] * 2)
    records = await ledger_records(ledger, tid, 5)
    with gw.admin() as admin:
        report = admin.get(f"/admin/tenants/{tid}/spend", params={"group_by": "hour"}).json()
        by_key = admin.get(
            f"/admin/tenants/{tid}/spend",
            params={"group_by": "total", "key_id": second_key["key"]["id"]},
        ).json()
    assert report["cost_nanos"] == sum(r.cost_nanos for r in records) > 0
    assert nanos(report["cost_usd"]) == report["cost_nanos"]
    assert report["requests"] == 5
    assert {row["key_id"] for row in report["rows"]} == {r.key_id for r in records}
    assert all(
        row["model"] == MODEL and row["period_start"].endswith(":00:00Z") for row in report["rows"]
    )
    mine = [r for r in records if r.key_id == second_key["key"]["id"]]
    assert by_key["cost_nanos"] == sum(r.cost_nanos for r in mine)
    assert [row["requests"] for row in by_key["rows"]] == [2]


async def test_a_price_change_never_reprices_past_usage(replicas, ledger):
    gw = replicas[0]
    set_price(gw, prompt_per_m=1.0, cached_per_m=1.0, completion_per_m=1.0)
    tid, key = gw.new_tenant()
    assert post(gw, key, completion(max_tokens=2)).status_code == 200
    (before,) = await ledger_records(ledger, tid, 1)
    set_price(gw, prompt_per_m=10.0, cached_per_m=10.0, completion_per_m=10.0)
    # a change scheduled for later is not in force yet
    later = time.time() + 3600
    scheduled = set_price(
        gw, prompt_per_m=99.0, cached_per_m=99.0, completion_per_m=99.0, effective_at=later
    )
    assert scheduled["effective_at"] == later
    assert (
        set_price(gw, prompt_per_m=10.0, cached_per_m=10.0, completion_per_m=10.0)["effective_at"]
        <= time.time()
    )
    assert post(gw, key, completion(max_tokens=2)).status_code == 200
    old, new = await ledger_records(ledger, tid, 2)
    assert old.cost_nanos == before.cost_nanos
    assert new.cost_nanos == 10 * before.cost_nanos
    with gw.admin() as admin:
        rows = admin.get("/admin/usage/export", params={"tenant": tid, "format": "json"}).json()
        assert [nanos(str(row["cost_total"])) for row in rows] == [
            before.cost_nanos,
            new.cost_nanos,
        ]
        # a price can not take effect in the past
        r = admin.put("/admin/prices/", json={"model": MODEL, "effective_at": 1.0})
        assert (r.status_code, error_of(r)["param"]) == (400, "effective_at")


# -- keys --------------------------------------------------------------------------------------


async def test_a_keys_own_limits_and_models_are_enforced_within_its_tenant(replicas):
    gw, other = replicas
    tid, key = gw.new_tenant(rpm=100)
    key_id = key_id_of(gw, tid)
    with gw.admin() as admin:
        limited = admin.post(
            f"/admin/tenants/{tid}/keys",
            json={"name": "ci", "limits": {"rpm": 2}, "metadata": {"team": "ml"}},
        ).json()
        assert limited["key"]["metadata"] == {"team": "ml"}
    codes = [
        r.status_code for r in await post_all(other.url, limited["secret"], [completion()] * 4)
    ]
    assert sorted(codes) == [200, 200, 429, 429]
    r = post(gw, limited["secret"], completion())
    assert (r.status_code, error_of(r)["code"]) == (429, "rate_limit_key_rpm")
    assert post(gw, key, completion()).status_code == 200  # the tenant's other key is not held
    # allowed models: the key may use only another model
    with gw.admin() as admin:
        r = admin.put(f"/admin/keys/{key_id}/limits", json={"allowed_models": ["other"]})
        assert r.status_code == 200, r.text
    r = post(gw, key, completion())
    assert (r.status_code, error_of(r)["code"]) == (403, "model_not_allowed")
    r = post(gw, key, {"model": MODEL, "prompt": "hi"}, path="/tokenize")
    assert (r.status_code, error_of(r)["code"]) == (403, "model_not_allowed")
    assert get(gw, key, "/v1/models").json()["data"] == []  # it lists what the key may use
    with gw.admin() as admin:
        assert admin.delete(f"/admin/keys/{key_id}/limits").status_code == 204
        status = admin.get(f"/admin/keys/{limited['key']['id']}/status").json()
    assert post(gw, key, completion()).status_code == 200
    assert time.time() - 120 < status["last_used_at"] <= time.time()
    assert status["key"]["limits"]["rpm"] == 2
    # the key's concurrency: one at a time
    with gw.admin() as admin:
        admin.put(f"/admin/keys/{key_id}/limits", json={"max_concurrent": 1})
    codes = [r.status_code for r in await post_all(gw.url, key, [completion(max_tokens=64)] * 4)]
    assert 200 in codes and 429 in codes


def test_v1_usage_shows_only_the_callers_tenant(replicas):
    gw = replicas[0]
    set_price(gw, prompt_per_m=1.0, completion_per_m=1.0)
    mine, my_key = gw.new_tenant()
    _, their_key = gw.new_tenant()
    assert post(gw, my_key, completion()).status_code == 200
    assert post(gw, their_key, completion(max_tokens=6)).status_code == 200
    deadline = time.monotonic() + 20
    while True:
        seen = get(gw, my_key, "/v1/usage/spend", group_by="total").json()
        if seen["spend"]["requests"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert seen["spend"]["tenant_id"] == mine
    assert seen["spend"]["requests"] == 1
    assert seen["key"]["key"]["tenant_id"] == mine
    assert seen["tenant_budget"]["budget"] is None
    rows = get(gw, my_key, "/v1/usage", granularity="request").json()
    assert [row["tenant_id"] for row in rows] == [mine]
    assert get(gw, "sk-strata-" + "x" * 43, "/v1/usage/spend").status_code == 401


def test_a_billing_token_reads_budgets_and_spend_and_changes_nothing(replicas):
    gw = replicas[0]
    tid, _ = gw.new_tenant()
    with gw.admin() as admin:
        r = admin.post("/admin/tokens/", json={"name": "finance", "role": "billing"})
        assert r.status_code == 201, r.text
        secret = r.json()["secret"]
    headers = {"authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=gw.url, headers=headers, timeout=30) as billing:
        assert billing.get(f"/admin/tenants/{tid}/budget").status_code == 200
        assert billing.get(f"/admin/tenants/{tid}/spend").status_code == 200
        assert billing.get("/admin/budget-events").status_code == 200
        r = billing.put(f"/admin/tenants/{tid}/budget", json={"limit_usd": 1})
        assert (r.status_code, error_of(r)["code"]) == (403, "insufficient_role")


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"limit_usd": -1}, "limit_usd"),
        ({"limit_usd": "ten"}, "limit_usd"),
        ({"limit_usd": "0.0000000001"}, "limit_usd"),
        ({"limit_usd": "2000000"}, "limit_usd"),
        ({"limit_usd": 5, "period": "week"}, "period"),
        ({"limit_usd": 5, "thresholds": [0]}, "thresholds"),
        ({"limit_usd": 5, "thresholds": ["half"]}, "thresholds[0]"),
        ({"period": "day"}, "limit_usd"),
    ],
)
def test_bad_budget_input_is_a_400_naming_the_field(replicas, body, field):
    gw = replicas[0]
    tid, _ = gw.new_tenant()
    key_id = key_id_of(gw, tid)
    with gw.admin() as admin:
        for path in (f"/admin/tenants/{tid}/budget", f"/admin/keys/{key_id}/budget"):
            r = admin.put(path, json=body)
            assert r.status_code == 400, r.text
            assert error_of(r)["param"] == field
            assert budget_of(gw, path)["budget"] is None  # nothing was set
        r = admin.put(f"/admin/keys/{key_id}/limits", json={"rpm": -3})
        assert (r.status_code, error_of(r)["param"]) == (400, "limits.rpm")
        r = admin.put(f"/admin/keys/{key_id}/metadata", json={"team": 7})
        assert r.status_code == 400
        assert admin.put("/admin/tenants/nobody/budget", json={"limit_usd": 1}).status_code == 404
    assert budget_of(gw, f"/admin/tenants/{tid}/budget")["budget"] is None
