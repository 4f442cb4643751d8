"""Numbers with `minimum` / `maximum` / `exclusiveMinimum` / `exclusiveMaximum`.

A bounded number is written without an exponent, and each byte is allowed only while some
completion of the text so far still lies within the bounds: a digit string `12` can still
become 12, 12.x, 120-129.x, 1200-1299.x and so on, `12.3` only [12.3, 12.4), and a `-` the
negatives. Arithmetic is exact (fractions), so `maximum: 0.3` allows 0.3 and not 0.30001.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from engine.structured.errors import SchemaError


@dataclass(frozen=True)
class Bounds:
    low: Fraction | None
    low_strict: bool
    high: Fraction | None
    high_strict: bool
    integer: bool

    def contains(self, value: Fraction) -> bool:
        if self.low is not None and (value < self.low or (self.low_strict and value == self.low)):
            return False
        return not (
            self.high is not None
            and (value > self.high or (self.high_strict and value == self.high))
        )

    def can_reach(self, text: bytes) -> bool:
        """Whether some number that starts with `text` (sign, digits, point, digits) is within
        the bounds."""
        negative = text.startswith(b"-")
        whole, point, fraction = text[negative:].partition(b".")
        # the bounds on the magnitude m of a number of this sign (x = -m when negative)
        if negative:
            edges = (_neg(self.high), self.high_strict, _neg(self.low), self.low_strict)
        else:
            edges = (self.low, self.low_strict, self.high, self.high_strict)
        if not whole:  # any magnitude
            return self._meets(Fraction(0), None, *edges)
        start = Fraction(int(whole))
        if point or whole == b"0":  # m is in [start.fraction, that + 10^-digits)
            scale = Fraction(1, 10 ** len(fraction))
            first = start + int(fraction or b"0") * scale
            return self._meets(first, first + scale, *edges)
        high = edges[2]
        k = 0  # more integer digits: m in [start * 10^k, (start + 1) * 10^k) for some k
        while high is None or start * 10**k <= high:
            if self._meets(start * 10**k, (start + 1) * 10**k, *edges):
                return True
            k += 1
        return False

    def _meets(
        self,
        first: Fraction,
        end: Fraction | None,
        low: Fraction | None,
        low_strict: bool,
        high: Fraction | None,
        high_strict: bool,
    ) -> bool:
        """Whether [first, end) (end None: unbounded) holds a magnitude within [low, high]
        (each edge exclusive where strict): any decimal, or any integer for integer
        schemas."""
        if self.integer:
            least = math.ceil(first)
            if low is not None:
                least = max(least, math.floor(low) + 1 if low_strict else math.ceil(low))
            most = None if end is None else math.ceil(end) - 1
            if high is not None:
                ceiling = math.ceil(high) - 1 if high_strict else math.floor(high)
                most = ceiling if most is None else min(most, ceiling)
            return most is None or least <= most
        # decimals are dense: what matters is the lowest point above `low`, and whether it
        # is itself included
        lowest, closed = first, True
        if low is not None and low >= first:
            lowest, closed = low, not low_strict
        if end is not None and lowest >= end:
            return False
        return high is None or lowest < high or (lowest == high and closed and not high_strict)


def _neg(value: Fraction | None) -> Fraction | None:
    return None if value is None else -value


def bounds_of(schema: Any, integer: bool, path: str) -> Bounds | None:
    """The bounds a number schema sets (None if none). Accepts exclusive bounds as numbers
    (2019-09 and later) or as flags beside minimum / maximum (draft 4)."""
    values: dict[str, Fraction | bool] = {}
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        value = schema.get(key)
        if value is None:
            continue
        if isinstance(value, bool) and key.startswith("exclusive"):
            values[key] = value
            continue
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise SchemaError(f"{path}.{key}: must be a number")
        values[key] = Fraction(str(value))
    if not values:
        return None
    low, low_strict = _edge(values, "minimum", "exclusiveMinimum", lower=True)
    high, high_strict = _edge(values, "maximum", "exclusiveMaximum", lower=False)
    bounds = Bounds(low, low_strict, high, high_strict, integer)
    if not (bounds.can_reach(b"") or bounds.can_reach(b"-")):
        raise SchemaError(f"{path}: no number lies within its bounds")
    return bounds


def _edge(values: dict[str, Any], plain: str, exclusive: str, lower: bool) -> tuple[Any, bool]:
    """One edge and whether it is exclusive, from the inclusive and exclusive keywords."""
    bound, flag = values.get(plain), values.get(exclusive)
    if isinstance(flag, bool):  # draft 4: the flag makes minimum / maximum exclusive
        return bound, flag and bound is not None
    if flag is None or bound is None:
        return (bound, False) if flag is None else (flag, True)
    tighter = flag >= bound if lower else flag <= bound  # the exclusive one wins a tie
    return (flag, True) if tighter else (bound, False)
