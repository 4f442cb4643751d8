"""The gateway's added latency: a request through the HTTP gateway (auth, tokenization,
admission, ledger) against the same request sent straight to the worker by `EngineClient`,
at 1, 16 and 64 concurrent clients, with the CPU time each process spends per request.
`--gateway-workers N` runs the gateway as N processes on its port (`strata gateway
--workers N`), to see requests/s scale with them; `--model synthetic:tiny` keeps the
engine's share small. Method and figures: docs/benchmarks.md.

    python bench/gateway_overhead.py            # full run
    python bench/gateway_overhead.py --quick    # smoke run
    python bench/gateway_overhead.py --model synthetic:tiny --gateway-workers 2

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_info, parse_args, publish, scratch_dir
from engine.client import EngineClient
from engine.model_specs import load_tokenizer_for
from engine.protocol import SamplingParams
from gateway.settings import cache_dir
from tenants.store import EmbeddedStore

ADMIN = "bench-admin-token-0123456789"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_PATH = "/v1/chat/completions"
CHAT_BODY = json.dumps(
    {"model": "default", "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
).encode()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not come up")
        time.sleep(0.1)


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (Linux)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its live children so far (Linux): the
    processes of a gateway started with --workers are its children."""
    total = 0
    for proc in [pid, *_children(pid)]:
        fields = _stat(proc)
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_stat(int(entry.name))[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class HTTPConnection:
    """A minimal keep-alive HTTP/1.1 client for one connection.

    The load generator's own CPU shares this 2-core machine with the gateway and the engine,
    so it should cost as little as `EngineClient` does on the direct path: a general-purpose
    client (httpx) spends more time per request than the gateway itself.
    """

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self._head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None
        self._writer.write(
            f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\n{self._head}"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = await self._reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        fields = {
            k.strip().lower(): v.strip()
            for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)
        }
        return status, fields, await self._reader.readexactly(int(fields["content-length"]))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def engine_ms(server_timing: str) -> float:
    for part in server_timing.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if name == "engine":
            return float(dur)
    raise ValueError(f"no engine timing in {server_timing!r}")


async def run_load(
    address: str | None, url: str | None, key: str, ids: list[int], n: int, conc: int
) -> dict[str, list[float]]:
    """`n` requests from `conc` clients, each with one request in flight at a time.

    Given both an engine address and a gateway URL, client c alternates paths, starting on
    path c % 2; given one, every request takes it. Returns latencies (s) by path, and under
    `server_timing` each gateway request's latency minus the engine time it reported.
    """
    paths = [name for name, target in (("direct", address), ("gateway", url)) if target]
    out: dict[str, list[float]] = {"direct": [], "gateway": [], "server_timing": []}
    client = EngineClient(address) if address else None
    if client is not None:
        await client.connect()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    host, _, port = (url or "http://:0").removeprefix("http://").rpartition(":")
    counter = iter(range(n))

    async def direct(i: int) -> None:
        assert client is not None
        start = time.perf_counter()
        async for _ in client.generate(f"d{i}-{time.monotonic_ns()}", ids, params):
            pass
        out["direct"].append(time.perf_counter() - start)

    async def gateway(conn: HTTPConnection) -> None:
        start = time.perf_counter()
        status, headers, reply = await conn.post(CHAT_PATH, CHAT_BODY)
        latency = time.perf_counter() - start
        assert status == 200, reply
        out["gateway"].append(latency)
        out["server_timing"].append(latency - engine_ms(headers["server-timing"]) / 1e3)

    async def one_client(c: int) -> None:
        conn = HTTPConnection(host, int(port), {"authorization": f"Bearer {key}"})
        try:
            if url:
                await conn.post(CHAT_PATH, CHAT_BODY)  # open the connection
            for turn, i in enumerate(counter):
                if paths[(c + turn) % len(paths)] == "direct":
                    await direct(i)
                else:
                    await gateway(conn)
        finally:
            conn.close()

    await asyncio.gather(*(one_client(c) for c in range(conc)))
    if client is not None:
        await client.close()
    return out


def measure(
    tmp: Path,
    levels: list[int],
    requests: int,
    engine_threads: int,
    model: str = "default",
    gateway_workers: int = 1,
) -> dict[str, dict]:
    """Start a store, an engine worker serving `model` and a gateway of `gateway_workers`
    processes with their files in `tmp`, load them at each concurrency of `levels`, and stop
    them (on an error too): the figures by name."""
    store = EmbeddedStore(tmp / "store")
    store.start()
    env = dict(
        os.environ,
        STRATA_LOG_LEVEL="WARNING",
        STRATA_ADMIN_TOKEN=ADMIN,
        STRATA_LOG_FORMAT="console",
        GOMP_SPINCOUNT="10000",
    )  # as `strata serve` does
    engine_addr = f"unix://{tmp / 'engine.sock'}"
    engine_cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "engine",
        "--listen",
        engine_addr,
        "--model",
        model,
        "--kv-cache-gb",
        "0.5",
        "--max-num-seqs",
        "128",
    ]
    if engine_threads:
        engine_cmd += ["--threads", str(engine_threads)]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen(engine_cmd, env=env))
        _wait((tmp / "engine.sock").exists, 300, "the engine worker")
        port = _port()
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gateway.cli",
                    "gateway",
                    "--engine",
                    engine_addr,
                    "--redis-url",
                    store.url,
                    "--port",
                    str(port),
                    "--data-dir",
                    str(tmp / "gateway"),
                    "--workers",
                    str(gateway_workers),
                ],
                env=env,
            )
        )
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:  # every process has started
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code != 200:
                    return False
                metrics = httpx.get(f"{url}/metrics", timeout=2).text
            except httpx.HTTPError:
                return False
            return metrics.count("strata:gateway_process_starts_total{") == gateway_workers

        _wait(up, 120, "the gateway")
        admin = httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"})
        tenant = admin.post("/admin/tenants/", json={"name": "bench"}).json()
        key = admin.post(f"/admin/tenants/{tenant['id']}/keys", json={}).json()["secret"]
        ids = load_tokenizer_for(model, cache_dir()).encode_chat(MESSAGES)

        overhead: dict[str, dict[str, float]] = {}
        delta: dict[str, dict[str, float]] = {}
        rps: dict[str, dict[str, float]] = {}
        latency: dict[str, dict[str, float]] = {}
        cpu: dict[str, dict[str, dict[str, float]]] = {}
        assert store.proc is not None
        pids = {"engine": procs[0].pid, "gateway": procs[1].pid, "store": store.proc.pid}
        for conc in levels:
            mixed = asyncio.run(run_load(engine_addr, url, key, ids, requests, conc))
            alone: dict[str, float] = {}
            n_alone = requests // 2
            for name, target in (("direct", (engine_addr, None)), ("gateway", (None, url))):
                before = {k: cpu_seconds(pid) for k, pid in pids.items()}
                client_before, start = time.process_time(), time.perf_counter()
                asyncio.run(run_load(*target, key, ids, n_alone, conc))
                alone[name] = round(n_alone / (time.perf_counter() - start), 1)
                used = {k: cpu_seconds(pid) - before[k] for k, pid in pids.items()}
                used["client"] = time.process_time() - client_before
                cpu.setdefault(str(conc), {})[name] = {
                    k: round(v * 1e3 / n_alone, 3) for k, v in used.items()
                }
            p = {
                name: {q: percentile(v, qq) * 1e3 for q, qq in (("p50", 0.5), ("p99", 0.99))}
                for name, v in mixed.items()
            }
            level = str(conc)
            overhead[level] = {q: round(v, 3) for q, v in p["server_timing"].items()}
            delta[level] = {q: round(p["gateway"][q] - p["direct"][q], 3) for q in ("p50", "p99")}
            rps[level] = alone
            latency[level] = {
                f"{name}_{q}": round(v, 3)
                for name in ("direct", "gateway")
                for q, v in p[name].items()
            }
            print(
                f"concurrency {conc:>3}: overhead p50 {overhead[level]['p50']:.2f} ms, "
                f"p99 {overhead[level]['p99']:.2f} ms | e2e delta p50 "
                f"{delta[level]['p50']:.2f} ms, p99 {delta[level]['p99']:.2f} ms (direct p50 "
                f"{p['direct']['p50']:.2f}, gateway p50 {p['gateway']['p50']:.2f}) | rps "
                f"gateway {rps[level]['gateway']} (direct {rps[level]['direct']})",
                flush=True,
            )
            print(f"  CPU ms per request, each path alone: {cpu[level]}", flush=True)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        store.stop()
    return {"overhead": overhead, "delta": delta, "rps": rps, "latency": latency, "cpu": cpu}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--requests", type=int, default=400, help="per path and concurrency")
    ap.add_argument("--quick", action="store_true", help="concurrency 1,16, 60 requests")
    ap.add_argument(
        "--engine-threads",
        type=int,
        default=1,
        help="worker threads (default 1: leaves the gateway a core of its own, so "
        "the figures are the gateway's cost rather than CPU stolen from a "
        "saturated engine; 0 = all cores)",
    )
    ap.add_argument(
        "--model",
        default="default",
        help="the worker's model spec (synthetic:tiny: the engine's time is small, so "
        "the gateway's shows)",
    )
    ap.add_argument(
        "--gateway-workers",
        type=int,
        default=1,
        help="gateway processes on the one port (strata gateway --workers)",
    )
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parse_args(ap, argv, concurrency="1,16", requests=60)
    levels = [int(c) for c in args.concurrency.split(",")]

    with scratch_dir("strata-gateway-bench-") as tmp:  # the store's files, the socket
        figures = measure(
            tmp, levels, args.requests, args.engine_threads, args.model, args.gateway_workers
        )
    overhead, delta, rps = figures["overhead"], figures["delta"], figures["rps"]
    latency, cpu = figures["latency"], figures["cpu"]

    summary = {
        "gateway_workers": args.gateway_workers,
        "overhead_ms": overhead,
        "e2e_delta_ms": delta,
        "rps": rps,
    }
    import torch

    record = {
        "benchmark": "gateway_overhead",
        **machine_info(torch.device("cpu")),
        "requests_per_level": args.requests,  # in the mixed run; half per path alone
        "quick": args.quick,
        "engine_threads": args.engine_threads or "all",
        "model": args.model,
        "gateway_workers": args.gateway_workers,
        "latency_ms": latency,
        "cpu_ms_per_request": cpu,
        **summary,
    }
    publish(args.out_dir, "gateway_overhead", record, summary)
    return summary


if __name__ == "__main__":
    main()
