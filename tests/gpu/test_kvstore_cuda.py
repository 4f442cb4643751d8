"""The KV store on a CUDA device: FP8 pages store the bytes the CPU path stores, and pages
from the host tier come back layer by layer on a copy stream (CuPy where installed), rows of
the host tier's pinned tensor read in place by a Triton kernel."""

from __future__ import annotations

import pytest
import torch

from kvstore import transfer, transfer_cuda
from kvstore.base import KVCacheSpec
from kvstore.device_pool import DeviceKVPool
from kvstore.fp8 import quantize_fp8
from kvstore.tiers import KVOffloader, Tier, TieredKVStore

pytestmark = pytest.mark.gpu


def test_fp8_quantization_on_cuda_is_bit_identical_to_cpu():
    x = torch.randn(4096, 8, 128, generator=torch.Generator().manual_seed(0)) * 3
    cpu_values, cpu_scales = quantize_fp8(x)
    values, scales = quantize_fp8(x.cuda())
    assert torch.equal(scales.cpu(), cpu_scales)
    assert torch.equal(values.cpu().view(torch.uint8), cpu_values.view(torch.uint8))


SPECS = {
    "bf16": KVCacheSpec(16, 8, 64, 16, torch.bfloat16),
    "fp8": KVCacheSpec(16, 8, 128, 16, torch.float8_e4m3fn),
}


def pinned_pages(spec: KVCacheSpec, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    pages = torch.randint(0, 120, (n, spec.bytes_per_block), generator=g, dtype=torch.uint8)
    return list(pages.pin_memory())


@pytest.mark.parametrize("name", list(SPECS))
def test_stream_loads_land_bit_for_bit_and_use_cupy_where_installed(name):
    spec = SPECS[name]
    pool = DeviceKVPool(spec, 64, torch.device("cuda"))  # auto: a CUDA stream
    assert pool.loads.backend == ("cupy" if transfer_cuda._cupy() is not None else "torch")
    pages = pinned_pages(spec, 24)
    blocks = list(range(63, 15, -2))
    pool.load_pages(blocks, pages)
    pool.loads.wait_all()
    got = pool.read_pages(blocks).cpu()
    assert torch.equal(got, torch.stack(pages))
    pool.loads.finish()
    assert not pool.loads.pending


def test_a_large_load_starts_copying_at_once_and_an_error_there_fails_the_step(monkeypatch):
    """Queued pages reaching `_EARLY_ISSUE_PAGES` are issued while scheduling goes on, and
    then again each time as many as went early are queued; the smaller rest waits for the
    step's issue; all land. A failed early issue raises nothing then: the step's issue
    raises it, once, and its blocks are failed."""
    monkeypatch.setattr(transfer, "_EARLY_ISSUE_PAGES", 6)
    spec = SPECS["fp8"]
    pool = DeviceKVPool(spec, 64, torch.device("cuda"))
    pages = pinned_pages(spec, 9)
    pool.load_pages(list(range(10, 16)), pages[:6])
    assert not pool.loads._queued and len(pool.loads._pending) == 1
    pool.load_pages([40, 41, 42], pages[6:])
    assert len(pool.loads._queued) == 1
    pool.loads.issue()
    pool.loads.wait_all()
    assert torch.equal(pool.read_pages([*range(10, 16), 40, 41, 42]).cpu(), torch.stack(pages))
    pool.loads.finish()
    issued = []
    with torch.cuda.stream(pool.loads._torch_stream):
        torch.cuda._sleep(200_000_000)  # none is done before the last is issued
    for first in (10, 16, 22, 28, 34):  # 6 pages each: issued after 6, 12, 24
        pool.load_pages(list(range(first, first + 6)), pages[:6])
        issued.append(len(pool.loads._pending))
    assert issued == [1, 2, 2, 3, 3] and len(pool.loads._queued) == 1
    pool.loads.finish()

    def broken(*args):
        raise RuntimeError("no copy engine")

    monkeypatch.setattr(pool.loads, "_issue", broken)
    pool.load_pages(list(range(20, 26)), pages[:6])  # the scheduler goes on
    with pytest.raises(RuntimeError, match="no copy engine"):
        pool.loads.issue()
    pool.loads.issue()
    assert sorted(pool.loads.take_failed()) == list(range(20, 26))


def test_each_layer_waits_on_the_gpu_for_its_own_pages():
    """The copy stream is held back by a long kernel, so the copies are still queued when the
    compute stream reads layer 0 then the last layer: each read waits for its layer's event
    (on the GPU; the host does not block) and sees the loaded pages."""
    spec = SPECS["fp8"]
    pool = DeviceKVPool(spec, 32, torch.device("cuda"))
    reference = DeviceKVPool(spec, 32, torch.device("cpu"), load_mode="sync")
    pages = pinned_pages(spec, 8)
    blocks = list(range(8, 16))
    reference.load_pages(blocks, pages)
    with torch.cuda.stream(pool.loads._torch_stream):
        torch.cuda._sleep(200_000_000)  # a spinning kernel ahead of the copies
    pool.load_pages(blocks, pages)
    for layer in (0, spec.num_layers - 1):
        pool.layer(layer)  # queues the wait for this layer's pages only
        for got, want in zip(pool.layer_parts(layer), reference.layer_parts(layer), strict=True):
            assert torch.equal(got[:, blocks].cpu(), want[:, blocks]), layer
    pool.loads.finish()


@pytest.mark.parametrize("reads", ["kernel", "copy", "copy-too-many-runs"])
@pytest.mark.parametrize("name", list(SPECS))
def test_host_tier_rows_are_read_in_place_bit_for_bit(name, reads, monkeypatch):
    """Pages that are rows of the host tier load with nothing staged, mixed in one batch
    with pages from elsewhere (staged), and land bit for bit: read by the Triton kernel, or
    by CuPy 2-D copies per run of neighbouring slots (the kernel where the runs are too
    many)."""
    if reads != "kernel" and transfer_cuda._cupy() is None:
        pytest.skip("2-D copies need CuPy")
    spec = SPECS[name]
    pool = DeviceKVPool(spec, 64, torch.device("cuda"), host_reads=reads.split("-")[0])
    store = TieredKVStore(spec.bytes_per_block, host_blocks=40, pin=True)
    KVOffloader(pool, store)
    assert store.before_host_use is not None  # rows are read in place
    assert store.host is not None
    host = store.host.data
    host.copy_(torch.stack(pinned_pages(spec, 40)))
    slots = [7, 3, 39, 0, 21, 22, 23, 5]  # six runs
    blocks = [60, 2, 17, 33, 34, 35, 9, 48]
    kernel_reads = []
    load_layer = pool.loads._reader.load_layer
    monkeypatch.setattr(
        pool.loads._reader, "load_layer", lambda *a: kernel_reads.append(a[0]) or load_layer(*a)
    )
    if reads == "copy-too-many-runs":
        monkeypatch.setattr(transfer_cuda, "_MAX_RUN_COPIES", 5)
    others = pinned_pages(spec, 3)  # not host rows: staged
    pool.load_pages(blocks, [host[s] for s in slots])
    pool.load_pages([50, 51, 52], others)
    assert not pool.loads._spare and pool.loads._reading[7] == 1
    pool.loads.wait_all()
    assert torch.equal(pool.read_pages(blocks).cpu(), host[slots])
    assert torch.equal(pool.read_pages([50, 51, 52]).cpu(), torch.stack(others))
    pool.loads.finish()
    assert not pool.loads._reading
    assert kernel_reads == ([] if reads == "copy" else list(range(spec.num_layers)))


def test_a_host_row_is_not_rewritten_before_its_load_reads_it():
    """A load still queued behind a long kernel reads host row 5; the tier hands slot 5 out
    for a new page: the load finishes first, so the device gets the old bytes."""
    spec = SPECS["fp8"]
    pool = DeviceKVPool(spec, 16, torch.device("cuda"))
    store = TieredKVStore(spec.bytes_per_block, host_blocks=8, pin=True)
    KVOffloader(pool, store)
    assert store.host is not None
    old = pinned_pages(spec, 1)[0]
    store.host.data[5].copy_(old)
    with torch.cuda.stream(pool.loads._torch_stream):
        torch.cuda._sleep(200_000_000)  # the copies wait behind this
    pool.load_pages([4], [store.host.data[5]])
    pool.loads.issue()  # in flight, not done
    store.before_host_use([5])  # what host_slot calls before handing slot 5 out
    assert not pool.loads.pending
    store.host.data[5].fill_(0)
    assert torch.equal(pool.read_pages([4]).cpu()[0], old)


def test_the_pinned_host_tier_is_locked_at_its_own_size_and_let_go_with_it(caplog):
    """The host tier registers its own mapping with CUDA (torch's pinned allocator would
    round it up to a power of two); a second tier after the first is gone registers too."""
    import gc

    spec = SPECS["fp8"]
    for _ in range(2):
        store = TieredKVStore(spec.bytes_per_block, host_blocks=3, pin=True)
        assert store.host is not None
        data = store.host.data
        assert data.is_pinned() and data.numel() == 3 * spec.bytes_per_block
        dev = torch.randint(0, 120, data.shape, dtype=torch.uint8, device="cuda")
        data.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(data.cuda(), dev)
        del store, data
        gc.collect()
    assert "cudaHostRegister refused" not in caplog.text


def test_a_spill_writes_host_rows_in_place_and_a_page_it_pushes_to_disk_is_whole(tmp_path):
    """Six blocks spill into a host tier of four slots over a disk tier: the first two
    pages, spilled in this very call, are pushed on to disk, so their saves finish before
    their rows are read. Every page reads back bit for bit from where it ended up."""
    spec = SPECS["fp8"]
    pool = DeviceKVPool(spec, 16, torch.device("cuda"))
    pool.load_pages(list(range(6)), pinned_pages(spec, 6))
    pool.loads.finish()
    want = pool.read_pages(list(range(6))).cpu()
    store = TieredKVStore(
        spec.bytes_per_block, host_blocks=4, disk_blocks=8, disk_dir=tmp_path, pin=True
    )
    offloader = KVOffloader(pool, store)
    assert offloader.in_place
    keys = [bytes([i]) * 16 for i in range(6)]
    assert offloader.spill([(b, k, "") for b, k in enumerate(keys)]) > 0  # saves in flight
    pool.loads.finish()  # the host rows are written once the saves are done
    assert [store.tier_of(k) for k in keys] == [Tier.DISK] * 2 + [Tier.HOST] * 4
    assert store.disk is not None
    store.disk.reap(wait=True)
    for i, key in enumerate(keys):
        got = store.get(key)
        assert got is not None and torch.equal(got[0].cpu(), want[i]), i
    store.close()


def test_a_spill_from_a_pool_past_16_gib_reads_every_layer_from_its_own_block():
    """The save kernel's offsets pass 2**31 words (8-byte words): the last layers of a large
    pool are read from where they are, not from a wrapped-around address."""
    spec = KVCacheSpec(32, 8, 128, 16, torch.float8_e4m3fn)
    num_blocks = 17_000  # 63 rows * 17,000 blocks * 2,048 words > 2**31: ~18 GB of values
    pool = DeviceKVPool(spec, num_blocks, torch.device("cuda"))
    blocks = [0, 9_999, num_blocks - 1]
    pool.write_pages(blocks, pinned_pages(spec, len(blocks)))
    want = pool.read_pages(blocks).cpu()
    store = TieredKVStore(spec.bytes_per_block, host_blocks=4, pin=True)
    offloader = KVOffloader(pool, store)
    assert offloader.in_place
    keys = [bytes([i]) * 16 for i in range(len(blocks))]
    offloader.spill([(b, k, "") for b, k in zip(blocks, keys, strict=True)])
    pool.loads.finish()
    for i, key in enumerate(keys):
        got = store.get(key)
        assert got is not None and torch.equal(got[0].cpu(), want[i]), i
    del pool
    torch.cuda.empty_cache()


def test_a_spill_on_its_own_stream_runs_beside_compute_and_a_later_load_goes_after_it():
    """The save stream is held back by a long kernel: the spill returns at once with a
    ticket; a load of the same host rows, started after it, waits on the GPU for the save
    and gets the saved bytes; the rows are read on the host once the save is done. A spill
    in the compute stream's order (inline) returns no ticket."""
    spec = SPECS["fp8"]
    pool = DeviceKVPool(spec, 16, torch.device("cuda"))
    pool.load_pages(list(range(4)), pinned_pages(spec, 4))
    pool.loads.finish()
    want = pool.read_pages(list(range(4))).cpu()
    store = TieredKVStore(spec.bytes_per_block, host_blocks=8, pin=True)
    offloader = KVOffloader(pool, store)
    keys = [bytes([i]) * 16 for i in range(4)]
    with torch.cuda.stream(pool.loads._save_torch_stream):
        torch.cuda._sleep(4_000_000_000)  # ahead of the save, longer than compiling it
    ticket = offloader.spill([(0, keys[0], ""), (1, keys[1], "")])
    assert ticket > 0 and not pool.loads.done({ticket})
    assert offloader.load([8, 9], keys[:2]) == [Tier.HOST, Tier.HOST]
    pool.loads.wait_all()
    assert torch.equal(pool.read_pages([8, 9]).cpu(), want[:2])
    pool.loads.finish()
    assert pool.loads.done({ticket}) and not pool.loads.pending
    for i in range(2):
        got = store.get(keys[i])
        assert got is not None and torch.equal(got[0], want[i]), i
    assert offloader.spill([(2, keys[2], ""), (3, keys[3], "")], inline=True) == 0
    torch.cuda.synchronize()
    for i in (2, 3):
        got = store.get(keys[i])
        assert got is not None and torch.equal(got[0], want[i]), i


def test_the_engine_gives_the_same_tokens_with_pages_loading_on_a_stream(strata_cache_dir):
    """Pages spilled to host RAM come back through the copy stream while layers compute,
    read from the host rows by the kernel or by 2-D copies."""
    from engine.config import CacheConfig, EngineConfig, KVCacheDtype
    from engine.llm import LLM
    from engine.protocol import SamplingParams

    doc = "The Roman Empire reached its greatest extent under Trajan in 117 AD. " * 8
    prompts = [f"{doc}\nQuestion {i}: what is this about?" for i in range(3)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = {}
    for load in ("sync", "stream", "stream-copy"):
        cache = CacheConfig(
            num_blocks=12,
            kv_cache_dtype=KVCacheDtype.AUTO,
            host_memory_bytes=256 << 20,
            kv_load=load.split("-")[0],
            kv_host_reads="copy" if "copy" in load else "auto",
        )
        cfg = EngineConfig(
            dtype="float32", device="cuda", cache=cache, cache_dir=str(strata_cache_dir)
        )
        llm = LLM(cfg)
        filler = "Filler text that pushes the document's pages out of the device pool. " * 10
        outs = []
        for p in prompts:  # each question after a filler request: the document comes back
            llm.generate([filler], params)
            outs.append(llm.generate([p], params)[0])
        runs[load] = [o.token_ids for o in outs]
        assert sum(o.num_cached_host_tokens for o in outs[1:]) > 0
        llm.core.check_integrity()
    assert runs["stream"] == runs["sync"] == runs["stream-copy"]


def test_a_request_loading_on_the_stream_waits_outside_the_running_batch(strata_cache_dir):
    """The copy stream is held back by a long kernel before the reader's pages are issued:
    the reader waits outside the batch while the running request decodes a token per step
    (its steps wait for none of the copies, CUDA graphs included); once the pages are in, it
    joins and gives the tokens of synchronous loads."""
    from engine.config import CacheConfig, EngineConfig, KVCacheDtype
    from engine.llm import LLM
    from engine.protocol import SamplingParams

    doc = "The Roman Empire reached its greatest extent under Trajan in 117 AD. " * 8
    question = f"{doc}\nWhat is this about?"
    filler = "Filler text that pushes the document's pages out of the device pool. " * 10
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    talk = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    tokens: dict[str, dict[str, list[int]]] = {}
    for load in ("sync", "stream"):
        # 14 blocks: the filler evicts 5 of the document's 8 cached pages to host RAM
        cache = CacheConfig(
            num_blocks=14,
            kv_cache_dtype=KVCacheDtype.AUTO,
            host_memory_bytes=256 << 20,
            kv_load=load,
        )
        cfg = EngineConfig(
            dtype="float32", device="cuda", cache=cache, cache_dir=str(strata_cache_dir)
        )
        llm = LLM(cfg)
        core = llm.core
        llm.generate([doc], params)
        llm.generate([filler], params)  # the document's pages go to host RAM
        got: dict[str, list[int]] = {"running": [], "reader": []}
        core.add_request("running", llm.encode("Tell me about the sea."), talk)
        got["running"] += core.step()[0].new_token_ids
        if load == "stream":
            with torch.cuda.stream(core.pool.loads._torch_stream):
                # about two seconds ahead of the copies, longer than compiling their kernel
                torch.cuda._sleep(4_000_000_000)
        core.add_request("reader", llm.encode(question), params)
        for i in range(3 if load == "stream" else 0):
            outs = {o.request_id: o for o in core.step()}
            assert "reader" not in outs and len(outs["running"].new_token_ids) == 1, i
            got["running"] += outs["running"].new_token_ids
            assert [r.request_id for r in core.scheduler.loading] == ["reader"]
        while core.has_unfinished():
            for out in core.step():
                got[out.request_id] += out.new_token_ids
                if out.request_id == "reader" and out.finished:
                    assert out.num_cached_host_tokens >= 64
        core.check_integrity()
        tokens[load] = got
    assert tokens["stream"] == tokens["sync"]
