"""A persistent disk tier across worker restarts, with real worker processes on one
`--kv-disk-path`: a document asked before a restart comes back from disk after it with the
same greedy tokens; torn and garbage pages are misses, counted, never errors; two workers
on one directory each hold a file of their own."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from engine.block_hash import chain_hashes, namespace, root_hash
from engine.client import EngineClient
from engine.protocol import EngineStats, SamplingParams
from kvstore.disk_page import HEADER_NBYTES, MAGIC, disk_slot_nbytes
from tests.integration.conftest import WorkerProcess

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DOC = [100 + (7 * i) % 300 for i in range(40)]  # 10 full blocks of 4 tokens
OTHERS = [[10 + (11 * i + 5 * d) % 400 for i in range(40)] for d in range(1, 3)]


def disk_worker(tmp_path: Path, cache_dir: Path, disk_dir: Path, name: str) -> WorkerProcess:
    """synthetic:tiny with a device pool of about one document and no host tier: what the
    device evicts goes to disk."""
    args = ["--model", "synthetic:tiny", "--dtype", "float32", "--block-size", "4"]
    args += ["--num-kv-blocks", "16", "--kv-disk-gb", "0.001", "--kv-disk-path", str(disk_dir)]
    return WorkerProcess(tmp_path / f"{name}.sock", args, cache_dir)


async def ask(client: EngineClient, rid: str, prompt: list[int]):
    """The greedy tokens, and the final output."""
    outs = [out async for out in client.generate(rid, prompt, GREEDY)]
    return [t for o in outs for t in o.new_token_ids], outs[-1]


async def stats_when(client: EngineClient, done, timeout: float = 30.0) -> EngineStats:
    """Stats, once `done(stats)` holds (each call also lets the worker take in pages it has
    indexed)."""
    async with asyncio.timeout(timeout):
        while True:
            stats = await client.stats()
            if done(stats):
                return stats
            await asyncio.sleep(0.05)


async def first_run(worker: WorkerProcess) -> tuple[list[int], str]:
    """Ask DOC, then the other documents so that DOC's pages leave the device for disk;
    DOC's greedy tokens, and the worker's cache namespace."""
    worker.start()
    client = EngineClient(worker.address)
    info = await client.connect()
    tokens, _ = await ask(client, "doc", DOC)
    for i, other in enumerate(OTHERS):
        await ask(client, f"other-{i}", other)
    await stats_when(client, lambda s: s.num_kv_disk_blocks_used >= 10)
    await client.close()
    worker.stop()  # the worker finishes its writes and lets go of its file
    return tokens, info.cache_namespace


def slot_of(path: Path, slot_nbytes: int, key: bytes) -> int:
    """The slot of the page file whose header names `key`."""
    data = path.read_bytes()
    headers = [
        data[(s + 1) * slot_nbytes - HEADER_NBYTES : (s + 1) * slot_nbytes]
        for s in range(len(data) // slot_nbytes)
    ]
    (slot,) = [s for s, h in enumerate(headers) if h.startswith(MAGIC) and key in h]
    return slot


def page_slots(path: Path, slot_nbytes: int) -> list[int]:
    """The slots of the page file holding a page header."""
    data = path.read_bytes()
    return [
        s
        for s in range(len(data) // slot_nbytes)
        if data[(s + 1) * slot_nbytes - HEADER_NBYTES :].startswith(MAGIC)
    ]


def write_at(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    os.pwrite(fd, data, offset)
    os.close(fd)


async def test_a_document_asked_before_a_restart_hits_the_disk_after_it(tmp_path, strata_cache_dir):
    disk_dir = tmp_path / "kv"
    before, _ = await first_run(disk_worker(tmp_path, strata_cache_dir, disk_dir, "first"))
    assert [p.name for p in disk_dir.iterdir()] == ["strata-kv-0.pages"]

    worker = disk_worker(tmp_path, strata_cache_dir, disk_dir, "second")
    worker.start()
    try:
        client = EngineClient(worker.address)
        await client.connect()
        stats = await stats_when(client, lambda s: s.num_kv_disk_pages_recovered >= 10)
        assert stats.num_kv_disk_pages_rejected == 0
        tokens, final = await ask(client, "again", DOC)
        assert tokens == before
        assert final.num_cached_disk_tokens >= 4 * 9  # all but the last block, from disk
        assert final.num_cached_tokens == final.num_cached_disk_tokens
        stats = await client.stats()
        assert stats.num_cache_hit_blocks["disk"] >= 9
        assert stats.num_kv_disk_checksum_failures == 0
        assert await client.health()  # the worker's integrity check passes
        await client.close()
    finally:
        worker.stop()


async def test_torn_and_garbage_pages_are_misses_not_errors(tmp_path, strata_cache_dir):
    disk_dir = tmp_path / "kv"
    first = disk_worker(tmp_path, strata_cache_dir, disk_dir, "first")
    before, cache_namespace = await first_run(first)
    path = disk_dir / "strata-kv-0.pages"
    slot_nbytes = disk_slot_nbytes(4 * 2 * 2 * 2 * 16 * 4)  # synthetic:tiny, float32
    root = root_hash(namespace(cache_namespace, "", ""))  # no tenant salt, no adapter
    doc_keys = chain_hashes(root, DOC, 4, 0)
    rotten = slot_of(path, slot_nbytes, doc_keys[0])
    write_at(path, rotten * slot_nbytes + 64, b"\xa5" * 32)  # bit rot in DOC's first page
    doc_slots = {slot_of(path, slot_nbytes, k) for k in doc_keys[:9]}
    *others, last = [s for s in page_slots(path, slot_nbytes) if s not in doc_slots]
    for slot in others[:2]:  # garbage in two other pages' headers
        write_at(path, (slot + 1) * slot_nbytes - HEADER_NBYTES + 50, b"\x5a" * 64)
    os.truncate(path, last * slot_nbytes + slot_nbytes // 2)  # a crash cut the last one short
    num_pages = len(doc_slots) + len(others)

    worker = disk_worker(tmp_path, strata_cache_dir, disk_dir, "second")
    worker.start()
    try:
        client = EngineClient(worker.address)
        await client.connect()
        stats = await stats_when(client, lambda s: s.num_kv_disk_pages_rejected >= 3)
        assert stats.num_kv_disk_pages_rejected == 3  # two garbage headers, one cut short
        assert stats.num_kv_disk_pages_recovered == num_pages - 2
        tokens, final = await ask(client, "again", DOC)
        assert tokens == before  # DOC's first page was a miss: recomputed, never wrong
        assert final.error is None and final.num_cached_tokens == 0
        stats = await client.stats()
        assert stats.num_kv_disk_checksum_failures == 1
        assert stats.num_kv_disk_pages_rejected == 4
        assert await client.health()
        await client.close()
    finally:
        worker.stop()


def _page_files_held(pid: int) -> set[str]:
    fds = Path(f"/proc/{pid}/fd")
    links = {os.readlink(fd) for fd in fds.iterdir() if fd.is_symlink()}
    return {Path(link).name for link in links if link.endswith(".pages")}


async def test_two_workers_on_one_directory_never_share_a_file(tmp_path, strata_cache_dir):
    disk_dir = tmp_path / "kv"
    workers = [disk_worker(tmp_path, strata_cache_dir, disk_dir, f"w{i}") for i in range(2)]
    try:
        for worker in workers:
            worker.start()
        held = [_page_files_held(w.proc.pid) for w in workers if w.proc is not None]
        assert held == [{"strata-kv-0.pages"}, {"strata-kv-1.pages"}]
        for worker in workers:  # both serve, each from its own file
            client = EngineClient(worker.address)
            await client.connect()
            await ask(client, "doc", DOC)
            await client.close()
    finally:
        for worker in workers:
            worker.stop()
