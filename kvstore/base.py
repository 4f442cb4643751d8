"""Types shared by every KV tier: what a page holds, how big it is, whose it is, which tier
holds it, and the interface (`KVConnector`) through which the block manager reaches the tiers
below the device."""

from __future__ import annotations

import enum
import functools
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvstore.fp8 import FP8_DTYPE, SCALE_DTYPE, can_rotate


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one KV page: `block_size` tokens of K and V for every layer and KV head.

    `dtype` is the storage dtype of the values. With `float8_e4m3fn` every (token, KV head)
    row also carries one float32 scale (kvstore/fp8.py), counted in the sizes below.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        assert self.num_layers > 0
        assert self.num_kv_heads > 0
        assert self.head_dim > 0
        assert self.block_size > 0

    @property
    def quantized(self) -> bool:
        """Whether pages hold FP8 values with per-row scales."""
        return self.dtype == FP8_DTYPE

    @property
    def rotate_keys(self) -> bool:
        """Whether FP8 keys are stored Hadamard-rotated (kvstore/fp8.py)."""
        return self.quantized and can_rotate(self.head_dim)

    @functools.cached_property
    def bytes_per_token(self) -> int:
        """K and V for one token across all layers, scales included (computed once: a page
        load asks for it per page)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        row = self.head_dim * itemsize
        if self.quantized:
            row += torch.empty((), dtype=SCALE_DTYPE).element_size()
        return 2 * self.num_layers * self.num_kv_heads * row

    @functools.cached_property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


class PageOwners:
    """Which tenant each page of a tier belongs to, with a count per tenant."""

    def __init__(self) -> None:
        self.of: dict[bytes, str] = {}
        self.counts: dict[str, int] = {}

    def add(self, key: bytes, owner: str) -> None:
        self.of[key] = owner
        self.counts[owner] = self.counts.get(owner, 0) + 1

    def remove(self, key: bytes) -> None:
        owner = self.of.pop(key)
        self.counts[owner] -= 1
        if not self.counts[owner]:
            del self.counts[owner]

    def add_many(self, pages: Iterable[tuple[bytes, str]]) -> None:
        """`add` for each (key, owner)."""
        of, added = self.of, Counter[str]()
        for key, owner in pages:
            of[key] = owner
            added[owner] += 1
        for owner, n in added.items():
            self.counts[owner] = self.counts.get(owner, 0) + n

    def remove_many(self, keys: Iterable[bytes]) -> None:
        """`remove` for each key."""
        of, counts = self.of, self.counts
        for owner, n in Counter(of.pop(key) for key in keys).items():
            counts[owner] -= n
            if not counts[owner]:
                del counts[owner]

    def oldest(
        self, order: Collection[bytes], owner: str | None, keep: Collection[bytes]
    ) -> bytes | None:
        """The first key of `order` (least recently used first) that belongs to `owner`
        (any owner when None) and is not in `keep`."""
        return next(
            (k for k in order if k not in keep and (owner is None or self.of[k] == owner)), None
        )

    def check(self, keys: Collection[bytes]) -> None:
        assert set(self.of) == set(keys), "page owners disagree with the pages"
        assert sum(self.counts.values()) == len(self.of), "owner counts disagree"


class ResidencyMeter:
    """Byte-seconds of KV each tenant has held in each tier: what a bill for KV kept warm
    charges. Each sample's page counts are taken to hold until the next sample, so the
    figures are exact when samples come at least as often as the counts change, and off by
    at most a sampling interval's worth otherwise."""

    def __init__(self, bytes_per_page: int, now: float) -> None:
        self.bytes_per_page = bytes_per_page
        self.byte_seconds: dict[str, dict[str, float]] = {}  # tenant -> tier -> total
        self._pages: Mapping[str, Mapping[str, int]] = {}  # the last sample
        self._at = now

    def since_sample(self, now: float) -> float:
        return now - self._at

    def sample(self, pages: Mapping[str, Mapping[str, int]], now: float) -> None:
        """Charge the last sample's pages up to `now`; `pages` (tenant -> tier -> pages)
        hold from now on."""
        elapsed = now - self._at
        if elapsed > 0:
            for tenant, tiers in self._pages.items():
                totals = self.byte_seconds.setdefault(tenant, {})
                for tier, n in tiers.items():
                    if n:
                        totals[tier] = totals.get(tier, 0.0) + n * self.bytes_per_page * elapsed
        self._pages, self._at = pages, max(now, self._at)


class KVConnector(Protocol):
    """The tiers below the device, as the block manager sees them: look up a chain's pages
    below the device, read them ahead, load them into device blocks, save device blocks
    down (evicted or ahead of eviction), and wait for the copies. `request_id` keys the
    reads ahead a request holds until its load or `release`. Every tier, and every way of
    copying, sits behind these calls (kvstore/connector.py)."""

    @property
    def has_disk(self) -> bool: ...

    @property
    def has_remote(self) -> bool: ...

    def find(self, request_id: str, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the tiers (or the request's reads ahead) hold; changes
        nothing."""
        ...

    def read_ahead(
        self, request_id: str, keys: Sequence[bytes], rest: Sequence[bytes], owner: str
    ) -> bool:
        """Start, or check on, reading the request's pages of `keys` from disk and fetching
        those of `rest` from the remote tier; True once nothing is still being read."""
        ...

    def fetched(self, request_id: str) -> bool:
        """Whether pages fetched from the remote tier wait for the request."""
        ...

    def wait_reads(self, timeout: float) -> None:
        """Block until some read ahead finishes or `timeout` seconds pass."""
        ...

    def load(
        self, request_id: str, blocks: Sequence[int], keys: Sequence[bytes]
    ) -> tuple[list[Tier], int]:
        """Copy the pages of `keys` into device `blocks`, up to the first no tier holds, and
        release the request's reads ahead. Returns each loaded page's tier, and the ticket
        of the copies still in flight (0: none)."""
        ...

    def release(self, request_id: str) -> None:
        """Drop the request's reads ahead."""
        ...

    def holds(self, key: bytes) -> bool:
        """Whether a tier below the device holds the page (changes no LRU order)."""
        ...

    def save(
        self,
        pages: Sequence[tuple[int, bytes, str]],
        keep: Collection[bytes] = (),
        inline: bool = False,
    ) -> int:
        """Copy device blocks' pages ((block, key, owner) each) down a tier, never evicting
        `keep` for room. Returns the ticket of the copies still reading the blocks (0:
        none)."""
        ...

    def publish(self, blocks: Sequence[int], keys: Sequence[bytes], owner: str) -> None:
        """Newly full blocks: shared with the fleet where the tiers do that."""
        ...

    def loads_done(self, tickets: Collection[int]) -> bool:
        """Whether the copies of these tickets have finished; never waits."""
        ...

    def finish_loads(self) -> list[int]:
        """Wait for every copy; returns the blocks whose loads failed (they hold no KV)."""
        ...

    def check_integrity(self) -> None: ...
