"""`TierConnector`: the tiers below the device behind the block manager's few calls
(kvstore/base.py `KVConnector`). It owns what a request holds below the device between its
lookup and its load: the pages read ahead from disk, those fetched from the remote tier, and
the order in which requests waiting for read-ahead room start. Moving pages is the
offloader's (kvstore/tiers.py), copying them the pool's page loads (kvstore/transfer.py).
The design is in docs/design/kv-pages-and-tiers.md.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from kvstore.base import Tier
from kvstore.disk import DiskPrefetch
from kvstore.remote import RemoteFetch
from kvstore.tiers import KVOffloader

log = logging.getLogger(__name__)


class TierConnector:
    """The host, disk and remote tiers of one device pool, as a `KVConnector`.

    Invariants (`check_integrity`): the disk reads ahead alive are exactly those requests
    hold; a request waiting for read-ahead room (`_next_read`) holds none."""

    def __init__(self, offloader: KVOffloader, *, publish_on_commit: bool = False) -> None:
        """`publish_on_commit`: every newly full block is also saved to the remote tier
        (written behind) when it is committed, not only when its page leaves host RAM."""
        self.offloader = offloader
        self.publish_on_commit = publish_on_commit
        self._reads: dict[str, DiskPrefetch] = {}  # request id -> its disk reads ahead
        self._fetches: dict[str, RemoteFetch] = {}  # request id -> its remote fetch
        self._next_read: str | None = None  # refused for room: starts before any other

    @property
    def has_disk(self) -> bool:
        return self.offloader.store.disk is not None

    @property
    def has_remote(self) -> bool:
        return self.offloader.store.remote is not None

    def find(self, request_id: str, keys: Sequence[bytes]) -> int:
        return self.offloader.find(keys, self._reads.get(request_id), self._fetches.get(request_id))

    def read_ahead(
        self, request_id: str, keys: Sequence[bytes], rest: Sequence[bytes], owner: str
    ) -> bool:
        """Pages fetched land in host RAM, for `owner`, where it takes them. A request
        refused for lack of read-ahead room starts first once there is room: no other starts
        before it."""
        fetched = self._fetch_remote(request_id, rest, owner)
        return self._read_disk(request_id, keys) and fetched

    def _fetch_remote(self, request_id: str, rest: Sequence[bytes], owner: str) -> bool:
        remote = self.offloader.store.remote
        if remote is None:
            return True
        fetch = self._fetches.get(request_id)
        if fetch is None:
            if not rest:
                return True
            fetch = remote.fetch(rest)
            if fetch is None:  # the store is down, or fetches hold their budget: a miss
                return True
            self._fetches[request_id] = fetch
        if fetch.settled:
            return True
        if not remote.settle(fetch):
            return False
        self.offloader.land(fetch, owner)
        return True

    def _read_disk(self, request_id: str, keys: Sequence[bytes]) -> bool:
        read = self._reads.get(request_id)
        if read is None:
            if not self.offloader.on_disk(keys):
                return True
            if self._next_read not in (None, request_id):
                return False  # an earlier request waits for room first
            read = self.offloader.prefetch(keys)
            if read is None:  # other requests' reads hold the read-ahead budget
                self._next_read = request_id
                return False
            self._next_read = None
            self._reads[request_id] = read
        return self.offloader.settle(read)

    def fetched(self, request_id: str) -> bool:
        fetch = self._fetches.get(request_id)
        return fetch is not None and bool(fetch.good)

    def wait_reads(self, timeout: float) -> None:
        self.offloader.wait_reads(timeout)

    def load(
        self, request_id: str, blocks: Sequence[int], keys: Sequence[bytes]
    ) -> tuple[list[Tier], int]:
        loads = self.offloader.pool.loads
        started = loads.num_started
        tiers = self.offloader.load(
            blocks, keys, self._reads.get(request_id), self._fetches.get(request_id)
        )
        self.release(request_id)
        return tiers, loads.num_started if loads.num_started > started else 0

    def release(self, request_id: str) -> None:
        if self._next_read == request_id:
            self._next_read = None
        fetch = self._fetches.pop(request_id, None)
        if fetch is not None:
            assert self.offloader.store.remote is not None
            self.offloader.store.remote.release(fetch)
        read = self._reads.pop(request_id, None)
        if read is not None:
            self.offloader.release(read)

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
            self.offloader.save_remote(blocks, keys, owner)

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
        assert self._next_read is None or self._next_read not in self._reads
        self.offloader.check_integrity(self._reads.values())
