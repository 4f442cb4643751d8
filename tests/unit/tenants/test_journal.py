"""The ledger journal: what a dead gateway left is replayed once, torn tails are dropped,
segments go away once stored, and a live gateway's journal is never taken."""

from __future__ import annotations

import multiprocessing
import os

from tenants.journal import LedgerJournal
from tenants.ledger import Ledger, LedgerWriter
from tests.unit.tenants.test_ledger import make_record


def _files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_records_left_pending_are_replayed_by_the_next_journal(tmp_path):
    first = LedgerJournal(tmp_path, segment_records=3)
    assert first.open() == []
    recs = [make_record(f"req-{i}") for i in range(7)]
    segments = [first.append(rec) for rec in recs]
    first.acknowledge(segments[:3])  # the first segment is whole in the store: deleted
    first.close()  # the process ends with four records pending

    second = LedgerJournal(tmp_path, segment_records=3)
    replayed = second.open()
    assert [rec for _, rec in replayed] == recs[3:]
    second.acknowledge(seg for seg, _ in replayed)
    second.close()
    assert _files(tmp_path) == []  # nothing pending: no segment, no directory left
    assert LedgerJournal(tmp_path).open() == []


def test_a_torn_tail_ends_the_segment_without_losing_what_precedes(tmp_path):
    journal = LedgerJournal(tmp_path)
    journal.open()
    for i in range(3):
        journal.append(make_record(f"req-{i}"))
    journal.sync()
    assert journal.dir is not None
    (segment,) = journal.dir.glob("*.seg")
    journal.close()
    data = segment.read_bytes()
    segment.write_bytes(data[:-5])  # the last frame was cut short by a crash
    replayed = LedgerJournal(tmp_path).open()
    assert [rec.request_id for _, rec in replayed] == ["req-0", "req-1"]


def test_a_corrupt_frame_is_not_replayed(tmp_path):
    journal = LedgerJournal(tmp_path)
    journal.open()
    journal.append(make_record("req-0"))
    journal.append(make_record("req-1"))
    assert journal.dir is not None
    (segment,) = journal.dir.glob("*.seg")
    journal.close()
    data = bytearray(segment.read_bytes())
    data[-3] ^= 0xFF  # a flipped byte inside the second record
    segment.write_bytes(bytes(data))
    replayed = LedgerJournal(tmp_path).open()
    assert [rec.request_id for _, rec in replayed] == ["req-0"]


def _hold_journal(root: str, started, release) -> None:
    journal = LedgerJournal(root)
    journal.open()
    journal.append(make_record("held"))
    started.set()
    release.wait(30)


def test_a_live_gateways_journal_is_not_claimed(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    started, release = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold_journal, args=(str(tmp_path), started, release))
    other.start()
    try:
        assert started.wait(60)
        assert LedgerJournal(tmp_path).open() == []  # its owner holds the lock
    finally:
        release.set()
        other.join(30)
    replayed = LedgerJournal(tmp_path).open()  # its owner is gone: now it is an orphan
    assert [rec.request_id for _, rec in replayed] == ["held"]


def test_the_journal_directory_is_private(tmp_path):
    journal = LedgerJournal(tmp_path / "journal")
    journal.open()
    assert journal.dir is not None
    assert os.stat(journal.dir).st_mode & 0o077 == 0
    journal.append(make_record("req-0"))
    (segment,) = journal.dir.glob("*.seg")
    assert os.stat(segment).st_mode & 0o077 == 0


async def test_writer_replays_the_journal_once_into_the_store(redis_client, tmp_path):
    ledger = Ledger(redis_client)
    before = LedgerJournal(tmp_path)
    before.open()
    stored, lost = make_record("req-stored"), make_record("req-lost")
    await ledger.record(stored)
    before.append(stored)  # written, but the acknowledgement never came back
    before.append(lost)  # never written
    before.close()

    writer = LedgerWriter(ledger, journal=LedgerJournal(tmp_path))
    assert writer.open() == 2
    assert await writer.drain(timeout=5) == 0
    writer.close()
    assert writer.num_written == 1 and writer.num_duplicates == 1  # one of each, no copies
    assert await ledger.get("req-lost") == lost
    assert await redis_client.zcard("strata:u:idx") == 2
    assert _files(tmp_path) == []


async def test_writer_journals_while_the_store_is_down(private_store, tmp_path):
    from tenants.store import connect

    client = connect(private_store.url, timeout=0.3)
    writer = LedgerWriter(Ledger(client), journal=LedgerJournal(tmp_path), retry_max_s=0.1)
    writer.start()
    private_store.kill()
    for i in range(5):
        writer.submit(make_record(f"req-{i}"))
    assert await writer.drain(timeout=0.5) == 5
    writer.close()
    await client.aclose()
    replayed = LedgerJournal(tmp_path).open()
    assert sorted(rec.request_id for _, rec in replayed) == [f"req-{i}" for i in range(5)]


def _open_journal(root: str, barrier, results) -> None:
    journal = LedgerJournal(root)
    barrier.wait(60)
    try:
        results.put(sorted(rec.request_id for _, rec in journal.open()))
    except Exception as exc:  # reported to the test, which fails on it
        results.put(repr(exc))


def test_processes_starting_together_split_the_orphans(tmp_path):
    """N gateway processes sharing a data dir: every record a dead process left is replayed
    by exactly one of them, and the empty directories crashed processes left behind (which
    another process may remove while this one is reading the root) are no error."""
    ctx = multiprocessing.get_context("spawn")
    with_records = [
        ctx.Process(target=_leave_pending, args=(str(tmp_path), f"req-{i}")) for i in range(6)
    ]
    for proc in with_records:  # one after another: each leaves its own directory
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0
    for i in range(400):
        (tmp_path / f"crashed-{i:03d}").mkdir()
        (tmp_path / f"crashed-{i:03d}" / "lock").touch()
    num_processes = 4
    barrier, results = ctx.Barrier(num_processes), ctx.Queue()
    procs = [
        ctx.Process(target=_open_journal, args=(str(tmp_path), barrier, results))
        for _ in range(num_processes)
    ]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(60)
    errors = [o for o in outcomes if isinstance(o, str)]
    assert not errors
    replayed = sorted(rid for found in outcomes for rid in found)
    assert replayed == [f"req-{i}" for i in range(6)]  # each once
    assert not list(tmp_path.glob("crashed-*"))


def _leave_pending(root: str, request_id: str) -> None:
    """A gateway that dies with one record pending (its lock goes with the process)."""
    journal = LedgerJournal(root)
    journal.open()
    journal.append(make_record(request_id))
    os._exit(0)
