"""A gateway replica's stop as bounded steps: each runs in a task of its own for at most its
`timeout_s`, so a step that hangs (a store call that never returns, a task that does not end)
is logged by name and left behind, and the steps after it still run."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from tenants.store import cancel_and_wait

log = logging.getLogger(__name__)

SLOW_STEP_S = 2.0  # a step that finishes but takes longer than this is logged with its time
ABANDON_S = 0.5  # how long a step past its time is given to end once cancelled


@dataclass(frozen=True)
class ShutdownStep:
    name: str  # what the log calls it: "writing usage records"
    run: Callable[[], Coroutine[Any, Any, object]]
    timeout_s: float

    def __post_init__(self) -> None:
        assert self.timeout_s > 0, self


def budget_s(timeouts: Sequence[float]) -> float:
    """The longest a stop of steps with these timeouts takes: each one's time, and the time
    a step past it is given to end."""
    return sum(t + ABANDON_S for t in timeouts)


async def run_steps(steps: Sequence[ShutdownStep]) -> list[str]:
    """Run `steps` in order, each for at most its `timeout_s`; returns the names of those that
    did not finish (past their time, or failed). A step past its time is logged as a warning,
    cancelled and left behind; a step that fails is logged with its error. Never raises but
    for the caller's own cancellation (which cancels the step running)."""
    return [step.name for step in steps if not await _run_step(step)]


async def _run_step(step: ShutdownStep) -> bool:
    started = time.monotonic()
    task = asyncio.create_task(step.run(), name=f"shutdown: {step.name}")
    try:
        await asyncio.wait([task], timeout=step.timeout_s)
    except BaseException:
        task.cancel()
        raise
    if not task.done():
        log.warning(
            "shutdown: %s did not finish within %.0fs; going on without it",
            step.name,
            step.timeout_s,
        )
        await cancel_and_wait(task, ABANDON_S)
        return False
    if task.cancelled():
        log.error("shutdown: %s was cancelled", step.name)
        return False
    if (error := task.exception()) is not None:
        log.error("shutdown: %s failed", step.name, exc_info=error)
        return False
    took = time.monotonic() - started
    if took > SLOW_STEP_S:
        log.warning("shutdown: %s took %.1fs", step.name, took)
    return True
