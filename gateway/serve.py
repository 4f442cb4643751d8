"""`strata serve`: the embedded store, one supervised engine worker and the gateway, as one
command. Ctrl-C / SIGTERM drains open streams, then stops the gateway, the worker and the
store, in that order."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from engine.client import EngineClient
from engine.handshake import ClientAuth
from engine.protocol import EngineDeadError
from gateway.app import SHUTDOWN_BUDGET_S, create_app
from gateway.settings import GatewaySettings
from tenants.errors import AuthError
from tenants.keys import KeyManager
from tenants.records import KeyCreate, Policy, TenantCreate
from tenants.registry import TenantRegistry
from tenants.store import EmbeddedStore, StoreError, connect, die_with_parent

log = logging.getLogger(__name__)

EMBEDDED_REMOTE = "embedded"  # --kv-remote-url: a store `serve` starts for the workers


class _Server(uvicorn.Server):
    """uvicorn, minus its own signal capture: `serve` owns SIGINT/SIGTERM so that, after the
    gateway drains, the worker and store are stopped too (uvicorn would re-raise the signal
    and kill the process before that)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def request_exit(self) -> None:
        """The first stop signal drains; a second one stops without waiting for streams.
        Either way the whole stop is bounded (`STOP_BUDGET_S`): past it, `serve` logs where
        it is stuck and exits 1 (its children die with it)."""
        if self.should_exit:
            log.warning("second stop signal: not waiting for open streams")
            self.force_exit = True
            return
        self.should_exit = True
        exit_after(STOP_BUDGET_S, code=1, why="the stop took longer than its budget")

    async def wait_started(self, running: asyncio.Task[None]) -> None:
        while not self.started and not running.done():  # noqa: ASYNC110 (uvicorn has a flag)
            await asyncio.sleep(0.05)


# a stop's bound: the gateway's drain of open streams, its shutdown steps (each bounded, the
# usage ledger's flush among them), then the workers (stopped together) and each store, with
# room to spare
STREAMS_DRAIN_S = 30
WORKER_STOP_S = 15.0
STORE_STOP_S = 10.0
STOP_BUDGET_S = STREAMS_DRAIN_S + SHUTDOWN_BUDGET_S + WORKER_STOP_S + 2 * STORE_STOP_S + 5.0
RESTART_FIRST_S = 1.0
RESTART_MAX_S = 30.0
HEALTHY_RUN_S = 60.0


def server_config(settings: GatewaySettings) -> uvicorn.Config:
    """uvicorn's configuration for one gateway process: uvloop and httptools, logs through
    structlog (no access log of uvicorn's own), 30 s to drain on a stop."""
    return uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=STREAMS_DRAIN_S,
    )


def exit_after(seconds: float, *, code: int, why: str) -> None:
    """End the process `seconds` from now unless it has ended by then: a stop must not hang
    on a stuck thread or task. The threads still alive are logged, then the process exits
    with `code` at once (no further teardown: that is what hangs)."""

    def fire() -> None:
        stuck = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        log.error("%s (%.0fs); exiting %d with threads still alive: %s", why, seconds, code, stuck)
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def restart_delay(previous_s: float | None, ran_for_s: float, healthy_after_s: float) -> float:
    """How long to wait before restarting a child that died after `ran_for_s` seconds: the
    delay doubles while it keeps dying young, and starts over once it ran `healthy_after_s`."""
    if previous_s is None or ran_for_s >= healthy_after_s:
        return RESTART_FIRST_S
    return min(previous_s * 2, RESTART_MAX_S)


class WorkerSupervisor:
    """`strata engine` as a child process, restarted (with backoff) whenever it dies. Its
    environment, never its command line, carries the fleet secret."""

    def __init__(
        self,
        args: list[str],
        address: str,
        env: dict[str, str],
        auth: ClientAuth,
        *,
        healthy_after_s: float = HEALTHY_RUN_S,
    ) -> None:
        self.args = args
        self.address = address
        self.env = env
        self.auth = auth
        self.healthy_after_s = healthy_after_s
        self.proc: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self, timeout: float = 600.0) -> None:
        await self._spawn()
        await self.wait_ready(timeout)
        self._watch = asyncio.create_task(self._supervise())

    async def _spawn(self) -> None:
        cmd = [sys.executable, "-m", "gateway.cli", "engine", "--listen", self.address, *self.args]
        self.proc = await asyncio.create_subprocess_exec(
            *cmd, env=self.env, preexec_fn=die_with_parent
        )

    async def wait_ready(self, timeout: float) -> None:
        client = EngineClient(self.address, connect_timeout=1.0, auth=self.auth)
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            assert self.proc is not None
            if self.proc.returncode is not None:
                raise RuntimeError(f"the engine worker exited with {self.proc.returncode}")
            try:
                await client.connect()
                await client.close()
                return
            except EngineDeadError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        delay: float | None = None
        while not self._stopping:
            assert self.proc is not None
            started = loop.time()
            code = await self.proc.wait()
            if self._stopping:
                return
            delay = restart_delay(delay, loop.time() - started, self.healthy_after_s)
            log.error("engine worker exited with %s; restarting in %.0fs", code, delay)
            await asyncio.sleep(delay)
            await self._spawn()

    async def stop(self) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), timeout=WORKER_STOP_S)
            except TimeoutError:
                log.warning(
                    "engine worker %s did not stop within %.0fs; killing it",
                    self.address,
                    WORKER_STOP_S,
                )
                self.proc.kill()
                await self.proc.wait()


class StoreSupervisor:
    """The embedded store, restarted (with backoff, from its own AOF) whenever it dies, so
    a crash of valkey-server costs seconds of store outage, not the rest of the run."""

    def __init__(self, store: EmbeddedStore, *, healthy_after_s: float = HEALTHY_RUN_S) -> None:
        self.store = store
        self.healthy_after_s = healthy_after_s
        self.num_restarts = 0
        self._watch: asyncio.Task[None] | None = None

    def start(self) -> str:
        url = self.store.start()
        self._watch = asyncio.get_running_loop().create_task(self._supervise())
        return url

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        delay: float | None = None
        started = loop.time()
        while True:
            await asyncio.sleep(0.2)
            proc = self.store.proc
            if proc is None or proc.poll() is None:
                continue
            delay = restart_delay(delay, loop.time() - started, self.healthy_after_s)
            log.error(
                "the embedded store exited with %s; restarting in %.0fs", proc.returncode, delay
            )
            await asyncio.sleep(delay)
            try:
                await asyncio.to_thread(self.store.start)
            except StoreError as exc:
                log.error("the embedded store did not restart: %s", exc)
                continue
            self.num_restarts += 1
            started = loop.time()

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        self.store.stop(timeout=STORE_STOP_S)


def admin_token(settings: GatewaySettings) -> str:
    """The configured admin token, else one generated once and kept in the data dir."""
    if settings.admin_token:
        return settings.admin_token
    path = Path(settings.data_dir) / "admin_token"
    if path.exists():
        return path.read_text().strip()
    token = "adm-" + secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


async def demo_key(redis_url: str, data_dir: Path) -> tuple[str, str, bool]:
    """The 'demo' tenant's key: (secret, key id, whether it is new). The tenant (modest
    limits) and its key are created once; the secret is kept in `<data_dir>/demo_key` (mode
    0600) and reused while it still authenticates, so each start does not mint another."""
    path = data_dir / "demo_key"
    redis = connect(redis_url)
    try:
        registry, keys = TenantRegistry(redis), KeyManager(redis)
        if path.exists():
            try:
                ctx = await keys.authenticate(path.read_text().strip())
            except AuthError:
                pass  # revoked, expired or rotated away: issue a new one below
            else:
                if ctx.tenant.name == "demo":
                    return path.read_text().strip(), ctx.key.id, False
        existing = [t for t in await registry.list_tenants() if t.name == "demo"]
        tenant = (
            existing[0]
            if existing
            else await registry.create_tenant(
                TenantCreate(name="demo", policy=Policy(rpm=600, tpm=200_000, max_concurrent=16))
            )
        )
        created = await keys.create_key(tenant.id, KeyCreate(name="demo"))
        partial = path.with_suffix(".new")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(created.secret)
        partial.replace(path)
        return created.secret, created.key.id, True
    finally:
        await redis.aclose()


def _prepare_data_dir(settings: GatewaySettings) -> Path:
    data_dir = Path(settings.data_dir)
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return data_dir


def _with_remote_url(args: list[str], url: str) -> list[str]:
    """A worker's options with `--kv-remote-url embedded` pointing at `url`."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg == f"--kv-remote-url={EMBEDDED_REMOTE}":
            out[i] = f"--kv-remote-url={url}"
        elif arg == "--kv-remote-url" and out[i + 1 : i + 2] == [EMBEDDED_REMOTE]:
            out[i + 1] = url
    return out


async def serve(
    settings: GatewaySettings,
    worker_args: list[list[str]],
    *,
    demo: bool,
    kv_remote_bytes: int | None = None,
) -> None:
    """The store (embedded unless STRATA_REDIS_URL names one), one supervised worker per entry
    of `worker_args` (each registered in the store, so the gateway finds them and the KV they
    hold) and the gateway, until SIGINT/SIGTERM. `kv_remote_bytes`: also a second embedded
    store of that size, the workers' KV remote tier (`--kv-remote-url embedded`)."""
    data_dir = _prepare_data_dir(settings)
    kv_remote: StoreSupervisor | None = None
    if kv_remote_bytes is not None:
        remote_store = EmbeddedStore(data_dir / "kv-remote", max_bytes=kv_remote_bytes)
        kv_remote = StoreSupervisor(remote_store)
        url = kv_remote.start()
        worker_args = [_with_remote_url(args, url) for args in worker_args]
    store: StoreSupervisor | None = None
    if settings.redis_url is None:
        store = StoreSupervisor(EmbeddedStore(data_dir / "store"))
        settings = dataclasses.replace(settings, redis_url=store.start())
    store_url = settings.redis_url
    assert store_url is not None
    settings = dataclasses.replace(settings, admin_token=admin_token(settings))
    # besides the sockets' mode, workers ask for the fleet secret (and seal their records in
    # the store with it): the configured one, else one made up for this run; it goes to the
    # workers in their environment
    worker_secret = settings.worker_secret or secrets.token_urlsafe(32)
    settings = dataclasses.replace(settings, worker_secret=worker_secret, engine_addresses=())
    env = dict(os.environ, STRATA_CACHE_DIR=settings.cache_dir, STRATA_WORKER_SECRET=worker_secret)
    # the workers share the cores with the gateway and the store: their OpenMP threads should
    # not spin long between kernels (measured: ~15% less engine CPU per request, same latency)
    env.setdefault("GOMP_SPINCOUNT", "10000")
    workers = []
    for i, args in enumerate(worker_args):
        name = "engine.sock" if len(worker_args) == 1 else f"engine-{i}.sock"
        address = f"unix://{(data_dir / name).resolve()}"
        fleet = ["--registry-url", store_url, "--worker-id", f"local-{i}"]
        workers.append(WorkerSupervisor([*args, *fleet], address, env, settings.worker_auth))
    try:
        await asyncio.gather(*(worker.start() for worker in workers))
        if demo:
            assert settings.redis_url is not None
            secret, key_id, new = await demo_key(settings.redis_url, data_dir)
            where = data_dir / "demo_key"
            print(
                f"demo tenant key ({'new, kept' if new else 'kept'} in {where}): {secret}\n"
                f"  rotate it with: strata admin --url http://{settings.host}:{settings.port} "
                f"--data-dir {data_dir} keys rotate {key_id}",
                flush=True,
            )
        server = _Server(server_config(settings))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.request_exit)
        running = asyncio.create_task(server.serve())
        await server.wait_started(running)
        if server.started:
            print(
                f"Strata is serving {settings.model} at http://{settings.host}:"
                f"{settings.port}/v1 (admin token in {data_dir / 'admin_token'} unless "
                "STRATA_ADMIN_TOKEN is set)",
                flush=True,
            )
        await running
    finally:
        log.info("stopping %d engine worker(s), then the store", len(workers))
        await asyncio.gather(*(worker.stop() for worker in workers))
        if store is not None:
            await store.stop()
        if kv_remote is not None:
            await kv_remote.stop()
        log.info("stopped")
