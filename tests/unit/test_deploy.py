"""deploy/ matches the code: Kubernetes manifests valid against the Kubernetes schemas (as
files, and as kustomize builds them), workers registering in the store the gateways read,
dashboards on a datasource variable, alert rules well formed, and every metric they name
documented."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from gateway.metrics import COLLECTED_METRICS, GatewayMetrics
from tests.deploy_files import (
    DEPLOY,
    RULE_FILES,
    dashboards,
    every_query,
    metric_names,
    panels,
    rules,
)

# a release the package ships schemas for (checked below); strict: unknown fields fail
KUBERNETES_VERSION = "1.33.0"
KUSTOMIZE = DEPLOY / "kubernetes"
OVERLAY = KUSTOMIZE / "overlays" / "example"
SECRET_KEYS = ("worker-secret", "admin-token", "metrics-token", "store-password")


def _manifests() -> list[Path]:
    """Every manifest file but kustomizations and the partial objects they patch with."""
    files = set(KUSTOMIZE.rglob("*.yaml"))
    for kustomization in KUSTOMIZE.rglob("kustomization.yaml"):
        patches = yaml.safe_load(kustomization.read_text()).get("patches", [])
        files -= {kustomization, *(kustomization.parent / p["path"] for p in patches)}
    return sorted(files)


def _validate(doc: dict, where: str) -> None:
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = "/".join(str(p) for p in exc.path)
        pytest.fail(f"{where}: {doc['kind']} {doc['metadata']['name']}: {path}: {exc.message}")


def _by_kind(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    return doc


def test_the_pinned_kubernetes_version_ships_with_the_validator() -> None:
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    assert (schemas / f"v{KUBERNETES_VERSION}-local-strict").is_dir()


def test_a_misspelt_field_fails_validation() -> None:
    """The check below can fail: strict schemas refuse what Kubernetes would ignore."""
    doc = next(yaml.safe_load_all((KUSTOMIZE / "base" / "network-policies.yaml").read_text()))
    doc["spec"]["podSelectr"] = doc["spec"].pop("podSelector")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_every_manifest_file_is_valid_kubernetes() -> None:
    files = _manifests()
    assert {f.name for f in files} >= {"gateway.yaml", "worker.yaml", "valkey.yaml"}
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            _validate(doc, str(path.relative_to(DEPLOY)))


def _base_docs() -> list[dict]:
    kustomization = yaml.safe_load((KUSTOMIZE / "base" / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += list(yaml.safe_load_all((KUSTOMIZE / "base" / name).read_text()))
    return docs


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _check_fleet(docs: list[dict]) -> None:
    """Workers register in the store the gateways read (the same URL, the password and the
    fleet secret from the same Secret keys), as their pod name, at their pod's DNS name under
    the headless Service; gateways list no worker; the store admits both; a gateway runs
    one process per core it requests; the Secret's keys are the ones referenced, probes hit
    /health and /ready, and the scrape annotations name the HTTP port."""
    workers = _by_kind(docs, "StatefulSet", "strata-worker")
    gateway = _by_kind(docs, "StatefulSet", "strata-gateway")
    pod = gateway["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert "STRATA_ENGINE_URLS" not in env and "--engine" not in container["args"]
    (engine,) = workers["spec"]["template"]["spec"]["containers"]
    args = engine["args"]
    worker_env = {e["name"]: e for e in engine["env"]}
    assert args[0] == "engine"
    registry = (
        _arg(args, "--registry-url")
        if "--registry-url" in args
        else worker_env["STRATA_REDIS_URL"]["value"]
    )
    assert registry == env["STRATA_REDIS_URL"]["value"]
    for name in ("STORE_PASSWORD", "STRATA_WORKER_SECRET"):
        assert worker_env[name]["valueFrom"] == env[name]["valueFrom"], name
    # $(VAR) expands only to a variable defined earlier in the container's env
    for where, e in [("env", env), ("worker env", worker_env)]:
        order = list(e)
        for name, var in e.items():
            for ref in re.findall(r"\$\((\w+)\)", var.get("value", "")):
                assert ref in order[: order.index(name)], f"{where}: {name} uses {ref}"
    for where, c, e in [("gateway", container, env), ("worker", engine, worker_env)]:
        for ref in {r for a in c["args"] for r in re.findall(r"\$\((\w+)\)", a)}:
            assert ref in e, f"{where} args use {ref}"
    assert worker_env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert _arg(args, "--worker-id") == "$(POD_NAME)"
    service = _by_kind(docs, "Service", workers["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"  # a DNS name per pod
    worker_labels = workers["spec"]["template"]["metadata"]["labels"]
    assert _selects(service["spec"]["selector"], worker_labels)
    port = _arg(args, "--listen").rpartition(":")[2]
    assert port == str(service["spec"]["ports"][0]["port"])
    assert _arg(args, "--advertise") == f"tcp://$(POD_NAME).{service['metadata']['name']}:{port}"
    store_policy = _by_kind(docs, "NetworkPolicy", "strata-valkey")
    peers = [
        p["podSelector"]["matchLabels"] for r in store_policy["spec"]["ingress"] for p in r["from"]
    ]
    for labels in (worker_labels, pod["metadata"]["labels"]):
        assert any(_selects(peer, labels) for peer in peers)
    requests = container["resources"]["requests"]
    assert int(_arg(container["args"], "--workers")) == int(requests["cpu"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    (http,) = container["ports"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(http["containerPort"])
    assert annotations["prometheus.io/path"] == "/metrics"
    assert {"STRATA_WORKER_SECRET", "STRATA_ADMIN_TOKEN", "STRATA_METRICS_TOKEN"} <= set(env)
    assert _arg(container["args"], "--model") == _arg(args, "--model")
    refs = [
        e["valueFrom"]["secretKeyRef"]
        for d in docs
        if d["kind"] == "StatefulSet"
        for c in d["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    ]
    assert {r["key"] for r in refs} == set(SECRET_KEYS)
    secrets = [d for d in docs if d["kind"] == "Secret"]
    for secret in secrets:  # a built overlay generates it; the base leaves it out
        assert {r["name"] for r in refs} == {secret["metadata"]["name"]}
        assert set(secret["data"]) == set(SECRET_KEYS)


def test_the_base_workers_register_where_the_gateways_look() -> None:
    _check_fleet(_base_docs())


def _kustomize(path: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its kustomize) is not installed")
    built = subprocess.run(
        [kubectl, "kustomize", str(path)], check=False, capture_output=True, text=True, timeout=120
    )
    assert built.returncode == 0, built.stderr
    return list(yaml.safe_load_all(built.stdout))


@pytest.mark.parametrize("which", ["base", "overlay"])
def test_kustomize_builds_valid_kubernetes(which: str, tmp_path: Path) -> None:
    if which == "base":
        docs = _kustomize(KUSTOMIZE / "base")
    else:  # a copy, with the secrets file an operator makes (never committed)
        shutil.copytree(KUSTOMIZE, tmp_path / "kubernetes")
        overlay = tmp_path / "kubernetes" / OVERLAY.relative_to(KUSTOMIZE)
        (overlay / "strata-secrets.env").write_text(
            "".join(f"{key}=generated-{key}-0123456789abcdef0123456789\n" for key in SECRET_KEYS)
        )
        docs = _kustomize(overlay)
        assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {
            "strata"
        }
    for doc in docs:
        _validate(doc, f"kustomize build {which}")
    _check_fleet(docs)


def _documented_series() -> set[str]:
    """Every series name /metrics can hold, from the declared metrics and collectors."""
    families = {m.name: m.type for m in GatewayMetrics().registry.collect()}
    families |= {m.name: m.kind for m in COLLECTED_METRICS}
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    return {name + s for name, kind in families.items() for s in suffixes.get(kind, [""])}


def test_every_metric_the_dashboards_and_rules_name_is_documented() -> None:
    known = _documented_series() | {"up"}  # up: Prometheus' own, per scrape target
    seen: set[str] = set()
    for where, expr in every_query():
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr}"
        assert names <= known, f"{where}: unknown {sorted(names - known)}"
        seen |= names
    assert len(seen) >= 20


def test_metric_names_are_found_in_promql() -> None:
    expr = (
        'sum by (tenant, le) (rate(a:b_bucket{tenant=~"$t", x="y"}[5m] offset 1h)) '
        "* on (tenant) group_left (name) max by (tenant, name) (c_info) / ignoring (le) "
        'histogram_quantile(0.9, d) unless count(e) > 0 or absent(f{g="h"}) + 1e3'
    )
    assert metric_names(expr) == {"a:b_bucket", "c_info", "d", "e", "f"}


def test_dashboards_use_a_datasource_variable() -> None:
    found = list(dashboards())
    assert len(found) >= 4
    assert len({dashboard["uid"] for _, dashboard in found}) == len(found)
    for name, dashboard in found:
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource", name
        assert variables["datasource"]["query"] == "prometheus", name
        for panel in panels(dashboard):
            if panel["type"] == "row":
                continue
            for source in [panel["datasource"], *(t["datasource"] for t in panel["targets"])]:
                assert source == {"type": "prometheus", "uid": "${datasource}"}, name
            assert panel["targets"], f"{name}: {panel['title']}"


def test_alert_rules_are_well_formed() -> None:
    found = list(rules())
    assert len(found) >= 10
    for file, rule in found:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, (file, rule)
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
    names = [rule["alert"] for _, rule in found]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-static.yml"])
def test_prometheus_scrapes_the_gateways_with_the_metrics_token(config: str) -> None:
    path = DEPLOY / "prometheus" / config
    loaded = yaml.safe_load(path.read_text())
    for rule_file in loaded["rule_files"]:
        assert (path.parent / rule_file).resolve() in [p.resolve() for p in RULE_FILES]
    (job,) = loaded["scrape_configs"]
    assert job["job_name"] == "strata-gateway"  # the rules' up{job=...}
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"]["type"] == "Bearer" and job["authorization"]["credentials_file"]


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return promtool


def test_promtool_accepts_the_rules_the_dashboards_and_the_static_config(tmp_path: Path) -> None:
    promtool = _promtool()
    queries = [
        {"record": f"dashboard:query_{i}", "expr": expr.replace("$__rate_interval", "5m")}
        for i, (_, expr) in enumerate(every_query())
    ]
    checked = tmp_path / "dashboards.yml"
    checked.write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": queries}]}))
    for args in (
        ["check", "rules", *map(str, RULE_FILES), str(checked)],
        # Debian's promtool is built without Kubernetes discovery: the static config only
        ["check", "config", "--syntax-only", str(DEPLOY / "prometheus/prometheus-static.yml")],
    ):
        done = subprocess.run(
            [promtool, *args], check=False, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr
