"""Routing over a fleet: M engine workers registered in a store, one gateway, many tenants
asking about long documents (Zipf popularity, interleaved with short chats). The same seeded
request stream goes through each routing policy on fresh workers, and once through one
worker whose host tier holds every document (the ideal hit rate). Method and figures:
docs/benchmarks.md.

    python bench/fleet.py            # 3 workers, 8 tenants x 3 documents of ~2,000 tokens
    python bench/fleet.py --quick    # 3 workers, 4 tenants x 2 documents of ~1,000 tokens
    python bench/fleet.py --device cuda --workers 2    # two workers on one GPU

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import pydoc_data.topics
import random
import secrets
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_cache_dir_argument, machine_info, parse_args, publish, scratch_dir
from bench.gateway_overhead import _port, _wait, percentile
from engine.config import resolve_device
from engine.model_specs import load_tokenizer_for
from engine.tokenizer import Tokenizer
from tenants.store import EmbeddedStore

ADMIN = "bench-admin-token-0123456789"
SECRET = secrets.token_urlsafe(32)  # the fleet secret of this run's workers and gateways
POLICIES = ("kv_aware", "least_loaded", "round_robin")
QUESTIONS = [
    "\n\nQuestion: What is the main topic of this section?",
    "\n\nQuestion: Give one example from the text above.",
    "\n\nQuestion: Which keywords does it mention?",
    "\n\nQuestion: Summarize it in one sentence.",
]
CHATS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Suggest a name for a cat.",
    "What is two plus two?",
    "Say hello in Spanish.",
    "Which planet is closest to the sun?",
]


@dataclass(frozen=True)
class Item:
    """One request of the stream: a tenant's question about one of its documents (`doc` is
    its index in the document list), or a short chat (`doc` is None)."""

    tenant: int
    doc: int | None
    content: str

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.content}]


def documents(tokenizer: Tokenizer, count: int, length: int) -> list[str]:
    """`count` distinct texts of about `length` tokens each: consecutive slices of Python's
    reference text (`pydoc_data.topics`), as text."""
    topics = pydoc_data.topics.topics
    ids = tokenizer.encode(
        "\n\n".join(topics[name] for name in sorted(topics)), add_special_tokens=False
    )
    if len(ids) < count * length:
        raise SystemExit(f"the reference text has {len(ids)} tokens; need {count * length}")
    return [tokenizer.decode(ids[i * length : (i + 1) * length]) for i in range(count)]


def workload(
    rng: random.Random,
    docs: list[str],
    tenants: int,
    num_requests: int,
    chat_fraction: float,
    zipf: float,
) -> list[Item]:
    """The request stream: each request is a chat (with probability `chat_fraction`, from a
    tenant drawn uniformly) or a question about a document drawn with Zipf popularity over
    every (tenant, document) pair; document k belongs to tenant k % tenants."""
    ranked = list(range(len(docs)))
    rng.shuffle(ranked)  # popularity rank -> document
    weights = [1.0 / (rank + 1) ** zipf for rank in range(len(docs))]
    items = []
    for _ in range(num_requests):
        if rng.random() < chat_fraction:
            items.append(Item(rng.randrange(tenants), None, rng.choice(CHATS)))
        else:
            (k,) = rng.choices(ranked, weights)
            items.append(Item(k % tenants, k, docs[k] + rng.choice(QUESTIONS)))
    return items


def analytic_hit_rate(tokenizer: Tokenizer, items: list[Item], block_size: int) -> float:
    """The hit rate of an unbounded prefix cache serving the stream one request at a time:
    each prompt's full blocks already computed for the same tenant (salted caches), at most
    all but its last token (which is always computed)."""
    seen: set[bytes] = set()
    prompt = cached = 0
    for item in items:
        ids = tokenizer.encode_chat(item.messages)
        chain, hits, missed = hashlib.sha256(str(item.tenant).encode()).digest(), 0, False
        for b in range(len(ids) // block_size):
            block = ids[b * block_size : (b + 1) * block_size]
            chain = hashlib.sha256(chain + repr(block).encode()).digest()
            if chain in seen and not missed:
                hits += 1
            else:
                missed = True
            seen.add(chain)
        prompt += len(ids)
        cached += min(hits * block_size, (len(ids) - 1) // block_size * block_size)
    return cached / prompt


# -- the processes -------------------------------------------------------------------------


@contextlib.contextmanager
def fleet(
    tmp: Path,
    store_url: str,
    name: str,
    worker_args: list[list[str]],
    routing: str,
    cache_dir: str,
) -> Iterator[str]:
    """Workers (one per entry of `worker_args`) registered in the store and one gateway
    routing by `routing` over them; yields the gateway's URL once it sees every worker.
    Everything is stopped on exit, on an error too."""
    env = dict(
        os.environ,
        STRATA_LOG_LEVEL="WARNING",
        STRATA_LOG_FORMAT="console",
        STRATA_ADMIN_TOKEN=ADMIN,
        STRATA_WORKER_SECRET=SECRET,
        STRATA_CACHE_DIR=cache_dir,
        GOMP_SPINCOUNT="10000",
    )
    for var in ("STRATA_ENGINE_URLS", "STRATA_REDIS_URL", "STRATA_METRICS_TOKEN"):
        env.pop(var, None)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, args in enumerate(worker_args):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "gateway.cli",
                        "engine",
                        "--listen",
                        f"tcp://127.0.0.1:{_port()}",
                        "--registry-url",
                        store_url,
                        "--worker-id",
                        f"{name}-{i}",
                        "--cache-dir",
                        cache_dir,
                        *args,
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                )
            )
        port = _port()
        (tmp / name).mkdir()
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gateway.cli",
                    "gateway",
                    "--redis-url",
                    store_url,
                    "--routing",
                    routing,
                    "--port",
                    str(port),
                    "--cache-dir",
                    cache_dir,
                    "--data-dir",
                    str(tmp / name),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
            )
        )
        url = f"http://127.0.0.1:{port}"

        def sees_every_worker() -> bool:
            for proc in procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
            try:
                view = httpx.get(
                    f"{url}/admin/workers/", timeout=2, headers={"authorization": f"Bearer {ADMIN}"}
                )
            except httpx.HTTPError:
                return False
            if view.status_code != 200:
                return False
            return sum(w["connected"] for w in view.json()) == len(worker_args)

        _wait(sees_every_worker, 300, "the gateway's view of the workers")
        yield url
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def new_tenants(url: str, count: int) -> list[str]:
    """`count` tenants with default policies (no limits); their API keys."""
    keys = []
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}) as admin:
        for i in range(count):
            tenant = admin.post("/admin/tenants/", json={"name": f"bench-{i}"})
            assert tenant.status_code == 201, tenant.text
            key = admin.post(f"/admin/tenants/{tenant.json()['id']}/keys", json={})
            assert key.status_code == 201, key.text
            keys.append(key.json()["secret"])
    return keys


def worker_figures(url: str) -> dict[str, dict[str, float]]:
    """Each worker's prefix-cache hits (blocks), preemptions and KV blocks in use, from the
    gateway's metrics, by worker."""
    wanted = {
        "strata:kv_cache_hit_blocks_total": "hit_blocks",
        "strata:num_preemptions_total": "preemptions",
        "strata:kv_blocks_used": "kv_blocks_used",
    }
    out: dict[str, dict[str, float]] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, rest = line.partition("{")
        if name in wanted and 'worker="' in rest:
            worker = rest.split('worker="', 1)[1].split('"', 1)[0]
            entry = out.setdefault(worker, {})
            entry[wanted[name]] = entry.get(wanted[name], 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# -- the load --------------------------------------------------------------------------------


@dataclass
class Outcome:
    item: Item
    ttft: float
    e2e: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


async def one(http: httpx.AsyncClient, key: str, item: Item, max_tokens: int) -> Outcome:
    """Stream one chat completion: time to the first content (or the finish, for an empty
    answer), to the end, and the usage chunk's token counts."""
    body = {
        "model": "default",
        "messages": item.messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] | None = None
    async with http.stream(
        "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {(await reply.aread())!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            for choice in chunk.get("choices", ()):
                if first is None and (choice["delta"].get("content") or choice["finish_reason"]):
                    first = time.perf_counter()
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    assert usage is not None and first is not None, "no usage chunk or no output"
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(
        item,
        first - start,
        end - start,
        usage["prompt_tokens"],
        details.get("cached_tokens", 0),
        usage["completion_tokens"],
    )


async def drive(
    url: str, keys: list[str], items: list[Item], concurrency: int, max_tokens: int
) -> tuple[list[Outcome], float]:
    """The stream in order with `concurrency` requests in flight, after a warm-up (not
    counted): a chat and a prompt as long as the longest request, `concurrency` of each, so
    that every worker has run its kernels at both sizes (a fresh GPU compiles them on first
    use); every outcome, and the wall time of the stream."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as http:
        longest = max(items, key=lambda item: len(item.content)).content
        for warm in (Item(-1, None, "Hello!"), Item(-1, None, longest)):
            # a tenant of its own, so its cache is no one else's; distinct prompts spread
            await asyncio.gather(
                *(
                    one(http, keys[-1], replace(warm, content=f"{i} {warm.content}"), 1)
                    for i in range(concurrency)
                )
            )
        outcomes: list[Outcome | None] = [None] * len(items)
        queue = iter(enumerate(items))

        async def client() -> None:
            for i, item in queue:
                outcomes[i] = await one(http, keys[item.tenant], item, max_tokens)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    assert all(o is not None for o in outcomes)
    return [o for o in outcomes if o is not None], wall


def figures(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    def ms(values: list[float], q: float) -> float:
        return round(percentile(values, q) * 1e3, 1)

    ttft = [o.ttft for o in outcomes]
    e2e = [o.e2e for o in outcomes]
    asked = [o for o in outcomes if o.item.doc is not None]
    prompt = sum(o.prompt_tokens for o in outcomes)
    doc_prompt = sum(o.prompt_tokens for o in asked)
    doc_cached = sum(o.cached_tokens for o in asked)
    chats = [o.ttft for o in outcomes if o.item.doc is None]
    return {
        "hit_rate": round(sum(o.cached_tokens for o in outcomes) / prompt, 4),
        "doc_hit_rate": round(doc_cached / max(1, doc_prompt), 4),
        "ttft_p50_ms": ms(ttft, 0.5),
        "ttft_p99_ms": ms(ttft, 0.99),
        "doc_ttft_p50_ms": ms([o.ttft for o in asked], 0.5) if asked else None,
        "chat_ttft_p50_ms": ms(chats, 0.5) if chats else None,
        "e2e_p50_ms": ms(e2e, 0.5),
        "e2e_p99_ms": ms(e2e, 0.99),
        "tokens_per_s": round(sum(o.completion_tokens for o in outcomes) / wall, 2),
        "prompt_tokens_per_s": round(prompt / wall, 1),
        "requests_per_s": round(len(outcomes) / wall, 3),
        "wall_s": round(wall, 1),
        "prompt_tokens": prompt,
        # each request in order: tenant, document (-1: a chat), prompt and cached tokens,
        # TTFT and end-to-end ms
        "requests": [
            [
                o.item.tenant,
                -1 if o.item.doc is None else o.item.doc,
                o.prompt_tokens,
                o.cached_tokens,
                round(o.ttft * 1e3, 1),
                round(o.e2e * 1e3, 1),
            ]
            for o in outcomes
        ],
    }


# -- the run ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M) or a spec")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--docs-per-tenant", type=int, default=3)
    ap.add_argument("--doc-tokens", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--chat-fraction", type=float, default=0.25)
    ap.add_argument(
        "--zipf",
        type=float,
        default=0.6,
        help="popularity exponent: a document of rank r is asked in proportion to "
        "r^-zipf (0.6: most documents are asked several times)",
    )
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--worker-docs", type=float, default=10.0, help="documents one worker's KV pool holds"
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--device", default="auto", help="the workers' device: auto, cpu, cuda (all on one GPU)"
    )
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument(
        "--ideal",
        choices=("measured", "analytic"),
        default="measured",
        help="the reference hit rate: a run through one worker whose host tier "
        "holds every document, or the analytic one only",
    )
    add_cache_dir_argument(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--quick", action="store_true", help="4 tenants x 2 documents of 1,000 tokens, 48 requests"
    )
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parse_args(
        ap, argv, tenants=4, docs_per_tenant=2, doc_tokens=1000, requests=48, worker_docs=4.0
    )
    policies = [p for p in args.policies.split(",") if p]
    assert set(policies) <= set(POLICIES), f"policies are {', '.join(POLICIES)}"
    load_before = [round(x, 2) for x in os.getloadavg()]

    tokenizer = load_tokenizer_for(args.model, args.cache_dir)
    num_docs = args.tenants * args.docs_per_tenant
    docs = documents(tokenizer, num_docs, args.doc_tokens)
    items = workload(
        random.Random(args.seed), docs, args.tenants, args.requests, args.chat_fraction, args.zipf
    )
    longest = max(len(tokenizer.encode_chat(it.messages)) for it in items if it.doc is not None)
    doc_blocks = -(-(longest + args.max_tokens) // args.block_size)
    worker_blocks = int(args.worker_docs * doc_blocks)
    ideal_analytic = round(analytic_hit_rate(tokenizer, items, args.block_size), 4)
    device = resolve_device(args.device)
    common = [
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--device",
        str(device),
        "--threads",
        str(args.threads),
        "--block-size",
        str(args.block_size),
        "--seed",
        str(args.seed),
    ]
    fleet_args = [*common, "--num-kv-blocks", str(worker_blocks)]
    asks = Counter(it.doc for it in items if it.doc is not None)
    print(
        f"{len(items)} requests: {sum(asks.values())} about {len(asks)} of {num_docs} "
        f"documents (most asked {max(asks.values())}x), {len(items) - sum(asks.values())} "
        f"chats; {worker_blocks} KV blocks per worker ({args.worker_docs} documents of "
        f"{doc_blocks} blocks); analytic ideal hit rate {ideal_analytic}",
        flush=True,
    )

    runs: dict[str, dict[str, Any]] = {}
    ideal_args: list[str] = []
    with scratch_dir("strata-fleet-bench-") as tmp:  # the store's files, the ledgers
        store = EmbeddedStore(tmp / "store")
        store.start()
        try:
            keys: list[str] = []
            kv_bytes_per_token = 0
            plan = [(p, [fleet_args] * args.workers) for p in policies]
            if args.ideal == "measured":
                plan.append(("ideal", [[]]))  # its arguments come from the first run
            for name, worker_args in plan:
                if name == "ideal":
                    # the fleet worker's device pool, and a host tier for every document
                    host_blocks = int(1.25 * num_docs * doc_blocks) + worker_blocks
                    host_gb = host_blocks * args.block_size * kv_bytes_per_token / (1 << 30)
                    ideal_args = [*fleet_args, "--kv-host-gb", f"{host_gb:.4f}"]
                    worker_args = [ideal_args]
                routing = name if name != "ideal" else "kv_aware"
                with fleet(tmp, store.url, name, worker_args, routing, args.cache_dir) as url:
                    keys = keys or new_tenants(url, args.tenants + 1)  # the last warms up
                    outcomes, wall = asyncio.run(
                        drive(url, keys, items, args.concurrency, args.max_tokens)
                    )
                    runs[name] = figures(outcomes, wall)
                    workers = worker_figures(url)
                    runs[name]["workers"] = workers
                    kv_bytes_per_token = kv_bytes_per_token or _kv_bytes_per_token(url)
                shown = {k: v for k, v in runs[name].items() if k != "requests"}
                print(f"{name:>12}: {shown}", flush=True)
        finally:
            store.stop()
    load_after = [round(x, 2) for x in os.getloadavg()]

    ideal = runs["ideal"]["hit_rate"] if "ideal" in runs else ideal_analytic
    ttft = {p: runs[p]["ttft_p50_ms"] for p in policies}
    summary: dict[str, Any] = {
        "ttft_p50_ms": ttft,
        "hit_rate": {**{p: runs[p]["hit_rate"] for p in policies}, "ideal": ideal},
        "speedup_vs_least_loaded": round(ttft["least_loaded"] / ttft["kv_aware"], 2)
        if {"kv_aware", "least_loaded"} <= set(ttft)
        else None,
    }
    floors = {}
    if "kv_aware" in runs:
        floors["hit_rate_vs_ideal"] = round(runs["kv_aware"]["hit_rate"] / ideal, 3)
        floors["hit_rate_floor_met"] = floors["hit_rate_vs_ideal"] >= 0.9
    if summary["speedup_vs_least_loaded"] is not None:
        floors["ttft_floor_met"] = summary["speedup_vs_least_loaded"] >= 2.0
    record = {
        "benchmark": "fleet",
        **machine_info(device),
        "load_average": {"before": load_before, "after": load_after},
        "model_spec": args.model,
        "synthetic_weights": args.model.startswith("synthetic:"),
        "dtype": args.dtype,
        "workers": args.workers,
        "threads_per_worker": args.threads,
        "gateways": 1,
        "tenants": args.tenants,
        "docs_per_tenant": args.docs_per_tenant,
        "doc_tokens": args.doc_tokens,
        "requests": args.requests,
        "doc_requests": sum(asks.values()),
        "docs_asked": len(asks),
        "most_asks_per_doc": max(asks.values()),
        "chat_fraction": args.chat_fraction,
        "zipf": args.zipf,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "kv_sizing": {
            "worker_kv_blocks": worker_blocks,
            "worker_docs": args.worker_docs,
            "blocks_per_doc_request": doc_blocks,
            "ideal_worker": "one worker, the same device pool, and a host tier holding every "
            "document"
            if ideal_args
            else None,
            "ideal_worker_args": ideal_args or None,
        },
        "ideal": args.ideal,
        "ideal_hit_rate_analytic": ideal_analytic,
        "seed": args.seed,
        "quick": args.quick,
        "runs": runs,
        "floors": floors,
        **summary,
    }
    publish(args.out_dir, "fleet", record, summary)
    return summary


def _kv_bytes_per_token(url: str) -> int:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("strata:kv_cache_bytes_per_token{"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise RuntimeError("no worker reported its KV bytes per token")


if __name__ == "__main__":
    main()
