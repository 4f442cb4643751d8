"""deploy/ against a served system: every metric a Grafana panel or an alert rule names is
in a real gateway's /metrics, typed as its suffix says, with no `_created` series, and the
workers' probe in the Kubernetes manifest passes the fleet-secret handshake."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import COLLECTED_METRICS
from tests.deploy_files import DEPLOY, every_query, metric_names
from tests.integration.conftest import (
    TINY_WORKER,
    GatewayServer,
    WorkerProcess,
    _free_port,
    gateway_settings,
)

FLEET_SECRET = "fleet-secret-of-the-deploy-tests-0123456789"
METRICS_TOKEN = "metrics-token-0123456789"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


@pytest.fixture(scope="module")
def fleet_worker(tmp_path_factory, strata_cache_dir) -> Iterator[WorkerProcess]:
    """A tiny worker on TCP, as in the manifests: it asks for the fleet secret."""
    worker = WorkerProcess(
        tmp_path_factory.mktemp("worker") / "unused.sock",
        TINY_WORKER,
        strata_cache_dir,
        address=f"tcp://127.0.0.1:{_free_port()}",
        env={"STRATA_WORKER_SECRET": FLEET_SECRET},
    )
    worker.start()
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def scraped(store_server, fleet_worker, strata_cache_dir) -> tuple[str, str, str]:
    """A gateway that served a success, a 429 and a 401; returns its tenant's id and name,
    and its /metrics text."""
    settings = gateway_settings(
        store_server.url,
        fleet_worker,
        strata_cache_dir,
        model="synthetic:tiny",
        worker_secret=FLEET_SECRET,
        metrics_token=METRICS_TOKEN,
    )
    server = GatewayServer(settings)
    server.start()
    try:
        with server.admin() as admin:
            name = f"acme-{uuid.uuid4().hex[:8]}"
            created = admin.post("/admin/tenants/", json={"name": name, "policy": {"rpm": 2}})
            assert created.status_code == 201, created.text
            tenant_id = created.json()["id"]
            key = admin.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "k"})
            auth = {"authorization": f"Bearer {key.json()['secret']}"}
        with httpx.Client(base_url=server.url, timeout=60) as http:
            body = {"model": "default", "prompt": "hi", "max_tokens": 4, "temperature": 0}
            codes = [
                http.post("/v1/completions", json=body, headers=auth).status_code for _ in range(3)
            ]
            assert codes == [200, 200, 429]
            stranger = {"authorization": "Bearer sk-strata-" + "x" * 43}
            assert http.post("/v1/completions", json=body, headers=stranger).status_code == 401
            assert http.get("/metrics").status_code == 401
            scraped = http.get("/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"})
            assert scraped.status_code == 200
            return tenant_id, name, scraped.text
    finally:
        server.stop()


def test_every_metric_of_the_dashboards_and_rules_is_exported(scraped):
    tenant_id, _, text = scraped
    families = {f.name: f for f in text_string_to_metric_families(text)}
    series = {
        name + suffix
        for name, family in families.items()
        for suffix in _SUFFIXES.get(family.type, ("",))
    }
    referenced = {name for _, expr in every_query() for name in metric_names(expr)}
    referenced.discard("up")  # Prometheus' own, per scrape target
    assert len(referenced) >= 20
    assert referenced <= series, sorted(referenced - series)
    # what the requests above touched has samples, not only a TYPE line
    sampled = {s.name for family in families.values() for s in family.samples}
    assert {
        "strata:request_success_total",
        "strata:request_rejected_total",
        "strata:prompt_tokens_total",
        "strata:generation_tokens_total",
        "strata:time_to_first_token_seconds_bucket",
        "strata:e2e_request_latency_seconds_bucket",
        "strata:num_requests_running",
        "strata:kv_blocks_capacity",
        "strata:num_preemptions_total",
        "strata:kv_cache_hit_blocks_total",
        "strata:tenant_info",
    } <= sampled
    rejected = families["strata:request_rejected"].samples
    assert {(s.labels["tenant"], s.labels["reason"]) for s in rejected} == {(tenant_id, "rpm")}
    assert "_created" not in text


def test_counters_are_typed_as_counters_and_tenant_info_names_the_tenant(scraped, fleet_worker):
    tenant_id, name, text = scraped
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for family in families.values():  # a `_total` series is a counter's, and only that
        totals = [s for s in family.samples if s.name.endswith("_total")]
        assert bool(totals) <= (family.type == "counter"), family.name
    for spec in COLLECTED_METRICS:
        family = families[spec.name]
        assert family.type == spec.kind, spec.name
        if "worker" in spec.labels:  # by tier: only the tiers the worker has, or has used
            workers = {s.labels["worker"] for s in family.samples}
            assert workers == {fleet_worker.address} or ("tier" in spec.labels and not workers)
    info = families["strata:tenant_info"].samples
    assert {"tenant": tenant_id, "name": name} in [s.labels for s in info]
    assert {s.value for s in info} == {1.0}


def _worker_probe() -> list[str]:
    manifest = (DEPLOY / "kubernetes" / "base" / "worker.yaml").read_text()
    workers = next(d for d in yaml.safe_load_all(manifest) if d["kind"] == "StatefulSet")
    (engine,) = workers["spec"]["template"]["spec"]["containers"]
    command = engine["livenessProbe"]["exec"]["command"]
    assert command == engine["startupProbe"]["exec"]["command"]
    return command


def test_the_workers_probe_passes_the_handshake_only_with_the_secret(fleet_worker):
    python, flag, script = _worker_probe()
    assert (python, flag) == ("python", "-c")
    assert "tcp://127.0.0.1:7000" in script  # the manifest's --listen port
    script = script.replace("tcp://127.0.0.1:7000", fleet_worker.address)

    def probe(secret: str) -> int:
        env = dict(os.environ, STRATA_WORKER_SECRET=secret)
        done = subprocess.run(
            [sys.executable, flag, script], env=env, check=False, capture_output=True, timeout=60
        )
        return done.returncode

    assert probe(FLEET_SECRET) == 0
    assert probe("another-secret-that-is-long-enough-0123456789") == 1
