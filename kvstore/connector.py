"""`TierConnector`: the tiers below the device behind the block manager's few calls
(kvstore/base.py `KVConnector`). It owns what a request holds below the device between its
lookup and its load: its read ahead from each tier that reads ahead (kvstore/base.py
`ReadAheadTier`), the fetched pages landed in host RAM, and the order in which requests
waiting for read-ahead room start. Moving pages is the offloader's (kvstore/tiers.py),
copying them the pool's page loads (kvstore/transfer.py). The design is in
docs/design/kv-pages-and-tiers.md.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.base import PageFetch, ReadAheadTier, Tier
from kvstore.tiers import KVOffloader

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """What one request holds below the device between its lookup and its load."""

    fetches: dict[Tier, PageFetch] = field(default_factory=dict)  # its read ahead, per tier
    landed: dict[bytes, Tier] = field(default_factory=dict)  # fetched, now in host rows


class TierConnector:
    """The tiers below one device pool, as a `KVConnector`.

    Invariants (`check_integrity`): the reads ahead alive in the tiers are exactly those
    requests hold; a request waiting for read-ahead room (`_next_read`) holds none from a
    tier indexed here."""

    def __init__(self, offloader: KVOffloader, *, publish_on_commit: bool = False) -> None:
        """`publish_on_commit`: every newly full block is also saved to the shared tier
        (written behind) when it is committed, not only when its page leaves host RAM."""
        self.offloader = offloader
        self.publish_on_commit = publish_on_commit
        self._held: dict[str, _Held] = {}  # request id -> what it holds
        self._next_read: str | None = None  # refused for room: starts before any other

    @property
    def has_disk(self) -> bool:
        return self.offloader.store.has(Tier.DISK)

    @property
    def has_remote(self) -> bool:
        return self.offloader.store.has(Tier.REMOTE)

    def find(self, request_id: str, keys: Sequence[bytes]) -> int:
        held = self._held.get(request_id)
        if held is None:
            return self.offloader.find(keys)
        return self.offloader.find(keys, *held.fetches.values())

    def read_ahead(
        self, request_id: str, keys: Sequence[bytes], rest: Sequence[bytes], owner: str
    ) -> bool:
        """Each tier that reads ahead reads its part: a tier indexed here, the pages of
        `keys` it holds; the shared tier, those of `rest`, which land in host RAM, for
        `owner`, where it takes them. The farthest tier goes first: what it lands is then
        not read from a nearer one."""
        held = self._held.get(request_id) or _Held()
        done = True
        for reader in reversed(self.offloader.store.readers.values()):
            chain = rest if reader.shared else keys
            done = self._read_ahead(request_id, held, reader, chain, owner) and done
        if held.fetches:
            self._held[request_id] = held
        return done

    def _read_ahead(
        self,
        request_id: str,
        held: _Held,
        reader: ReadAheadTier[Any],
        chain: Sequence[bytes],
        owner: str,
    ) -> bool:
        """Start, or check on, the request's read ahead from `reader`; True once none is
        still being read. A tier indexed here that refuses for room has the request start
        first once there is room, no other before it; the shared tier's refusal (the store
        is down, or its fetches hold their budget) is a miss: a recompute, never a stall."""
        fetch = held.fetches.get(reader.tier)
        if fetch is None:
            todo = self.offloader.to_fetch(reader, chain)
            if not todo:
                return True
            if not reader.shared and self._next_read not in (None, request_id):
                return False  # an earlier request waits for room first
            fetch = reader.fetch(todo)
            if fetch is None:
                if reader.shared:
                    return True
                self._next_read = request_id
                return False
            if not reader.shared:
                self._next_read = None
            held.fetches[reader.tier] = fetch
        if fetch.settled:
            return True
        if not reader.settle(fetch):
            return False
        if reader.shared:
            held.landed.update(dict.fromkeys(self.offloader.land(fetch, owner), fetch.tier))
        return True

    def fetched(self, request_id: str) -> bool:
        held = self._held.get(request_id)
        readers = self.offloader.store.readers
        return held is not None and any(
            f.good for tier, f in held.fetches.items() if readers[tier].shared
        )

    def wait_reads(self, timeout: float) -> None:
        self.offloader.wait_reads(timeout)

    def load(
        self, request_id: str, blocks: Sequence[int], keys: Sequence[bytes]
    ) -> tuple[list[Tier], int]:
        loads = self.offloader.pool.loads
        started = loads.num_started
        held = self._held.get(request_id)
        if held is None:
            tiers = self.offloader.load(blocks, keys)
        else:
            tiers = self.offloader.load(blocks, keys, *held.fetches.values(), landed=held.landed)
        self.release(request_id)
        return tiers, loads.num_started if loads.num_started > started else 0

    def release(self, request_id: str) -> None:
        if self._next_read == request_id:
            self._next_read = None
        held = self._held.pop(request_id, None)
        if held is not None:
            for fetch in held.fetches.values():
                self.offloader.release(fetch)

    def holds(self, key: bytes) -> bool:
        return self.offloader.store.tier_of(key) is not None

    def save(
        self,
        pages: Sequence[tuple[int, bytes, str]],
        keep: Collection[bytes] = (),
        inline: bool = False,
    ) -> int:
        return self.offloader.spill(pages, keep, inline=inline)

    def publish(self, blocks: Sequence[int], keys: Sequence[bytes], owner: str) -> None:
        if self.publish_on_commit and blocks:
            self.offloader.publish(blocks, keys, owner)

    def loads_done(self, tickets: Collection[int]) -> bool:
        return self.offloader.pool.loads.done(tickets)

    def finish_loads(self) -> list[int]:
        loads = self.offloader.pool.loads
        try:
            loads.finish()
        except Exception:
            log.exception("a KV page load failed")
        return loads.take_failed()

    def check_integrity(self) -> None:
        readers = self.offloader.store.readers
        waiting = None if self._next_read is None else self._held.get(self._next_read)
        assert waiting is None or all(readers[t].shared for t in waiting.fetches), (
            "a request waiting for read-ahead room holds a read"
        )
        self.offloader.check_integrity([f for h in self._held.values() for f in h.fetches.values()])
