"""Disaggregated prefill through the remote KV tier, with real worker processes, a real
Valkey store and the real gateway over HTTP: a prefill worker and a decode worker that
share one remote tier pass a long prompt's pages through it, not through the gateway, and
the tokens are those of a colocated run; with the store gone, the prefill worker's pages
travel through the gateway after all, and the request is still answered (billed once)."""

from __future__ import annotations

import pytest

from engine.client import EngineClient
from engine.protocol import EngineStats
from tenants.store import EmbeddedStore
from tests.integration.conftest import WorkerProcess
from tests.integration.test_disagg import (
    DECODE,
    MIN_PROMPT_TOKENS,
    TINY,
    assert_billed_once,
    complete,
    disagg_count,
    split_and_colocated,
)
from tests.integration.test_disagg import document as _document

REMOTE = ["--kv-remote-timeout-ms", "1000"]


def document(topic: str) -> str:
    return _document(f"{topic} (through the store)")


@pytest.fixture(scope="module")
def shared(tmp_path_factory, strata_cache_dir, store_server):
    """A prefill and a decode worker sharing one remote tier behind one gateway (transport
    `auto`); a `both` worker behind another, for reference."""
    root = tmp_path_factory.mktemp("disagg-remote")
    remote = EmbeddedStore(root / "kv", max_bytes=64 << 20)
    remote.start()
    through = ["--kv-remote-url", remote.url, *REMOTE]
    workers = {
        "prefill": WorkerProcess(
            root / "p.sock",
            [*TINY, "--role", "prefill", "--kv-host-gb", "0.01", *through],
            strata_cache_dir,
        ),
        "decode": WorkerProcess(root / "d.sock", [*DECODE, *through], strata_cache_dir),
        "both": WorkerProcess(root / "b.sock", TINY, strata_cache_dir),
    }
    with split_and_colocated(workers, store_server.url, strata_cache_dir) as fleet:
        yield {**fleet, "remote": remote}
    remote.stop()


async def stats(worker: WorkerProcess) -> EngineStats:
    client = EngineClient(worker.address)
    try:
        return await client.stats()
    finally:
        await client.close()


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 0.9, "seed": 5}],
    ids=["greedy", "seeded"],
)
async def test_pages_through_the_shared_remote_tier_give_the_colocated_tokens(shared, sampling):
    split, colocated = shared["split"], shared["colocated"]
    decode = shared["workers"]["decode"]
    _, key = split.new_tenant()
    _, ref_key = colocated.new_tenant()
    prompt = document(f"remote {sampling}")
    through_store = disagg_count(split, "remote")
    relayed = disagg_count(split, "sent")
    before = await stats(decode)

    reply = complete(split, key, prompt, **sampling)
    reference = complete(colocated, ref_key, prompt, **sampling)

    assert reply["choices"][0]["text"] == reference["choices"][0]["text"]
    prompt_tokens = reply["usage"]["prompt_tokens"]
    assert prompt_tokens >= MIN_PROMPT_TOKENS
    num_blocks = (prompt_tokens - 1) // 4
    # the decode worker never saw the prompt: every full block before its last token came
    # from the remote tier, and no page crossed the gateway
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == num_blocks * 4
    after = await stats(decode)
    hits = after.num_cache_hit_blocks.get("remote", 0) - before.num_cache_hit_blocks.get(
        "remote", 0
    )
    assert hits == num_blocks
    assert after.num_kv_pages_received == before.num_kv_pages_received
    assert disagg_count(split, "remote") == through_store + 1
    assert disagg_count(split, "sent") == relayed


async def test_with_the_remote_store_gone_the_pages_go_through_the_gateway(shared):
    """Runs last in the module: it stops the shared store."""
    split, colocated = shared["split"], shared["colocated"]
    decode = shared["workers"]["decode"]
    tenant, key = split.new_tenant()
    _, ref_key = colocated.new_tenant()
    prompt = document("a store that went away")
    reference = complete(colocated, ref_key, prompt, temperature=0)
    shared["remote"].stop()
    relayed = disagg_count(split, "sent")
    before = await stats(decode)

    reply = complete(split, key, prompt, temperature=0)

    assert reply["choices"][0]["text"] == reference["choices"][0]["text"]
    num_blocks = (reply["usage"]["prompt_tokens"] - 1) // 4
    # the prefill worker could not save its pages, so it sent them: the decode worker took
    # them from the gateway and computed none of them
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == num_blocks * 4
    after = await stats(decode)
    assert after.num_kv_pages_received == before.num_kv_pages_received + num_blocks
    assert disagg_count(split, "sent") == relayed + 1
    await assert_billed_once(shared["store"], reply, tenant)
