"""`strata admin …`: the admin REST API from a terminal, one command per endpoint, built
from the table in `gateway/admin_commands.py`. This module owns the machinery: the parser,
the connection (URL and admin token), tenant names, errors and printing.

A command for a new endpoint is one `Command` entry in that table, for example:

    Command(
        "budgets", "set", "PUT", "/admin/tenants/{tenant}/budget",
        "set a tenant's monthly budget",
        args=(TENANT, opt("--monthly", help="spend per calendar month, in the price "
                          "currency", field="monthly_limit", type=float)),
    )

- `{name}` in the path is filled from the argument of that name; `{tenant}` (the `TENANT`
  argument) takes a tenant's id or name, and a name is resolved through the tenant list (an
  ambiguous name is an error listing the candidates).
- `opt(...)` options go into the JSON body (`to="query"`: the query string), under `field`
  (default: the option's name); an option not given is left out, so PATCH bodies work.
- `body` adds fixed fields (`{"disabled": True}`); `columns` picks a list's table columns;
  `done` is the line printed when the server answers with nothing (a 204).
- Anything else (files, several calls) is a `run` hook: `run(call) -> answer to print`.
A new group also needs a line in `GROUPS`. The connection and output options (`--url`,
`--admin-token`, `--json`, ...) are added to every command, so they go anywhere on the line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import field as default
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

import httpx

from gateway import settings
from gateway.admin_output import render

DEFAULT_URL = "http://127.0.0.1:8000"  # `strata serve`'s default address


class AdminError(Exception):
    """What `strata admin` prints as one line on stderr before exiting with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Arg:
    """One argument of a command: a positional (filled into the path) or an option."""

    flags: tuple[str, ...]
    help: str
    to: Literal["path", "body", "query", "local"] = "path"
    field: str | None = None  # the body or query key (default: the argument's name)
    tenant: bool = False  # a tenant's id or name (names resolve to ids)
    options: Mapping[str, Any] = default(default_factory=dict)  # more add_argument keywords

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")


def pos(name: str, help: str, **options: Any) -> Arg:
    return Arg((name,), help, to="path", options=options)


def opt(
    *flags: str,
    help: str,
    to: Literal["body", "query", "local"] = "body",
    field: str | None = None,
    tenant: bool = False,
    **options: Any,
) -> Arg:
    return Arg(flags, help, to=to, field=field, tenant=tenant, options=options)


TENANT = Arg(("tenant",), "the tenant's id or name", tenant=True)


@dataclass(frozen=True)
class Command:
    group: str
    name: str
    method: str
    path: str
    help: str
    args: tuple[Arg, ...] = ()
    body: Mapping[str, Any] = default(default_factory=dict)
    columns: tuple[str, ...] = ()
    done: str | None = None  # printed for an empty answer; `{name}` from the arguments
    aliases: tuple[str, ...] = ()
    run: Callable[[Call], Any] | None = None


class AdminClient:
    """The admin API over HTTP; every failure becomes an AdminError."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self.http = httpx.Client(
            base_url=url, headers={"authorization": f"Bearer {token}"}, timeout=60
        )

    def request(self, method: str, path: str, **kw: Any) -> Any:
        with self.stream(method, path, **kw) as response:
            response.read()
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise AdminError(
                f"{self.url} answered with something else than JSON: is it a "
                "Strata gateway? (set STRATA_URL or --url)",
                2,
            ) from None

    def stream(self, method: str, path: str, **kw: Any) -> _Streamed:
        return _Streamed(self, method, path, kw)

    def close(self) -> None:
        self.http.close()


class _Streamed:
    """A streamed response, checked: an HTTP error or an unreachable server is raised."""

    def __init__(self, client: AdminClient, method: str, path: str, kw: dict[str, Any]) -> None:
        self.client, self.request = client, client.http.build_request(method, path, **kw)
        self.response: httpx.Response | None = None

    def __enter__(self) -> httpx.Response:
        try:
            self.response = self.client.http.send(self.request, stream=True)
        except httpx.TransportError as exc:
            raise AdminError(
                f"cannot reach {self.client.url}: {_reason(exc)} (set STRATA_URL or --url)", 2
            ) from None
        if self.response.status_code >= 400:
            self.response.read()
            self.response.close()
            raise AdminError(f"{self.response.status_code}: {_server_message(self.response)}")
        return self.response

    def __exit__(self, *exc: object) -> None:
        if self.response is not None:
            self.response.close()


def _reason(exc: httpx.TransportError) -> str:
    text = str(exc)
    if isinstance(exc, httpx.ConnectError) and "refused" in text.lower():
        return "connection refused"
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    return text.rsplit("] ", 1)[-1] or type(exc).__name__


def _server_message(response: httpx.Response) -> str:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):  # not the API's error shape
        html = "html" in response.headers.get("content-type", "")
        message = (None if html else response.text.strip()[:200]) or response.reason_phrase
    return " ".join(str(message).split())


@dataclass
class Call:
    """One command being run: its parsed arguments and the client."""

    command: Command
    args: argparse.Namespace
    client: AdminClient
    tenants: list[dict[str, Any]] | None = None  # the tenant list, once a name was looked up

    def given(self, arg: Arg) -> bool:
        return hasattr(self.args, arg.dest)

    def value(self, arg: Arg) -> Any:
        value = getattr(self.args, arg.dest)
        if not arg.tenant or value is None:
            return value
        if isinstance(value, list):
            return [self.tenant_id(v) for v in value]
        return self.tenant_id(value)

    def path(self) -> str:
        fill = {
            a.dest: quote(str(self.value(a)), safe="@:")
            for a in self.command.args
            if a.to == "path"
        }
        return self.command.path.format(**fill)

    def fields(self, to: str) -> dict[str, Any]:
        """The given arguments bound for the body or the query; a dotted field
        (`policy.rpm`) goes into a nested record."""
        out: dict[str, Any] = dict(self.command.body) if to == "body" else {}
        for arg in self.command.args:
            if arg.to == to and self.given(arg):
                *parents, key = (arg.field or arg.dest).split(".")
                record = out
                for parent in parents:
                    record = record.setdefault(parent, {})
                record[key] = self.value(arg)
        return out

    def send(self) -> Any:
        c = self.command
        body = self.fields("body") if c.method in ("POST", "PUT", "PATCH") else None
        params = self.fields("query") or None
        return self.client.request(c.method, self.path(), json=body, params=params)

    def tenant_id(self, ident: str) -> str:
        """The id of the tenant with this id or name (the value itself when none has it, so
        the server answers with its 404)."""
        if self.tenants is None:
            self.tenants = self.client.request("GET", "/admin/tenants/")
        tenants = self.tenants or []
        if any(t["id"] == ident for t in tenants):
            return ident
        named = [t for t in tenants if t["name"] == ident]
        if len(named) > 1:
            ids = ", ".join(t["id"] for t in named)
            raise AdminError(f"tenant name {ident!r} is ambiguous: use one of the ids {ids}")
        return named[0]["id"] if named else ident


# -- the command line ------------------------------------------------------------------------


def _common_options(parser: argparse.ArgumentParser) -> None:
    """Added to `admin`, to each group and to each command, so they go anywhere; SUPPRESS
    keeps a later parser from overwriting what an earlier one read."""
    group = parser.add_argument_group("connection and output")
    s = argparse.SUPPRESS
    group.add_argument(
        "--url",
        default=s,
        metavar="URL",
        help=f"the gateway's base URL (default: $STRATA_URL, else {DEFAULT_URL})",
    )
    group.add_argument(
        "--admin-token",
        "--token",
        default=s,
        metavar="TOKEN",
        help="the admin token (default: $STRATA_ADMIN_TOKEN, else the file admin_token in "
        "--data-dir)",
    )
    group.add_argument(
        "--data-dir",
        default=s,
        metavar="DIR",
        help="where `strata serve` keeps the admin token it generated (default: "
        "$STRATA_DATA_DIR, else .strata)",
    )
    group.add_argument(
        "--json", action="store_true", default=s, help="print the server's JSON, not a table"
    )


def add_admin(
    sub: Any, help: str, commands: tuple[Command, ...], groups: Mapping[str, str]
) -> None:
    """`strata admin <group> <command>` for every command, under the subparsers `sub`;
    `groups` gives each group's help (and its aliases after `|`)."""
    admin = sub.add_parser("admin", help=help, description=help)
    _common_options(admin)
    group_parsers = admin.add_subparsers(dest="admin_group", required=True, metavar="GROUP")
    for group, text in groups.items():
        add_group(group_parsers, group, text, tuple(c for c in commands if c.group == group))


def add_group(sub: Any, name: str, text: str, commands: tuple[Command, ...]) -> None:
    """`<name> <command>` for each of `commands`, under the subparsers `sub`."""
    help, *aliases = text.split("|")
    parser = sub.add_parser(name, help=help, description=help, aliases=aliases)
    _common_options(parser)
    actions = parser.add_subparsers(dest="admin_action", required=True, metavar="COMMAND")
    for command in commands:
        leaf = actions.add_parser(
            command.name, help=command.help, description=command.help, aliases=command.aliases
        )
        for arg in command.args:
            keywords = dict(arg.options)
            if arg.flags[0].startswith("-"):
                keywords.setdefault("default", argparse.SUPPRESS)
            leaf.add_argument(*arg.flags, help=arg.help, **keywords)
        _common_options(leaf)
        leaf.set_defaults(admin_command=command)


def run_admin(args: argparse.Namespace) -> int:
    """Run the parsed command; 0, or 1 when the server refused, 2 when it cannot be asked."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    command: Command = args.admin_command
    try:
        client = AdminClient(_url(args), _token(args))
        try:
            call = Call(command, args, client)
            answer = command.run(call) if command.run is not None else call.send()
        finally:
            client.close()
    except AdminError as exc:
        print(f"strata admin: {exc}", file=sys.stderr)
        return exc.exit_code
    except httpx.HTTPError as exc:  # the connection lost halfway through an answer
        print(f"strata admin: {_url(args)}: {exc or type(exc).__name__}", file=sys.stderr)
        return 2
    if answer is not None:
        as_json = getattr(args, "json", False)
        print(json.dumps(answer, indent=2) if as_json else render(answer, command.columns))
    elif command.done is not None:
        print(command.done.format(**vars(args)))
    return 0


def _url(args: argparse.Namespace) -> str:
    url: str = getattr(args, "url", None) or settings.strata_url() or DEFAULT_URL
    if not url.startswith(("http://", "https://")):
        raise AdminError(f"--url must start with http:// or https://, not {url!r}", 2)
    return url.rstrip("/")


def _token(args: argparse.Namespace) -> str:
    token = getattr(args, "admin_token", None) or settings.admin_token()
    if token:
        return str(token)
    path = Path(getattr(args, "data_dir", None) or settings.data_dir()) / "admin_token"
    try:
        return path.read_text().strip()
    except OSError:
        raise AdminError(
            f"no admin token: use --admin-token or STRATA_ADMIN_TOKEN ({path} not found)", 2
        ) from None
