"""Layer-wise page loads (kvstore/transfer.py) on CPU: the synchronous mode and the worker
thread, which runs the same per-layer copies as the CUDA stream and signals each layer."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.config import CacheConfig, ConfigError
from kvstore import transfer
from kvstore.base import KVCacheSpec
from kvstore.device_pool import DeviceKVPool
from tests.held_copies import hold_saves, waits_until_set

CPU = torch.device("cpu")
SPECS = [KVCacheSpec(3, 2, 64, 4, torch.bfloat16), KVCacheSpec(3, 2, 64, 4, torch.float8_e4m3fn)]


def random_pages(spec: KVCacheSpec, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, 256, (n, spec.bytes_per_block), generator=g, dtype=torch.uint8))


def layer_bytes(pool: DeviceKVPool, layer: int, blocks: list[int]) -> list[torch.Tensor]:
    return [part[:, blocks].clone() for part in pool.layer_parts(layer)]


@pytest.mark.parametrize("mode", ["sync", "thread"])
@pytest.mark.parametrize("spec", SPECS, ids=["bf16", "fp8"])
def test_loaded_pages_read_back_bit_for_bit_and_the_rows_are_free_at_once(spec, mode):
    pool = DeviceKVPool(spec, 9, CPU, load_mode=mode)
    assert pool.loads.backend == mode
    pages = random_pages(spec, 4, seed=1)
    sources = [p.clone() for p in pages]
    blocks = [7, 2, 5, 0]
    pool.load_pages(blocks, sources)
    for row in sources:  # the caller may reuse its rows (host slots) as soon as it returns
        row.fill_(0xAB)
    pool.loads.finish()
    assert not pool.loads.pending
    assert torch.equal(pool.read_pages(blocks), torch.stack(pages))
    untouched = [b for b in range(9) if b not in blocks]
    assert not pool.read_pages(untouched).any(), "other blocks stay zero"


def test_a_layer_waits_for_its_own_pages_only(monkeypatch):
    """The worker holds every layer after the first until released: reading layer 0 returns
    with its pages in place while layer 1 is still empty; reading layer 1 then waits for it."""
    spec = SPECS[1]
    pool = DeviceKVPool(spec, 6, CPU, load_mode="thread")
    gate = threading.Event()
    copies: list[int] = []
    real = transfer._scatter

    def held(dst, src, index):
        if copies:  # every layer after the first
            assert gate.wait(30)
        real(dst, src, index)
        copies.append(len(copies))

    monkeypatch.setattr(transfer, "_scatter", held)
    pages = random_pages(spec, 3, seed=2)
    blocks = [4, 1, 3]
    pool.load_pages(blocks, pages)
    assert pool.loads.pending
    pool.layer(0)  # returns: layer 0 has arrived
    loaded = torch.stack(pages)
    first = layer_bytes(pool, 0, blocks)
    assert copies == [0]
    assert not any(p.any() for p in layer_bytes(pool, 1, blocks)), "layer 1 is still loading"
    waiter = threading.Thread(target=pool.layer, args=(1,))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "layer 1 waits for its pages"
    gate.set()
    waiter.join(30)
    assert not waiter.is_alive()
    assert copies[:2] == [0, 1]
    pool.loads.finish()
    assert torch.equal(pool.read_pages(blocks), loaded)
    assert all(torch.equal(a, b) for a, b in zip(first, layer_bytes(pool, 0, blocks), strict=True))


def test_a_failed_copy_raises_where_it_is_waited_for_and_never_hangs(monkeypatch):
    pool = DeviceKVPool(SPECS[0], 4, CPU, load_mode="thread")

    def broken(dst, src, index):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(transfer, "_scatter", broken)
    pool.load_pages([1], random_pages(SPECS[0], 1, seed=3))
    with pytest.raises(RuntimeError, match="copy failed"):
        pool.layer(2)
    with pytest.raises(RuntimeError, match="copy failed"):
        pool.loads.finish()
    assert not pool.loads.pending


def test_stream_loads_need_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        DeviceKVPool(SPECS[0], 4, CPU, load_mode="stream")
    assert DeviceKVPool(SPECS[0], 4, CPU).loads.backend == "sync"  # auto on CPU


def test_the_loads_of_a_step_go_out_together_layer_by_layer(monkeypatch):
    """Two requests' loads, started one after the other, are issued by the first wait with
    layer 0 of both first: the second request's layer 0 does not wait for the first
    request's later layers."""
    spec = SPECS[0]
    pool = DeviceKVPool(spec, 10, CPU, load_mode="thread")
    order: list[tuple[int, ...]] = []
    real = transfer._scatter

    def noted(dst, src, index):
        order.append(tuple(index.tolist()))
        real(dst, src, index)

    monkeypatch.setattr(transfer, "_scatter", noted)
    first, second = random_pages(spec, 2, seed=4), random_pages(spec, 3, seed=5)
    pool.load_pages([1, 2], first)
    pool.load_pages([6, 7, 8], second)
    assert not order, "nothing is copied before the step's first wait"
    pool.layer(0)
    pool.loads.finish()
    assert order == [(1, 2), (6, 7, 8)] * spec.num_layers
    assert torch.equal(pool.read_pages([1, 2, 6, 7, 8]), torch.stack(first + second))


def test_issue_starts_the_queued_loads_before_any_wait(monkeypatch):
    """The engine issues a step's loads once its requests are picked: the copies run (on the
    worker thread) before the step reaches its first layer, still layer by layer."""
    spec = SPECS[0]
    pool = DeviceKVPool(spec, 10, CPU, load_mode="thread")
    copied = threading.Event()
    order: list[tuple[int, ...]] = []
    real = transfer._scatter

    def noted(dst, src, index):
        real(dst, src, index)
        order.append(tuple(index.tolist()))
        if len(order) == 2 * spec.num_layers:
            copied.set()

    monkeypatch.setattr(transfer, "_scatter", noted)
    first, second = random_pages(spec, 2, seed=6), random_pages(spec, 1, seed=7)
    pool.load_pages([3, 4], first)
    pool.load_pages([9], second)
    assert not order
    pool.loads.issue()
    assert copied.wait(30), "the copies ran with no wait for a layer"
    assert order == [(3, 4), (9,)] * spec.num_layers
    pool.loads.issue()  # nothing queued: nothing more
    pool.loads.finish()
    assert torch.equal(pool.read_pages([3, 4, 9]), torch.stack(first + second))


def test_host_slots_group_into_runs_of_neighbours_in_slot_order():
    """The 2-D copies of host rows (kvstore/transfer.py, `copy` reads) go one per run."""
    assert transfer.slot_runs([]) == []
    assert transfer.slot_runs([7, 3, 39, 0, 21, 22, 23, 5]) == [
        (0, 1),
        (3, 1),
        (5, 1),
        (7, 1),
        (21, 3),
        (39, 1),
    ]
    assert transfer.slot_runs(list(range(100, 0, -1))) == [(1, 100)]


def test_host_reads_are_named_and_checked():
    loads = DeviceKVPool(SPECS[0], 4, CPU, "sync", "copy").loads
    assert loads.host_reads is transfer.HostReads.COPY
    with pytest.raises(ValueError, match="dma"):
        transfer.SyncLoads(DeviceKVPool(SPECS[0], 4, CPU), host_reads="dma")
    with pytest.raises(ConfigError, match="kv_host_reads"):
        CacheConfig(kv_host_reads="dma")


@pytest.mark.parametrize("spec", SPECS, ids=["bf16", "fp8"])
def test_thread_loads_read_host_rows_in_place_by_runs(spec):
    """Rows of the host tier go straight from the host tensor into the blocks on the worker
    thread, a scatter per run of neighbouring slots (one row twice, into two blocks, too);
    they stay marked as read until the load is done. Spills write rows in place, on the
    worker too: marked as written until they are done."""
    pool = DeviceKVPool(spec, 16, CPU, "thread")
    host = torch.stack(random_pages(spec, 12, seed=3))
    assert pool.loads.read_host_rows(host)
    slots = [7, 3, 8, 0, 9, 3]  # runs: 0 | 3 | 3 | 7 8 9
    blocks = [1, 5, 2, 14, 9, 11]
    pool.load_pages(blocks, [host[s] for s in slots])
    assert pool.loads._reading[3] == 2
    pool.loads.wait_all()
    assert torch.equal(pool.read_pages(blocks), host[slots])
    pool.loads.finish()
    assert not pool.loads._reading and not pool.loads._spare  # nothing was staged
    assert pool.loads.save_host_rows([14, 2], [10, 11]) == 2  # the load's ticket was 1
    pool.loads.before_host_writes([10])  # waits for the save writing that row
    assert not pool.loads._writing and not pool.loads.pending
    assert torch.equal(host[10:12], pool.read_pages([14, 2]))


def test_a_step_waits_for_the_loads_it_needs_and_later_ones_run_on(monkeypatch):
    """Tickets: the first load arrives, the second is held on the worker; a step that
    needs only the first waits for no layer of the second, and `finish` leaves it in
    flight. `done` tells them apart without waiting; the waits cover every load again after
    `finish`."""
    spec = SPECS[0]
    pool = DeviceKVPool(spec, 8, CPU, load_mode="thread")
    loads = pool.loads
    gate = threading.Event()
    real = transfer._scatter
    held = {"on": False}

    def copy(dst, src, index):
        if held["on"]:
            assert gate.wait(30)
        real(dst, src, index)

    monkeypatch.setattr(transfer, "_scatter", copy)
    first, second = random_pages(spec, 2, seed=5), random_pages(spec, 2, seed=6)
    assert loads.start([0, 1], first) == 1
    loads.finish()
    held["on"] = True
    assert loads.start([2, 3], second) == 2
    assert loads.done({1}) and not loads.done({1, 2})  # `done` issued it: the worker holds it
    loads.need({1})
    for layer in range(spec.num_layers):
        pool.layer(layer)  # returns: nothing needed is in flight
    loads.finish()
    assert loads.pending and not loads.done({2})
    assert torch.equal(pool.read_pages([0, 1]), torch.stack(first))
    waits_until_set(gate, loads.finish)  # every load again: waits for the second
    assert not loads.pending and loads.done({2})
    assert torch.equal(pool.read_pages([2, 3]), torch.stack(second))
    assert DeviceKVPool(spec, 2, CPU).loads.start([0], first[:1]) == 0  # sync: arrived


def test_a_save_to_host_rows_runs_beside_the_step_and_orders_what_follows(monkeypatch):
    """A save (a spill into host rows) is held on its thread: `save_host_rows` returns at
    once, a step needing only an earlier load does not wait for it, a load started after it
    starts after it, and its rows are neither read on the host nor rewritten before it is
    done."""
    spec = SPECS[1]
    pool = DeviceKVPool(spec, 8, CPU, load_mode="thread")
    loads = pool.loads
    host = torch.zeros(6, spec.bytes_per_block, dtype=torch.uint8)
    assert loads.read_host_rows(host)
    pages = random_pages(spec, 4, seed=8)
    pool.write_pages([0, 1], pages[:2])
    earlier = loads.start([2, 3], pages[2:])  # a load, not yet issued
    gate = hold_saves(monkeypatch, pool)
    saved = loads.save_host_rows([0, 1], [4, 5])
    assert saved == earlier + 1 and not loads.done({saved}) and loads._writing[4] == 1
    loads.need({earlier})
    for layer in range(spec.num_layers):
        pool.layer(layer)  # the earlier load only
    loads.finish()
    assert torch.equal(pool.read_pages([2, 3]), torch.stack(pages[2:]))
    later = loads.start_host_rows([6, 7], [4, 5])  # reads the rows being saved
    assert not loads.done({later})
    waits_until_set(gate, loads.before_host_writes, [5])  # the row is still being written
    assert loads.done({saved, later}) and not loads._writing
    assert torch.equal(host[4:6], torch.stack(pages[:2]))
    assert torch.equal(pool.read_pages([6, 7]), torch.stack(pages[:2]))  # after the save
