"""The host's bookkeeping per page when requests whose prefixes sit in host RAM are
admitted into a full device pool: the work the scheduler does before a step can run.

B documents of C tokens are cached, then pushed out to host RAM by filler requests that
leave the device pool full of their own cold cached pages. Each round admits B requests
over the documents the way the scheduler does (`lookup`, `lookup_below`, `allocate`, which
evicts and spills the filler's pages, `load_below`, `loads_ready`), the copies left to the
worker thread; only those calls are timed. Pages are tiny (one layer of 16 floats), so
what is measured is the bookkeeping, not the copies.

    python bench/kv_admit.py                 # B=8, C=8192: 4,096 pages a round
    python bench/kv_admit.py --quick

Reported: microseconds per admitted page (the best round, and the median). The last printed
line is one JSON object; the full record goes to bench/results/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_info, publish
from engine.block_hash import chain_hashes, root_hash
from engine.block_manager import BlockManager
from kvstore.base import KVCacheSpec
from kvstore.connector import TierConnector
from kvstore.device_pool import DeviceKVPool
from kvstore.tiers import KVOffloader, Tier, TieredKVStore

BLOCK = 16


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.rounds = 2, 512, 3
    pages = args.context // BLOCK
    num_blocks = args.batch * pages + 8
    spec = KVCacheSpec(1, 1, 16, BLOCK, torch.float32)
    pool = DeviceKVPool(spec, num_blocks, torch.device("cpu"), "thread")
    store = TieredKVStore(spec.bytes_per_block, host_blocks=4 * args.batch * pages)
    bm = BlockManager(num_blocks, BLOCK, connector=TierConnector(KVOffloader(pool, store)))
    g = torch.Generator().manual_seed(args.seed)
    root = root_hash("bench")

    def cached(tag: str) -> list[list[bytes]]:
        """B requests of C new tokens, computed (committed) and finished: cold cached pages."""
        chains = []
        for i in range(args.batch):
            tokens = torch.randint(0, 50_000, (args.context,), generator=g).tolist()
            chains.append(chain_hashes(root, tokens, BLOCK, 0))
            bm.allocate(f"{tag}-{i}", args.context)
            bm.commit(f"{tag}-{i}", chains[-1])
            bm.free(f"{tag}-{i}")
        pool.loads.finish()
        return chains

    docs = cached("doc")
    seconds: list[float] = []
    for r in range(args.rounds):
        cached(f"fill{r}")  # the documents go to host RAM; the pool is full of the filler
        start = time.perf_counter()
        for i, hashes in enumerate(docs):
            rid = f"q{r}-{i}"
            hits = bm.lookup(hashes)
            below = bm.lookup_below(rid, hashes[len(hits) :])
            bm.allocate(rid, args.context + 1, hits, below, background=True)
            bm.load_below(rid, len(hits), below)
            bm.loads_ready(rid)
        seconds.append(time.perf_counter() - start)
        pool.loads.finish()
        for i in range(len(docs)):
            bm.free(f"q{r}-{i}")
    bm.check_integrity()
    admitted = args.batch * pages
    summary = {
        "pages_per_round": admitted,
        "us_per_page": {
            "best": round(min(seconds) / admitted * 1e6, 3),
            "median": round(statistics.median(seconds) / admitted * 1e6, 3),
        },
        "host_hits": bm.num_tier_hit_blocks[Tier.HOST],
    }
    print(
        f"{args.batch} requests x {pages} pages from host RAM, each evicting a cached page: "
        f"{summary['us_per_page']['best']} us per page (best of {args.rounds} rounds), "
        f"{summary['us_per_page']['median']} median"
    )
    record = {
        "benchmark": "kv_admit",
        **machine_info(torch.device("cpu")),
        "batch": args.batch,
        "context": args.context,
        "rounds": args.rounds,
        "quick": args.quick,
        "round_ms": [round(s * 1e3, 3) for s in seconds],
        **summary,
    }
    publish(args.out_dir, "kv_admit", record, summary)
    return summary


if __name__ == "__main__":
    main()
