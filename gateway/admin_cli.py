"""`strata admin …` and `strata usage export …`: the admin REST API from a terminal."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import httpx

from gateway import settings as env
from tenants.records import LIMIT_FIELDS


def add_admin_commands(sub: Any) -> None:
    admin = sub.add_parser("admin", help="manage tenants and keys through the admin API")
    _connection_options(admin)
    groups = admin.add_subparsers(dest="admin_command", required=True)

    tenants = groups.add_parser("tenants").add_subparsers(dest="action", required=True)
    create = tenants.add_parser("create")
    create.add_argument("name")
    for limit in LIMIT_FIELDS:
        create.add_argument(f"--{limit.replace('_', '-')}", type=int, default=None)
    tenants.add_parser("list")
    show = tenants.add_parser("show")
    show.add_argument("tenant_id")
    remove = tenants.add_parser("delete")
    remove.add_argument("tenant_id")

    keys = groups.add_parser("keys").add_subparsers(dest="action", required=True)
    kcreate = keys.add_parser("create")
    kcreate.add_argument("tenant_id")
    kcreate.add_argument("--name", default="default")
    kcreate.add_argument("--expires-in", type=float, default=None, help="seconds")
    klist = keys.add_parser("list")
    klist.add_argument("tenant_id")
    revoke = keys.add_parser("revoke")
    revoke.add_argument("key_id")
    rotate = keys.add_parser("rotate")
    rotate.add_argument("key_id")
    rotate.add_argument("--grace", type=float, default=0.0, help="seconds the old key lives")

    workers = groups.add_parser("workers").add_subparsers(dest="action", required=True)
    workers.add_parser("list", help="every worker this gateway routes to")
    for verb, text in (
        ("drain", "take no new requests (running ones finish)"),
        ("undrain", "take requests again"),
    ):
        verb_parser = workers.add_parser(verb, help=text)
        verb_parser.add_argument("worker_id")

    usage = sub.add_parser("usage", help="usage queries and billing exports")
    usage_cmd = usage.add_subparsers(dest="usage_command", required=True)
    export = usage_cmd.add_parser("export")
    _connection_options(export)
    export.add_argument("--tenant", default=None)
    export.add_argument("--start", default=None, help="unix seconds or ISO 8601")
    export.add_argument("--end", default=None, help="unix seconds or ISO 8601")
    export.add_argument("--format", choices=["csv", "ndjson", "json"], default="csv")
    export.add_argument("--granularity", choices=["request", "hour", "day"], default="request")
    export.add_argument("--output", default="-", help="file (default: stdout)")


def _connection_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    p.add_argument(
        "--token",
        default=None,
        help="admin token (default: $STRATA_ADMIN_TOKEN, else <data-dir>/admin_token)",
    )
    p.add_argument("--data-dir", default=".strata")


def _client(args: argparse.Namespace) -> httpx.Client:
    token = args.token or env.GatewaySettings.from_env().admin_token
    if token is None:
        path = Path(args.data_dir) / "admin_token"
        if not path.exists():
            raise SystemExit("strata: error: no admin token (use --token or STRATA_ADMIN_TOKEN)")
        token = path.read_text().strip()
    return httpx.Client(base_url=args.url, headers={"authorization": f"Bearer {token}"}, timeout=60)


def _call(client: httpx.Client, method: str, path: str, **kw: Any) -> Any:
    response = client.request(method, path, **kw)
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise SystemExit(f"strata: error: {response.status_code}: {message}")
    return response.json() if response.content else None


def _quiet_http_logs() -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)


def run_admin(args: argparse.Namespace) -> int:
    _quiet_http_logs()
    with _client(args) as client:
        result = _dispatch_admin(client, args)
    if result is not None:
        print(json.dumps(result, indent=2))
    return 0


def _dispatch_admin(client: httpx.Client, args: argparse.Namespace) -> Any:
    group, action = args.admin_command, args.action
    if group == "tenants":
        if action == "create":
            limits = {k: getattr(args, k) for k in LIMIT_FIELDS}
            policy = {k: v for k, v in limits.items() if v is not None}
            return _call(
                client, "POST", "/admin/tenants/", json={"name": args.name, "policy": policy}
            )
        if action == "list":
            return _call(client, "GET", "/admin/tenants/")
        if action == "show":
            return _call(client, "GET", f"/admin/tenants/{args.tenant_id}")
        return _call(client, "DELETE", f"/admin/tenants/{args.tenant_id}")
    if group == "workers":
        if action == "list":
            return _call(client, "GET", "/admin/workers/")
        return _call(client, "POST", f"/admin/workers/{action}", json={"worker_id": args.worker_id})
    if action == "create":
        body: dict[str, Any] = {"name": args.name}
        if args.expires_in is not None:
            body["expires_in_s"] = args.expires_in
        return _call(client, "POST", f"/admin/tenants/{args.tenant_id}/keys", json=body)
    if action == "list":
        return _call(client, "GET", f"/admin/tenants/{args.tenant_id}/keys")
    if action == "revoke":
        return _call(client, "POST", f"/admin/keys/{args.key_id}/revoke")
    return _call(
        client, "POST", f"/admin/keys/{args.key_id}/rotate", json={"grace_seconds": args.grace}
    )


def run_usage(args: argparse.Namespace) -> int:
    _quiet_http_logs()
    params = {
        k: v
        for k, v in {
            "tenant": args.tenant,
            "start": args.start,
            "end": args.end,
            "format": args.format,
            "granularity": args.granularity,
        }.items()
        if v is not None
    }
    out = sys.stdout.buffer if args.output == "-" else open(args.output, "wb")  # noqa: SIM115
    try:
        with (
            _client(args) as client,
            client.stream("GET", "/admin/usage/export", params=params) as response,
        ):
            if response.status_code >= 400:
                response.read()
                _call_error(response)
            for chunk in response.iter_bytes():
                out.write(chunk)
    finally:
        if out is not sys.stdout.buffer:
            out.close()
    return 0


def _call_error(response: httpx.Response) -> None:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    raise SystemExit(f"strata: error: {response.status_code}: {message}")
