"""`strata gateway`: one replica as one process, or with `--workers N` as N whole replicas on
one port (each binds its own SO_REUSEPORT socket), under a parent that restarts a process
that dies and forwards SIGTERM/SIGINT so that each drains and exits 0. Why SO_REUSEPORT and
not a shared socket: docs/design/fleet.md, "Gateway processes".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import msgspec
import structlog
import uvicorn
import uvloop

from gateway.logs import configure_logging
from gateway.serve import HEALTHY_RUN_S, restart_delay, server_config
from gateway.settings import GatewaySettings, log_level
from tenants.store import die_with_parent

log = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# open streams get 30 s to finish, the ledger 10 s more: a process still running after this
# is killed (its pending records stay in its journal, written at the next start)
STOP_TIMEOUT_S = 60.0


# -- one process -----------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn, ending with status 0 after a signal's graceful drain (uvicorn raises the
    signal again once shut down, which ends the process as killed by it)."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_started = on_started  # called once it accepts connections

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        # one of N processes starts with these blocked (see `_child_preexec`): one that
        # came since is handled now, as a drain
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED_SIGNALS)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started()


def serve_one(
    settings: GatewaySettings,
    sockets: list[socket.socket] | None = None,
    on_started: Callable[[], None] = lambda: None,
) -> None:
    """Serve until SIGINT/SIGTERM, then drain; on `sockets` (already bound) if given, else
    on settings.host:port. Raises SystemExit when the app fails to start."""
    config = server_config(settings)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_Server(config, on_started).serve(sockets))


def bind_shared(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEPORT, so that each of a replica's
    processes has its own and the kernel balances connections between them."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _check_port_free(host: str, port: int) -> None:
    """Fail now if anything listens on host:port: SO_REUSEPORT would otherwise let another
    group of processes (of the same user) share the port with this one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _child_preexec() -> None:
    """In each of N processes, before it runs Python: SIGTERM when the parent dies, and
    SIGINT/SIGTERM held until the server can drain on them, so that a stop signal that
    arrives while the process starts is a drain too, never a kill."""
    die_with_parent()
    signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)


def _child_main(argv: Sequence[str] | None = None) -> int:
    """One of N processes: its settings come as JSON on stdin; it writes a line to the
    file descriptor `--ready-fd` once it serves."""
    parser = argparse.ArgumentParser(prog="gateway.processes")
    parser.add_argument("--ready-fd", type=int, required=True)
    args = parser.parse_args(argv)
    settings = msgspec.json.decode(sys.stdin.buffer.read(), type=GatewaySettings)
    configure_logging(log_level(), json=settings.json_logs)
    structlog.contextvars.bind_contextvars(gateway_process=settings.process_index)
    sock = bind_shared(settings.host, settings.port)

    def started() -> None:
        with contextlib.suppress(OSError):
            os.write(args.ready_fd, b"ready\n")
        os.close(args.ready_fd)

    serve_one(settings, [sock], started)
    return 0


# -- N processes -----------------------------------------------------------------------------


@dataclass
class _Child:
    index: int
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    restart_delay_s: float | None = None
    exit_code: int | None = None  # once stopped for good


class GatewayProcesses:
    """The parent of N gateway processes: start them, restart one that dies (with the
    backoff `strata serve` gives its workers), forward SIGINT/SIGTERM, and return 0 once
    every process has drained and exited 0 (1 otherwise, or when one fails to start)."""

    def __init__(
        self,
        settings: GatewaySettings,
        num_processes: int,
        *,
        healthy_after_s: float = HEALTHY_RUN_S,
        stop_timeout_s: float = STOP_TIMEOUT_S,
    ) -> None:
        if num_processes < 1:
            raise ValueError("--workers must be at least 1")
        if not hasattr(socket, "SO_REUSEPORT"):
            raise ValueError("--workers above 1 needs SO_REUSEPORT (Linux, BSD, macOS)")
        self.settings = settings
        self.children = [_Child(i) for i in range(num_processes)]
        self.healthy_after_s = healthy_after_s
        self.stop_timeout_s = stop_timeout_s
        self.metrics_dir: str | None = None
        self._stopping: asyncio.Event | None = None
        self._forwarded: set[int] = set()
        self._kill_timer: asyncio.TimerHandle | None = None

    async def run(self) -> int:
        _check_port_free(self.settings.host, self.settings.port)
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self.metrics_dir = tempfile.mkdtemp(prefix="strata-gateway-metrics-")
        for sig in HANDLED_SIGNALS:
            loop.add_signal_handler(sig, self._forward, sig)
        failed = False
        try:
            ready = await asyncio.gather(*(self._start(child) for child in self.children))
            if self._stopping.is_set():
                pass
            elif all(ready):
                log.info(
                    "%d gateway processes serving at http://%s:%d",
                    len(self.children),
                    self.settings.host,
                    self.settings.port,
                )
            else:
                log.error("a gateway process exited before it served; stopping the others")
                failed = True
                self._forward(signal.SIGTERM)
            await asyncio.gather(*(self._supervise(child) for child in self.children))
            return 1 if failed or any(c.exit_code != 0 for c in self.children) else 0
        finally:
            if self._kill_timer is not None:
                self._kill_timer.cancel()
            for sig in HANDLED_SIGNALS:
                loop.remove_signal_handler(sig)
            for child in self.children:  # only if this coroutine was cancelled
                if child.proc is not None and child.proc.returncode is None:
                    child.proc.kill()
                    await child.proc.wait()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _forward(self, sig: int) -> None:
        assert self._stopping is not None
        if not self._stopping.is_set():
            self._stopping.set()
            loop = asyncio.get_running_loop()
            self._kill_timer = loop.call_later(self.stop_timeout_s, self._kill_all)
        self._forwarded.add(sig)
        for child in self.children:
            if child.proc is not None and child.proc.returncode is None:
                child.proc.send_signal(sig)

    def _kill_all(self) -> None:
        for child in self.children:
            if child.proc is not None and child.proc.returncode is None:
                log.error(
                    "gateway process %d did not stop in %.0f s: killing it",
                    child.index,
                    self.stop_timeout_s,
                )
                child.proc.kill()

    async def _start(self, child: _Child) -> bool:
        """Spawn the process; True once it serves, False if it exits first."""
        assert self.metrics_dir is not None and self._stopping is not None
        settings = dataclasses.replace(
            self.settings, process_index=child.index, metrics_dir=self.metrics_dir
        )
        read_fd, write_fd = os.pipe()
        try:
            child.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "gateway.processes",
                "--ready-fd",
                str(write_fd),
                stdin=asyncio.subprocess.PIPE,
                pass_fds=(write_fd,),
                env=dict(os.environ, PROMETHEUS_MULTIPROC_DIR=self.metrics_dir),
                start_new_session=True,  # a terminal's Ctrl-C reaches the parent only
                preexec_fn=_child_preexec,
            )
        finally:
            os.close(write_fd)
        child.started_at = asyncio.get_running_loop().time()
        assert child.proc.stdin is not None
        with contextlib.suppress(ConnectionError):  # it died at once: it reports no ready
            child.proc.stdin.write(msgspec.json.encode(settings))
            await child.proc.stdin.drain()
            child.proc.stdin.close()
        if self._stopping.is_set():  # a signal came while it was being spawned
            for sig in self._forwarded:
                child.proc.send_signal(sig)
        with os.fdopen(read_fd, "rb") as ready:
            line = await asyncio.to_thread(ready.readline)  # empty: it exited first
        return line == b"ready\n"

    async def _supervise(self, child: _Child) -> None:
        """Wait for the process to end; restart it unless the group is stopping."""
        assert self._stopping is not None
        loop = asyncio.get_running_loop()
        while True:
            assert child.proc is not None
            code = await child.proc.wait()
            if self._stopping.is_set():
                child.exit_code = code
                return
            delay = restart_delay(
                child.restart_delay_s, loop.time() - child.started_at, self.healthy_after_s
            )
            child.restart_delay_s = delay
            log.error(
                "gateway process %d exited with %s; restarting in %.0fs", child.index, code, delay
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            if self._stopping.is_set():
                child.exit_code = 0  # nothing ran to drain
                return
            if await self._start(child):
                log.info("gateway process %d is back", child.index)


def run_processes(settings: GatewaySettings, num_processes: int) -> int:
    """`strata gateway --workers N`: returns the command's exit status."""
    return asyncio.run(GatewayProcesses(settings, num_processes).run())


if __name__ == "__main__":
    sys.exit(_child_main())
