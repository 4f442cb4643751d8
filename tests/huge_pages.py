"""Reading whether a tensor's memory is backed by transparent huge pages (Linux)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

needs_thp = pytest.mark.skipif(
    not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
    reason="transparent huge pages are off on this machine",
)


def huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds t's first byte (/proc/self/smaps)."""
    addr, inside = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")
