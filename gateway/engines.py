"""The gateway's view of its engine workers: one multiplexed EngineClient per worker (each
proving the fleet secret and requiring the worker's proof), the least busy connected one
chosen per request, and what they serve."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from engine.client import EngineClient
from engine.handshake import ClientAuth, FleetSecretError
from engine.protocol import EngineDeadError, EngineStats, ModelInfo

log = logging.getLogger(__name__)


class EnginePool:
    def __init__(
        self, addresses: list[str] | tuple[str, ...], auth: ClientAuth | None = None
    ) -> None:
        if not addresses:
            raise ValueError("the gateway needs at least one engine worker address")
        self.clients = [EngineClient(a, connect_timeout=2.0, auth=auth) for a in addresses]
        self.info: ModelInfo | None = None

    async def connect(self, timeout: float = 60.0) -> ModelInfo:
        """Wait until at least one worker answers; returns what it serves."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            for client in self.clients:
                try:
                    self.info = await client.connect()
                    return self.info
                except EngineDeadError:
                    continue
            if asyncio.get_running_loop().time() > deadline:
                errors = "; ".join(str(c.last_error) for c in self.clients if c.last_error)
                raise EngineDeadError(f"no engine worker became reachable: {errors}")
            await asyncio.sleep(0.2)

    def pick(self) -> EngineClient:
        """The connected worker with the fewest in-flight requests (else any: it reconnects
        on use and fails with EngineDeadError if it is still down)."""
        connected = [c for c in self.clients if c.connected]
        candidates = connected or self.clients
        return min(candidates, key=lambda c: c.num_in_flight)

    async def ready(self, timeout: float = 1.0) -> bool:
        """Whether some worker is reachable: its connection is open, or opens now. Reachable,
        not idle: a ping would wait behind the step a busy worker is computing. The workers
        not connected are tried together, so a restarted one is picked up and one that
        fails the fleet secret shows in `errors()`."""
        await asyncio.gather(*(_try_connect(c, timeout) for c in self.clients if not c.connected))
        return any(c.connected for c in self.clients)

    def errors(self) -> list[str]:
        """Why workers are out of reach, one line each, without their addresses (for /ready):
        a fleet secret error by name, anything else as 'unreachable'."""
        return [
            c.last_error.reason if isinstance(c.last_error, FleetSecretError) else "unreachable"
            for c in self.clients
            if c.last_error is not None
        ]

    async def stats(self) -> dict[str, EngineStats]:
        """The connected workers' figures, by address (those that do not answer within a
        second are left out)."""
        out = {}
        for client in self.clients:
            if client.connected:
                with contextlib.suppress(EngineDeadError, TimeoutError):
                    async with asyncio.timeout(1.0):
                        out[client.address] = await client.stats()
        return out

    async def close(self) -> None:
        for client in self.clients:
            await client.close()


async def _try_connect(client: EngineClient, timeout: float) -> None:
    with contextlib.suppress(EngineDeadError, TimeoutError):
        async with asyncio.timeout(timeout):
            await client.connect()
