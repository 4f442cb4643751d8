"""A real worker process over a real Unix socket, driven by EngineClient."""

from __future__ import annotations

import asyncio
import socket

import pytest

from engine.client import EngineClient
from engine.protocol import (
    EngineDeadError,
    FinishReason,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    Scheduling,
)

LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


async def collect(
    client: EngineClient,
    rid: str,
    prompt: list[int],
    params: SamplingParams,
    scheduling: Scheduling | None = None,
):
    outs: list[RequestOutput] = [
        out async for out in client.generate(rid, prompt, params, scheduling=scheduling)
    ]
    return outs


async def wait_idle(client: EngineClient, timeout: float = 10.0):
    async with asyncio.timeout(timeout):
        while True:
            stats = await client.stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                return stats
            await asyncio.sleep(0.02)


async def test_concurrent_streams_each_get_their_own_tokens(tiny_worker):
    client = EngineClient(tiny_worker.address)
    info = await client.connect()
    assert info.model_id == "synthetic:tiny"
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(8)]
    results = await asyncio.gather(
        *(collect(client, f"r{i}", p, params) for i, p in enumerate(prompts))
    )
    for outs in results:
        tokens = [t for o in outs for t in o.new_token_ids]
        assert len(tokens) == 12
        assert outs[-1].finish_reason is FinishReason.LENGTH
        assert outs[-1].num_prompt_tokens == 3
        assert outs[-1].num_output_tokens == 12
    # the same prompt alone gives the same greedy tokens as inside the crowd
    alone = await collect(client, "again", prompts[3], params)
    assert [t for o in alone for t in o.new_token_ids] == [
        t for o in results[3] for t in o.new_token_ids
    ]
    stats = await wait_idle(client)
    assert stats.num_kv_blocks_used == 0
    assert await client.health()
    await client.close()


async def test_abort_mid_stream_frees_blocks(tiny_worker):
    client = EngineClient(tiny_worker.address)
    seen = 0
    async for out in client.generate("long", [1, 2, 3, 4, 5], LONG):
        seen += len(out.new_token_ids)
        if seen >= 5:
            break  # leaving the loop aborts the request
    stats = await wait_idle(client)
    assert stats.num_kv_blocks_used == 0
    assert await client.health()  # the worker's integrity check passes
    # an explicit abort of a running request ends its stream with finish_reason=abort
    gen = client.generate("long2", [7, 8, 9], LONG)
    await anext(gen)
    await client.abort("long2")
    outs = [out async for out in gen]
    assert outs[-1].finish_reason is FinishReason.ABORT
    assert (await wait_idle(client)).num_kv_blocks_used == 0
    await client.close()


async def test_client_disconnect_aborts_its_requests(tiny_worker):
    first = EngineClient(tiny_worker.address)
    gen = first.generate("hang", [1, 2, 3], LONG)
    await anext(gen)
    await first.close()  # drop the connection with the request still running
    observer = EngineClient(tiny_worker.address)
    stats = await wait_idle(observer)
    assert stats.num_kv_blocks_used == 0
    await observer.close()


async def test_invalid_requests_fail_alone(tiny_worker):
    client = EngineClient(tiny_worker.address)
    info = await client.connect()
    good = asyncio.create_task(
        collect(client, "ok", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    )
    bad_cases = [  # and the field at fault, where there is one, crosses the wire
        ([1] * (info.max_model_len + 5), SamplingParams(max_tokens=1), "context", None),
        ([info.vocab_size + 7], SamplingParams(max_tokens=1), "token ids", None),
        ([1, 2], SamplingParams(max_tokens=1, top_p=0.0), "top_p", "top_p"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens", "max_tokens"),
        ([], SamplingParams(max_tokens=1), "empty", None),
    ]
    for i, (prompt, params, needle, param) in enumerate(bad_cases):
        with pytest.raises(InvalidRequestError, match=needle) as err:
            await collect(client, f"bad{i}", prompt, params)
        assert err.value.param == param
    with pytest.raises(InvalidRequestError, match="weight"):
        await collect(client, "w", [1, 2], SamplingParams(max_tokens=1), Scheduling(weight=0.0))
    outs = await good
    assert sum(len(o.new_token_ids) for o in outs) == 20
    assert await client.health()
    await client.close()


async def test_garbage_frames_drop_only_that_connection(tiny_worker):
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(str(tiny_worker.sock))
    raw.sendall(b"\x00\x00\x00\x05hello")
    raw.close()
    client = EngineClient(tiny_worker.address)
    outs = await collect(client, "after", [3, 4], SamplingParams(max_tokens=3, ignore_eos=True))
    assert outs[-1].finished
    await client.close()


async def test_killed_worker_fails_in_flight_and_client_reconnects(tiny_worker):
    client = EngineClient(tiny_worker.address)
    gen = client.generate("doomed", [1, 2, 3], LONG)
    await anext(gen)
    tiny_worker.kill()
    with pytest.raises(EngineDeadError):
        async for _ in gen:
            pass
    with pytest.raises(EngineDeadError):
        await collect(client, "nobody-home", [1], SamplingParams(max_tokens=1))
    assert not await client.health(timeout=1.0)
    tiny_worker.start()
    outs = await collect(client, "back", [1, 2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert sum(len(o.new_token_ids) for o in outs) == 4
    await client.close()
