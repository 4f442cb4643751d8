"""The `strata` command: `generate` (offline) and `engine` (one worker process)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import ConfigError, EngineConfig, ModelLoadError
from engine.options import add_options, argv_from_args, config_from_args
from gateway import settings
from gateway.admin_cli import run_admin
from gateway.admin_commands import add_admin_commands
from gateway.logs import configure_logging

if TYPE_CHECKING:
    from engine.fleet import FleetConfig
    from engine.worker import ListenConfig


def _engine_options(p: argparse.ArgumentParser) -> None:
    add_options(p.add_argument_group("engine"), EngineConfig)


class _RepeatableModel:
    """`serve`'s engine options: `--model` may be given once per model to serve."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def add_argument(self, *flags: str, **kwargs: Any) -> Any:
        if flags == ("--model",):  # read as `models`; `model` stays the field's default
            kwargs |= {
                "action": "append",
                "default": None,
                "dest": "models",
                "help": f"{kwargs.get('help', '')}; repeatable: one set of workers per model",
            }
        return self.group.add_argument(*flags, **kwargs)


def _engine_config(
    args: argparse.Namespace, seed: int = EngineConfig.seed, adapter_dir: str | None = None
) -> EngineConfig:
    """The engine options parsed, with what the command line leaves to the entry point: the
    seed, and where unset the cache directory (from the environment) and the adapter one."""
    defaults = {"seed": seed, "cache_dir": settings.cache_dir(), "lora.adapter_dir": adapter_dir}
    return config_from_args(EngineConfig, args, defaults)


def _alias_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="ALIAS=MODEL",
        help="another name clients may use for the served model (repeatable; default: "
        "$STRATA_MODEL_ALIASES, comma-separated); bills and metrics use the model's own id",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline and print it")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument(
        "--json-schema",
        default=None,
        help="constrain the output to JSON of this schema (JSON text, or @file)",
    )
    _engine_options(gen)

    srv = sub.add_parser("serve", help="store + engine worker + gateway on one machine")
    srv.add_argument("--host", default=None, help="default: $STRATA_HOST or 127.0.0.1")
    srv.add_argument("--port", type=int, default=None, help="default: $STRATA_PORT or 8000")
    srv.add_argument("--data-dir", default=None, help="default: $STRATA_DATA_DIR or .strata")
    srv.add_argument(
        "--demo", action="store_true", help="create a demo tenant and print its API key once"
    )
    _alias_option(srv)
    srv.add_argument(
        "--workers",
        type=int,
        default=1,
        help="engine workers per model, each its own process (default 1)",
    )
    add_options(_RepeatableModel(srv.add_argument_group("engine")), EngineConfig)
    srv.set_defaults(model=EngineConfig.model)

    gw = sub.add_parser("gateway", help="one gateway replica (store and workers run elsewhere)")
    gw.add_argument(
        "--engine",
        action="append",
        default=[],
        help="engine worker address (repeatable; default: $STRATA_ENGINE_URLS)",
    )
    gw.add_argument("--redis-url", default=None, help="default: $STRATA_REDIS_URL")
    gw.add_argument(
        "--model",
        default=None,
        help="the default model: what 'default' names (an id; default: the first to join)",
    )
    gw.add_argument(
        "--routing",
        default=None,
        choices=["kv_aware", "least_loaded", "round_robin"],
        help="how a request's worker is chosen (default: $STRATA_ROUTING or kv_aware: the "
        "worker holding the longest cached prefix of the prompt, weighed against its load)",
    )
    gw.add_argument(
        "--disagg-min-prompt-tokens",
        type=int,
        default=None,
        help="with prefill and decode workers: a prompt with at least this many tokens to "
        "compute on its decode worker is prefilled on a prefill worker (default: "
        "$STRATA_DISAGG_MIN_PROMPT_TOKENS or 512)",
    )
    gw.add_argument(
        "--disagg-transport",
        default=None,
        choices=["auto", "gateway", "remote"],
        help="how a prefill worker's pages reach the decode worker: gateway (relayed by "
        "this gateway), remote (through the remote KV tier both workers use) or auto (the "
        "remote tier when both report the same one, else the gateway; default: "
        "$STRATA_DISAGG_TRANSPORT or auto)",
    )
    gw.add_argument("--host", default=None)
    gw.add_argument("--port", type=int, default=None)
    gw.add_argument(
        "--workers",
        type=int,
        default=1,
        help="gateway processes serving the port (SO_REUSEPORT), each a whole replica on a "
        "core of its own; restarted when one dies (default 1: this process serves)",
    )
    gw.add_argument("--cache-dir", default=None)
    gw.add_argument(
        "--data-dir",
        default=None,
        help="default: $STRATA_DATA_DIR or .strata (the usage ledger's journal lives here)",
    )
    _alias_option(gw)

    add_admin_commands(sub)

    eng = sub.add_parser("engine", help="run one engine worker")
    eng.add_argument(
        "--listen",
        default="unix://.strata/engine.sock",
        help="unix:///path/to.sock (mode 0600), or tcp://host:port, which needs the fleet "
        "secret STRATA_WORKER_SECRET (loopback too) and takes TLS with --tls-cert",
    )
    eng.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TCP inside TLS")
    eng.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    eng.add_argument("--seed", type=int, default=EngineConfig.seed, help="engine random seed")
    fleet = eng.add_argument_group("fleet")
    fleet.add_argument(
        "--registry-url",
        default=None,
        help="the store to register in, so gateways find this worker and its cached KV "
        "(default: $STRATA_REDIS_URL; none: gateways reach it by --engine only); needs the "
        "fleet secret STRATA_WORKER_SECRET",
    )
    fleet.add_argument(
        "--advertise",
        default=None,
        help="the address gateways reach this worker at (default: --listen, with the host "
        "name for 0.0.0.0)",
    )
    fleet.add_argument(
        "--worker-id",
        default=None,
        help="this worker's id in the fleet (default: host name and port or socket name; a "
        "restarted worker keeps it)",
    )
    _engine_options(eng)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from engine.protocol import SamplingParams  # noqa: PLC0415

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        json_schema=_read_schema(args.json_schema),
    )
    params.validate()  # before spending seconds on importing torch and loading the model
    if params.json_schema is not None:
        from engine.structured import check  # noqa: PLC0415

        check(params.json_schema, None)
    from engine.llm import LLM  # noqa: PLC0415

    llm = LLM(_engine_config(args), progress=True)
    (result,) = llm.generate([args.prompt], params, chat=args.chat)
    print(result.text)
    return 0


def _read_schema(value: str | None) -> str | None:
    """--json-schema's text: as given, or read from the file after an @."""
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        raise ValueError(f"--json-schema: cannot read {value[1:]}: {exc.strerror}") from None


def _engine(args: argparse.Namespace) -> int:
    from engine.factory import create_engine  # noqa: PLC0415
    from engine.worker import ListenConfig, run_worker  # noqa: PLC0415

    listen = ListenConfig(  # checked before the model loads
        address=args.listen,
        secret=settings.worker_secret(),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )
    configure_logging(settings.log_level(), json=settings.json_logs())  # as gateways do
    fleet = _fleet_config(args, listen)
    adapter_dir = os.path.join(settings.data_dir(), "adapters")
    core, tokenizer = create_engine(_engine_config(args, args.seed, adapter_dir), progress=True)
    run_worker(core, listen, fleet, tokenizer)
    return 0


def _fleet_config(args: argparse.Namespace, listen: ListenConfig) -> FleetConfig | None:
    """Where and as what the worker registers, or None when it does not (no store)."""
    from engine.fleet import FleetConfig  # noqa: PLC0415
    from engine.wire import parse_address  # noqa: PLC0415

    url = args.registry_url or settings.redis_url()
    if url is None:
        return None
    if listen.secret is None:
        raise ValueError(
            "a worker registers in a fleet only with the fleet secret: set STRATA_WORKER_SECRET"
        )
    kind, host, port = parse_address(listen.address)
    advertise = args.advertise
    if advertise is None:
        public = host in ("0.0.0.0", "::", "")
        advertise = f"{kind}://{socket.gethostname()}:{port}" if public else listen.address
    default_id = f"{socket.gethostname()}-{port if kind != 'unix' else os.path.basename(host)}"
    return FleetConfig(
        redis_url=url,
        secret=listen.secret,
        advertise=advertise,
        worker_id=args.worker_id or default_id,
        role=args.role,
    )


def _serve_worker_argv(args: argparse.Namespace, model: str, data_dir: str) -> list[str]:
    """One of `serve`'s workers' options: every engine option given to `serve`, the model
    it serves, and adapters from where the gateway keeps its uploads unless --adapter-dir
    says otherwise."""
    worker = argparse.Namespace(**vars(args))
    worker.model = model
    if worker.adapter_dir is None:
        worker.adapter_dir = os.path.join(data_dir, "adapters")
    return argv_from_args(EngineConfig, worker)


def _serve(args: argparse.Namespace) -> int:
    import asyncio  # noqa: PLC0415

    import uvloop  # noqa: PLC0415

    from gateway.serve import EMBEDDED_REMOTE, exit_after, serve  # noqa: PLC0415

    models = args.models or [None]  # None: $STRATA_MODEL, else the default model
    if args.workers < 1:
        raise ValueError("--workers must be at least 1")
    gateway_settings = settings.GatewaySettings.from_env(
        model=models[0],
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        cache_dir=args.cache_dir,
        model_aliases=tuple(args.alias) or None,
    )
    configure_logging(settings.log_level(), json=gateway_settings.json_logs)
    specs = [m or gateway_settings.model for m in models]
    worker_args = [
        _serve_worker_argv(args, spec, gateway_settings.data_dir)
        for spec in specs
        for _ in range(args.workers)
    ]
    remote_bytes = None
    if args.kv_remote_url == EMBEDDED_REMOTE:
        worker = argparse.Namespace(**vars(args))
        worker.model = specs[0]
        remote_bytes = _engine_config(worker).cache.remote_memory_bytes
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(
            serve(gateway_settings, worker_args, demo=args.demo, kv_remote_bytes=remote_bytes)
        )
        # every child has stopped: the event loop's own teardown (cancelling what is left,
        # joining its executor's threads) gets a few seconds, not an unbounded wait
        exit_after(10.0, code=0, why="the event loop's teardown hung after a clean stop")
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from gateway.processes import run_processes, serve_one  # noqa: PLC0415

    if args.workers < 1:
        raise ValueError("--workers must be at least 1")
    gateway_settings = settings.GatewaySettings.from_env(
        model=args.model,
        host=args.host,
        port=args.port,
        cache_dir=args.cache_dir,
        data_dir=args.data_dir,
        redis_url=args.redis_url,
        routing=args.routing,
        disagg_min_prompt_tokens=args.disagg_min_prompt_tokens,
        disagg_transport=args.disagg_transport,
        engine_addresses=tuple(args.engine) or None,
        model_aliases=tuple(args.alias) or None,
    )
    if gateway_settings.redis_url is None:
        raise ValueError("a gateway replica needs --redis-url (or STRATA_REDIS_URL)")
    if not gateway_settings.engine_addresses and gateway_settings.worker_secret is None:
        raise ValueError(
            "a gateway replica needs workers: --engine addresses, or the fleet secret "
            "STRATA_WORKER_SECRET to find registered workers in the store"
        )
    configure_logging(settings.log_level(), json=gateway_settings.json_logs)
    if args.workers > 1:
        return run_processes(gateway_settings, args.workers)
    serve_one(gateway_settings)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=settings.log_level(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    from engine.protocol import InvalidRequestError  # noqa: PLC0415
    from engine.tokenizer import ChatTemplateError, TokenizerError  # noqa: PLC0415

    handlers = {
        "gateway": _gateway,
        "generate": _generate,
        "engine": _engine,
        "serve": _serve,
        "admin": run_admin,
        "usage": run_admin,
    }
    try:
        return handlers[args.command](args)
    except (
        ModelLoadError,
        ConfigError,
        InvalidRequestError,
        TokenizerError,
        ChatTemplateError,
        ValueError,
    ) as exc:  # input errors: one line, no traceback
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
