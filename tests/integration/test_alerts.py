"""Operator alerts as signed webhooks: a real gateway over real HTTP with its own
valkey-server, real synthetic:tiny workers, and a real HTTP receiver in a thread that
records what it is sent (and can fail or hang on purpose)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
import secrets
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from gateway.webhooks import AlertConfig
from tenants.alerts import STREAM
from tenants.store import EmbeddedStore, connect
from tests.integration.conftest import (
    ADMIN_TOKEN,
    TINY_WORKER,
    GatewayServer,
    WorkerProcess,
    _free_port,
    gateway_settings,
)
from tests.integration.test_console import signed_in_client

FAST = AlertConfig(backoff_s=0.05, max_backoff_s=0.2, timeout_s=30.0, lost_check_delay_s=0.5)
SECRET = secrets.token_urlsafe(32)


class Receiver:
    """An HTTP server on a free port that records every request it gets. It answers 500 to
    the first `num_failures` requests, and while `hanging` holds each request until
    `release` is set."""

    def __init__(self, num_failures: int = 0, hanging: bool = False) -> None:
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.num_failures = num_failures
        self.hanging = hanging
        self.release = threading.Event()
        self.num_held = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver.lock:
                    receiver.requests.append(
                        ({k.lower(): v for k, v in self.headers.items()}, body)
                    )
                    failing = len(receiver.requests) <= receiver.num_failures
                    if receiver.hanging:
                        receiver.num_held += 1
                if receiver.hanging:
                    receiver.release.wait(60)
                self.send_response(500 if failing else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", _free_port()), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def of_type(self, kind: str) -> list[tuple[dict[str, str], bytes]]:
        with self.lock:
            return [(h, b) for h, b in self.requests if h.get("x-strata-event") == kind]


def wait_until(predicate, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
    return value


@pytest.fixture(scope="module")
def alerts_store(tmp_path_factory) -> Iterator[EmbeddedStore]:
    store = EmbeddedStore(tmp_path_factory.mktemp("alerts-store"))
    store.start()
    yield store
    store.stop()


@pytest.fixture(scope="module")
def alerts_gateway(tmp_path_factory, alerts_store, strata_cache_dir) -> Iterator[GatewayServer]:
    root = tmp_path_factory.mktemp("alerts")
    worker = WorkerProcess(root / "engine.sock", TINY_WORKER, strata_cache_dir)
    worker.start()
    settings = gateway_settings(alerts_store.url, worker, strata_cache_dir, alerts=FAST)
    server = GatewayServer(settings)
    server.start()
    yield server
    server.stop()
    worker.stop()


def register(admin: httpx.Client, url: str, events: list[str], description: str = "") -> dict:
    created = admin.post(
        "/admin/webhooks/", json={"url": url, "events": events, "description": description}
    )
    assert created.status_code == 201, created.text
    return created.json()


def verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """What a receiver does: recompute the signature over "<t>.<body>" and compare."""
    fields = dict(part.split("=", 1) for part in headers["x-strata-signature"].split(","))
    expected = hmac.new(secret.encode(), f"{fields['t']}.".encode() + body, hashlib.sha256)
    return hmac.compare_digest(expected.hexdigest(), fields["v1"])


def test_a_registered_webhook_gets_a_signed_test_event(alerts_gateway) -> None:
    with Receiver() as receiver, alerts_gateway.admin() as admin:
        created = register(admin, receiver.url, ["worker_lost"], "on-call")
        hook, secret = created["webhook"], created["secret"]
        assert secret.startswith("whsec_")
        listed = admin.get("/admin/webhooks/").json()
        assert [h["id"] for h in listed if h["id"] == hook["id"]] == [hook["id"]]
        assert secret not in json.dumps(listed)  # shown once, never listed

        sent = admin.post(f"/admin/webhooks/{hook['id']}/test")
        assert sent.status_code == 202, sent.text
        event_id = sent.json()["event_id"]
        headers, body = wait_until(lambda: receiver.of_type("test"))[0]
        payload = json.loads(body)
        assert payload["id"] == event_id == headers["x-strata-delivery"]
        assert payload["type"] == "test" and payload["data"]["webhook_id"] == hook["id"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", payload["created"])
        assert verify(secret, headers, body)
        assert not verify("whsec_another", headers, body)
        assert not verify(secret, headers, body + b" ")

        log = wait_until(lambda: admin.get(f"/admin/webhooks/{hook['id']}/deliveries").json())
        assert log[0] | {"attempted_at": 0} == {
            "event_id": event_id,
            "type": "test",
            "attempt": 1,
            "attempted_at": 0,
            "status_code": 200,
            "error": None,
            "ok": True,
        }
        assert admin.delete(f"/admin/webhooks/{hook['id']}").status_code == 204
        assert admin.get(f"/admin/webhooks/{hook['id']}/deliveries").status_code == 404


def test_a_failing_receiver_gets_the_same_idempotency_id_until_it_accepts(alerts_gateway) -> None:
    with Receiver(num_failures=2) as receiver, alerts_gateway.admin() as admin:
        hook = register(admin, receiver.url, ["*"])["webhook"]
        event_id = admin.post(f"/admin/webhooks/{hook['id']}/test").json()["event_id"]
        wait_until(lambda: len(receiver.requests) == 3)
        ids = [h["x-strata-delivery"] for h, _ in receiver.requests]
        assert ids == [event_id] * 3
        assert {json.loads(b)["id"] for _, b in receiver.requests} == {event_id}

        def logged() -> list[dict]:
            log = admin.get(f"/admin/webhooks/{hook['id']}/deliveries").json()
            return log if len(log) == 3 else []

        log = wait_until(logged)
        assert [(d["attempt"], d["status_code"], d["ok"]) for d in log] == [
            (3, 200, True),
            (2, 500, False),
            (1, 500, False),
        ]
        text = httpx.get(f"{alerts_gateway.url}/metrics").text
        assert _sample(text, 'strata:webhook_deliveries_total{result="retried"}') >= 2
        assert _sample(text, 'strata:webhook_deliveries_total{result="ok"}') >= 1
        admin.delete(f"/admin/webhooks/{hook['id']}")


def test_a_hanging_receiver_does_not_hold_up_requests(alerts_gateway) -> None:
    _, key = alerts_gateway.new_tenant()
    with Receiver(hanging=True) as receiver, alerts_gateway.admin() as admin:
        hook = register(admin, receiver.url, ["*"])["webhook"]
        admin.post(f"/admin/webhooks/{hook['id']}/test")
        wait_until(lambda: receiver.num_held == 1)
        body = {"model": "default", "prompt": "one two three", "max_tokens": 2}
        served = httpx.post(
            f"{alerts_gateway.url}/v1/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert served.status_code == 200, served.text
        assert admin.get("/admin/webhooks/").status_code == 200
        assert not receiver.release.is_set() and receiver.num_held == 1  # still hanging
        admin.delete(f"/admin/webhooks/{hook['id']}")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "ftp://example.com/x", "events": ["*"]}, "url"),
        ({"url": "http:///no-host", "events": ["*"]}, "url"),
        ({"url": "https://example.com/x", "events": ["budget_exceeded"]}, "events"),
        ({"url": "https://example.com/x", "events": []}, "events"),
        ({"url": "https://example.com/x", "events": "worker_lost"}, "events"),
        ({"url": "https://example.com/x", "events": ["*"], "description": 5}, "description"),
        ({"url": "https://example.com/x", "events": ["*"], "secret": "mine"}, "secret"),
    ],
)
def test_bad_webhooks_are_refused_naming_the_field(alerts_gateway, body, field) -> None:
    with alerts_gateway.admin() as admin:
        before = admin.get("/admin/webhooks/").json()
        refused = admin.post("/admin/webhooks/", json=body)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert field in error["message"]
        if error["param"] is not None:
            assert error["param"] == field
        assert admin.get("/admin/webhooks/").json() == before


def test_unknown_webhooks_and_bad_limits(alerts_gateway) -> None:
    with alerts_gateway.admin() as admin:
        assert admin.delete("/admin/webhooks/wh_missing").status_code == 404
        assert admin.post("/admin/webhooks/wh_missing/test").status_code == 404
        assert admin.get("/admin/webhooks/wh_missing/deliveries").status_code == 404
        hook = register(admin, "https://example.com/x", ["*"])["webhook"]
        refused = admin.get(f"/admin/webhooks/{hook['id']}/deliveries", params={"limit": 0})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "limit"
        admin.delete(f"/admin/webhooks/{hook['id']}")
    assert httpx.get(f"{alerts_gateway.url}/admin/webhooks/").status_code == 401
    schema = httpx.get(f"{alerts_gateway.url}/schema/openapi.json")
    assert schema.status_code == 200 and "/admin/webhooks/{webhook_id}/test" in schema.text


def test_the_console_lists_adds_and_tests_webhooks(alerts_gateway) -> None:
    with Receiver() as receiver, alerts_gateway.admin() as admin:
        hook = register(admin, receiver.url, ["worker_lost"], "pager duty bridge")["webhook"]
        client, csrf = signed_in_client(alerts_gateway.url)
        try:
            page = client.get("/ui/alerts")
            assert page.status_code == 200
            assert "pager duty bridge" in page.text and receiver.url in page.text
            assert 'href="/ui/alerts"' in page.text  # in the nav

            refused = client.post(
                "/ui/alerts", data={"url": "gopher://x", "events": "*", "_csrf": csrf}
            )
            assert refused.status_code == 400 and "url must be" in refused.text

            added = client.post(
                "/ui/alerts",
                data={"url": receiver.url, "events": "*", "description": "new one", "_csrf": csrf},
            )
            assert added.status_code == 200, added.text
            assert "whsec_" in added.text and "new one" in added.text
            new_id = next(
                h["id"]
                for h in admin.get("/admin/webhooks/").json()
                if h["id"] != hook["id"] and h["description"] == "new one"
            )

            tested = client.post(f"/ui/alerts/{new_id}/test", data={"_csrf": csrf})
            assert tested.status_code == 200
            wait_until(lambda: receiver.of_type("test"))
            deliveries = wait_until(
                lambda: "200" in (t := client.get(f"/ui/alerts/{new_id}").text) and t
            )
            assert "test" in deliveries

            removed = client.post(f"/ui/alerts/{new_id}/delete", data={"_csrf": csrf})
            assert removed.status_code == 200
            assert "new one" not in removed.text
        finally:
            client.close()
        admin.delete(f"/admin/webhooks/{hook['id']}")


def registry_worker(tmp_path, store_url: str, cache_dir, worker_id: str) -> WorkerProcess:
    return WorkerProcess(
        tmp_path / f"{worker_id}.sock",
        [*TINY_WORKER, "--registry-url", store_url, "--worker-id", worker_id],
        cache_dir,
        address=f"tcp://127.0.0.1:{_free_port()}",
        env={"STRATA_WORKER_SECRET": SECRET},
    )


def test_a_killed_worker_is_one_worker_lost_alert_across_two_gateways(
    tmp_path, alerts_store, strata_cache_dir
) -> None:
    """Two gateways see a worker stop cleanly (no alert), then another die (one alert)."""
    stopped = registry_worker(tmp_path, alerts_store.url, strata_cache_dir, "w-stopped")
    killed = registry_worker(tmp_path, alerts_store.url, strata_cache_dir, "w-lost")
    stopped.start()
    killed.start()
    gateways = [
        GatewayServer(
            gateway_settings(
                alerts_store.url,
                None,
                strata_cache_dir,
                worker_secret=SECRET,
                model="synthetic:tiny",
                alerts=FAST,
            )
        )
        for _ in range(2)
    ]

    def in_views() -> set[str]:
        seen: set[str] = set()
        for gateway in gateways:
            with gateway.admin() as each:
                seen |= {w["worker_id"] for w in each.get("/admin/workers/").json()}
        return seen

    def judged() -> bool:
        total = 0.0
        for gateway in gateways:
            text = httpx.get(f"{gateway.url}/metrics").text
            for result in ("raised", "duplicate"):
                series = f'strata:alerts_raised_total{{result="{result}",type="worker_lost"}}'
                total += _sample(text, series)
        return total == 2

    try:
        for gateway in gateways:
            gateway.start()
        with Receiver() as receiver, gateways[0].admin() as admin:
            hook = register(admin, receiver.url, ["worker_lost"])["webhook"]
            wait_until(lambda: in_views() == {"w-stopped", "w-lost"})
            stopped.stop()
            wait_until(lambda: in_views() == {"w-lost"})
            killed.kill()
            wait_until(lambda: not in_views())

            wait_until(judged)
            lost = wait_until(lambda: receiver.of_type("worker_lost"))
            payload = json.loads(lost[0][1])
            assert payload["data"] == {
                "worker_id": "w-lost",
                "address": killed.address,
                "model": payload["data"]["model"],
            }
            assert payload["data"]["model"].startswith("synthetic")
            assert asyncio.run(_num_events("worker_lost", alerts_store.url)) == 1
            wait_until(lambda: asyncio.run(_num_pending(alerts_store.url)) == 0)
            assert len(receiver.of_type("worker_lost")) == 1
            admin.delete(f"/admin/webhooks/{hook['id']}")
    finally:
        for gateway in gateways:
            gateway.stop()
        stopped.stop()
        killed.stop()


async def _num_events(kind: str, url: str) -> int:
    client = connect(url)
    try:
        entries = await client.xrange(STREAM)
        return sum(json.loads(fields[b"event"])["type"] == kind for _, fields in entries)
    finally:
        await client.aclose()


async def _num_pending(url: str) -> int:
    client = connect(url)
    try:
        return int((await client.xpending(STREAM, "delivery"))["pending"])
    finally:
        await client.aclose()


def _sample(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_cli_adds_tests_lists_and_deletes_a_webhook(
    alerts_gateway, monkeypatch, capsys
) -> None:
    from gateway.cli import main

    monkeypatch.setenv("STRATA_URL", alerts_gateway.url)
    monkeypatch.setenv("STRATA_ADMIN_TOKEN", ADMIN_TOKEN)

    def strata(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 2
        out, err = capsys.readouterr()
        return code, out, err

    with Receiver() as receiver:
        code, out, err = strata(
            "admin", "webhooks", "add", receiver.url, "--events", "worker_lost,budget_threshold",
            "--description", "from the cli", "--json",
        )  # fmt: skip
        assert code == 0, err
        assert "shown only this once" in err
        created = json.loads(out)
        hook_id = created["webhook"]["id"]
        assert created["webhook"]["events"] == ["budget_threshold", "worker_lost"]

        code, out, _ = strata("admin", "webhooks", "list")
        assert code == 0 and hook_id in out and "from the cli" in out

        code, out, err = strata("admin", "webhooks", "test", hook_id, "--json")
        assert code == 0, err
        event_id = json.loads(out)["event_id"]
        headers, body = wait_until(lambda: receiver.of_type("test"))[0]
        assert headers["x-strata-delivery"] == event_id
        assert verify(created["secret"], headers, body)

        def logged() -> list[dict]:
            code, out, _ = strata("admin", "webhooks", "deliveries", hook_id, "--json")
            return json.loads(out) if code == 0 else []

        assert wait_until(logged)[0]["event_id"] == event_id
        code, out, _ = strata("admin", "webhooks", "deliveries", hook_id, "--limit", "0")
        assert code == 1
        code, out, _ = strata("admin", "webhooks", "add", "not-a-url")
        assert code == 1
        code, out, _ = strata("admin", "webhooks", "delete", hook_id)
        assert code == 0 and f"deleted webhook {hook_id}" in out
        assert strata("admin", "webhooks", "delete", hook_id)[0] == 1


def test_a_store_outage_is_delivered_from_memory(tmp_path, private_store, strata_cache_dir) -> None:
    """The store is out of reach: the gateway that sees it sends store_unreachable to the
    webhooks it knows, and store_recovered once the store answers again."""
    worker = WorkerProcess(tmp_path / "engine.sock", TINY_WORKER, strata_cache_dir)
    worker.start()
    config = AlertConfig(backoff_s=0.05, max_backoff_s=0.2, store_outage_s=1.0, store_check_s=0.2)
    gateway = GatewayServer(
        gateway_settings(private_store.url, worker, strata_cache_dir, alerts=config)
    )
    gateway.start()
    try:
        with Receiver() as receiver, gateway.admin() as admin:
            created = register(admin, receiver.url, ["store_unreachable", "store_recovered"])
            admin.post(f"/admin/webhooks/{created['webhook']['id']}/test")
            wait_until(lambda: receiver.of_type("test"))  # the gateway has read the webhook

            private_store.kill()
            headers, body = wait_until(lambda: receiver.of_type("store_unreachable"))[0]
            assert verify(created["secret"], headers, body)
            assert json.loads(body)["subject"] == "store"
            assert not receiver.of_type("store_recovered")

            private_store.start()
            headers, body = wait_until(lambda: receiver.of_type("store_recovered"))[0]
            assert verify(created["secret"], headers, body)
            assert len(receiver.of_type("store_unreachable")) == 1
    finally:
        gateway.stop()
        worker.stop()


def test_webhook_changes_are_audited_without_the_secret(alerts_gateway) -> None:
    with alerts_gateway.admin() as admin:
        created = register(admin, "https://ops.example.com/audited", ["*"])
        hook_id = created["webhook"]["id"]
        admin.delete(f"/admin/webhooks/{hook_id}")
        export = admin.get("/admin/audit/export").text
    entries = [json.loads(line) for line in export.splitlines()]
    made = [e for e in entries if e["created_id"] == hook_id]
    assert [(e["method"], e["status"]) for e in made] == [("POST", 201)]
    gone = [e for e in entries if e["target"] == hook_id and e["method"] == "DELETE"]
    assert [e["status"] for e in gone] == [204]
    assert created["secret"] not in export


def test_a_budget_threshold_crossed_is_one_signed_alert(alerts_gateway) -> None:
    gw = alerts_gateway
    tid, key = gw.new_tenant()
    with Receiver() as receiver, gw.admin() as admin:
        created = register(admin, receiver.url, ["budget_threshold"], "finance")
        model = admin.get("/admin/workers/").json()[0]["model"]
        r = admin.put("/admin/prices/", json={"model": model, "prompt_per_m": 1000.0})
        assert r.status_code == 200, r.text
        budget = {"limit_usd": "1", "period": "day", "thresholds": [1, 99]}
        assert admin.put(f"/admin/tenants/{tid}/budget", json=budget).status_code == 200
        for _ in range(2):  # the second crosses nothing new: still one alert
            r = httpx.post(
                f"{gw.url}/v1/completions",
                json={"model": "default", "prompt": "Hello there", "max_tokens": 2},
                headers={"authorization": f"Bearer {key}"},
                timeout=60,
            )
            assert r.status_code == 200, r.text
        headers, body = wait_until(lambda: receiver.requests and receiver.requests[0])
        time.sleep(1.0)  # room for a second delivery, which must not come
        assert len(receiver.requests) == 1
        assert verify(created["secret"], headers, body)
        event = json.loads(body)
        assert (event["type"], event["subject"]) == ("budget_threshold", tid)
        data = event["data"]
        assert (data["tenant_id"], data["scope"], data["threshold_pct"]) == (tid, "tenant", 1)
        assert data["limit_usd"] == "1.00" and data["key_id"].startswith("key_")  # who crossed
