"""The usage ledger: one idempotent record per request id, indexed by finish time per tenant
and overall (`Ledger`), and `LedgerWriter`, the gateway's fire-and-forget path in front of
it, backed by a local `LedgerJournal`. Layout and guarantees are in
docs/design/admission-and-ledger.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import random
from collections.abc import AsyncIterator, Sequence
from typing import cast

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tenants.journal import LedgerJournal
from tenants.records import UsageRecord
from tenants.store import KEY_PREFIX, cancel_and_wait

log = logging.getLogger(__name__)

_REC_PREFIX = f"{KEY_PREFIX}u:rec:"
_GLOBAL_INDEX = f"{KEY_PREFIX}u:idx"

# KEYS: record, tenant index, global index; ARGV: encoded record, score, request id
_RECORD_SCRIPT = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX') then
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
  redis.call('ZADD', KEYS[3], ARGV[2], ARGV[3])
  return 1
end
return 0
"""


class LedgerError(ValueError):
    """A usage record the ledger cannot store (empty ids, non-finite finish time)."""


def record_key(request_id: str) -> str:
    return f"{_REC_PREFIX}{request_id}"


def index_key(tenant_id: str | None) -> str:
    """The tenant's index, or the global one for `None`."""
    return _GLOBAL_INDEX if tenant_id is None else f"{_GLOBAL_INDEX}:{tenant_id}"


def check_record(rec: UsageRecord) -> None:
    """Raise LedgerError if `rec` could never be written (a caller bug, not an outage)."""
    if not rec.request_id:
        raise LedgerError("request_id must not be empty")
    if not rec.tenant_id:
        raise LedgerError("tenant_id must not be empty")
    if not math.isfinite(rec.finished_at):
        raise LedgerError("finished_at must be a finite unix time")


def _score(value: float) -> str:
    # repr round-trips a double exactly; Redis accepts inf/-inf spelled this way
    return repr(float(value))


class Ledger:
    """Usage records in the store. Holds no state besides the client; safe to share."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self._script = redis.register_script(_RECORD_SCRIPT)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(UsageRecord)

    def _script_args(self, rec: UsageRecord) -> tuple[list[str], list[bytes | str]]:
        check_record(rec)
        keys = [record_key(rec.request_id), index_key(rec.tenant_id), index_key(None)]
        return keys, [self._encoder.encode(rec), _score(rec.finished_at), rec.request_id]

    async def record(self, rec: UsageRecord) -> bool:
        """Store `rec` and index it, unless its request id is already stored.

        Mutates the record key and both indexes atomically. Returns False (and changes
        nothing) when the request id already exists: the first write wins. Raises
        LedgerError for an unstorable record and RedisError/OSError when the store fails.
        """
        keys, args = self._script_args(rec)
        return bool(await self._script(keys=keys, args=args))

    async def record_many(self, recs: Sequence[UsageRecord]) -> list[bool]:
        """`record` for each of `recs` in one pipelined round trip (not one transaction:
        each record is atomic on its own). Returns, in order, whether each was new."""
        if not recs:
            return []
        calls = [self._script_args(rec) for rec in recs]
        async with self.redis.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                await self._script(keys=keys, args=args, client=pipe)
            results = await pipe.execute()
        return [bool(r) for r in results]

    async def get(self, request_id: str) -> UsageRecord | None:
        blob = await self.redis.get(record_key(request_id))
        return None if blob is None else self._decoder.decode(cast(bytes, blob))

    async def count(self, tenant_id: str | None, start: float, end: float) -> int:
        """Records with start <= finished_at < end (every tenant for `tenant_id=None`)."""
        return int(await self.redis.zcount(index_key(tenant_id), _score(start), f"({_score(end)}"))

    async def iter_records(
        self, tenant_id: str | None, start: float, end: float, *, batch: int = 500
    ) -> AsyncIterator[UsageRecord]:
        """Records with start <= finished_at < end, in (finished_at, request_id) order.

        Reads `batch` index entries and their records per round trip; pages continue from
        the last score seen (keyset pagination), so a page costs O(log N + batch) however
        deep into the range it is. Records finishing inside the range while it is being
        read may or may not be included.
        """
        if batch < 1:
            raise ValueError("batch must be positive")
        key = index_key(tenant_id)
        upper = f"({_score(end)}"
        lower, skip = float(start), 0
        while True:
            page = cast(
                list[tuple[bytes, float]],
                await self.redis.zrangebyscore(
                    key, _score(lower), upper, start=skip, num=batch, withscores=True
                ),
            )
            if not page:
                return
            blobs = await self.redis.mget([record_key(m.decode()) for m, _ in page])
            for blob in blobs:
                if blob is not None:
                    yield self._decoder.decode(cast(bytes, blob))
            if len(page) < batch:
                return
            last = page[-1][1]
            num_at_last = 0
            for _, score in reversed(page):
                if score != last:
                    break
                num_at_last += 1
            if last == lower:
                skip += num_at_last
            else:
                lower, skip = last, num_at_last


class LedgerWriter:
    """Writes usage records in the background so the request path never waits on the store.

    `submit` appends the record to the journal (when there is one) and to an in-memory
    queue. A background task (`start`) writes queued records in pipelined batches, oldest
    first, syncing the journal to disk before each batch; a record leaves the queue, and the
    journal, only once the store has acknowledged it. While the store is unreachable the
    task retries with exponential backoff and keeps every record, logging a warning with the
    pending count. A batch whose outcome was ambiguous is simply written again, as are the
    records a restart replays from the journal: `Ledger.record` is idempotent by request id.
    Use from the event loop's thread only.
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        journal: LedgerJournal | None = None,
        batch_size: int = 256,
        retry_initial_s: float = 0.05,
        retry_max_s: float = 5.0,
    ) -> None:
        assert batch_size >= 1 and 0 < retry_initial_s <= retry_max_s
        self.ledger = ledger
        self.journal = journal
        self.batch_size = batch_size
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.num_written = 0  # records that were new in the store
        self.num_duplicates = 0  # request ids that were already stored
        self.num_replayed = 0  # records read back from the journal at start
        self.num_journal_errors = 0  # records the journal could not keep (queued all the same)
        # each record with its journal segment (None: not journaled)
        self._queue: collections.deque[tuple[UsageRecord, int | None]] = collections.deque()
        self._wake = asyncio.Event()
        self._writing = asyncio.Lock()  # one batch in flight at a time (worker or drain)
        self._task: asyncio.Task[None] | None = None
        self._opened = False

    @property
    def pending(self) -> int:
        """Records submitted and not yet acknowledged by the store."""
        return len(self._queue)

    def open(self) -> int:
        """Open the journal and queue the records it kept from earlier runs (idempotent);
        returns how many. Blocks on disk reads: call before serving."""
        if self._opened or self.journal is None:
            return 0
        self._opened = True
        replayed = self.journal.open()
        self._queue.extendleft(reversed([(rec, seg) for seg, rec in replayed]))
        self.num_replayed += len(replayed)
        if replayed:
            self._wake.set()
        return len(replayed)

    def submit(self, rec: UsageRecord) -> None:
        """Journal and queue `rec` for writing; never blocks on the store. Raises LedgerError
        at once for a record that could never be stored, so one bad record cannot stall the
        queue."""
        check_record(rec)
        segment = None
        if self.journal is not None and self.journal.dir is not None:
            try:
                segment = self.journal.append(rec)
            except OSError as exc:
                self.num_journal_errors += 1
                log.error(
                    "usage ledger journal write failed (%s); %s kept in memory only",
                    exc.strerror,
                    rec.request_id,
                )
        self._queue.append((rec, segment))
        self._wake.set()

    def start(self) -> None:
        """Open the journal if needed and start the background writer (idempotent); needs a
        running event loop."""
        self.open()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="ledger-writer")

    async def drain(self, timeout: float) -> int:
        """Stop the background writer and write everything pending, retrying until `timeout`
        seconds have passed. Returns how many records are still unwritten (they stay in
        `pending` and in the journal; `start` or another `drain` carries on with them)."""
        deadline = asyncio.get_running_loop().time() + timeout
        await self._stop(timeout)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await self._write_pending()
        return len(self._queue)

    def close(self) -> None:
        """Close the journal (after `drain`): what is still pending stays in it for the
        next start."""
        if self.journal is not None and self._opened:
            self.journal.close()
            self._opened = False

    async def _stop(self, timeout: float) -> None:
        task, self._task = self._task, None
        if task is not None:  # were it to run on, it takes turns with `drain` (`_writing`)
            await cancel_and_wait(task, timeout)

    async def _run(self) -> None:
        while True:
            await self._write_pending()
            self._wake.clear()
            if not self._queue:
                await self._wake.wait()

    async def _write_pending(self) -> None:
        async with self._writing:
            await self._write_until_empty()

    async def _sync_journal(self) -> None:
        if self.journal is not None and self._opened:
            try:
                await asyncio.to_thread(self.journal.sync)
            except OSError as exc:
                log.error("usage ledger journal sync failed: %s", exc.strerror)

    async def _write_until_empty(self) -> None:
        delay = self.retry_initial_s
        while self._queue:
            await self._sync_journal()
            batch = list(itertools.islice(self._queue, self.batch_size))
            try:
                results = await self.ledger.record_many([rec for rec, _ in batch])
            except (RedisError, OSError) as exc:
                log.warning(
                    "usage ledger store unreachable (%s); %d records pending, retry in %.2fs",
                    exc,
                    len(self._queue),
                    delay,
                )
            except Exception:
                log.exception("usage ledger write failed; %d records pending", len(self._queue))
            else:
                for _ in batch:
                    self._queue.popleft()
                if self.journal is not None and self._opened:
                    self.journal.acknowledge(seg for _, seg in batch if seg is not None)
                num_new = sum(results)
                self.num_written += num_new
                self.num_duplicates += len(results) - num_new
                delay = self.retry_initial_s
                continue
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self.retry_max_s)
