"""The commands of `strata admin`, one entry per admin REST endpoint (the pattern for adding
one is in `gateway/admin_cli.py`), and the hooks of those that are more than one call."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.admin_cli import TENANT, AdminError, Arg, Call, Command, add_admin, add_group, opt, pos
from gateway.admin_values import (
    duration,
    instant,
    limit,
    names,
    policy_options,
    price,
    seconds_at,
)
from tenants.export import PERIOD_COLUMNS

# -- hooks -------------------------------------------------------------------------------------


def _secret_once(warning: str) -> Callable[[Call], Any]:
    """A hook that sends the command and warns on stderr that the answer's secret is shown
    only this once."""

    def run(call: Call) -> Any:
        answer = call.send()
        print(f"strata admin: {warning}", file=sys.stderr)
        return answer

    return run


_issue = _secret_once(
    "the key's secret is shown only this once (the server keeps only its hash): store it now"
)
_add_webhook = _secret_once(
    "the webhook's signing secret is shown only this once: give it to the receiver now"
)
_create_token = _secret_once(
    "the admin token is shown only this once (the server keeps only its hash): store it "
    "now; it can do whatever its role allows"
)


def _in_force(call: Call, model: str) -> dict[str, Any] | None:
    """The version of `model`'s price in force now (the latest to have taken effect)."""
    now = time.time()
    versions = [
        p
        for p in call.client.request("GET", "/admin/prices/")
        if p["model"] == model and (p.get("effective_at") or 0) <= now
    ]
    return max(versions, key=lambda p: p.get("effective_at") or 0, default=None)


def _set_price(call: Call) -> Any:
    """PUT a new version of the model's price: the given fields changed, the others as in
    the version in force, taking effect now or at --effective-at."""
    model = call.args.model
    current = {k: v for k, v in (_in_force(call, model) or {}).items() if k != "effective_at"}
    body = {**current, **call.fields("body"), "model": model}
    return call.client.request("PUT", "/admin/prices/", json=body)


def _show_price(call: Call) -> Any:
    price = _in_force(call, call.args.model)
    if price is None:
        raise AdminError(f"no price for {call.args.model!r}")
    return price


def _upload_adapter(call: Call) -> Any:
    folder = Path(call.args.directory)
    paths = {
        "adapter_config": folder / "adapter_config.json",
        "adapter_model": folder / "adapter_model.safetensors",
    }
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise AdminError(f"not a PEFT adapter directory: {', '.join(missing)} not found", 2)
    form = {**call.fields("body"), "name": call.args.name}
    if "allowed_tenants" in form:
        form["allowed_tenants"] = json.dumps(form["allowed_tenants"])
    with paths["adapter_config"].open("rb") as config, paths["adapter_model"].open("rb") as model:
        files = {"adapter_config": config, "adapter_model": model}
        return call.client.request("POST", "/admin/adapters/upload", data=form, files=files)


def _export(call: Call) -> None:
    output = getattr(call.args, "output", "-")
    params = call.fields("query")
    with call.client.stream("GET", call.path(), params=params) as response:
        if output == "-":
            for chunk in response.iter_bytes():
                sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
            return
        try:
            with open(output, "wb") as out:
                for chunk in response.iter_bytes():
                    out.write(chunk)
        except OSError as exc:
            raise AdminError(f"--output: cannot write {output}: {exc.strerror}", 2) from None


def _as_json(call: Call) -> Any:
    """An export endpoint's rows as JSON, for a table."""
    params = {**call.fields("query"), "format": "json"}
    return call.client.request("GET", call.command.path, params=params)


def _audit_page(call: Call) -> Any:
    """One page of the audit log: its entries as a table (the whole page with --json), and
    how to read the next one."""
    answer = call.send()
    if answer.get("next"):
        print(f"strata admin: more entries: add --after {answer['next']}", file=sys.stderr)
    return answer if getattr(call.args, "json", False) else answer["data"]


def _set_kv_prices(call: Call) -> Any:
    """PUT the KV prices with the given tiers changed and the others as they were."""
    current: dict[str, Any] = call.client.request("GET", "/admin/kv-prices/")
    return call.client.request("PUT", "/admin/kv-prices/", json={**current, **call.fields("body")})


# -- the table ---------------------------------------------------------------------------------

OUTPUT = opt(
    "--output", "-o", help="the file to write (default: -, stdout)", to="local", default="-"
)


KEY = pos("key_id", "the key's id (key_...)")
WEBHOOK = pos("webhook_id", "the webhook's id (wh_...), as `webhooks list` shows it")
WORKER = opt("worker_id", help="the worker's id, as `workers list` shows it")
WINDOW = (
    opt("--tenant", help="a tenant's id or name (default: every tenant)", to="query", tenant=True),
    opt(
        "--start",
        help="from: ISO 8601 date, unix seconds, or an age like 7d (default: the beginning)",
        to="query",
        type=instant,
        metavar="WHEN",
    ),
    opt(
        "--end",
        help="until (not included): ISO 8601 date, unix seconds, or an age like 1d (default: now)",
        to="query",
        type=instant,
        metavar="WHEN",
    ),
)
ALLOWED = opt(
    "--allowed-tenants",
    help="comma-separated tenant ids or names that may use it (default: every tenant)",
    tenant=True,
    type=names,
    metavar="TENANT,...",
)
PRICE_OPTIONS = tuple(
    opt(
        f"--{kind}",
        help=f"{text}, per 1M tokens (default: unchanged, else 0)",
        field=f"{kind}_per_m",
        type=price,
        metavar="PRICE",
    )
    for kind, text in (
        ("prompt", "prompt tokens not served from the cache"),
        ("cached", "prompt tokens served from the prefix cache"),
        ("completion", "generated tokens"),
    )
)

ADMIN_TOKEN = pos("token_id", "the token's id (adm_...)")
TOKEN_COMMANDS = (
    Command(
        "tokens",
        "create",
        "POST",
        "/admin/tokens/",
        "issue an admin token with a role; it is printed once",
        args=(
            opt("name", help="a label for the token (letters, digits, - and _)"),
            opt(
                "--role",
                help="admin: everything; viewer: read everything; billing: usage, spend, "
                "exports and prices only",
                choices=["admin", "billing", "viewer"],
                required=True,
            ),
        ),
        aliases=("issue",),
        run=_create_token,
    ),
    Command(
        "tokens",
        "list",
        "GET",
        "/admin/tokens/",
        "every admin token, revoked ones included (prefixes, never tokens)",
        columns=("id", "name", "role", "prefix", "created_at", "created_by", "revoked_at"),
    ),
    Command("tokens", "show", "GET", "/admin/tokens/{token_id}", "one token", args=(ADMIN_TOKEN,)),
    Command(
        "tokens",
        "revoke",
        "DELETE",
        "/admin/tokens/{token_id}",
        "revoke a token now, on every replica (its console sessions end too)",
        args=(ADMIN_TOKEN,),
    ),
)
AUDIT_TARGET = opt(
    "--target", help="only entries about this id (a tenant, key, token, ...)", to="query"
)
AUDIT_COMMANDS = (
    Command(
        "audit",
        "list",
        "GET",
        "/admin/audit/",
        "audit entries, oldest first, as a table",
        args=(
            *WINDOW[1:],
            AUDIT_TARGET,
            opt("--limit", help="entries per page, 1 to 1000 (default: 100)", to="query", type=int),
            opt("--after", help="the cursor printed by the previous page", to="query"),
        ),
        columns=("at", "actor", "role", "action", "target", "status", "client"),
        run=_audit_page,
    ),
    Command(
        "audit",
        "export",
        "GET",
        "/admin/audit/export",
        "every audit entry of the window as NDJSON, streamed to a file or stdout",
        args=(
            *WINDOW[1:],
            AUDIT_TARGET,
            OUTPUT,
        ),
        run=_export,
    ),
)

TENANT_COLUMNS = (
    "id",
    "name",
    "disabled",
    "created_at",
    "policy.rpm",
    "policy.tpm",
    "policy.max_concurrent",
    "policy.kv_budget_tokens",
)
KEY_COLUMNS = ("id", "tenant_id", "name", "prefix", "created_at", "expires_at", "revoked_at")
T = "/admin/tenants/{tenant}"

GROUPS = {
    "tenants": "create, list, show, update, disable, enable and delete tenants|tenant",
    "policies": "read and change a tenant's limits|policy",
    "keys": "issue, list, rotate and revoke tenants' API keys|key",
    "adapters": "register, upload, list and delete LoRA adapters|adapter",
    "prices": "prices per 1M tokens, per model or adapter|price",
    "usage": "usage totals and billing exports",
    "workers": "the engine workers: list, drain, undrain|worker",
    "budgets": "spend caps per tenant and key, per UTC day or month|budget",
    "spend": "what tenants spent, from the ledger",
    "tokens": "create, list, show and revoke admin tokens (roles admin, billing, viewer)|token",
    "audit": "the audit log of admin and console changes",
    "kv": "KV cache residency: prices per GiB-hour of each tier, and what tenants held",
    "webhooks": "alerts delivered as signed webhooks: add, list, delete, test|webhook",
}

COMMANDS: tuple[Command, ...] = (
    Command(
        "tenants",
        "create",
        "POST",
        "/admin/tenants/",
        "create a tenant",
        args=(
            opt("name", help="the tenant's name"),
            opt("--id", help="its id (default: one is generated)"),
            *policy_options("policy."),
        ),
    ),
    Command("tenants", "list", "GET", "/admin/tenants/", "every tenant", columns=TENANT_COLUMNS),
    Command("tenants", "show", "GET", T, "one tenant", args=(TENANT,)),
    Command(
        "tenants",
        "update",
        "PATCH",
        T,
        "rename a tenant",
        args=(TENANT, opt("--name", help="its new name", required=True)),
    ),
    Command(
        "tenants",
        "disable",
        "PATCH",
        T,
        "refuse the tenant's keys (401) until enabled",
        args=(TENANT,),
        body={"disabled": True},
    ),
    Command(
        "tenants",
        "enable",
        "PATCH",
        T,
        "accept the tenant's keys again",
        args=(TENANT,),
        body={"disabled": False},
    ),
    Command(
        "tenants",
        "delete",
        "DELETE",
        T,
        "delete a tenant and its keys (usage stays)",
        args=(TENANT,),
        done="deleted tenant {tenant}",
    ),
    Command(
        "tenants",
        "rotate-cache-salt",
        "POST",
        T + "/rotate-cache-salt",
        "a new cache salt: the tenant's cached prefixes are never hit again",
        args=(TENANT,),
    ),
    Command(
        "policies",
        "show",
        "GET",
        T + "/policy",
        "a tenant's policy, with its KV budget in bytes",
        args=(TENANT,),
    ),
    Command(
        "policies",
        "set",
        "PATCH",
        T + "/policy",
        "change the fields given; the others keep their values",
        args=(TENANT, *policy_options()),
        aliases=("patch",),
    ),
    Command(
        "policies",
        "replace",
        "PUT",
        T + "/policy",
        "replace the whole policy; fields not given take their defaults",
        args=(TENANT, *policy_options()),
    ),
    Command(
        "keys",
        "issue",
        "POST",
        T + "/keys",
        "issue a key; its secret is printed once",
        args=(
            TENANT,
            opt("--name", help="a label for the key (default: default)"),
            opt(
                "--expires-in",
                help="lifetime: seconds, or 90m, 12h, 30d (default: until revoked)",
                field="expires_in_s",
                type=duration,
                metavar="DURATION",
            ),
        ),
        aliases=("create",),
        run=_issue,
    ),
    Command(
        "keys",
        "list",
        "GET",
        T + "/keys",
        "a tenant's keys (prefixes, never secrets)",
        args=(TENANT,),
        columns=KEY_COLUMNS[:1] + KEY_COLUMNS[2:],
    ),
    Command("keys", "show", "GET", "/admin/keys/{key_id}", "one key", args=(KEY,)),
    Command(
        "keys",
        "rotate",
        "POST",
        "/admin/keys/{key_id}/rotate",
        "a new key with the same name and expiry; its secret is printed once",
        args=(
            KEY,
            opt(
                "--grace",
                help="how long the old key keeps working: seconds, or "
                "15m, 12h, 1d, at most 30d (default: 0, revoked now)",
                field="grace_seconds",
                type=duration,
                metavar="DURATION",
            ),
        ),
        run=_issue,
    ),
    Command(
        "keys", "revoke", "POST", "/admin/keys/{key_id}/revoke", "revoke a key now", args=(KEY,)
    ),
    Command(
        "adapters",
        "register",
        "POST",
        "/admin/adapters/",
        "register a PEFT adapter directory the workers can read (a new version)",
        args=(
            opt("name", help="the adapter's name, as tenants call it"),
            opt("path", help="the adapter directory, as the workers see it"),
            ALLOWED,
            opt("--base-model", help="the served model it adapts (default: the default model)"),
        ),
    ),
    Command(
        "adapters",
        "upload",
        "POST",
        "/admin/adapters/upload",
        "upload a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)",
        args=(
            Arg(("name",), "the adapter's name", to="local"),
            Arg(("directory",), "the local adapter directory", to="local"),
            ALLOWED,
            opt("--base-model", help="the served model it adapts"),
        ),
        run=_upload_adapter,
    ),
    Command(
        "adapters",
        "list",
        "GET",
        "/admin/adapters/",
        "the latest version of each adapter",
        columns=("name", "version", "base_model", "allowed_tenants", "created_at", "path"),
    ),
    Command(
        "adapters",
        "delete",
        "DELETE",
        "/admin/adapters/{name}",
        "delete every version of an adapter",
        args=(pos("name", "the adapter's name"),),
        done="deleted adapter {name}",
    ),
    Command("prices", "list", "GET", "/admin/prices/", "every price"),
    Command(
        "prices",
        "show",
        "GET",
        "/admin/prices/",
        "one model's or adapter's price",
        args=(pos("model", "a model id, an adapter, or adapter@version"),),
        run=_show_price,
    ),
    Command(
        "prices",
        "set",
        "PUT",
        "/admin/prices/",
        "set a model's, an adapter's or an adapter version's price",
        args=(
            Arg(("model",), "a model id, an adapter, or adapter@version", to="local"),
            *PRICE_OPTIONS,
            opt(
                "--effective-at",
                help="when the new price takes effect: ISO 8601 date, unix seconds, or now "
                "(default: now); past requests keep the price they were billed at",
                type=seconds_at,
                metavar="WHEN",
            ),
        ),
        run=_set_price,
    ),
    Command(
        "prices",
        "delete",
        "DELETE",
        "/admin/prices/{model}",
        "delete a price",
        args=(pos("model", "a model id, an adapter, or adapter@version"),),
        done="deleted the price of {model}",
    ),
    Command(
        "usage",
        "show",
        "GET",
        "/admin/usage/export",
        "usage and costs as a table",
        args=(
            *WINDOW,
            opt(
                "--granularity",
                help="sums per UTC hour or day, tenant, model and adapter",
                to="query",
                choices=["hour", "day"],
                default="day",
            ),
        ),
        columns=(*PERIOD_COLUMNS[:-5], "cost_total"),
        run=_as_json,
    ),
    Command(
        "usage",
        "export",
        "GET",
        "/admin/usage/export",
        "a billing export, streamed to a file or stdout",
        args=(
            *WINDOW,
            opt(
                "--format",
                help="csv, ndjson (a record per line) or json (one array)",
                to="query",
                choices=["csv", "ndjson", "json"],
                default="csv",
            ),
            opt(
                "--granularity",
                help="one row per request, or summed per UTC hour or "
                "day, tenant, model and adapter",
                to="query",
                choices=["request", "hour", "day"],
                default="request",
            ),
            OUTPUT,
        ),
        run=_export,
    ),
    Command(
        "workers",
        "list",
        "GET",
        "/admin/workers/",
        "every worker this gateway routes to",
        columns=(
            "worker_id",
            "model",
            "role",
            "address",
            "drained",
            "connected",
            "num_running",
            "num_waiting",
            "kv_blocks_used",
            "kv_blocks_total",
            "indexed_blocks",
        ),
    ),
    Command(
        "workers",
        "drain",
        "POST",
        "/admin/workers/drain",
        "take no new requests (running ones finish)",
        args=(WORKER,),
    ),
    Command(
        "workers",
        "undrain",
        "POST",
        "/admin/workers/undrain",
        "take requests again",
        args=(WORKER,),
    ),
    *TOKEN_COMMANDS,
    *AUDIT_COMMANDS,
    Command(
        "webhooks",
        "add",
        "POST",
        "/admin/webhooks/",
        "register a webhook for alerts; its signing secret is printed once",
        args=(
            opt("endpoint", help="where alerts are POSTed (http:// or https://)", field="url"),
            opt(
                "--events",
                help="comma-separated: budget_threshold, worker_lost, store_unreachable, "
                "store_recovered, or * for all (default: *)",
                type=names,
                metavar="EVENT,...",
            ),
            opt("--description", help="what the webhook is for"),
        ),
        run=_add_webhook,
    ),
    Command(
        "webhooks",
        "list",
        "GET",
        "/admin/webhooks/",
        "every webhook (never their secrets)",
        columns=("id", "url", "events", "description", "created_at"),
    ),
    Command(
        "webhooks",
        "delete",
        "DELETE",
        "/admin/webhooks/{webhook_id}",
        "delete a webhook: it gets no more alerts",
        args=(WEBHOOK,),
        done="deleted webhook {webhook_id}",
    ),
    Command(
        "webhooks",
        "test",
        "POST",
        "/admin/webhooks/{webhook_id}/test",
        "send the webhook a test event",
        args=(WEBHOOK,),
    ),
    Command(
        "webhooks",
        "deliveries",
        "GET",
        "/admin/webhooks/{webhook_id}/deliveries",
        "the webhook's latest delivery attempts, newest first",
        args=(
            WEBHOOK,
            opt("--limit", help="how many (1-100, default 50)", to="query", type=int),
        ),
        columns=("attempted_at", "event_id", "type", "attempt", "status_code", "error"),
    ),
)


def _spend(call: Call) -> Any:
    """The spend report's rows (the totals with --json)."""
    report = call.send()
    return report if getattr(call.args, "json", False) else report["rows"]


def _key_limits(call: Call) -> Any:
    """PUT the key's limits with the given fields changed and the others as they were."""
    status = call.client.request("GET", call.path().removesuffix("/limits") + "/status")
    current = status.get("key", {}).get("limits") or {}
    return call.client.request("PUT", call.path(), json={**current, **call.fields("body")})


BUDGET_OPTIONS = (
    opt(
        "--limit",
        help="the budget in USD per period, e.g. 250 or 99.50",
        field="limit_usd",
        type=str,
        metavar="USD",
        required=True,
    ),
    opt(
        "--period",
        help="what the limit is per: a UTC day, a UTC month, or none (lifetime)",
        choices=["day", "month", "none"],
        default="month",
    ),
    opt(
        "--thresholds",
        help="comma-separated percentages of the limit whose crossing is recorded as a "
        "budget event (default: 50,80,100)",
        type=lambda text: [int(p) for p in text.split(",") if p.strip()],
        metavar="PCT,...",
    ),
)

COMMANDS += (
    Command(
        "budgets",
        "show",
        "GET",
        "/admin/tenants/{tenant}/budget",
        "a tenant's budget and what is spent and held of it this period",
        args=(TENANT,),
    ),
    Command(
        "budgets",
        "set",
        "PUT",
        "/admin/tenants/{tenant}/budget",
        "cap a tenant's spend per period (requests that could pass it are refused)",
        args=(TENANT, *BUDGET_OPTIONS),
    ),
    Command(
        "budgets",
        "clear",
        "DELETE",
        "/admin/tenants/{tenant}/budget",
        "remove a tenant's budget",
        args=(TENANT,),
        done="the tenant has no budget now",
    ),
    Command(
        "budgets",
        "show-key",
        "GET",
        "/admin/keys/{key_id}/budget",
        "a key's budget and what is spent and held of it this period",
        args=(KEY,),
    ),
    Command(
        "budgets",
        "set-key",
        "PUT",
        "/admin/keys/{key_id}/budget",
        "cap one key's spend per period, within its tenant's budget",
        args=(KEY, *BUDGET_OPTIONS),
    ),
    Command(
        "budgets",
        "clear-key",
        "DELETE",
        "/admin/keys/{key_id}/budget",
        "remove a key's budget",
        args=(KEY,),
        done="the key has no budget now",
    ),
    Command(
        "budgets",
        "events",
        "GET",
        "/admin/budget-events",
        "budget thresholds crossed, oldest first",
        args=(
            opt("--after", help="only events after this id", to="query"),
            opt("--limit", help="at most this many events (1-1000)", to="query", type=int),
        ),
    ),
    Command(
        "spend",
        "show",
        "GET",
        "/admin/tenants/{tenant}/spend",
        "a tenant's spend from its ledger, by period, key, model and adapter",
        args=(
            TENANT,
            *WINDOW[1:],
            opt(
                "--group-by",
                help="sums per UTC hour or day, or one total per key, model and adapter",
                to="query",
                choices=["hour", "day", "total"],
                default="day",
            ),
            opt("--key", help="only this key's spend (its id)", to="query", field="key_id"),
        ),
        columns=("period_start", "key_id", "model", "adapter", "requests", "cost_usd"),
        run=_spend,
    ),
    Command(
        "keys",
        "limits",
        "PUT",
        "/admin/keys/{key_id}/limits",
        "set a key's own limits within its tenant's (the fields not given are kept)",
        args=(
            KEY,
            opt("--rpm", help="requests per minute; none: the tenant's", type=limit),
            opt("--tpm", help="tokens per minute; none: the tenant's", type=limit),
            opt(
                "--max-concurrent",
                help="requests in flight at once; none: the tenant's",
                type=limit,
            ),
            opt(
                "--allowed-models",
                help="comma-separated model ids the key may use; none: every model",
                type=names,
                metavar="MODEL,...",
            ),
            opt(
                "--allowed-adapters",
                help="comma-separated adapters the key may use; none: every adapter",
                type=names,
                metavar="ADAPTER,...",
            ),
        ),
        run=_key_limits,
    ),
    Command(
        "keys",
        "status",
        "GET",
        "/admin/keys/{key_id}/status",
        "a key with its limits, last use and budget",
        args=(KEY,),
    ),
)

KV_TIERS = ("device", "host", "disk", "remote")

COMMANDS += (
    Command("kv", "prices", "GET", "/admin/kv-prices/", "USD per GiB-hour of each KV tier"),
    Command(
        "kv",
        "set-prices",
        "PUT",
        "/admin/kv-prices/",
        "price KV held in tiers (the tiers not given keep their price)",
        args=tuple(
            opt(
                f"--{tier}",
                help=f"USD per GiB-hour of KV held in the {tier} tier",
                type=price,
                metavar="PRICE",
            )
            for tier in KV_TIERS
        ),
        run=_set_kv_prices,
    ),
    Command(
        "kv",
        "residency",
        "GET",
        "/admin/kv-residency/",
        "KV each tenant held per tier, in GiB-hours, and its cost",
        args=(
            *WINDOW,
            opt(
                "--granularity",
                help="sums per UTC hour or day, tenant and tier",
                to="query",
                choices=["hour", "day"],
                default="day",
            ),
        ),
        columns=("period_start", "tenant_id", "tier", "gib_hours", "price_per_gib_hour", "cost"),
        run=_as_json,
    ),
)


def add_admin_commands(sub: Any) -> None:
    """`strata admin …`, and `strata usage …` as a shorter name for `strata admin usage …`."""
    add_admin(
        sub,
        "manage tenants, keys, policies, adapters, prices, usage, workers, webhooks, admin "
        "tokens and the audit log",
        COMMANDS,
        GROUPS,
    )
    usage = tuple(c for c in COMMANDS if c.group == "usage")
    add_group(sub, "usage", "usage totals and billing exports (as strata admin usage)", usage)
