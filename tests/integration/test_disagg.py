"""Disaggregated prefill with real worker processes and the real gateway over HTTP: a
prefill worker computes a long prompt's KV pages, the gateway hands them to a decode
worker, and the tokens are those of a colocated run, greedy and seeded; short prompts stay
on the decode worker; a prefill worker killed mid-request leaves the request to the decode
worker, billed once; torn or foreign pages are misses, never wrong KV."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.client import EngineClient
from engine.protocol import SamplingParams
from tenants.ledger import Ledger
from tenants.store import connect
from tests.integration.conftest import GatewayServer, WorkerProcess, gateway_settings

TINY = ["--model", "synthetic:tiny", "--dtype", "float32", "--block-size", "4"]
TINY += ["--num-kv-blocks", "512"]
DECODE = [*TINY, "--role", "decode", "--kv-host-gb", "0.01"]
MIN_PROMPT_TOKENS = 48


def document(topic: str) -> str:
    return " ".join(f"Note {i} on {topic}: the tide comes in and goes out." for i in range(10))


@pytest.fixture(scope="module")
def disagg(tmp_path_factory, strata_cache_dir, store_server):
    """A prefill and a decode worker behind one gateway; a `both` worker behind another,
    for reference."""
    root = tmp_path_factory.mktemp("disagg")
    workers = {
        "prefill": WorkerProcess(root / "p.sock", [*TINY, "--role", "prefill"], strata_cache_dir),
        "decode": WorkerProcess(root / "d.sock", DECODE, strata_cache_dir),
        "both": WorkerProcess(root / "b.sock", TINY, strata_cache_dir),
    }
    with split_and_colocated(workers, store_server.url, strata_cache_dir) as fleet:
        yield fleet


@contextlib.contextmanager
def split_and_colocated(
    workers: dict[str, WorkerProcess], store_url: str, cache_dir: Path
) -> Iterator[dict]:
    """`workers` (prefill, decode, both) started, the first two behind one gateway and the
    third behind another; everything stopped after."""
    for worker in workers.values():
        worker.start()
    settings = gateway_settings(
        store_url, workers["decode"], cache_dir, disagg_min_prompt_tokens=MIN_PROMPT_TOKENS
    )
    addresses = (workers["prefill"].address, workers["decode"].address)
    split = GatewayServer(dataclasses.replace(settings, engine_addresses=addresses))
    colocated = GatewayServer(gateway_settings(store_url, workers["both"], cache_dir))
    split.start()
    colocated.start()
    try:
        yield {"workers": workers, "split": split, "colocated": colocated, "store": store_url}
    finally:
        split.stop()
        colocated.stop()
        for worker in workers.values():
            worker.stop()


def complete(gateway: GatewayServer, key: str, prompt: str, **extra) -> dict:
    with httpx.Client(base_url=gateway.url, timeout=120) as http:
        r = http.post(
            "/v1/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": "synthetic:tiny", "prompt": prompt, "max_tokens": 12, **extra},
        )
    assert r.status_code == 200, r.text
    return r.json()


async def prefilled_tokens(worker: WorkerProcess) -> int:
    """Tokens the worker has generated: a prefill worker samples one per prefill."""
    client = EngineClient(worker.address)
    try:
        return (await client.stats()).num_generated_tokens
    finally:
        await client.close()


def disagg_count(gateway: GatewayServer, outcome: str) -> float:
    with gateway.admin() as admin:
        text = admin.get("/metrics").text
    line = f'strata:disagg_prefills_total{{model="synthetic:tiny",outcome="{outcome}"}}'
    values = [float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)]
    return values[0] if values else 0.0


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 0.9, "seed": 11}],
    ids=["greedy", "seeded"],
)
async def test_a_long_prompt_prefilled_elsewhere_gives_the_colocated_tokens(disagg, sampling):
    split, colocated = disagg["split"], disagg["colocated"]
    _, key = split.new_tenant()
    _, ref_key = colocated.new_tenant()
    prompt = document(f"prefill {sampling}")
    before = await prefilled_tokens(disagg["workers"]["prefill"])
    sent = disagg_count(split, "sent")

    reply = complete(split, key, prompt, **sampling)
    reference = complete(colocated, ref_key, prompt, **sampling)

    assert reply["choices"][0]["text"] == reference["choices"][0]["text"]
    prompt_tokens = reply["usage"]["prompt_tokens"]
    assert prompt_tokens >= MIN_PROMPT_TOKENS
    # a prompt the decode worker never saw starts from the pages the prefill worker sent:
    # every full block before its last token
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 4 * 4
    assert reference["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert await prefilled_tokens(disagg["workers"]["prefill"]) == before + 1
    assert disagg_count(split, "sent") == sent + 1


async def test_a_short_prompt_stays_on_the_decode_worker(disagg):
    split = disagg["split"]
    _, key = split.new_tenant()
    before = await prefilled_tokens(disagg["workers"]["prefill"])
    reply = complete(split, key, "A short question about tides?", temperature=0)
    assert reply["usage"]["prompt_tokens"] < MIN_PROMPT_TOKENS
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert await prefilled_tokens(disagg["workers"]["prefill"]) == before


async def test_a_prefill_worker_killed_mid_request_leaves_it_to_the_decode_worker(disagg):
    split, colocated = disagg["split"], disagg["colocated"]
    prefill = disagg["workers"]["prefill"]
    tenant, key = split.new_tenant()
    _, ref_key = colocated.new_tenant()
    prompt = document("a killed prefill")
    reference = complete(colocated, ref_key, prompt, temperature=0)
    handle = split.server.config.app.state.gateway.fleet.workers[prefill.address]
    assert prefill.proc is not None
    os.kill(prefill.proc.pid, signal.SIGSTOP)  # it takes the prefill and never answers
    try:
        asking = asyncio.create_task(asyncio.to_thread(complete, split, key, prompt, temperature=0))
        deadline = time.monotonic() + 60
        while handle.client.num_in_flight == 0:  # the prefill is on its way to it
            assert time.monotonic() < deadline, "the prefill never went to the prefill worker"
            await asyncio.sleep(0.02)
        prefill.kill()
        reply = await asking
    finally:
        prefill.stop()
        prefill.start()
    assert reply["choices"][0]["text"] == reference["choices"][0]["text"]
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed in place
    assert disagg_count(split, "failed") >= 1
    await assert_billed_once(disagg["store"], reply, tenant)


async def test_torn_pages_are_misses_and_the_tokens_stay(disagg):
    """Pages straight over the worker protocol: one with a torn payload in the middle of
    the prompt, the next with a torn header; the decode worker takes the pages before the
    torn one, computes the rest, and generates what a worker that computed everything
    does."""
    workers = disagg["workers"]
    prefill, decode, both = (
        EngineClient(workers[n].address) for n in ("prefill", "decode", "both")
    )
    prompt = [100 + (13 * i) % 350 for i in range(81)]  # 20 full blocks before the last token
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        pages = [blob async for reply in prefill.prefill("p", prompt) for blob in reply.pages]
        assert len(pages) == 20
        torn = bytearray(pages[6])
        torn[100] ^= 0xFF  # a payload byte: its CRC no longer matches
        header = bytearray(pages[7])
        header[-512 + 8] ^= 0x01  # the header's version: its own CRC no longer matches
        before = await decode.stats()
        await decode.put_pages([*pages[:6], bytes(torn), bytes(header), *pages[8:]])
        outs = [o async for o in decode.generate("d", prompt, params)]
        refs = [o async for o in both.generate("b", prompt, params)]
        after = await decode.stats()
    finally:
        for client in (prefill, decode, both):
            await client.close()
    assert [t for o in outs for t in o.new_token_ids] == [t for o in refs for t in o.new_token_ids]
    assert outs[-1].num_cached_tokens == outs[-1].num_cached_host_tokens == 6 * 4
    assert after.num_kv_pages_refused == before.num_kv_pages_refused + 2
    assert after.num_kv_pages_received == before.num_kv_pages_received + 18


def test_a_decode_worker_needs_a_host_tier(tmp_path: Path, strata_cache_dir: Path):
    worker = WorkerProcess(tmp_path / "x.sock", [*TINY, "--role", "decode"], strata_cache_dir)
    with pytest.raises(RuntimeError, match="exited"):
        worker.start()


def test_the_workers_list_shows_each_workers_role(disagg):
    with disagg["split"].admin() as admin:
        listed = admin.get("/admin/workers/").json()
    workers = disagg["workers"]
    roles = {w["address"]: w["role"] for w in listed}
    assert roles == {workers["prefill"].address: "prefill", workers["decode"].address: "decode"}


async def assert_billed_once(store_url: str, reply: dict, tenant: str) -> None:
    """The request's one usage record appears in the ledger with the reply's counts."""
    store = connect(store_url)
    try:
        ledger = Ledger(store)
        deadline = time.monotonic() + 20
        while (record := await ledger.get(reply["id"])) is None:
            assert time.monotonic() < deadline, "no usage record"
            await asyncio.sleep(0.1)
        assert record.tenant_id == tenant
        assert record.prompt_tokens == reply["usage"]["prompt_tokens"]
        assert record.completion_tokens == reply["usage"]["completion_tokens"] == 12
    finally:
        await store.aclose()
