"""Usage through the real gateway: ledger records, billing exports in every format and
granularity (sums equal to the ledger), prices, tenant isolation, and the admin CLI."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from tenants.ledger import Ledger
from tests.integration.conftest import ADMIN_TOKEN

MODEL = "SmolLM2-135M-Instruct"


async def ledger_record(store_url: str, request_id: str):
    """The ledger's record of a request, once the gateway has written it (10 s at most)."""
    from tenants.store import connect

    client = connect(store_url)
    try:
        ledger = Ledger(client)
        deadline = time.monotonic() + 10
        while (record := await ledger.get(request_id)) is None:
            assert time.monotonic() < deadline, f"no ledger record for {request_id}"
            await asyncio.sleep(0.05)
        return record
    finally:
        await client.aclose()


def chat(key: str, gateway, *, max_tokens: int, user: str | None = None) -> dict:
    with httpx.Client(base_url=gateway.url, timeout=120) as http:
        r = http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "max_tokens": max_tokens,
                "temperature": 0,
                "user": user,
                "messages": [{"role": "user", "content": "Tell me about the sea."}],
            },
            headers={"authorization": f"Bearer {key}"},
        )
    assert r.status_code == 200, r.text
    return r.json()


def parse(fmt: str, raw: bytes) -> list[dict]:
    text = raw.decode()
    if fmt == "csv":
        return list(csv.DictReader(io.StringIO(text)))
    if fmt == "ndjson":
        return [json.loads(line) for line in text.splitlines() if line]
    return json.loads(text)


@pytest.fixture(scope="module")
def billed(gateway):
    """Two tenants with traffic, and a price for the model."""
    with gateway.admin() as admin:
        r = admin.put(
            "/admin/prices/",
            json={
                "model": MODEL,
                "prompt_per_m": 0.5,
                "cached_per_m": 0.1,
                "completion_per_m": 1.5,
            },
        )
        assert r.status_code == 200, r.text
    a, a_key = gateway.new_tenant()
    b, b_key = gateway.new_tenant()
    replies = [chat(a_key, gateway, max_tokens=n, user="alice") for n in (3, 5, 7)]
    replies.append(chat(b_key, gateway, max_tokens=4))
    return {"a": a, "a_key": a_key, "b": b, "b_key": b_key, "replies": replies}


async def test_ledger_has_exactly_one_record_per_request(billed, store_server):
    from tenants.store import connect

    client = connect(store_server.url)
    ledger = Ledger(client)
    for reply in billed["replies"]:
        rec = None
        deadline = time.monotonic() + 10
        while rec is None and time.monotonic() < deadline:
            rec = await ledger.get(reply["id"])
        assert rec is not None
        assert rec.completion_tokens == reply["usage"]["completion_tokens"]
        assert rec.prompt_tokens == reply["usage"]["prompt_tokens"]
        assert rec.model == MODEL
        assert rec.status in ("stop", "length")
        assert rec.ttft_ms is not None and rec.e2e_ms >= rec.ttft_ms
    alice = await ledger.get(billed["replies"][0]["id"])
    assert alice.user == "alice"
    assert alice.tenant_id == billed["a"]
    assert await ledger.count(billed["a"], 0, time.time() + 10) == 3
    await client.aclose()


@pytest.mark.parametrize("fmt", ["csv", "ndjson", "json"])
@pytest.mark.parametrize("granularity", ["request", "hour", "day"])
def test_exports_round_trip_with_sums_equal_to_the_ledger(gateway, billed, fmt, granularity):
    expected = {"prompt": 0, "cached": 0, "completion": 0}
    for reply in billed["replies"][:3]:
        expected["prompt"] += reply["usage"]["prompt_tokens"]
        expected["cached"] += reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        expected["completion"] += reply["usage"]["completion_tokens"]
    assert expected["cached"] > 0  # the same prompt three times: the prefix cache served it
    with gateway.admin() as admin:
        r = admin.get(
            "/admin/usage/export",
            params={"tenant": billed["a"], "format": fmt, "granularity": granularity},
        )
    assert r.status_code == 200, r.text
    rows = parse(fmt, r.content)
    assert sum(int(row["prompt_tokens"]) for row in rows) == expected["prompt"]
    assert sum(int(row["completion_tokens"]) for row in rows) == expected["completion"]
    assert sum(int(row["cached_tokens"]) for row in rows) == expected["cached"]
    assert all(row["tenant_id"] == billed["a"] for row in rows)
    cost = sum(float(row["cost_total"]) for row in rows)
    uncached = expected["prompt"] - expected["cached"]
    manual = (uncached * 0.5 + expected["cached"] * 0.1 + expected["completion"] * 1.5) / 1e6
    assert cost == pytest.approx(manual, rel=1e-6)
    if granularity == "request":
        assert len(rows) == 3
    else:
        assert sum(int(row["requests"]) for row in rows) == 3


async def test_a_request_sent_as_default_is_billed_at_the_served_models_price(
    gateway, billed, store_server
):
    tenant, key = gateway.new_tenant()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as http:
        r = await http.post(
            "/v1/chat/completions",
            json={
                "model": "default",
                "max_tokens": 4,
                "temperature": 0,
                "messages": [{"role": "user", "content": "Tell me about the sea."}],
            },
            headers={"authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["model"] == MODEL
        record = await ledger_record(store_server.url, r.json()["id"])
        assert record.model == MODEL
        with gateway.admin() as admin:
            rows = admin.get(
                "/admin/usage/export", params={"tenant": tenant, "granularity": "day"}
            ).json()
        (row,) = rows
        assert (row["model"], row["priced"], row["requests"]) == (MODEL, True, 1)
        expected = (record.prompt_tokens * 0.5 + record.completion_tokens * 1.5) / 1e6
        assert float(row["cost_total"]) == pytest.approx(expected, rel=1e-12)
        metrics = (await http.get("/metrics")).text
        assert (
            f'strata:request_success_total{{model="{MODEL}",status="length",tenant="{tenant}"}}'
            in metrics
        )


async def test_unpriced_usage_is_flagged_counted_and_logged(gateway, store_server, caplog):
    from tenants.ledger import Ledger
    from tenants.records import UsageRecord
    from tenants.store import connect

    tenant, _ = gateway.new_tenant()
    client = connect(store_server.url)
    try:
        await Ledger(client).record(
            UsageRecord(
                request_id=f"cmpl-old-{tenant}",
                tenant_id=tenant,
                key_id="key_x",
                model="never-priced",
                prompt_tokens=10,
                finished_at=time.time() - 60,
            )
        )
    finally:
        await client.aclose()
    with gateway.admin() as admin, caplog.at_level("WARNING"):
        (row,) = admin.get("/admin/usage/export", params={"tenant": tenant}).json()
        assert (row["priced"], row["cost_total"]) == (False, 0)
        metrics = admin.get("/metrics").text
    assert 'strata:usage_unpriced_requests_total{model="never-priced"}' in metrics
    assert any(
        "never-priced" in r.getMessage() and "no price" in r.getMessage() for r in caplog.records
    )


def test_export_windows_take_iso_dates(gateway, billed):
    """Operators bill by calendar: the same export by ISO 8601 dates as by unix seconds."""
    today = datetime.now(UTC).date()
    window = {"start": str(today - timedelta(days=1)), "end": str(today + timedelta(days=2))}
    past = {"start": "2020-01-01", "end": "2020-02-01T00:00:00Z"}
    with gateway.admin() as admin:
        rows = [
            admin.get("/admin/usage/export", params={"tenant": billed["a"], **w}).json()
            for w in (window, past)
        ]
        bad = admin.get("/admin/usage/export", params={"start": "last month"})
    assert len(rows[0]) == 3 and rows[1] == []
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "start"


def test_tenant_usage_endpoint_is_isolated(gateway, billed):
    with httpx.Client(base_url=gateway.url) as http:
        own = http.get(
            "/v1/usage",
            params={"granularity": "request"},
            headers={"authorization": f"Bearer {billed['b_key']}"},
        )
    assert own.status_code == 200
    rows = own.json()
    assert len(rows) == 1
    assert rows[0]["tenant_id"] == billed["b"]
    with httpx.Client(base_url=gateway.url) as http:
        # a tenant key never opens the admin export
        r = http.get(
            "/admin/usage/export",
            params={"tenant": billed["a"]},
            headers={"authorization": f"Bearer {billed['b_key']}"},
        )
    assert r.status_code == 401


def test_admin_cli_mirrors_the_api(gateway, billed, tmp_path):
    env = dict(os.environ, STRATA_ADMIN_TOKEN=ADMIN_TOKEN)

    def strata(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    made = strata(
        "admin", "--url", gateway.url, "--json", "tenants", "create", "cli-tenant", "--rpm", "7"
    )
    assert made.returncode == 0, made.stderr
    tenant = json.loads(made.stdout)
    assert tenant["policy"]["rpm"] == 7
    key = strata("admin", "--url", gateway.url, "keys", "create", tenant["id"], "--json")
    secret = json.loads(key.stdout)["secret"]
    assert secret.startswith("sk-strata-")
    assert chat(secret, gateway, max_tokens=2)["usage"]["completion_tokens"] == 2
    out = tmp_path / "usage.csv"
    exported = strata(
        "usage",
        "export",
        "--url",
        gateway.url,
        "--tenant",
        billed["a"],
        "--format",
        "csv",
        "--output",
        str(out),
    )
    assert exported.returncode == 0, exported.stderr
    assert len(parse("csv", out.read_bytes())) == 3
    missing = strata("admin", "--url", gateway.url, "tenants", "show", "t_nope")
    assert missing.returncode != 0
    assert "404" in missing.stderr


async def test_prefix_cache_is_isolated_per_tenant_unless_shared(gateway, store_server):

    document = "Strata keeps the KV of long documents so questions about them start fast. " * 12
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": document + "What does Strata keep?"}],
        "max_tokens": 2,
        "temperature": 0,
    }

    async def ask(key: str) -> dict:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as http:
            headers = {"authorization": f"Bearer {key}"}
            r = await http.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()

    def cached(reply: dict) -> int:
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    _, first = gateway.new_tenant()
    _, second = gateway.new_tenant()
    assert cached(await ask(first)) == 0
    hit = await ask(first)
    assert cached(hit) >= 150  # the same tenant reuses its own blocks
    assert cached(await ask(second)) == 0  # another tenant never sees them
    _, shared_a = gateway.new_tenant(shared_cache_namespace="public-docs")
    _, shared_b = gateway.new_tenant(shared_cache_namespace="public-docs")
    assert cached(await ask(shared_a)) == 0
    assert cached(await ask(shared_b)) == cached(hit)  # both opted into one namespace
    record = await ledger_record(store_server.url, hit["id"])
    assert record.cached_tokens == cached(hit)  # billed as cached


async def test_cached_tokens_are_broken_down_by_tier(store_server, strata_cache_dir, tmp_path):
    """A worker whose device pool holds about one document: a document asked about again
    after others comes back from host RAM and disk, and the API and the ledger say so."""
    from tests.integration.conftest import GatewayServer, WorkerProcess, gateway_settings

    worker = WorkerProcess(
        tmp_path / "engine.sock",
        [
            "--model",
            "default",
            "--num-kv-blocks",
            "24",
            "--kv-host-gb",
            "0.006",
            "--kv-disk-gb",
            "0.05",
            "--kv-disk-path",
            str(tmp_path / "kv"),
        ],
        strata_cache_dir,
    )
    worker.start()
    server = GatewayServer(gateway_settings(store_server.url, worker, strata_cache_dir))
    server.start()
    try:
        tenant_id, key = server.new_tenant()
        docs = [
            f"Document {d}: " + f"fact {d} about the ocean, the wind and the tide. " * 20
            for d in range(3)
        ]

        async def ask(doc: str) -> dict:
            body = {
                "model": "default",
                "max_tokens": 1,
                "temperature": 0,
                "messages": [{"role": "user", "content": doc + "Summarize."}],
            }
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                r = await http.post(
                    "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
                )
            assert r.status_code == 200, r.text
            return r.json()

        for doc in docs:
            await ask(doc)
        again = await ask(docs[0])  # its pages left the device while the others ran
        details = again["usage"]["prompt_tokens_details"]
        below = details["cached_tokens_host"] + details["cached_tokens_disk"]
        assert details["cached_tokens"] >= 150 and below > 0
        assert details["cached_tokens_host"] > 0 and details["cached_tokens_disk"] > 0
        record = await ledger_record(store_server.url, again["id"])
        assert record.cached_tokens == details["cached_tokens"]
        assert record.cached_host_tokens == details["cached_tokens_host"]
        assert record.cached_disk_tokens == details["cached_tokens_disk"]
        async with httpx.AsyncClient(base_url=server.url) as http:
            metrics = (await http.get("/metrics")).text
        for tier in ("device", "host", "disk"):  # the tenant's blocks, tier by tier
            assert f'strata:kv_blocks{{tenant="{tenant_id}",tier="{tier}"}}' in metrics
        value = {
            line.split()[0]: float(line.split()[1])
            for line in metrics.splitlines()
            if line[:1] != "#"
        }
        of_worker = f'worker="{worker.address}"'
        for tier in ("host", "disk"):  # pages went down to each tier and were hit there
            assert value[f'strata:kv_spilled_blocks_total{{tier="{tier}",{of_worker}}}'] > 0
            assert value[f'strata:kv_cache_hit_blocks_total{{tier="{tier}",{of_worker}}}'] > 0
        assert value[f'strata:kv_cache_hit_blocks_total{{tier="device",{of_worker}}}'] >= 0
        assert value[f"strata:num_requests_loading_kv{{{of_worker}}}"] == 0  # loads are over
        assert value[f"strata:kv_disk_write_errors_total{{{of_worker}}}"] == 0
        # the disk pages were read ahead, and their buffers went with the loads
        assert value[f"strata:kv_disk_read_ahead_bytes{{{of_worker}}}"] == 0
        assert value[f"strata:kv_disk_checksum_failures_total{{{of_worker}}}"] == 0
    finally:
        server.stop()
        worker.stop()
