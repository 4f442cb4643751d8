"""`strata admin` against the real app over HTTP, with the real store and a tiny worker: the
commands in-process through `main()` (fast), and as a real subprocess where the process
itself is the point (its environment, its exit code, what reaches stderr)."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine.model_specs import PRESETS
from gateway.cli import main
from tests.integration.conftest import (
    ADMIN_TOKEN,
    GatewayServer,
    WorkerProcess,
    _free_port,
    gateway_settings,
)
from tests.lora_files import write_adapter

UNREACHABLE = f"http://127.0.0.1:{_free_port()}"


@dataclass
class Ran:
    code: int
    out: str
    err: str

    def json(self) -> object:
        assert self.code == 0, self.err
        return json.loads(self.out)


@pytest.fixture(scope="module")
def served(store_server, strata_cache_dir, tmp_path_factory) -> Iterator[GatewayServer]:
    root = tmp_path_factory.mktemp("admin-cli")
    worker = WorkerProcess(
        root / "engine.sock",
        [
            "--model",
            "synthetic:tiny",
            "--num-kv-blocks",
            "64",
            "--block-size",
            "4",
            "--dtype",
            "float32",
            "--max-loras",
            "2",
            "--adapter-dir",
            str(root),
        ],
        strata_cache_dir,
    )
    worker.start()
    settings = gateway_settings(
        store_server.url,
        worker,
        strata_cache_dir,
        model="synthetic:tiny",
        data_dir=str(root / "data"),
    )
    server = GatewayServer(settings)
    server.start()
    yield server
    server.stop()
    worker.stop()


@pytest.fixture
def strata(served, monkeypatch, capsys) -> Callable[..., Ran]:
    """`strata ...` run in-process, against the served app through STRATA_URL."""
    monkeypatch.setenv("STRATA_URL", served.url)
    monkeypatch.setenv("STRATA_ADMIN_TOKEN", ADMIN_TOKEN)

    def run(*argv: str) -> Ran:
        capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as stop:  # argparse's own errors
            code = stop.code if isinstance(stop.code, int) else 2
        captured = capsys.readouterr()
        return Ran(code, captured.out, captured.err)

    return run


def subprocess_strata(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    child = dict(os.environ, STRATA_LOG_LEVEL="WARNING", **env)
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *argv],
        env=child,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def complete(server: GatewayServer, secret: str) -> httpx.Response:
    body = {"model": "default", "prompt": "hello", "max_tokens": 3, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        return http.post(
            "/v1/completions", json=body, headers={"authorization": f"Bearer {secret}"}
        )


def test_a_tenant_is_created_limited_keyed_and_deleted_by_name(strata, served):
    name = unique("acme")
    made = strata("admin", "tenants", "create", name, "--rpm", "7", "--kv-budget-tokens", "4096")
    assert made.code == 0, made.err
    assert "policy.rpm" in made.out and name in made.out  # a record prints as a table
    listed = strata("admin", "tenants", "list", "--json").json()
    (tenant,) = [t for t in listed if t["name"] == name]
    assert tenant["policy"]["rpm"] == 7
    assert tenant["policy"]["kv_budget_tokens"] == 4096

    changed = strata("admin", "policies", "set", name, "--tpm", "50000", "--rpm", "none")
    assert changed.code == 0, changed.err
    policy = strata("admin", "policy", "show", tenant["id"], "--json").json()
    assert policy["policy"]["tpm"] == 50000
    assert policy["policy"]["rpm"] is None  # none: unlimited
    assert policy["policy"]["kv_budget_tokens"] == 4096  # a PATCH keeps what it does not name

    replaced = strata("admin", "policies", "replace", name, "--max-tokens", "64", "--json").json()
    assert replaced["max_tokens"] == 64
    assert replaced["tpm"] is None and replaced["kv_budget_tokens"] is None  # back to defaults

    issued = strata("admin", "keys", "issue", name, "--name", "ci", "--json")
    created = issued.json()
    assert created["secret"].startswith("sk-strata-")
    assert "only this once" in issued.err
    assert complete(served, created["secret"]).status_code == 200
    keys = strata("admin", "keys", "list", name)
    assert created["key"]["id"] in keys.out and created["secret"] not in keys.out
    shown = strata("admin", "keys", "show", created["key"]["id"], "--json").json()
    assert shown["name"] == "ci" and shown["tenant_id"] == tenant["id"]
    revoked = strata("admin", "keys", "revoke", created["key"]["id"], "--json").json()
    assert revoked["revoked_at"] is not None
    deadline = time.monotonic() + 30  # every replica drops its cached authentication
    while complete(served, created["secret"]).status_code != 401:
        assert time.monotonic() < deadline, "a revoked key still authenticates"
        time.sleep(0.2)

    assert strata("admin", "tenants", "disable", name, "--json").json()["disabled"] is True
    assert strata("admin", "tenants", "enable", name, "--json").json()["disabled"] is False
    renamed = unique("globex")
    assert strata("admin", "tenants", "update", name, "--name", renamed).code == 0
    deleted = strata("admin", "tenants", "delete", renamed)
    assert deleted.code == 0 and "deleted tenant" in deleted.out
    gone = strata("admin", "tenants", "show", tenant["id"])
    assert gone.code == 1
    assert gone.err.strip() == f"strata admin: 404: tenant {tenant['id']!r} not found"


def test_rotation_prints_the_new_secret_and_keeps_the_old_key_for_its_grace(strata, served):
    name = unique("rot")
    strata("admin", "tenants", "create", name)
    old = strata("admin", "keys", "create", name, "--json").json()
    new = strata("admin", "keys", "rotate", old["key"]["id"], "--grace", "1h", "--json")
    rotated = new.json()
    assert rotated["secret"] != old["secret"] and "only this once" in new.err
    assert complete(served, rotated["secret"]).status_code == 200
    assert complete(served, old["secret"]).status_code == 200  # within its hour of grace


def test_options_go_before_or_after_the_subcommand(strata, served, monkeypatch):
    monkeypatch.setenv("STRATA_URL", UNREACHABLE)  # so only a --url that was read works
    monkeypatch.delenv("STRATA_ADMIN_TOKEN")
    token = ("--admin-token", ADMIN_TOKEN)
    lines = [
        ("admin", "--url", served.url, *token, "--json", "tenants", "list"),
        ("admin", "tenants", "--url", served.url, "list", *token, "--json"),
        ("admin", "tenants", "list", "--json", "--url", served.url, *token),
    ]
    answers = [strata(*line).json() for line in lines]
    assert answers[0] == answers[1] == answers[2]
    assert isinstance(answers[0], list)


def test_an_ambiguous_name_is_refused_with_its_candidates(strata):
    name = unique("twin")
    first = strata("admin", "tenants", "create", name, "--id", unique("t"), "--json").json()
    second = strata("admin", "tenants", "create", name, "--id", unique("t"), "--json").json()
    shown = strata("admin", "tenants", "show", name)
    assert shown.code == 1
    assert "ambiguous" in shown.err
    assert first["id"] in shown.err and second["id"] in shown.err
    assert strata("admin", "tenants", "show", first["id"], "--json").json()["id"] == first["id"]


def test_a_refused_request_prints_the_servers_message_on_one_line(strata, monkeypatch):
    name = unique("bad")
    strata("admin", "tenants", "create", name)
    weight = strata("admin", "policies", "set", name, "--weight", "5000")
    assert weight.code == 1
    assert weight.err.count("\n") == 1
    assert weight.err.startswith("strata admin: 400: ") and "weight must be in" in weight.err
    monkeypatch.setenv("STRATA_ADMIN_TOKEN", "not-the-admin-token-at-all")
    wrong = strata("admin", "tenants", "list")
    assert wrong.code == 1 and wrong.err.startswith("strata admin: 401: ")
    bad_flag = strata("admin", "tenants", "create", unique("x"), "--rpm", "0")
    assert bad_flag.code == 2 and "--rpm" in bad_flag.err


def test_prices_change_only_the_fields_given(strata):
    model = unique("priced")
    assert (
        strata("admin", "prices", "set", model, "--prompt", "0.15", "--completion", "0.6").code == 0
    )
    assert strata("admin", "prices", "set", model, "--cached", "0.05").code == 0
    price = strata("admin", "prices", "show", model, "--json").json()
    assert {k: v for k, v in price.items() if k != "effective_at"} == {
        "model": model,
        "prompt_per_m": 0.15,
        "cached_per_m": 0.05,
        "completion_per_m": 0.6,
    }
    later = strata(
        "admin", "prices", "set", model, "--prompt", "0.2", "--effective-at", "2099-01-01"
    )
    assert later.code == 0, later.err
    shown = strata("admin", "prices", "show", model, "--json").json()
    assert shown["prompt_per_m"] == 0.15  # the later price is not in force yet
    assert model in strata("admin", "prices", "list").out
    assert strata("admin", "prices", "delete", model).code == 0
    assert strata("admin", "prices", "show", model).code == 1


def test_usage_is_exported_over_a_relative_or_iso_window(strata, served, tmp_path):
    name = unique("billed")
    tenant = strata("admin", "tenants", "create", name, "--json").json()
    secret = strata("admin", "keys", "issue", name, "--json").json()["secret"]
    for _ in range(2):
        assert complete(served, secret).status_code == 200
    out = tmp_path / "usage.csv"
    exported = strata(
        "usage", "export", "--tenant", name, "--start", "1d", "--format", "csv", "-o", str(out)
    )
    assert exported.code == 0, exported.err
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert len(rows) == 2 and {r["tenant_id"] for r in rows} == {tenant["id"]}
    ndjson = strata("admin", "usage", "export", "--tenant", tenant["id"], "--format", "ndjson")
    assert len(ndjson.out.splitlines()) == 2
    before = strata("admin", "usage", "export", "--tenant", name, "--end", "2020-01-01")
    assert before.code == 0 and len(before.out.splitlines()) == 1  # the csv header only
    daily = strata("admin", "usage", "show", "--tenant", name, "--start", "7d", "--json").json()
    assert sum(row["requests"] for row in daily) == 2
    table = strata("admin", "usage", "show", "--tenant", name)
    assert "REQUESTS" in table.out and tenant["id"] in table.out


def test_workers_are_listed_drained_and_undrained(strata):
    (worker,) = strata("admin", "workers", "list", "--json").json()
    assert worker["connected"] is True
    worker_id = worker["worker_id"]
    assert strata("admin", "workers", "drain", worker_id, "--json").json()["drained"] is True
    assert strata("admin", "workers", "undrain", worker_id, "--json").json()["drained"] is False
    table = strata("admin", "workers", "list")
    assert table.out.splitlines()[0].split()[:2] == ["WORKER_ID", "MODEL"]
    assert worker_id in table.out
    assert strata("admin", "workers", "drain", "no-such-worker").code == 1


def test_adapters_are_uploaded_registered_listed_and_deleted(strata, served, tmp_path):
    name = unique("tenant")
    tenant = strata("admin", "tenants", "create", name, "--json").json()
    source = write_adapter(tmp_path / "src", PRESETS["tiny"], rank=4)
    up = strata("admin", "adapters", "upload", "support", str(source), "--allowed-tenants", name)
    assert up.code == 0, up.err
    listed = strata("admin", "adapters", "list", "--json").json()
    (adapter,) = [a for a in listed if a["name"] == "support"]
    assert adapter["allowed_tenants"] == [tenant["id"]]  # the name resolved to the id
    again = strata("admin", "adapters", "register", "support", adapter["path"], "--json").json()
    assert again["version"] == adapter["version"] + 1
    missing = strata("admin", "adapters", "upload", "x", str(tmp_path / "nowhere"))
    assert missing.code == 2 and "adapter_config.json" in missing.err
    assert strata("admin", "adapters", "delete", "support").code == 0
    assert "support" not in strata("admin", "adapters", "list").out


def test_strata_url_is_honoured_by_the_command(served):
    listed = subprocess_strata(
        "admin", "tenants", "list", STRATA_URL=served.url, STRATA_ADMIN_TOKEN=ADMIN_TOKEN
    )
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[0].split()[:2] == ["ID", "NAME"]


def test_an_unreachable_server_is_one_line_and_exit_code_2():
    done = subprocess_strata(
        "admin", "workers", "list", STRATA_URL=UNREACHABLE, STRATA_ADMIN_TOKEN=ADMIN_TOKEN
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr == (
        f"strata admin: cannot reach {UNREACHABLE}: connection refused (set STRATA_URL or --url)\n"
    )
    assert done.stdout == ""


def test_no_token_is_one_line(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k != "STRATA_ADMIN_TOKEN"}
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "admin", "tenants", "list"],
        env=dict(env, STRATA_DATA_DIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("strata admin: no admin token")
    assert done.stderr.count("\n") == 1


def test_admin_tokens_are_created_listed_shown_and_revoked(strata, served):
    name = unique("ops")
    made = strata("admin", "tokens", "create", name, "--role", "viewer")
    assert made.code == 0, made.err
    assert "only this once" in made.err
    secret = re.search(r"sa-strata-[A-Za-z0-9_-]{43}", made.out)
    token_id = re.search(r"adm_[0-9a-f]{16}", made.out)
    assert secret is not None and token_id is not None
    secret, token_id = secret.group(0), token_id.group(0)
    bearer = {"authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=served.url, headers=bearer, timeout=30) as http:
        assert http.get("/admin/tenants/").status_code == 200
        assert http.post("/admin/tenants/", json={"name": unique("x")}).status_code == 403

        listed = strata("admin", "tokens", "list")
        assert listed.out.splitlines()[0].split() == [
            "ID",
            "NAME",
            "ROLE",
            "PREFIX",
            "CREATED_AT",
            "CREATED_BY",
            "REVOKED_AT",
        ]
        (row,) = [line.split() for line in listed.out.splitlines() if token_id in line]
        assert row[1:3] == [name, "viewer"] and row[-2:] == ["bootstrap", "-"]
        assert secret not in listed.out
        shown = strata("admin", "token", "show", token_id, "--json").json()
        assert (shown["role"], shown["created_by"], shown["revoked_at"]) == (
            "viewer",
            "bootstrap",
            None,
        )
        revoked = strata("admin", "tokens", "revoke", token_id, "--json").json()
        assert revoked["revoked_at"] is not None
        assert http.get("/admin/tenants/").status_code == 401  # at once
    bad_role = strata("admin", "tokens", "create", unique("x"), "--role", "root")
    assert bad_role.code == 2 and "--role" in bad_role.err
    missing = strata("admin", "tokens", "show", "adm_missing")
    assert missing.code == 1 and missing.err.startswith("strata admin: 404: ")


def test_the_audit_log_is_listed_as_a_table_and_exported_as_ndjson(strata, tmp_path):
    name = unique("audited")
    tenant_id = strata("admin", "tenants", "create", name, "--json").json()["id"]
    assert strata("admin", "policies", "set", name, "--rpm", "5").code == 0
    listed = strata("admin", "audit", "list", "--target", tenant_id, "--start", "1h")
    assert listed.code == 0, listed.err
    header, *rows = listed.out.splitlines()
    assert header.split() == ["AT", "ACTOR", "ROLE", "ACTION", "TARGET", "STATUS", "CLIENT"]
    assert [row.split()[4] for row in rows] == ["tenants.create", "tenants.patch_policy"]
    for row in rows:  # a human date, then who did it
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ +bootstrap +admin ", row), row

    first = strata("admin", "audit", "list", "--target", tenant_id, "--limit", "1")
    assert len(first.out.splitlines()) == 2
    cursor = re.search(r"--after (\S+)", first.err)
    assert cursor is not None
    rest = strata(
        "admin", "audit", "list", "--target", tenant_id, "--after", cursor.group(1), "--json"
    ).json()
    assert [e["action"] for e in rest["data"]] == ["tenants.patch_policy"]
    assert rest["next"] is None

    out = tmp_path / "audit.ndjson"
    assert strata("admin", "audit", "export", "--target", tenant_id, "-o", str(out)).code == 0
    entries = [json.loads(line) for line in out.read_text().splitlines()]
    assert [e["action"] for e in entries] == ["tenants.create", "tenants.patch_policy"]
    assert {e["actor"] for e in entries} == {"bootstrap"}
    to_stdout = strata("admin", "audit", "export", "--target", tenant_id, "--start", "1d")
    assert [json.loads(line)["id"] for line in to_stdout.out.splitlines()] == [
        e["id"] for e in entries
    ]
    before = strata("admin", "audit", "list", "--target", tenant_id, "--end", "2020-01-01")
    assert before.out.strip() == "(none)"
    bad_limit = strata("admin", "audit", "list", "--limit", "0")
    assert bad_limit.code == 1 and "limit must be in" in bad_limit.err


def test_kv_prices_and_residency(strata) -> None:
    ran = strata("admin", "kv", "set-prices", "--device", "1.5", "--json")
    assert ran.code == 0, ran.err
    assert json.loads(ran.out) == {"device": 1.5}
    ran = strata("admin", "kv", "set-prices", "--json", "--host", "0.02")
    assert json.loads(ran.out) == {"device": 1.5, "host": 0.02}  # the device price is kept
    assert strata("admin", "kv", "set-prices", "--disk", "-1").code == 2
    ran = strata("admin", "kv", "residency", "--start", "1d")
    assert ran.code == 0, ran.err


def test_budgets_key_limits_and_spend(strata, served) -> None:
    name = unique("budget")
    assert strata("admin", "tenants", "create", name).code == 0
    status = strata(
        "admin", "budgets", "set", name, "--limit", "2.50", "--period", "day", "--json"
    ).json()
    assert status["budget"]["limit_usd"] in ("2.50", "2.5", 2.5)
    assert status["budget"]["period"] == "day"
    shown = strata("admin", "budgets", "show", name)
    assert shown.code == 0 and "remaining_usd" in shown.out
    refused = strata("admin", "budgets", "set", name, "--limit", "-1")
    assert refused.code == 1 and "limit_usd" in refused.err

    created = strata("admin", "keys", "issue", name, "--json").json()
    key_id = created["key"]["id"]
    key = strata("admin", "keys", "limits", key_id, "--rpm", "10", "--json").json()
    assert key["limits"]["rpm"] == 10
    key = strata("admin", "keys", "limits", key_id, "--tpm", "500", "--json").json()
    assert (key["limits"]["rpm"], key["limits"]["tpm"]) == (10, 500)  # the rest is kept
    assert complete(served, created["secret"]).status_code == 200
    key_budget = strata("admin", "budgets", "set-key", key_id, "--limit", "1", "--json").json()
    assert key_budget["budget"]["period"] == "month"

    report = strata("admin", "spend", "show", name, "--group-by", "total", "--json").json()
    assert report["requests"] == 1 and len(report["rows"]) == 1
    table = strata("admin", "spend", "show", name)
    assert table.code == 0 and key_id in table.out
    assert strata("admin", "budgets", "clear", name).code == 0
    assert strata("admin", "budgets", "show", name, "--json").json()["budget"] is None
