"""`strata gateway --workers N`: N real gateway processes on one port in front of a real
worker and store. Connections reach every process, one scrape reads the sums of all of them,
SIGTERM drains each (pending usage records written, exit 0), and a process that dies is
restarted and its records written by its successor."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tenants.ledger import Ledger
from tenants.store import connect
from tests.integration.conftest import GatewayProcess, _free_port

NUM_PROCESSES = 2
# requests on fresh connections that the kernel spreads over the processes: all of them on
# one process has odds of 2**-(n-1)
NUM_SPREAD = 24


def chat_body() -> dict:
    return {
        "model": "default",
        "max_tokens": 2,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Hi"}],
    }


async def post_fresh(url: str, key: str) -> httpx.Response:
    """One chat request on a connection of its own."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await client.post(
            "/v1/chat/completions", json=chat_body(), headers={"authorization": f"Bearer {key}"}
        )


async def spread(url: str, key: str, n: int = NUM_SPREAD) -> list[str]:
    """`n` chat requests, one connection each; their request ids."""
    replies = [await post_fresh(url, key) for _ in range(n)]
    assert [r.status_code for r in replies] == [200] * n, replies[-1].text
    return [r.headers["x-request-id"] for r in replies]


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """/metrics on a fresh connection: sample name -> labels -> value."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def by_process(samples: dict[tuple[tuple[str, str], ...], float]) -> dict[str, float]:
    return {dict(labels)["process"]: value for labels, value in samples.items()}


def children(pid: int) -> set[int]:
    """The live child processes of `pid` (Linux /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(entry.name))
    return found


def alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if Path(f"/proc/{pid}").exists()}


async def records(store_url: str, request_ids: list[str]) -> dict:
    client = connect(store_url)
    try:
        ledger = Ledger(client)
        return {rid: await ledger.get(rid) for rid in request_ids}
    finally:
        await client.aclose()


async def count(store_url: str, tenant_id: str) -> int:
    client = connect(store_url)
    try:
        return await Ledger(client).count(tenant_id, 0, time.time() + 60)
    finally:
        await client.aclose()


async def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"{what}: not in {timeout} s"
        await asyncio.sleep(0.1)


def journal_owners(data_dir: Path) -> set[Path]:
    """The ledger journal directories holding pending records."""
    return {seg.parent for seg in (data_dir / "ledger-journal").rglob("*.seg")}


@pytest.fixture
def gateway_group(private_store, tiny_worker, strata_cache_dir, tmp_path, empty_tempdir):
    """`strata gateway --workers 2` on a port of its own (killed at the end if still up)."""
    gw = GatewayProcess(
        private_store.url,
        tiny_worker,
        strata_cache_dir,
        tmp_path / "gw",
        "--workers",
        str(NUM_PROCESSES),
    )
    gw.start()
    yield gw
    if gw.proc is not None and gw.proc.poll() is None:
        left = children(gw.proc.pid)
        gw.stop()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_connections_reach_every_process_and_a_scrape_sums_them(gateway_group, private_store):
    gw = gateway_group
    assert gw.proc is not None
    assert len(children(gw.proc.pid)) == NUM_PROCESSES
    tid, key = gw.new_tenant()
    await spread(gw.url, key)
    first, second = scrape(gw.url), scrape(gw.url)  # answered by either process
    served = by_process(first["strata:gateway_responses_total"])
    assert set(served) == {str(i) for i in range(NUM_PROCESSES)}
    assert all(n > 0 for n in served.values())
    for metrics in (first, second):
        mine = [
            v
            for labels, v in metrics["strata:request_success_total"].items()
            if dict(labels)["tenant"] == tid
        ]
        assert sum(mine) == NUM_SPREAD  # each process counted its own: the sums
        starts = by_process(metrics["strata:gateway_process_starts_total"])
        assert starts == {str(i): 1.0 for i in range(NUM_PROCESSES)}
    assert await count(private_store.url, tid) == NUM_SPREAD


async def test_sigterm_drains_every_process_and_writes_their_pending_usage(
    gateway_group, private_store, tmp_path, empty_tempdir
):
    gw = gateway_group
    assert gw.proc is not None
    tid, key = gw.new_tenant(on_store_unavailable="fail_open")
    warm = await spread(gw.url, key)  # every process has verified the key
    private_store.kill()
    pending = await spread(gw.url, key)
    assert len(journal_owners(tmp_path / "gw")) == NUM_PROCESSES  # each holds some
    processes = children(gw.proc.pid)
    gw.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(1.0)  # the processes are draining, the store still down
    private_store.start()
    assert await asyncio.to_thread(gw.proc.wait, 90) == 0
    assert not alive(processes)
    assert None not in (await records(private_store.url, warm + pending)).values()
    assert await count(private_store.url, tid) == len(warm) + len(pending)  # each once
    assert not journal_owners(tmp_path / "gw")
    assert not list(empty_tempdir.iterdir()), "the shared metrics directory is removed"


async def test_a_killed_process_is_restarted_and_its_records_written(
    gateway_group, private_store, tmp_path
):
    gw = gateway_group
    assert gw.proc is not None
    tid, key = gw.new_tenant(on_store_unavailable="fail_open")
    warm = await spread(gw.url, key)
    private_store.kill()
    pending = await spread(gw.url, key)
    assert len(journal_owners(tmp_path / "gw")) == NUM_PROCESSES
    before = children(gw.proc.pid)
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    private_store.start()

    async def replaced() -> bool:
        now = children(gw.proc.pid)
        return len(now) == NUM_PROCESSES and victim not in now

    await wait_for(replaced, what="a new process in the killed one's place")
    assert gw.proc.poll() is None  # the parent lives on

    async def written() -> bool:
        return None not in (await records(private_store.url, warm + pending)).values()

    await wait_for(written, what="the killed process's records, replayed by its successor")
    assert await count(private_store.url, tid) == len(warm) + len(pending)

    async def restarted_once() -> bool:
        try:
            starts = by_process(scrape(gw.url)["strata:gateway_process_starts_total"])
        except httpx.HTTPError:
            return False
        return sorted(starts.values()) == [1.0, 2.0]

    await wait_for(restarted_once, what="one process started twice")
    await spread(gw.url, key, 4)  # serving again
    gw.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(gw.proc.wait, 90) == 0


def run_gateway(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, STRATA_LOG_LEVEL="WARNING", STRATA_LOG_FORMAT="console")
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "gateway", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_a_port_another_group_listens_on_is_refused(store_server):
    """SO_REUSEPORT would let a second group of processes share the port unnoticed."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        done = run_gateway(
            "--workers",
            "2",
            "--port",
            str(port),
            "--redis-url",
            store_server.url,
            "--engine",
            "unix:///nonexistent.sock",
        )
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_a_process_that_cannot_start_stops_the_group(store_server, tmp_path):
    done = run_gateway(
        "--workers",
        "2",
        "--port",
        str(_free_port()),
        "--redis-url",
        store_server.url,
        "--engine",
        "bogus://address",
        "--data-dir",
        str(tmp_path),
    )
    assert done.returncode == 1, done.stderr
    assert "a gateway process exited before it served" in done.stderr
