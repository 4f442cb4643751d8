"""Holding the KV copies' threads in tests, to see what waits for them and what does not."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvstore.device_pool import DeviceKVPool


def hold_saves(monkeypatch, pool: DeviceKVPool) -> threading.Event:
    """Hold the pool's saves into host rows, on their own thread, until the returned event
    is set (reads of the pool's pages on any other thread go ahead)."""
    gate = threading.Event()
    read = pool.read_pages_into

    def held(blocks, out):
        if threading.current_thread().name.startswith("strata-kv-save"):
            assert gate.wait(30), "saves held too long"
        read(blocks, out)

    monkeypatch.setattr(pool, "read_pages_into", held)
    return gate


def waits_until_set(gate: threading.Event, call: Callable[..., Any], *args: Any) -> None:
    """`call(*args)` blocks while `gate` is unset, and returns once it is set."""
    waiter = threading.Thread(target=call, args=args)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), f"{call.__name__} did not wait"
    gate.set()
    waiter.join(30)
    assert not waiter.is_alive(), f"{call.__name__} still waits"
