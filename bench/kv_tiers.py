"""Copy bandwidth of each KV tier path (device <-> host, host <-> disk) against a raw copy of
the same bytes on this machine. Method and figures: docs/benchmarks.md.

    python bench/kv_tiers.py            # 256 pages
    python bench/kv_tiers.py --quick    # 32 pages
    python bench/kv_tiers.py --device cuda

The last printed line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_info, publish, scratch_dir
from kvstore import transfer_cuda
from kvstore.base import KVCacheSpec
from kvstore.device_pool import DeviceKVPool
from kvstore.tiers import KVOffloader, TieredKVStore

CHUNK = 4 << 20


def best_seconds(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def raw_disk(directory: Path, nbytes: int, repeats: int) -> tuple[float, float]:
    """Best write and read seconds for `nbytes` through O_DIRECT in 4 MiB chunks."""
    path = directory / "raw.bin"
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    buf = mmap.mmap(-1, CHUNK)
    buf.write(os.urandom(CHUNK))
    chunks = -(-nbytes // CHUNK)

    def write() -> None:
        for i in range(chunks):
            os.pwritev(fd, [buf], i * CHUNK)

    def read() -> None:
        for i in range(chunks):
            os.preadv(fd, [buf], i * CHUNK)

    try:
        return best_seconds(write, repeats, lambda: None), best_seconds(read, repeats, lambda: None)
    finally:
        os.close(fd)
        path.unlink()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "fp8_e4m3"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--disk-path",
        default=None,
        help="where the run's disk directory goes (removed after the run; "
        "default: the temporary directory)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.pages, args.repeats = 32, 2
    device = torch.device(args.device)
    dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8_e4m3" else torch.bfloat16
    spec = KVCacheSpec(30, 3, 64, 16, dtype)
    n = args.pages
    pool = DeviceKVPool(spec, 2 * n, device)
    pool.kv.view(torch.uint8).random_(0, 120)
    page = spec.bytes_per_block
    nbytes = n * page

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    pinned = device.type == "cuda"
    host = TieredKVStore(page, host_blocks=n, pin=pinned)
    offloader = KVOffloader(pool, host)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    blocks = list(range(n))
    seconds: dict[str, float] = {}

    assert host.host is not None
    host_pool = host.host

    def spill() -> None:
        host_pool.clear()  # every repeat copies every page
        offloader.spill([(b, k, "") for b, k in zip(blocks, keys, strict=True)])

    seconds["device_to_host"] = best_seconds(spill, args.repeats, sync)

    def load() -> None:
        offloader.load(list(range(n, 2 * n)), keys)
        pool.loads.finish()  # issued at a step's first layer otherwise

    seconds["host_to_device"] = best_seconds(load, args.repeats, sync)
    assert torch.equal(pool.read_pages(list(range(n, 2 * n))), pool.read_pages(blocks))
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds["raw_device_to_host"] = best_seconds(lambda: src.copy_(dst), args.repeats, sync)
    seconds["raw_host_to_device"] = best_seconds(lambda: dst.copy_(src), args.repeats, sync)
    cupy = transfer_cuda._cupy() if device.type == "cuda" else None
    if cupy is not None:  # the copy the layer-wise loads issue, on a stream of their own
        stream = cupy.cuda.Stream(non_blocking=True)

        def cupy_copy() -> None:
            cupy.cuda.runtime.memcpyAsync(
                dst.data_ptr(),
                src.data_ptr(),
                nbytes,
                cupy.cuda.runtime.memcpyHostToDevice,
                stream.ptr,
            )
            stream.synchronize()

        seconds["cupy_host_to_device"] = best_seconds(cupy_copy, args.repeats, sync)

    pages = pool.read_pages(blocks).cpu()
    disk_seconds = dict.fromkeys(("write", "caller", "read", "serial"), float("inf"))
    # the disk tier's files and the raw copy's go with the run's directory
    with scratch_dir("strata-kv-bench-", args.disk_path) as directory:
        # one store for every repeat, as an engine keeps its own: from the second repeat on, each
        # page written evicts one of the last repeat's, and staging buffers are reused
        store = TieredKVStore(page, host_blocks=0, disk_blocks=n, disk_dir=directory)
        disk = store.disk
        assert disk is not None, "the disk tier could not be created"
        direct = disk.direct
        for r in range(args.repeats):
            tagged = [k + r.to_bytes(4, "little") for k in keys]
            start = time.perf_counter()
            for k, p in zip(tagged, pages, strict=True):
                store.put(k, p)
            caller = time.perf_counter() - start  # what the scheduler's thread pays
            disk.reap(wait=True)
            disk_seconds["write"] = min(disk_seconds["write"], time.perf_counter() - start)
            disk_seconds["caller"] = min(disk_seconds["caller"], caller)
            start = time.perf_counter()  # read ahead, as the scheduler does for a waiting request
            fetch = disk.fetch(tagged)
            assert fetch is not None
            while not disk.settle(fetch):
                disk.wait_reads(1.0)
            assert len(fetch.good) == n, "a page failed its checksum"
            disk_seconds["read"] = min(disk_seconds["read"], time.perf_counter() - start)
            disk.release(fetch)
            start = time.perf_counter()  # one page at a time (a load's fallback)
            for k in tagged:
                assert store.get(k) is not None
            disk_seconds["serial"] = min(disk_seconds["serial"], time.perf_counter() - start)
        store.close()
        raw_write, raw_read = raw_disk(directory, nbytes, args.repeats)
        seconds["raw_host_to_disk"], seconds["raw_disk_to_host"] = raw_write, raw_read
    seconds["host_to_disk"] = disk_seconds["write"]
    seconds["disk_to_host"] = disk_seconds["read"]
    seconds["disk_to_host_serial"] = disk_seconds["serial"]

    gbps = {name: round(nbytes / s / 1e9, 2) for name, s in seconds.items()}
    paths = ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host")
    summary = {
        "gb_per_s": {p: gbps[p] for p in paths},
        "raw_gb_per_s": {p: gbps[f"raw_{p}"] for p in paths},
        "fraction_of_raw": {p: round(gbps[p] / gbps[f"raw_{p}"], 3) for p in paths},
        "loads": pool.loads.backend,
        "disk_to_host_serial_gb_per_s": gbps["disk_to_host_serial"],
        "host_to_disk_caller_us_per_page": round(disk_seconds["caller"] / n * 1e6, 1),
    }
    if "cupy_host_to_device" in gbps:  # CuPy's async copy against torch's cudaMemcpyAsync
        summary["cupy_host_to_device_gb_per_s"] = gbps["cupy_host_to_device"]
        summary["cupy_fraction_of_raw"] = round(
            gbps["cupy_host_to_device"] / gbps["raw_host_to_device"], 3
        )
    for p in paths:
        print(f"{p:>15}: {gbps[p]:6.2f} GB/s (raw copy {gbps[f'raw_{p}']:6.2f} GB/s)")
    record = {
        "benchmark": "kv_tiers",
        **machine_info(device),
        "pages": n,
        "page_bytes": page,
        "kv_dtype": args.kv_dtype,
        "o_direct": direct,
        "repeats": args.repeats,
        "quick": args.quick,
        **summary,
    }
    publish(args.out_dir, "kv_tiers", record, summary)
    return summary


if __name__ == "__main__":
    main()
