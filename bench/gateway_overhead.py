"""The gateway's added latency: a full request through the HTTP gateway (auth, tokenization,
admission, ledger) vs the same request through `EngineClient` straight to the worker.

Both paths hit the same engine worker with the same prompt tokens and `max_tokens=1`, at
1, 16 and 64 concurrent clients, alternating path by path. Everything runs on this machine:
an embedded store, one engine worker (the default model) and one gateway replica, each in
its own process. Two measures of overhead:

- `overhead_ms` (per request, paired): the client's latency minus the time the gateway's
  own `EngineClient` waited on the engine for that request (the `engine` entry of the
  response's `Server-Timing`). What is left is HTTP, auth, tokenization, admission and
  rendering: the gateway's added latency, free of the engine's step-to-step variance.
- `e2e_delta_ms`: gateway latency minus direct latency at the same percentile, from two
  separate runs. When the engine is saturated its batching swings these percentiles by
  tens of ms either way, so read it next to `rps`, which shows any throughput the
  gateway costs.

    python bench/gateway_overhead.py            # full run
    python bench/gateway_overhead.py --quick    # smoke run

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
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_info, write_result
from engine.client import EngineClient
from engine.factory import load_tokenizer_for
from engine.protocol import SamplingParams
from gateway.settings import cache_dir
from tenants.store import EmbeddedStore

ADMIN = "bench-admin-token-0123456789"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_direct(address: str, ids: list[int], n: int, conc: int) -> list[float]:
    client = EngineClient(address)
    await client.connect()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    latencies: list[float] = []
    counter = iter(range(n))

    async def one_client() -> None:
        for i in counter:
            start = time.perf_counter()
            async for _ in client.generate(f"d{i}-{time.monotonic_ns()}", ids, params):
                pass
            latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(one_client() for _ in range(conc)))
    await client.close()
    return latencies


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


async def run_gateway(url: str, key: str, n: int, conc: int) -> tuple[list[float], list[float]]:
    """Latencies and, per request, latency minus the engine time the gateway reported."""
    body = json.dumps(
        {"model": "default", "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    ).encode()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    latencies: list[float] = []
    overheads: list[float] = []
    counter = iter(range(n))

    async def one_client() -> None:
        conn = HTTPConnection(host, int(port), {"authorization": f"Bearer {key}"})
        try:
            await conn.post("/v1/chat/completions", body)  # open the connection
            for _ in counter:
                start = time.perf_counter()
                status, headers, reply = await conn.post("/v1/chat/completions", body)
                latency = time.perf_counter() - start
                assert status == 200, reply
                latencies.append(latency)
                overheads.append(latency - engine_ms(headers["server-timing"]) / 1e3)
        finally:
            conn.close()

    await asyncio.gather(*(one_client() for _ in range(conc)))
    return latencies, overheads


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--requests", type=int, default=400, help="per path and concurrency")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--engine-threads",
        type=int,
        default=1,
        help="worker threads (default 1: leaves the gateway a core of its own, so "
        "the figures are the gateway's cost rather than CPU stolen from a "
        "saturated engine; 0 = all cores)",
    )
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests = "1,16", 60
    levels = [int(c) for c in args.concurrency.split(",")]

    tmp = Path(tempfile.mkdtemp(prefix="strata-bench-"))
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
        "--kv-cache-gb",
        "0.5",
        "--max-num-seqs",
        "128",
    ]
    if args.engine_threads:
        engine_cmd += ["--threads", str(args.engine_threads)]
    procs = [subprocess.Popen(engine_cmd, env=env)]
    try:
        _wait((tmp / "engine.sock").exists, 300, "the engine worker")
        port = _port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "gateway", "--engine", engine_addr,
             "--redis-url", store.url, "--port", str(port)], env=env,
        ))  # fmt: skip
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{url}/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _wait(up, 120, "the gateway")
        admin = httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"})
        tenant = admin.post("/admin/tenants/", json={"name": "bench"}).json()
        key = admin.post(f"/admin/tenants/{tenant['id']}/keys", json={}).json()["secret"]
        ids = load_tokenizer_for("default", cache_dir()).encode_chat(MESSAGES)

        overhead: dict[str, dict[str, float]] = {}
        delta: dict[str, dict[str, float]] = {}
        rps: dict[str, dict[str, float]] = {}
        latency: dict[str, dict[str, float]] = {}
        for conc in levels:
            direct, via, paired = [], [], []
            for _ in range(2):  # alternate the paths, twice, to share any drift fairly
                t0 = time.perf_counter()
                direct += asyncio.run(run_direct(engine_addr, ids, args.requests // 2, conc))
                t1 = time.perf_counter()
                lat, over = asyncio.run(run_gateway(url, key, args.requests // 2, conc))
                via += lat
                paired += over
                t2 = time.perf_counter()
            p = {
                name: {q: percentile(v, qq) * 1e3 for q, qq in (("p50", 0.5), ("p99", 0.99))}
                for name, v in (("direct", direct), ("gateway", via), ("paired", paired))
            }
            overhead[str(conc)] = {q: round(p["paired"][q], 3) for q in ("p50", "p99")}
            delta[str(conc)] = {
                q: round(p["gateway"][q] - p["direct"][q], 3) for q in ("p50", "p99")
            }
            rps[str(conc)] = {
                "direct": round(len(direct) / (2 * (t1 - t0)), 1),
                "gateway": round(len(via) / (2 * (t2 - t1)), 1),
            }
            latency[str(conc)] = {
                f"{name}_{q}": round(v, 3)
                for name in ("direct", "gateway")
                for q, v in p[name].items()
            }
            print(
                f"concurrency {conc:>3}: overhead p50 {overhead[str(conc)]['p50']:.2f} ms, "
                f"p99 {overhead[str(conc)]['p99']:.2f} ms | e2e delta p50 "
                f"{delta[str(conc)]['p50']:.2f} ms, p99 {delta[str(conc)]['p99']:.2f} ms | "
                f"direct p50 {p['direct']['p50']:.2f} ms, "
                f"gateway p50 {p['gateway']['p50']:.2f} ms | "
                f"rps gateway {rps[str(conc)]['gateway']} (direct {rps[str(conc)]['direct']})",
                flush=True,
            )
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=60)
        store.stop()

    summary = {"overhead_ms": overhead, "e2e_delta_ms": delta, "rps": rps}
    import torch

    record = {
        "benchmark": "gateway_overhead",
        **machine_info(torch.device("cpu")),
        "requests_per_level": args.requests,
        "quick": args.quick,
        "engine_threads": args.engine_threads or "all",
        "latency_ms": latency,
        **summary,
    }
    print(f"wrote {write_result(args.out_dir, 'gateway_overhead', record)}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
