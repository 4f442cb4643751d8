"""A gateway's stop runs its steps in order, each bounded: a step that hangs (even one that
ignores its cancellation, as a cancellation lost on Python 3.11 does) or fails is logged by
name and left behind, and the steps after it, the usage write among them, still run."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway.shutdown import ShutdownStep, run_steps


async def run_bounded(steps: list[ShutdownStep]) -> list[str]:
    """`run_steps`, failing the test rather than hanging it."""
    task = asyncio.create_task(run_steps(steps))
    await asyncio.wait([task], timeout=30.0)
    assert task.done(), "the stop hung"
    return task.result()


async def test_a_hung_step_is_left_behind_and_the_usage_is_still_written(caplog):
    release = asyncio.Event()
    ran: list[str] = []

    async def hangs() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    async def writes_usage() -> None:
        ran.append("usage")

    async def closes() -> None:
        ran.append("close")

    steps = [
        ShutdownStep("settling running requests", hangs, 0.2),
        ShutdownStep("writing usage records", writes_usage, 5.0),
        ShutdownStep("closing the fleet", closes, 5.0),
    ]
    with caplog.at_level(logging.WARNING, logger="gateway.shutdown"):
        assert await run_bounded(steps) == ["settling running requests"]
    assert ran == ["usage", "close"]
    assert "settling running requests did not finish within" in caplog.text
    release.set()


async def test_a_failed_step_is_logged_and_the_rest_still_run(caplog):
    ran: list[str] = []

    async def fails() -> None:
        raise ConnectionError("store gone")

    async def writes_usage() -> None:
        ran.append("usage")

    steps = [
        ShutdownStep("recording KV residency", fails, 5.0),
        ShutdownStep("writing usage records", writes_usage, 5.0),
    ]
    with caplog.at_level(logging.ERROR, logger="gateway.shutdown"):
        assert await run_bounded(steps) == ["recording KV residency"]
    assert ran == ["usage"]
    assert "recording KV residency failed" in caplog.text
    assert "store gone" in caplog.text


async def test_steps_that_finish_are_not_reported(caplog):
    async def quick() -> None:
        await asyncio.sleep(0)

    with caplog.at_level(logging.WARNING, logger="gateway.shutdown"):
        assert await run_bounded([ShutdownStep("closing the key cache", quick, 5.0)]) == []
    assert not caplog.records
