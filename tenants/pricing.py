"""Prices with effective times, and what a request costs under them in nano-dollars.

A price per 1M tokens in dollars is 1000 times that in nano-dollars per token, so a cost is
`tokens x rate x 1000`, exact for prices of up to three decimal places per 1M tokens and
otherwise rounded up to a whole nano-dollar per part (prompt, cached, completion). Budgets,
spend counters and ledger records all hold these integers, so spend always equals the sum
of the ledger.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal

import msgspec

from tenants.records import Price, UsageRecord


def exact_rate(price_per_m: float) -> Decimal:
    """The rate as the operator wrote it (the shortest repr of the float: 0.15, not
    0.1499999…)."""
    return Decimal(repr(float(price_per_m)))


def _nanos(num_tokens: int, rate: Decimal) -> int:
    # dollars per 1M tokens = nano-dollars per 1000 tokens
    return math.ceil(Decimal(num_tokens) * rate * 1000)


@dataclass(frozen=True, slots=True)
class Rates:
    """Dollars per 1M tokens, as exact decimals."""

    prompt: Decimal
    cached: Decimal
    completion: Decimal

    @classmethod
    def of(cls, price: Price) -> Rates:
        return cls(
            exact_rate(price.prompt_per_m),
            exact_rate(price.cached_per_m),
            exact_rate(price.completion_per_m),
        )

    def worst_case_nanos(self, prompt_tokens: int, max_completion_tokens: int) -> int:
        """The most a request can cost: every prompt token at the dearer of the prompt and
        cached rates, plus every completion token it may generate."""
        prompt = _nanos(prompt_tokens, max(self.prompt, self.cached))
        return prompt + _nanos(max_completion_tokens, self.completion)

    def costs(
        self, prompt_tokens: int, cached_tokens: int, completion_tokens: int
    ) -> tuple[int, int, int]:
        """(prompt, cached, completion) nano-dollars; cached tokens are part of the prompt
        and billed at the cached rate."""
        cached = min(cached_tokens, prompt_tokens)
        return (
            _nanos(prompt_tokens - cached, self.prompt),
            _nanos(cached, self.cached),
            _nanos(completion_tokens, self.completion),
        )


class PriceHistory:
    """Every price version, by name (model, adapter, or `adapter@version`), ordered by
    effective time. Immutable once built; `rates_at` answers which price was in force."""

    def __init__(self, prices: Iterable[Price]) -> None:
        versions: dict[str, list[Price]] = {}
        for price in prices:
            versions.setdefault(price.model, []).append(price)
        self._times: dict[str, list[float]] = {}
        self._rates: dict[str, list[Rates]] = {}
        for name, found in versions.items():
            found.sort(key=lambda p: p.effective_at or -math.inf)
            self._times[name] = [p.effective_at or -math.inf for p in found]
            self._rates[name] = [Rates.of(p) for p in found]

    def _at(self, name: str, at: float, earliest: bool) -> Rates | None:
        times = self._times.get(name)
        if times is None:
            return None
        i = bisect.bisect_right(times, at)
        if not i:
            return self._rates[name][0] if earliest else None
        return self._rates[name][i - 1]

    def rates_at(
        self,
        at: float,
        model: str,
        adapter: str | None,
        adapter_version: int | None = None,
        *,
        earliest: bool = False,
    ) -> Rates | None:
        """The rates in force at `at` of the first priced of: the adapter's version, the
        adapter, its base model. None when none of them was priced then; with `earliest`,
        a name priced only later answers with its first price."""
        names = []
        if adapter:
            if adapter_version is not None:
                names.append(f"{adapter}@{adapter_version}")
            names.append(adapter)
        names.append(model)
        for name in names:
            if (rates := self._at(name, at, earliest)) is not None:
                return rates
        return None


def with_costs(rec: UsageRecord, rates: Rates | None) -> UsageRecord:
    """`rec` carrying its cost under `rates` (unchanged when no price applied)."""
    if rates is None:
        return rec
    prompt, cached, completion = rates.costs(
        rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens
    )
    return msgspec.structs.replace(
        rec,
        cost_prompt_nanos=prompt,
        cost_cached_nanos=cached,
        cost_completion_nanos=completion,
    )
