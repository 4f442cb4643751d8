"""KV that outlives its worker or moves between workers, one scenario per function:

- `restart`: documents read on a worker with a persistent disk tier (`--kv-disk-path`);
  the worker restarts as a new process; questions on those documents then take their
  prefixes from disk. Median time to first token against a worker that recomputes them
  (a fresh directory), and whether the tokens are the same.
- `disagg`: streams decoding while long prompts arrive, through the gateway: one `both`
  worker against a prefill worker and a decode worker on the same cores. The running
  streams' inter-token p99, and whether every output is the same. `--disagg-transport
  remote` passes the pages through a remote KV tier the two workers share rather than
  through the gateway.
- `cross_worker` (bench/kv_shared_cross.py): documents read on one worker, questions on
  another that takes their KV from the shared remote tier, against recomputing them.

    python bench/kv_shared.py --quick                      # a few minutes on 2 CPU cores
    python bench/kv_shared.py --scenarios restart          # one scenario
    python bench/kv_shared.py --quick --device cuda --kv-host-gb 1 \
        --model synthetic:llama3.2-1b --scenarios cross_worker,restart   # on a GPU

On a GPU the workers' pages move through CuPy copies, and `--kv-host-gb` gives the
cross_worker engines a pinned host tier where fetched pages land. `disagg` compares splits
of CPU cores and runs on CPUs only.

Seeded; the full record goes to bench/results/, and the last printed line is one JSON
object with one entry per scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import pydoc_data.topics
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_cache_dir_argument, machine_info, parse_args, publish, scratch_dir
from bench.gateway_overhead import _port, _wait, percentile
from bench.kv_shared_cross import run_cross_worker
from engine.client import EngineClient
from engine.model_specs import load_tokenizer_for
from engine.protocol import EngineStats, SamplingParams
from tenants.store import EmbeddedStore

ADMIN = "bench-admin-token-0123456789"
QUESTION = "\n\nQuestion: what is the section above about? Answer:"
BLOCK_SIZE = 16


class Worker:
    """`strata engine` on a Unix socket in `root`, pinned to `cores` (taskset) when given."""

    def __init__(
        self, root: Path, name: str, args: list[str], cache_dir: str, cores: str | None = None
    ) -> None:
        self.sock = root / f"{name}.sock"
        self.address = f"unix://{self.sock}"
        self.args, self.cache_dir, self.cores = args, cache_dir, cores
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ, STRATA_LOG_LEVEL="WARNING", STRATA_CACHE_DIR=self.cache_dir)
        for var in ("STRATA_WORKER_SECRET", "STRATA_REDIS_URL"):
            env.pop(var, None)
        pin = ["taskset", "-c", self.cores] if self.cores else []
        cli = [sys.executable, "-m", "gateway.cli", "engine", "--listen", self.address]
        self.proc = subprocess.Popen(
            [*pin, *cli, "--cache-dir", self.cache_dir, *self.args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def listening() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.args} exited with {self.proc.returncode}")
            return self.sock.exists()

        _wait(listening, 600, "an engine worker")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def running(*workers: Worker) -> Iterator[None]:
    try:
        for worker in workers:
            worker.start()
        yield
    finally:
        for worker in reversed(workers):
            worker.stop()


def document_ids(model: str, cache_dir: str, count: int, length: int) -> list[list[int]]:
    """`count` distinct documents of `length` tokens: consecutive slices of Python's
    reference text (`pydoc_data.topics`)."""
    tokenizer = load_tokenizer_for(model, cache_dir)
    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= count * length, f"the reference text has {len(ids)} tokens"
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def question_ids(model: str, cache_dir: str) -> list[int]:
    return load_tokenizer_for(model, cache_dir).encode(QUESTION, add_special_tokens=False)


async def ttft(
    client: EngineClient, rid: str, prompt: list[int], max_tokens: int
) -> tuple[float, list[int]]:
    """Seconds to the first generated token, and the greedy tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start, first, tokens = time.perf_counter(), None, []
    async for out in client.generate(rid, prompt, params):
        if out.new_token_ids and first is None:
            first = time.perf_counter() - start
        tokens += out.new_token_ids
    assert first is not None
    return first, tokens


async def stats_when(client: EngineClient, done: Callable[[EngineStats], bool]) -> EngineStats:
    deadline = time.monotonic() + 120
    while not done(stats := await client.stats()):
        assert time.monotonic() < deadline, "the worker's figures did not get there in time"
        await asyncio.sleep(0.1)
    return stats


# -- restart ---------------------------------------------------------------------------------


def run_restart(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_restart(args))


async def _restart(args: argparse.Namespace) -> dict[str, Any]:
    docs = document_ids(args.model, args.cache_dir, args.docs + 2, args.doc_tokens)
    docs, fillers = docs[:-2], docs[-2:]
    question = question_ids(args.model, args.cache_dir)
    doc_blocks = args.doc_tokens // BLOCK_SIZE
    # a device pool of about one document and no host tier: what the device evicts goes to
    # disk, so after two more documents every one before them is there
    common = ["--model", args.model, "--dtype", args.dtype, "--threads", str(args.threads)]
    common += ["--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(doc_blocks + 8)]
    common += ["--device", args.device]
    with scratch_dir("strata-kv-shared-") as tmp:
        disk = [*common, "--kv-disk-gb", str(args.disk_gb), "--kv-disk-path", str(tmp / "kv")]
        first = Worker(tmp, "first", disk, args.cache_dir)
        with running(first):
            client = EngineClient(first.address)
            for i, doc in enumerate([*docs, *fillers]):
                await ttft(client, f"read-{i}", doc, 1)
            await stats_when(client, lambda s: s.num_kv_disk_blocks_used >= len(docs) * doc_blocks)
            await client.close()
        again = Worker(tmp, "again", disk, args.cache_dir)  # a new process, the same directory
        with running(again):
            client = EngineClient(again.address)
            await stats_when(
                client, lambda s: s.num_kv_disk_pages_recovered >= len(docs) * doc_blocks
            )
            from_disk = [await ttft(client, f"q-{i}", d + question, 8) for i, d in enumerate(docs)]
            stats = await client.stats()
            await client.close()
        fresh = [*common, "--kv-disk-gb", str(args.disk_gb), "--kv-disk-path", str(tmp / "fresh")]
        recompute = Worker(tmp, "recompute", fresh, args.cache_dir)
        with running(recompute):
            client = EngineClient(recompute.address)
            computed = [await ttft(client, f"q-{i}", d + question, 8) for i, d in enumerate(docs)]
            await client.close()
    disk_p50 = statistics.median(t for t, _ in from_disk)
    compute_p50 = statistics.median(t for t, _ in computed)
    return {
        "speedup": round(compute_p50 / disk_p50, 2),
        "ttft_p50_disk_s": round(disk_p50, 4),
        "ttft_p50_recompute_s": round(compute_p50, 4),
        "tokens_identical": [t for _, t in from_disk] == [t for _, t in computed],
        "docs": len(docs),
        "doc_tokens": args.doc_tokens,
        "disk_hit_blocks": stats.num_cache_hit_blocks.get("disk", 0),
        "pages_recovered": stats.num_kv_disk_pages_recovered,
        "setup": f"one worker at a time, {args.threads} torch threads, device pool of about "
        "one document, no host tier; 'recompute' is a worker on a fresh directory",
    }


# -- disagg ----------------------------------------------------------------------------------


def run_disagg(args: argparse.Namespace) -> dict[str, Any]:
    count = args.long_prompts + args.streams
    docs = document_ids(args.model, args.cache_dir, count, args.doc_tokens)
    random.Random(args.seed).shuffle(docs)
    question = question_ids(args.model, args.cache_dir)
    shorts = [d[:48] + question for d in docs[args.long_prompts :]]
    longs = [d + question for d in docs[: args.long_prompts]]
    common = ["--model", args.model, "--dtype", args.dtype, "--block-size", str(BLOCK_SIZE)]
    common += ["--kv-cache-gb", "1"]
    runs: dict[str, Any] = {}
    with scratch_dir("strata-kv-shared-") as tmp:
        store = EmbeddedStore(tmp / "store")
        kv_store = EmbeddedStore(tmp / "kv-store", max_bytes=1 << 30)
        store.start()
        try:
            both = Worker(tmp, "both", [*common, "--threads", "2"], args.cache_dir, "0,1")
            one = gateway(tmp, store.url, [both], args.cache_dir, args.disagg_min_prompt_tokens)
            with running(both), one as url:
                runs["colocated"] = asyncio.run(_disagg_load(url, shorts, longs, args))
            prefill = [*common, "--threads", "1", "--role", "prefill"]
            decode = [*common, "--threads", "1", "--role", "decode", "--kv-host-gb", "1"]
            if args.disagg_transport == "remote":  # both workers share one remote tier
                kv_store.start()
                shared = ["--kv-remote-url", kv_store.url]
                prefill += ["--kv-host-gb", "1", *shared]
                decode += shared
            workers = [
                Worker(tmp, "prefill", prefill, args.cache_dir, "0"),
                Worker(tmp, "decode", decode, args.cache_dir, "1"),
            ]
            split = gateway(
                tmp,
                store.url,
                workers,
                args.cache_dir,
                args.disagg_min_prompt_tokens,
                ["--disagg-transport", args.disagg_transport],
            )
            with running(*workers), split as url:
                runs["disaggregated"] = asyncio.run(_disagg_load(url, shorts, longs, args))
                runs["disaggregated"]["prefills"] = _disagg_outcomes(url)
        finally:
            store.stop()
            kv_store.stop()
    colocated, split = runs["colocated"], runs["disaggregated"]
    transport = "remote KV tier" if args.disagg_transport == "remote" else "gateway"
    return {
        "itl_p99_ratio": round(colocated["itl_p99_s"] / split["itl_p99_s"], 2),
        "tokens_identical": colocated["outputs"] == split["outputs"],
        "colocated": {k: v for k, v in colocated.items() if k != "outputs"},
        "disaggregated": {k: v for k, v in split.items() if k != "outputs"},
        "streams": args.streams,
        "stream_tokens": args.stream_tokens,
        "long_prompts": len(longs),
        "long_prompt_tokens": len(longs[0]),
        "disagg_transport": args.disagg_transport,
        "setup": "2 cores: colocated is one `both` worker on cores 0-1 with 2 torch threads; "
        "disaggregated is a prefill worker on core 0 and a decode worker on core 1, one "
        f"torch thread each (taskset), pages through the {transport}; one "
        "unpinned gateway in front of either, greedy "
        f"streams of {args.stream_tokens} tokens, a long prompt every "
        f"{args.long_every_s} s once every stream has its first token",
    }


@contextlib.contextmanager
def gateway(
    tmp: Path,
    store_url: str,
    workers: list[Worker],
    cache_dir: str,
    min_prompt_tokens: int,
    extra: Sequence[str] = (),
) -> Iterator[str]:
    """`strata gateway` over `workers` (by address); yields its URL once it serves."""
    port = _port()
    data = tmp / f"gateway-{port}"
    data.mkdir()
    env = dict(os.environ, STRATA_LOG_LEVEL="WARNING", STRATA_LOG_FORMAT="console")
    env["STRATA_ADMIN_TOKEN"] = ADMIN
    for var in ("STRATA_ENGINE_URLS", "STRATA_REDIS_URL", "STRATA_WORKER_SECRET"):
        env.pop(var, None)
    argv = [sys.executable, "-m", "gateway.cli", "gateway", "--redis-url", store_url]
    argv += [arg for w in workers for arg in ("--engine", w.address)]
    argv += ["--port", str(port), "--cache-dir", cache_dir, "--data-dir", str(data)]
    argv += ["--disagg-min-prompt-tokens", str(min_prompt_tokens), *extra]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def serving() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode}")
        try:
            return httpx.get(f"{url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait(serving, 300, "the gateway")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _disagg_outcomes(url: str) -> dict[str, float]:
    """The gateway's prefills for decode workers by outcome (sent, remote, failed)."""
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}) as admin:
        text = admin.get("/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("strata:disagg_prefills_total{"):
            outcome = line.partition('outcome="')[2].partition('"')[0]
            out[outcome] = out.get(outcome, 0.0) + float(line.split()[-1])
    return out


def _api_key(url: str) -> str:
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}) as admin:
        tenant = admin.post("/admin/tenants/", json={"name": "bench"})
        assert tenant.status_code == 201, tenant.text
        key = admin.post(f"/admin/tenants/{tenant.json()['id']}/keys", json={})
        assert key.status_code == 201, key.text
        return str(key.json()["secret"])


async def _disagg_load(
    url: str, shorts: list[list[int]], longs: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    """The streams, then the long prompts while they run; each stream's gaps between
    tokens, and every output's text (streams first)."""
    headers = {"authorization": f"Bearer {_api_key(url)}"}
    started = [asyncio.Event() for _ in shorts]
    async with httpx.AsyncClient(base_url=url, timeout=900, headers=headers) as http:
        # warm-up: both prompt sizes once, so no first-use cost lands in the figures
        await _complete(http, shorts[0][::-1], 4)
        await _complete(http, longs[0][::-1], 4)

        async def long_prompts() -> list[tuple[str, float, int]]:
            for event in started:
                await event.wait()
            out = []
            for prompt in longs:
                out.append(asyncio.create_task(_complete(http, prompt, args.long_tokens)))
                await asyncio.sleep(args.long_every_s)
            return [await t for t in out]

        streams = [
            _stream(http, prompt, args.stream_tokens, started[i]) for i, prompt in enumerate(shorts)
        ]
        stream_results, long_results = await asyncio.gather(
            asyncio.gather(*streams), long_prompts()
        )
    gaps = [g for _, stream_gaps in stream_results for g in stream_gaps]
    latencies = [t for _, t, _ in long_results]
    return {
        "itl_p50_s": round(percentile(gaps, 0.5), 4),
        "itl_p99_s": round(percentile(gaps, 0.99), 4),
        "itl_max_s": round(max(gaps), 4),
        "num_gaps": len(gaps),
        "long_prompt_latency_p50_s": round(statistics.median(latencies), 3),
        # prompt tokens the long prompts found cached where they ran: the prefilled pages
        "long_prompt_cached_tokens": sum(c for _, _, c in long_results),
        "outputs": [text for text, _ in stream_results] + [text for text, _, _ in long_results],
    }


async def _complete(
    http: httpx.AsyncClient, prompt: list[int], max_tokens: int
) -> tuple[str, float, int]:
    """A greedy completion: its text, its latency and its cached prompt tokens."""
    start = time.perf_counter()
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    reply = await http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return answer["choices"][0]["text"], time.perf_counter() - start, cached


async def _stream(
    http: httpx.AsyncClient, prompt: list[int], max_tokens: int, started: asyncio.Event
) -> tuple[str, list[float]]:
    """A greedy streamed completion of exactly `max_tokens`: its text and the gaps between
    its chunks after the first."""
    body = {
        "model": "default",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    text, times = "", []
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk.get("choices", ()):
                text += choice.get("text") or ""
                times.append(time.perf_counter())
                started.set()
    return text, [b - a for a, b in itertools.pairwise(times)]


# -- the driver ------------------------------------------------------------------------------


def run_cross(args: argparse.Namespace) -> dict[str, Any]:
    """bench/kv_shared_cross.py's scenario, at this run's document shape."""
    return run_cross_worker(
        quick=args.quick,
        seed=args.seed,
        docs=args.docs,
        doc_tokens=args.doc_tokens,
        dtype=args.dtype,
        cache_dir=args.cache_dir,
        model=args.model,
        device=args.device,
        host_gb=args.kv_host_gb,
    )


SCENARIOS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "cross_worker": run_cross,
    "restart": run_restart,
    "disagg": run_disagg,
}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="", help="comma-separated (default: every one)")
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M) or a spec")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (restart, cross_worker)")
    ap.add_argument(
        "--kv-host-gb",
        type=float,
        default=0.0,
        help="cross_worker: each engine's host tier (pinned on CUDA), in GiB",
    )
    ap.add_argument("--threads", type=int, default=2, help="restart: torch threads")
    ap.add_argument("--docs", type=int, default=6, help="restart: documents")
    ap.add_argument("--doc-tokens", type=int, default=2000)
    ap.add_argument("--disk-gb", type=float, default=1.0, help="restart: the disk tier")
    ap.add_argument("--streams", type=int, default=8, help="disagg: streams decoding")
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--long-prompts", type=int, default=6, help="disagg: long prompts")
    ap.add_argument("--long-tokens", type=int, default=16, help="disagg: tokens per long prompt")
    ap.add_argument("--long-every-s", type=float, default=1.5)
    ap.add_argument("--disagg-min-prompt-tokens", type=int, default=512)
    ap.add_argument(
        "--disagg-transport",
        choices=["gateway", "remote"],
        default="gateway",
        help="disagg: the pages through the gateway, or through a remote KV tier both "
        "workers share",
    )
    add_cache_dir_argument(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="3 documents; 4 streams of 128 tokens and 3 long prompts",
    )
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parse_args(ap, argv, docs=3, streams=4, stream_tokens=128, long_prompts=3)
    available = SCENARIOS
    chosen = [s for s in args.scenarios.split(",") if s] or list(available)
    unknown = set(chosen) - set(available)
    if unknown:
        ap.error(f"unknown scenarios {sorted(unknown)}; here: {', '.join(available)}")
    if args.device != "cpu" and "disagg" in chosen:
        ap.error("disagg compares splits of CPU cores: run it with --device cpu")
    random.seed(args.seed)
    load_before = [round(x, 2) for x in os.getloadavg()]
    summary = {name: available[name](args) for name in chosen}
    record = {
        "benchmark": "kv_shared",
        **machine_info(__import__("torch").device(args.device)),
        "model": args.model,
        "dtype": args.dtype,
        "quick": args.quick,
        "seed": args.seed,
        "load_average_before": load_before,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "results": summary,
    }
    publish(args.out_dir, "kv_shared", record, summary)
    return summary


if __name__ == "__main__":
    main()
