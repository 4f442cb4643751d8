"""Types shared by every KV tier: what a page holds, how big it is, whose it is, which tier
holds it, the interface every tier below the device implements (`KVTier`, and `ReadAheadTier`
for those read into memory ahead of a load), and the one (`KVConnector`) through which the
block manager reaches them."""

from __future__ import annotations

import enum
import functools
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

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


def holds_in_lru(order: OrderedDict[bytes, Any], key: bytes, touch: bool) -> bool:
    """`KVTier.holds` over a tier's LRU index (an OrderedDict, least recently used first):
    whether `key` is in it, and with `touch` moved to its most recent end."""
    if key not in order:
        return False
    if touch:
        order.move_to_end(key)
    return True


class PageFetch(Protocol):
    """Pages of one request read ahead from a tier into memory: `keys`, in chain order, each
    read into its own row. Once `settled` (the tier's `settle`), `good` holds the keys whose
    pages arrived and passed their checks, and `page(key)` gives each of those (a view of
    the fetch's buffer; None for any other key)."""

    @property
    def tier(self) -> Tier:
        """The tier the pages are read from."""
        ...

    @property
    def keys(self) -> Sequence[bytes]: ...

    @property
    def good(self) -> Collection[bytes]: ...

    @property
    def settled(self) -> bool: ...

    def page(self, key: bytes) -> torch.Tensor | None: ...


class KVTier(Protocol):
    """One tier below the device pool (kvstore/host.py, disk.py, remote.py): pages under
    their prefix-cache hash, each with the tenant it belongs to. Where pages move between
    tiers is the tiers' policy (kvstore/tiers.py), not a tier's.

    `shared`: a store the fleet shares. What it holds is known by reading it, not from an
    index here, so it is never looked up page by page: its pages are written behind, read
    ahead past what this worker's tiers hold, and land in host RAM."""

    @property
    def tier(self) -> Tier: ...

    @property
    def shared(self) -> bool: ...

    def holds(self, key: bytes, *, touch: bool = False) -> bool:
        """Whether the tier holds `key`'s page (the shared tier: as far as this worker
        knows); `touch` also marks it recently used here."""
        ...

    def write(
        self, key: bytes, page: torch.Tensor, owner: str = "", limit: int | None = None
    ) -> bool:
        """Keep a copy of `page` (taken now) under `key` for `owner`, who may keep at most
        `limit` pages here (None: no limit of its own). False when the page is not kept.
        A page held already is only marked recently used."""
        ...

    def pages_by_owner(self) -> dict[str, int]:
        """Pages each owner holds here."""
        ...

    def check_integrity(self) -> None:
        """Assert the tier's invariants (its index, owners and budgets agree)."""
        ...

    def close(self) -> None:
        """Let go of what the tier holds (files, connections, threads); nothing is called
        on it afterwards."""
        ...


FetchT = TypeVar("FetchT", bound=PageFetch)


class ReadAheadTier(KVTier, Protocol[FetchT]):
    """A tier whose pages are read into memory ahead of their load, on threads of its own
    (the disk tier's file, the remote tier's store): a load then copies them from memory,
    never waiting on the tier. Host RAM is read in place and has nothing to read ahead, so
    this is a capability of some tiers, not a call every tier answers.

    Every fetch started is `release`d once its request is done with it."""

    def fetch(self, keys: Sequence[bytes]) -> FetchT | None:
        """Start reading the pages of `keys` (a chain, in order; a tier indexed here reads
        those of them it holds). None when it cannot start now: nothing to read, or the
        reads alive take the tier's read-ahead budget (the shared tier: also when the store
        is down)."""
        ...

    def settle(self, fetch: FetchT) -> bool:
        """True once no page of `fetch` is still being read, or the shared tier's bound on a
        fetch has passed (never waits); its `good` pages are then known. Pages that failed
        are misses."""
        ...

    def release(self, fetch: FetchT) -> None:
        """Done with `fetch`: its buffer goes once its reads have finished."""
        ...

    @property
    def fetching(self) -> bool:
        """Whether a read ahead is still in flight."""
        ...

    def wait_reads(self, timeout: float) -> None:
        """Block until some read ahead finishes or `timeout` seconds pass (at once when
        none is in flight)."""
        ...

    @property
    def open_fetches(self) -> list[FetchT]:
        """The reads ahead not yet released."""
        ...


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
