"""Supervised children (engine worker, embedded store): the restart delay doubles while a
child keeps dying young and starts over once it has run healthily; a stop is bounded."""

from __future__ import annotations

import subprocess
import sys

from gateway.serve import RESTART_FIRST_S, RESTART_MAX_S, restart_delay


def test_delay_doubles_while_the_child_dies_young_and_is_capped():
    delay = None
    seen = []
    for _ in range(8):
        delay = restart_delay(delay, ran_for_s=2.0, healthy_after_s=60.0)
        seen.append(delay)
    assert seen[:4] == [
        RESTART_FIRST_S,
        2 * RESTART_FIRST_S,
        4 * RESTART_FIRST_S,
        8 * RESTART_FIRST_S,
    ]
    assert seen[-1] == RESTART_MAX_S


def test_a_healthy_run_resets_the_delay():
    delay = None
    for _ in range(6):
        delay = restart_delay(delay, ran_for_s=1.0, healthy_after_s=60.0)
    assert delay == RESTART_MAX_S
    assert restart_delay(delay, ran_for_s=61.0, healthy_after_s=60.0) == RESTART_FIRST_S


def test_a_stop_stuck_on_a_thread_ends_at_its_bound_naming_the_thread():
    # a non-daemon thread that never ends would keep the interpreter from exiting
    script = (
        "import threading\n"
        "from gateway.serve import exit_after\n"
        "threading.Thread(target=threading.Event().wait, name='stuck-join').start()\n"
        "exit_after(0.3, code=3, why='stop over budget')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3
    assert "stop over budget" in done.stderr and "stuck-join" in done.stderr
