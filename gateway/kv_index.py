"""Which worker holds which KV blocks, by tier, as the workers report them (engine/fleet.py
KVEvents): the gateway's view for routing a request to the worker that holds the longest
prefix of its block chain. Keys are the 64-bit block keys of engine/block_hash.py, salted
per tenant like the cache itself, so one tenant's request never matches another's blocks.

Blocks a worker reports in the remote tier (a store the fleet shares) are a hit on every
worker: any of them can fetch those pages.

Blocks a gateway has just sent a worker are noted as expected there (`expect`) until the
worker's own events catch up, so a document asked about twice in a row routes the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.fleet import TIERS, KVEvent

EXPECTED_S = 5.0  # how long a block sent to a worker counts as cached there unreported


@dataclass
class _WorkerBlocks:
    seq: int = 0
    tiers: dict[str, set[int]] = field(default_factory=lambda: {t: set() for t in TIERS})
    expected: dict[int, float] = field(default_factory=dict)  # key -> until (monotonic)


@dataclass(frozen=True)
class PrefixHit:
    """A worker's longest cached prefix of a chain, in blocks, by the tier each is in."""

    device: int = 0
    host: int = 0
    disk: int = 0
    remote: int = 0  # in the fleet's remote tier (saved by any worker)

    @property
    def blocks(self) -> int:
        return self.device + self.host + self.disk + self.remote


class KVIndex:
    """Block keys per worker and tier. Mutated only through `apply`, `load`, `expect` and
    `forget`; counts malformed or stray events in `num_dropped`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._workers: dict[str, _WorkerBlocks] = {}
        self._clock = clock
        self.num_dropped = 0
        self.num_gaps = 0

    def known(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def add_worker(self, worker_id: str) -> None:
        self._workers.setdefault(worker_id, _WorkerBlocks())

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def apply(self, event: KVEvent) -> bool:
        """Apply a delta of a known worker. False when the caller should reload the
        worker's snapshot (a sequence gap: events were missed); an event from a worker not
        in the fleet is dropped and counted."""
        blocks = self._workers.get(event.worker_id)
        if blocks is None:
            self.num_dropped += 1
            return True
        if event.seq <= blocks.seq:
            return True  # already seen (or older than the snapshot loaded)
        if event.seq != blocks.seq + 1:
            self.num_gaps += 1
            return False
        for tier, keys in event.removed.items():
            if tier in blocks.tiers:
                blocks.tiers[tier].difference_update(keys)
        for tier, keys in event.added.items():
            if tier in blocks.tiers:
                blocks.tiers[tier].update(keys)
                for key in keys:
                    blocks.expected.pop(key, None)
        blocks.seq = event.seq
        return True

    def load(self, snapshot: KVEvent) -> None:
        """Replace a worker's blocks with a snapshot of them."""
        blocks = self._workers.setdefault(snapshot.worker_id, _WorkerBlocks())
        blocks.tiers = {t: set(snapshot.added.get(t, ())) for t in TIERS}
        blocks.seq = snapshot.seq

    def expect(self, worker_id: str, keys: Sequence[int]) -> None:
        """Note `keys` as about to be cached on the worker's device (a request sent there)."""
        blocks = self._workers.get(worker_id)
        if blocks is not None:
            until = self._clock() + EXPECTED_S
            blocks.expected.update(dict.fromkeys(keys, until))

    def prefix(self, worker_id: str, keys: Sequence[int]) -> PrefixHit:
        """The worker's longest prefix of `keys`, each block counted in the fastest tier
        that holds it (expected blocks count as on the device; blocks any worker saved to
        the remote tier count as there)."""
        blocks = self._workers.get(worker_id)
        if blocks is None:
            return PrefixHit()
        device, host, disk = blocks.tiers["device"], blocks.tiers["host"], blocks.tiers["disk"]
        remote = [w.tiers["remote"] for w in self._workers.values() if w.tiers["remote"]]
        expected, now = blocks.expected, self._clock()
        counts = {"device": 0, "host": 0, "disk": 0, "remote": 0}
        for key in keys:
            if key in device or expected.get(key, 0.0) > now:
                counts["device"] += 1
            elif key in host:
                counts["host"] += 1
            elif key in disk:
                counts["disk"] += 1
            elif any(key in saved for saved in remote):
                counts["remote"] += 1
            else:
                break
        if len(expected) > 4 * len(device) + 1024:  # keep the notes bounded
            blocks.expected = {k: t for k, t in expected.items() if t > now}
        return PrefixHit(**counts)

    def num_blocks(self, worker_id: str) -> dict[str, int]:
        blocks = self._workers.get(worker_id)
        return {} if blocks is None else {t: len(keys) for t, keys in blocks.tiers.items()}
