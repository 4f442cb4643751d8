"""The ledger's local journal: usage records not yet confirmed by the store, in append-only
segment files (`<root>/<owner>/<seq>.seg`, frames `len:u32 crc32:u32 msgpack(UsageRecord)`)
under an owner directory each process holds with `flock`, so a gateway killed with records
pending writes them after it restarts. See docs/design/admission-and-ledger.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import struct
import threading
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from tenants.records import UsageRecord

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">II")
_MAX_FRAME = 16 << 20


@dataclass
class _Segment:
    path: Path
    num_pending: int = 0
    fd: int | None = None  # open for appending while it is the current segment
    dirty: bool = False


class LedgerJournal:
    """Append records, sync them in batches, forget them once stored. Call `open` first;
    use from one event loop, except `sync`, which may run on a worker thread."""

    def __init__(self, root: str | os.PathLike[str], *, segment_records: int = 4096) -> None:
        assert segment_records >= 1
        self.root = Path(root)
        self.segment_records = segment_records
        self.dir: Path | None = None
        self._locks: dict[Path, int] = {}  # owner directory -> its lock file's fd
        self._segments: dict[int, _Segment] = {}
        self._next_id = 0
        self._current: int | None = None
        self._num_in_current = 0
        self._io = threading.Lock()  # sync against rotation and close
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(UsageRecord)

    # -- start -----------------------------------------------------------------------------

    def open(self) -> list[tuple[int, UsageRecord]]:
        """Claim a directory of our own and every orphaned one; returns the orphans'
        records (with their segment ids, for `acknowledge`), oldest segment first."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        name = secrets.token_hex(8)
        # locked before it is visible under its name: no other process can take it for
        # an orphan in between
        hidden, own = self.root / f".new-{name}", self.root / name
        hidden.mkdir(mode=0o700)
        if not self._lock(hidden):
            raise RuntimeError(f"cannot lock the new journal directory {hidden}")
        hidden.rename(own)
        self._locks[own] = self._locks.pop(hidden)
        self.dir = own
        replay: list[tuple[int, UsageRecord]] = []
        owners = (p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        for other in sorted(p for p in owners if p != own):
            if not self._lock(other):
                continue  # a live gateway owns it
            found = self._claim(other)
            replay += found
            if not found:
                self._remove_owner(other)
        if replay:
            log.warning("replaying %d usage records from the ledger journal", len(replay))
        return replay

    def _lock(self, directory: Path) -> bool:
        try:
            fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:  # another gateway starting at once claimed and removed it
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._locks[directory] = fd
        return True

    def _claim(self, directory: Path) -> list[tuple[int, UsageRecord]]:
        out: list[tuple[int, UsageRecord]] = []
        for path in sorted(directory.glob("*.seg")):
            try:
                records = list(self._read(path))
            except FileNotFoundError:
                continue
            if not records:
                path.unlink()
                continue
            seg_id = self._new_segment(path)
            self._segments[seg_id].num_pending = len(records)
            out += [(seg_id, rec) for rec in records]
        return out

    def _read(self, path: Path) -> Iterable[UsageRecord]:
        data = path.read_bytes()
        at = 0
        while at + _HEADER.size <= len(data):
            size, crc = _HEADER.unpack_from(data, at)
            body = data[at + _HEADER.size : at + _HEADER.size + size]
            if size > _MAX_FRAME or len(body) < size or zlib.crc32(body) != crc:
                log.warning("ledger journal %s: torn or corrupt tail at byte %d", path, at)
                return
            try:
                yield self._decoder.decode(body)
            except msgspec.DecodeError:
                log.warning("ledger journal %s: undecodable record at byte %d", path, at)
                return
            at += _HEADER.size + size

    # -- appending -------------------------------------------------------------------------

    def append(self, rec: UsageRecord) -> int:
        """Write `rec` to the current segment (into the OS cache: it survives the process,
        and `sync` makes it survive the machine); returns its segment id."""
        assert self.dir is not None, "open() the journal first"
        if self._current is None or self._num_in_current >= self.segment_records:
            self._rotate()
        seg_id = self._current
        assert seg_id is not None
        seg = self._segments[seg_id]
        body = self._encoder.encode(rec)
        frame = _HEADER.pack(len(body), zlib.crc32(body)) + body
        assert seg.fd is not None
        os.write(seg.fd, frame)
        seg.num_pending += 1
        seg.dirty = True
        self._num_in_current += 1
        return seg_id

    def _rotate(self) -> None:
        assert self.dir is not None
        self._close_current()
        path = self.dir / f"{self._next_id:010d}.seg"
        seg_id = self._new_segment(path)
        self._segments[seg_id].fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._current, self._num_in_current = seg_id, 0

    def _new_segment(self, path: Path) -> int:
        seg_id, self._next_id = self._next_id, self._next_id + 1
        self._segments[seg_id] = _Segment(path)
        return seg_id

    def _close_current(self) -> None:
        if self._current is None:
            return
        seg = self._segments[self._current]
        self._current = None
        with self._io:
            if seg.fd is not None:
                if seg.dirty:
                    os.fsync(seg.fd)
                os.close(seg.fd)
                seg.fd, seg.dirty = None, False
        if seg.num_pending == 0:
            self._drop(seg)

    def sync(self) -> None:
        """fsync the current segment if it has unsynced records (safe on a thread)."""
        with self._io:
            seg = self._segments.get(self._current) if self._current is not None else None
            if seg is not None and seg.fd is not None and seg.dirty:
                seg.dirty = False
                os.fsync(seg.fd)

    # -- forgetting ------------------------------------------------------------------------

    def acknowledge(self, seg_ids: Iterable[int]) -> None:
        """The store holds these records (one segment id per record): a segment none of
        whose records is pending any more is deleted."""
        for seg_id in seg_ids:
            seg = self._segments[seg_id]
            seg.num_pending -= 1
            assert seg.num_pending >= 0
            if seg.num_pending == 0:
                if seg_id == self._current:
                    self._close_current()  # the next append starts a fresh file
                else:
                    self._drop(seg)

    def _drop(self, seg: _Segment) -> None:
        for seg_id, other in list(self._segments.items()):
            if other is seg:
                del self._segments[seg_id]
        with contextlib.suppress(FileNotFoundError):
            seg.path.unlink()
        owner = seg.path.parent
        if owner != self.dir and not any(s.path.parent == owner for s in self._segments.values()):
            self._remove_owner(owner)

    def _remove_owner(self, owner: Path) -> None:
        """Delete a claimed directory whose records are all stored."""
        for leftover in owner.glob("*.seg"):
            leftover.unlink()
        with contextlib.suppress(FileNotFoundError):
            (owner / "lock").unlink()
        with contextlib.suppress(OSError):
            owner.rmdir()
        fd = self._locks.pop(owner, None)
        if fd is not None:
            os.close(fd)

    @property
    def num_pending(self) -> int:
        return sum(s.num_pending for s in self._segments.values())

    def close(self) -> None:
        """Sync and close; a journal with nothing pending leaves no directory behind."""
        self._close_current()
        for seg in list(self._segments.values()):
            if seg.num_pending == 0:
                self._drop(seg)
        if self.dir is not None and self.num_pending == 0:
            self._remove_owner(self.dir)
        for fd in self._locks.values():
            os.close(fd)
        self._locks.clear()
        self.dir = None
