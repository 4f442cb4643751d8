"""Two workers sharing one remote KV tier, each behind its own gateway on one control
store: a document computed on one is a hit on the other, with the same greedy tokens; another
tenant's identical prompt is not; a corrupted page is a miss and counted; a remote store
that goes away mid-run costs recomputes, never failed requests."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from engine.client import EngineClient
from engine.protocol import EngineStats
from kvstore.remote import KEY_PREFIX, TENANT_PREFIX
from tenants.store import EmbeddedStore
from tests.integration.conftest import GatewayServer, WorkerProcess, gateway_settings

TINY = ["--model", "synthetic:tiny", "--num-kv-blocks", "128", "--block-size", "4"]
TINY += ["--dtype", "float32", "--kv-remote-timeout-ms", "1000", "--kv-host-gb", "0.01"]
DOC = " ".join(f"Clause {i}: the lessee keeps the premises in good repair." for i in range(4))


class Pair:
    def __init__(self, root: Path, cache_dir: Path, store_url: str, remote_url: str) -> None:
        args = [*TINY, "--kv-remote-url", remote_url]
        # B loads pages layer by layer on a worker thread, A before the step
        self.workers = [
            WorkerProcess(root / f"{n}.sock", [*args, "--kv-load", load], cache_dir)
            for n, load in (("a", "sync"), ("b", "thread"))
        ]
        self.gateways: list[GatewayServer] = []
        for worker in self.workers:
            worker.start()
            gw = GatewayServer(
                gateway_settings(store_url, worker, cache_dir, model="synthetic:tiny")
            )
            gw.start()
            self.gateways.append(gw)

    def stop(self) -> None:
        for gw in self.gateways:
            gw.stop()
        for worker in self.workers:
            worker.stop()

    def stats(self, i: int) -> EngineStats:
        async def get() -> EngineStats:
            client = EngineClient(self.workers[i].address)
            try:
                return await client.stats()
            finally:
                await client.close()

        return asyncio.run(get())

    def wait_saved(self, i: int, at_least: int = 0) -> EngineStats:
        """Until worker i has saved `at_least` pages and has no save queued."""
        deadline = time.monotonic() + 30
        while (stats := self.stats(i)).kv_remote.get("saved", 0) < at_least or stats.kv_remote[
            "pending"
        ]:
            assert time.monotonic() < deadline, f"saves not sent: {stats.kv_remote}"
            time.sleep(0.05)
        return stats


def complete(gw: GatewayServer, key: str, prompt: str) -> dict:
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        r = http.post(
            "/v1/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": "synthetic:tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0},
        )
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def remote_store(tmp_path_factory) -> Iterator[EmbeddedStore]:
    store = EmbeddedStore(tmp_path_factory.mktemp("kv-remote"), max_bytes=64 << 20)
    store.start()
    yield store
    store.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory, strata_cache_dir, store_server, remote_store) -> Iterator[Pair]:
    fleet = Pair(
        tmp_path_factory.mktemp("pair"), strata_cache_dir, store_server.url, remote_store.url
    )
    yield fleet
    fleet.stop()


def test_a_document_computed_on_one_worker_is_a_remote_hit_on_another(pair):
    a, b = pair.gateways
    _, key = a.new_tenant()
    _, other_key = a.new_tenant()
    prompt = f"{DOC}\nWho keeps the premises in repair?"
    first = complete(a, key, prompt)
    assert cached(first) == 0
    num_blocks = first["usage"]["prompt_tokens"] // 4
    saved = pair.wait_saved(0, num_blocks - 1).kv_remote["saved"]
    assert saved >= num_blocks - 1  # every full block of the prompt, written behind
    # another tenant's identical prompt: its chain is salted apart, so B computes it
    stranger = complete(b, other_key, prompt)
    assert cached(stranger) == 0
    hits_before = pair.stats(1).num_cache_hit_blocks.get("remote", 0)
    second = complete(b, key, prompt)  # the same tenant on the other worker
    stats = pair.stats(1)
    hits = stats.num_cache_hit_blocks["remote"] - hits_before
    assert cached(second) >= (num_blocks - 1) * 4 and hits * 4 == cached(second)
    # the pages landed in B's host RAM on their way to its device: B keeps them
    assert stats.num_kv_host_blocks_used >= hits
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["choices"][0]["text"] == stranger["choices"][0]["text"]
    assert pair.stats(1).kv_remote["rejected"] == 0


def test_a_corrupted_remote_page_is_a_miss_and_counted(pair, remote_store):
    a, b = pair.gateways
    tenant, key = a.new_tenant()
    prompt = f"{DOC}\nWhat does clause 3 say?"
    first = complete(a, key, prompt)
    pair.wait_saved(0)
    client = redis.Redis.from_url(remote_store.url)
    deadline = time.monotonic() + 30
    while not (pages := client.zrange(TENANT_PREFIX + tenant + ":pages", 0, -1)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for page_key in pages:  # every page of the tenant's: the prefix breaks at once
        value = bytearray(client.get(page_key))
        value[-1] ^= 0x5A
        client.set(page_key, bytes(value))
    assert all(k.startswith(KEY_PREFIX) for k in pages)
    rejected = pair.stats(1).kv_remote["rejected"]
    second = complete(b, key, prompt)
    assert cached(second) == 0
    assert pair.stats(1).kv_remote["rejected"] == rejected + 1
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_requests_complete_by_recompute_when_the_remote_store_dies(
    tmp_path, strata_cache_dir, store_server
):
    store = EmbeddedStore(tmp_path / "kv-remote", max_bytes=16 << 20)
    store.start()
    fleet = Pair(tmp_path, strata_cache_dir, store_server.url, store.url)
    try:
        a, b = fleet.gateways
        _, key = a.new_tenant()
        warm = complete(a, key, f"{DOC}\nFirst question.")
        fleet.wait_saved(0, 1)
        assert store.proc is not None
        with ThreadPoolExecutor(4) as pool:
            asked = [
                pool.submit(complete, gw, key, f"{DOC}\nQuestion {i}.")
                for i in range(3)
                for gw in (a, b)
            ]
            store.proc.send_signal(signal.SIGSTOP)  # mid-run: it answers nothing from here
            replies = [f.result() for f in asked]
        store.kill()  # then it is gone altogether
        replies += [complete(gw, key, f"{DOC}\nQuestion {i}.") for i in (7, 8) for gw in (a, b)]
        # every request completed: what the store could not give was computed
        assert all(r["usage"]["completion_tokens"] == 8 for r in replies)
        again = complete(b, key, f"{DOC}\nFirst question.")  # was in the remote tier: gone
        assert again["choices"][0]["text"] == warm["choices"][0]["text"]
        assert fleet.stats(0).kv_remote["save_dropped"] > 0
        assert fleet.stats(1).num_cache_hit_blocks.get("remote", 0) == 0
    finally:
        fleet.stop()
        store.stop()


def test_a_tenants_policy_caps_its_pages_in_the_remote_tier(pair, remote_store):
    a, _ = pair.gateways
    capped, capped_key = a.new_tenant(kv_remote_tokens=16)  # 4 pages of 4 tokens
    free, free_key = a.new_tenant()
    client = redis.Redis.from_url(remote_store.url)
    complete(a, free_key, f"{DOC}\nA question of the free tenant.")
    pair.wait_saved(0)
    free_pages = client.zrange(TENANT_PREFIX + free + ":pages", 0, -1)
    assert len(free_pages) > 4
    evicted = pair.stats(0).kv_remote["quota_evicted"]
    complete(a, capped_key, f"{DOC}\nA question of the capped tenant.")
    deadline = time.monotonic() + 30
    while pair.stats(0).kv_remote["quota_evicted"] == evicted:
        assert time.monotonic() < deadline, "no page was evicted for the quota"
        time.sleep(0.05)
    pair.wait_saved(0)
    assert client.zcard(TENANT_PREFIX + capped + ":pages") == 4
    page_nbytes = int(client.get(TENANT_PREFIX + capped + ":bytes")) // 4
    assert page_nbytes > 0
    # the other tenant's pages are all still there
    assert all(client.exists(k) for k in free_pages)
    residency = pair.stats(0).kv_blocks_by_tenant
    assert residency[capped]["remote"] == 4 and residency[free]["remote"] == len(free_pages)


def test_a_negative_remote_quota_is_refused_naming_the_field(pair):
    a, _ = pair.gateways
    with a.admin() as admin:
        r = admin.post(
            "/admin/tenants/", json={"name": "negative", "policy": {"kv_remote_tokens": -5}}
        )
    assert r.status_code == 400, r.text
    assert "kv_remote_tokens" in r.json()["error"]["message"]
