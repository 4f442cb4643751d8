"""This replica's copy of the price history, for pricing requests at admission: read from
the registry at most once per `refresh_s` (one reader at a time), so a price put on any
replica is in force everywhere within that long, and a price scheduled ahead with
`effective_at` takes effect at exactly that time."""

from __future__ import annotations

import asyncio
import time

from redis.exceptions import RedisError

from tenants.pricing import PriceHistory
from tenants.registry import TenantRegistry


class PriceCache:
    """The price history as the registry held it at most `refresh_s` ago; a price change
    made through this replica's registry is read on the next request."""

    def __init__(self, registry: TenantRegistry, *, refresh_s: float = 1.0) -> None:
        assert refresh_s > 0
        self.registry = registry
        self.refresh_s = refresh_s
        self._history: PriceHistory | None = None
        self._read_at = -float("inf")
        self._lock = asyncio.Lock()
        registry.price_listeners.append(self.invalidate)

    def invalidate(self) -> None:
        """Read the registry again on the next request (after a price change here)."""
        self._read_at = -float("inf")

    async def history(self) -> PriceHistory:
        """The price history, at most `refresh_s` old. A store error propagates unless an
        older copy is at hand, which is then used."""
        if self._history is not None and time.monotonic() - self._read_at < self.refresh_s:
            return self._history
        async with self._lock:
            if self._history is not None and time.monotonic() - self._read_at < self.refresh_s:
                return self._history
            try:
                self._history = PriceHistory(await self.registry.list_prices())
            except (RedisError, OSError):
                if self._history is None:
                    raise
            self._read_at = time.monotonic()
            return self._history
