"""The remote tier: KV pages in a Redis-protocol store (Valkey) shared by a fleet, so a
document's KV computed on one worker is a hit on another.

Pages are stored under their prefix-cache hash, each value a header (kvstore/disk_page.py:
model, cache namespace, KV dtype, layout, payload CRC-32) followed by the page's bytes: a
value written for another model or layout, or torn, is a miss and is counted. Saves are
written behind by one thread from a bounded queue (dropped and counted when it is full or
the store is down); fetches run on reader threads, one pipelined MGET per request's chain,
and are bounded in time: a slow or absent store costs a recompute, never a stall. Per
tenant, a Lua script keeps a byte count and a time-ordered set of the pages the tenant
saved, and at its quota evicts the tenant's own oldest pages. The tier's bookkeeping
changes on the caller's thread only. The tier is a shared `ReadAheadTier` (kvstore/base.py).
The design is in docs/design/kv-pages-and-tiers.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import redis
import torch

from kvstore.base import PageOwners, Tier, holds_in_lru
from kvstore.disk_page import HEADER_NBYTES, HeaderError, PageFormat, pack_header, unpack_header

log = logging.getLogger(__name__)

KEY_PREFIX = b"strata:kvp:"  # then the block hash
TENANT_PREFIX = "strata:kvq:"  # then the tenant: its pages (zset), bytes, page sizes (hash)
FETCH_BYTES = 256 << 20  # pages fetched and held for waiting requests, at most
_MGET_PAGES = 16  # keys per MGET of a fetch's pipeline
_SAVE_BATCH = 32  # saves sent in one pipeline
_RETRY_S = 1.0  # after a store error, saves are dropped and fetches skipped this long
_READ_THREADS = 2
_KNOWN_PAGES = 1 << 18  # keys remembered as saved (not sent again, counted as held)

# KEYS: page, tenant's pages (zset by time), tenant's bytes, tenant's page sizes (hash)
# ARGV: value, score (time), page bytes, quota in bytes (-1: none)
# Returns the keys evicted to stay within the quota (the tenant's own oldest pages), or
# false when the page alone exceeds the quota.
_SAVE_LUA = """
local size = tonumber(ARGV[3])
local quota = tonumber(ARGV[4])
if quota >= 0 and size > quota then return false end
local old = tonumber(redis.call('HGET', KEYS[4], KEYS[1]) or '0')
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], KEYS[1])
redis.call('HSET', KEYS[4], KEYS[1], size)
local total = redis.call('INCRBY', KEYS[3], size - old)
local evicted = {}
while quota >= 0 and total > quota do
  local victim = redis.call('ZPOPMIN', KEYS[2])
  if #victim == 0 then break end
  local vsize = tonumber(redis.call('HGET', KEYS[4], victim[1]) or '0')
  redis.call('HDEL', KEYS[4], victim[1])
  redis.call('DEL', victim[1])
  total = redis.call('DECRBY', KEYS[3], vsize)
  evicted[#evicted + 1] = victim[1]
end
return evicted
"""


def store_id(url: str) -> str:
    """A short digest naming the store at `url` (its credentials left out): workers that
    report the same id share one remote tier (docs/design/disaggregation.md)."""
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc += f":{parts.port}"
    path = parts.path.rstrip("/") or "/0"  # database 0 when none is named
    plain = urlunsplit((parts.scheme, netloc, path, parts.query, ""))
    return hashlib.sha256(plain.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RemoteConfig:
    """How a worker reaches its remote tier: a Redis-protocol `url`, the bound on one
    fetch (and on each store call) in seconds, and the saves that may wait to be sent."""

    url: str
    timeout_s: float = 1.0
    max_queued_pages: int = 256


class RemoteFetch:
    """Pages of one request fetched from the remote tier: page i of `keys` lands in row i
    of one buffer. Once settled, `good` holds the keys of the leading pages that arrived
    and passed their checks (a missing or failing page ends the prefix).

    Built by `RemoteKVTier.fetch`; `RemoteKVTier.settle` finishes it."""

    tier = Tier.REMOTE

    def __init__(self, keys: list[bytes], page_nbytes: int, deadline: float) -> None:
        self.keys = keys
        self.page_nbytes = page_nbytes
        self.deadline = deadline  # monotonic: past it, the fetch is a miss
        self.buffer = bytearray(len(keys) * page_nbytes)
        self.rows = {k: i for i, k in enumerate(keys)}
        self.good: set[bytes] = set()
        # (pages good, pages rejected, None or why the store did not answer: "timeout", "error")
        self.future: Future[tuple[int, int, str | None]] | None = None
        self.settled = False

    @property
    def nbytes(self) -> int:
        return len(self.buffer)

    def page(self, key: bytes) -> torch.Tensor | None:
        """The page fetched for `key` (a view of the buffer), or None."""
        if key not in self.good:
            return None
        return torch.frombuffer(
            self.buffer,
            dtype=torch.uint8,
            count=self.page_nbytes,
            offset=self.rows[key] * self.page_nbytes,
        )


class RemoteKVTier:
    """Pages of `page_nbytes` bytes written as `page_format` in the store at `config.url`.

    `save` queues a page (write-behind); `fetch` starts reading a chain's pages and
    `settle` takes the result (never waiting past the fetch's deadline). Counters:
    `num_saved`, `num_save_dropped` (queue full, store down or failing),
    `num_rejected` (values with a wrong header or checksum: misses), `num_load_timeouts`,
    `num_quota_evicted` (this worker's saves that pushed out their tenant's own pages).
    `owners` holds the pages this worker saved that it knows to be there, per tenant."""

    tier = Tier.REMOTE
    shared = True

    def __init__(self, config: RemoteConfig, page_format: PageFormat, page_nbytes: int) -> None:
        self.config = config
        self.page_format = page_format
        self.page_nbytes = page_nbytes
        t = config.timeout_s
        self.client = redis.Redis.from_url(
            config.url, socket_timeout=t, socket_connect_timeout=t, health_check_interval=0
        )
        self._script = self.client.register_script(_SAVE_LUA)
        self.quotas: dict[str, int] = {}  # tenant -> bytes
        self.owners = PageOwners()
        self._known: OrderedDict[bytes, None] = OrderedDict()  # saved or queued
        self._queued: dict[bytes, int] = {}  # saves queued per key, outcome not taken in
        self._num_pending = 0  # queued saves whose results are not yet taken in
        self._queue: queue.Queue[tuple[bytes, bytes, str, int] | None] = queue.Queue(
            config.max_queued_pages
        )
        # (key, owner, saved, evicted keys): results of the writer, taken in by `reap`
        self._results: deque[tuple[bytes, str, bool, list[bytes]]] = deque()
        self._down_until = 0.0  # monotonic; written by any thread
        self._fetches: list[RemoteFetch] = []  # not yet released
        self._readers = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="strata-kv-remote")
        self._writer = threading.Thread(target=self._drain, name="strata-kv-remote-w", daemon=True)
        self.num_saved = 0
        self.num_save_dropped = 0
        self.num_rejected = 0
        self.num_load_timeouts = 0
        self.num_quota_evicted = 0
        self._writer.start()

    # -- saves ----------------------------------------------------------------------------

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def _mark_down(self, exc: Exception) -> None:
        if not self.down:
            log.warning("KV remote tier unreachable (%s); retrying in %.0f s", exc, _RETRY_S)
        self._down_until = time.monotonic() + _RETRY_S

    def set_quota(self, owner: str, num_bytes: int | None) -> None:
        """At most `num_bytes` of `owner`'s pages in the store (None: no quota)."""
        if num_bytes is None:
            self.quotas.pop(owner, None)
        else:
            self.quotas[owner] = num_bytes

    def knows(self, key: bytes) -> bool:
        return key in self._known

    def holds(self, key: bytes, *, touch: bool = False) -> bool:
        """Whether `key`'s page was saved or fetched here, or a save of it is queued (it is
        not sent again)."""
        return holds_in_lru(self._known, key, touch)

    def write(
        self, key: bytes, page: torch.Tensor, owner: str = "", limit: int | None = None
    ) -> bool:
        """`save`: the store bounds a tenant by bytes (`set_quota`), never by a count of
        pages, so `limit` is None."""
        assert limit is None, "the remote tier bounds tenants by bytes"
        return self.save(key, page, owner)

    def stored(self, key: bytes) -> bool:
        """Whether `key`'s page is in the store as far as this worker knows: saved (the
        store answered) or fetched, and not queued to be saved again."""
        self.reap()
        return key in self._known and key not in self._queued

    def queued(self, key: bytes) -> bool:
        """Whether a save of `key` is queued whose outcome is not yet known."""
        self.reap()
        return key in self._queued

    def save(self, key: bytes, page: torch.Tensor, owner: str = "") -> bool:
        """Queue `page` (copied now) to be stored under `key` for `owner`; False when it is
        dropped (counted): the queue is full or the store is down. A page saved or fetched
        before is not sent again."""
        self.reap()
        if key in self._known:
            self._known.move_to_end(key)
            return True
        if self.down:
            self.num_save_dropped += 1
            return False
        payload = page.detach().to("cpu").contiguous().numpy().tobytes()
        try:
            self._queue.put_nowait((key, payload, owner, self.quotas.get(owner, -1)))
        except queue.Full:
            self.num_save_dropped += 1
            return False
        self._num_pending += 1
        self._queued[key] = self._queued.get(key, 0) + 1
        self._remember(key)
        return True

    def _remember(self, key: bytes) -> None:
        self._known[key] = None
        if len(self._known) > _KNOWN_PAGES:
            oldest, _ = self._known.popitem(last=False)
            if oldest in self.owners.of:  # no longer followed: not counted as held
                self.owners.remove(oldest)

    def _drain(self) -> None:
        """Writer thread: send queued saves in pipelines of up to _SAVE_BATCH."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < _SAVE_BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._send(batch)
                    return
                batch.append(more)
            self._send(batch)

    def _send(self, batch: list[tuple[bytes, bytes, str, int]]) -> None:
        if self.down:
            self._results.extend((key, owner, False, []) for key, _, owner, _ in batch)
            return
        pipe = self.client.pipeline(transaction=False)
        now = time.time()
        for key, payload, owner, quota in batch:
            header = pack_header(
                self.page_format, key, owner, len(payload), zlib.crc32(payload), time.time_ns()
            )
            tenant = TENANT_PREFIX + (owner or "_")
            self._script(
                keys=[KEY_PREFIX + key, tenant + ":pages", tenant + ":bytes", tenant + ":sizes"],
                args=[header + payload, now, len(payload), quota],
                client=pipe,
            )
        try:
            replies = pipe.execute(raise_on_error=False)
        except (redis.RedisError, OSError) as exc:
            self._mark_down(exc)
            replies = [exc] * len(batch)
        for (key, _, owner, _), reply in zip(batch, replies, strict=True):
            saved = not isinstance(reply, Exception) and reply is not None
            evicted = [bytes(v) for v in reply] if isinstance(reply, list) else []
            self._results.append((key, owner, saved, evicted))

    def reap(self) -> None:
        """Take in what the writer has done: pages saved join `owners`, pages evicted for a
        quota leave it, saves that failed are counted as dropped."""
        results = self._results
        while results:
            key, owner, saved, evicted = results.popleft()
            self._num_pending -= 1
            left = self._queued.pop(key, 1) - 1
            if left:
                self._queued[key] = left
            if not saved:
                self.num_save_dropped += 1
                self._known.pop(key, None)
                continue
            self.num_saved += 1
            if key not in self.owners.of and key in self._known:
                self.owners.add(key, owner)
            self.num_quota_evicted += len(evicted)
            for victim in evicted:
                self._forget(victim.removeprefix(KEY_PREFIX))

    def _forget(self, key: bytes) -> None:
        """`key` is not (or no longer) in the store, as far as this worker knows."""
        self._known.pop(key, None)
        if key in self.owners.of:
            self.owners.remove(key)

    @property
    def num_pending(self) -> int:
        """Saves queued whose outcome is not yet known."""
        self.reap()
        return self._num_pending

    @property
    def idle(self) -> bool:
        """Whether every save queued so far has been sent (or dropped)."""
        return self.num_pending == 0

    # -- fetches --------------------------------------------------------------------------

    @property
    def num_fetch_bytes(self) -> int:
        """Bytes of the fetches that hold pages, or may: a settled fetch that holds none
        takes nothing from the budget."""
        return sum(f.nbytes for f in self._fetches if not f.settled or f.good)

    @property
    def open_fetches(self) -> list[RemoteFetch]:
        """Fetches not yet released."""
        return list(self._fetches)

    def fetch(self, keys: Sequence[bytes]) -> RemoteFetch | None:
        """Start fetching the pages of `keys` (a chain, in order) on a reader thread. None
        when it cannot start: nothing to fetch, the store is down, or the fetches held
        would exceed FETCH_BYTES (the chain is cut to fit that alone)."""
        room = FETCH_BYTES - self.num_fetch_bytes
        keys = list(keys[: max(0, room // self.page_nbytes)])
        if not keys or self.down:
            return None
        fetch = RemoteFetch(keys, self.page_nbytes, time.monotonic() + self.config.timeout_s)
        fetch.future = self._readers.submit(self._read, fetch)
        self._fetches.append(fetch)
        return fetch

    def _read(self, fetch: RemoteFetch) -> tuple[int, int, str | None]:
        """Reader thread: one pipeline of MGETs; the leading pages that are there and pass
        their checks land in the fetch's buffer. Returns (pages good, pages rejected, None
        or why the store did not answer)."""
        pipe = self.client.pipeline(transaction=False)
        keys = fetch.keys
        for i in range(0, len(keys), _MGET_PAGES):
            pipe.mget([KEY_PREFIX + k for k in keys[i : i + _MGET_PAGES]])
        try:
            values = [v for reply in pipe.execute() for v in reply]
        except (redis.RedisError, OSError) as exc:
            self._mark_down(exc)
            timed_out = isinstance(exc, (redis.TimeoutError, TimeoutError))
            return 0, 0, "timeout" if timed_out else "error"
        n, size = 0, self.page_nbytes
        for key, value in zip(keys, values, strict=True):
            if value is None:
                return n, 0, None
            if not self._intact(key, value):
                return n, 1, None
            fetch.buffer[n * size : (n + 1) * size] = memoryview(value)[HEADER_NBYTES:]
            n += 1
        return n, 0, None

    def _intact(self, key: bytes, value: bytes) -> bool:
        """Whether `value` is a whole page for `key`, written in this worker's format."""
        if len(value) != HEADER_NBYTES + self.page_nbytes:
            return False
        try:
            header = unpack_header(value[:HEADER_NBYTES], self.page_format, self.page_nbytes)
        except HeaderError:
            return False
        return header.key == key and zlib.crc32(memoryview(value)[HEADER_NBYTES:]) == (
            header.payload_crc
        )

    def settle(self, fetch: RemoteFetch) -> bool:
        """True once `fetch` is finished: its pages arrived, or its deadline passed (then it
        holds none, and is counted as a timeout). Never waits."""
        if fetch.settled:
            return True
        assert fetch.future is not None
        if not fetch.future.done():
            if time.monotonic() < fetch.deadline:
                return False
            self.num_load_timeouts += 1
            self._mark_down(TimeoutError(f"a fetch took over {self.config.timeout_s} s"))
        else:
            num_good, num_rejected, failure = fetch.future.result()
            self.num_load_timeouts += failure == "timeout"
            self.num_rejected += num_rejected
            if num_rejected:
                log.warning("KV remote tier: a page failed its checks; treating it as a miss")
            fetch.good.update(fetch.keys[:num_good])
            for key in fetch.keys[:num_good]:
                self._remember(key)
            if failure is None:  # the store has not the rest (its LRU, a quota): when
                for key in fetch.keys[num_good:]:  # computed again here, they are saved again
                    self._forget(key)
        fetch.settled = True
        return True

    def release(self, fetch: RemoteFetch) -> None:
        """Done with `fetch`: its buffer goes (once its read has finished)."""
        fetch.good.clear()
        fetch.settled = True
        self._fetches = [f for f in self._fetches if f is not fetch]

    @property
    def fetching(self) -> bool:
        """Whether a fetch is still running."""
        return any(f.future is not None and not f.future.done() for f in self._fetches)

    def wait_reads(self, timeout: float) -> None:
        """Block until some fetch finishes or `timeout` seconds pass."""
        running = [f.future for f in self._fetches if f.future is not None and not f.settled]
        if running:
            wait(running, timeout, return_when=FIRST_COMPLETED)

    def pages_by_owner(self) -> dict[str, int]:
        self.reap()
        return dict(self.owners.counts)

    def check_integrity(self) -> None:
        self.reap()
        owners = self.owners
        assert sum(owners.counts.values()) == len(owners.of), "owner counts disagree"
        assert sum(self._queued.values()) == self._num_pending, "queued saves leak"
        assert self.num_fetch_bytes <= FETCH_BYTES, "fetches exceed their budget"

    def close(self) -> None:
        """Send the saves still queued (each bounded by the timeout), then let go."""
        with contextlib.suppress(queue.Full):  # else the writer is stuck: a daemon thread
            self._queue.put(None, timeout=self.config.timeout_s)
        self._writer.join(timeout=max(1.0, 4 * self.config.timeout_s))
        self._readers.shutdown(wait=False, cancel_futures=True)
        self.client.close()
