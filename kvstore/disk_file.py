"""Opening the disk tier's page file: an anonymous one (unlinked at once, gone with the
process) or a persistent one in a directory that outlives the worker, held with an
exclusive lock so that two workers never write the same file.
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

MAX_PAGE_FILES = 64  # workers sharing one directory, at most


@dataclass(frozen=True)
class PageFile:
    """An open page file. `num_existing_bytes`: its size when opened (what a persistent file
    kept from an earlier run; 0 for an anonymous one)."""

    fd: int
    path: Path
    direct: bool  # opened with O_DIRECT
    num_existing_bytes: int


def _open(path: Path, flags: int) -> tuple[int, bool]:
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600), True
    except OSError:  # tmpfs and some others refuse O_DIRECT
        return os.open(path, flags, 0o600), False


def open_anonymous(directory: Path, tag: str) -> PageFile:
    """A fresh page file in `directory`, unlinked as soon as it is open."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"strata-kv-{os.getpid()}-{tag}.pages"
    fd, direct = _open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    path.unlink()
    return PageFile(fd, path, direct, 0)


def open_persistent(directory: Path) -> PageFile:
    """The first page file of `directory` (`strata-kv-0.pages`, `-1`, ...) that no other
    process holds, kept with its contents and locked (flock) until closed. Raises OSError
    when all `MAX_PAGE_FILES` names are held."""
    directory.mkdir(parents=True, exist_ok=True)
    for n in range(MAX_PAGE_FILES):
        path = directory / f"strata-kv-{n}.pages"
        fd, direct = _open(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            size = os.fstat(fd).st_size
        except BlockingIOError:
            os.close(fd)
            continue  # another worker's
        except OSError:
            os.close(fd)
            raise
        return PageFile(fd, path, direct, size)
    raise OSError(
        errno.EBUSY,
        f"all {MAX_PAGE_FILES} KV page files are held by other workers",
        str(directory),
    )
