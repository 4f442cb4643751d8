"""Scheduler logic without a model: tokens are appended by hand after each step."""

from collections import Counter

import pytest

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig, SchedulingPolicy
from engine.protocol import FinishReason, SamplingParams
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def make(num_blocks=64, block_size=4, cache_namespace="", **cfg):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(
        SchedulerConfig(**cfg),
        bm,
        max_model_len=num_blocks * block_size,
        cache_namespace=cache_namespace,
    )


def run_step(s: Scheduler, token=7):
    out = s.schedule()
    s.advance(out)
    for sr in out.scheduled:
        r = sr.request
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(token)
            s.check_stop(r, frozenset({0}))
    s.block_manager.check_integrity()
    return out


def test_chunked_prefill_respects_token_budget():
    s = make(max_num_batched_tokens=5)
    s.add_request(Request("a", list(range(1, 13)), GREEDY))
    chunks = []
    while True:
        out = s.schedule()
        chunks.append(out.num_tokens)
        done = out.scheduled[0].completes_sequence
        s.advance(out)
        if done:
            break
    assert chunks == [5, 5, 2]


def test_decode_and_new_prefill_share_a_step():
    s = make(max_num_batched_tokens=8)
    s.add_request(Request("a", [1, 2, 3], GREEDY))
    run_step(s)
    s.add_request(Request("b", list(range(1, 20)), GREEDY))
    out = run_step(s)
    sizes = {sr.request.request_id: sr.num_new_tokens for sr in out.scheduled}
    assert sizes == {"a": 1, "b": 7}


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add_request(Request(str(i), [1, 2], GREEDY))
    out = run_step(s)
    assert len(out.scheduled) == 2
    assert s.num_waiting == 1


def test_finishes_on_max_tokens_and_eos_and_frees_blocks():
    s = make()
    s.add_request(Request("len", [1, 2], SamplingParams(max_tokens=2, temperature=0.0)))
    run_step(s)
    run_step(s)
    assert not s.has_unfinished()
    r = Request("eos", [1, 2], GREEDY)
    s.add_request(r)
    run_step(s, token=0)
    assert r.finish_reason is FinishReason.STOP
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_ignore_eos_and_stop_token_ids():
    s = make()
    r = Request("a", [1], SamplingParams(max_tokens=3, ignore_eos=True, stop_token_ids=(9,)))
    s.add_request(r)
    run_step(s, token=0)
    assert not r.is_finished
    run_step(s, token=9)
    assert r.finish_reason is FinishReason.STOP
    assert r.stop_reason == 9


def test_preemption_recomputes_newest_request_first():
    # 4 blocks of 4 tokens; two requests of 7 prompt tokens fill the pool as they grow
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = Request("a", list(range(1, 8)), SamplingParams(max_tokens=6, temperature=0.0))
    b = Request("b", list(range(1, 8)), SamplingParams(max_tokens=6, temperature=0.0))
    s.add_request(a)
    s.add_request(b)
    preempted = []
    for _ in range(40):
        if not s.has_unfinished():
            break
        preempted += run_step(s).preempted_ids
    assert not s.has_unfinished()
    assert "b" in preempted
    assert "a" not in preempted
    assert b.num_preemptions >= 1
    assert a.num_output_tokens == b.num_output_tokens == 6


def test_priority_policy_admits_and_keeps_urgent_requests():
    s = make(num_blocks=4, block_size=4, max_num_seqs=1, policy=SchedulingPolicy.PRIORITY)
    low = Request("low", [1, 2], GREEDY, priority=5, arrival_time=0.0)
    high = Request("high", [1, 2], GREEDY, priority=-1, arrival_time=1.0)
    s.add_request(low)
    s.add_request(high)
    out = run_step(s)
    assert [sr.request.request_id for sr in out.scheduled] == ["high"]


def test_priority_policy_preempts_least_urgent():
    s = make(num_blocks=4, block_size=4, policy=SchedulingPolicy.PRIORITY)
    urgent = Request(
        "u", list(range(1, 8)), SamplingParams(max_tokens=8), priority=0, arrival_time=1.0
    )
    lazy = Request(
        "l", list(range(1, 8)), SamplingParams(max_tokens=8), priority=9, arrival_time=0.0
    )
    s.add_request(lazy)
    s.add_request(urgent)
    preempted = []
    while s.has_unfinished():
        preempted += run_step(s).preempted_ids
    assert preempted
    assert set(preempted) == {"l"}


def test_finish_waiting_request_removes_it():
    s = make(max_num_seqs=1)
    s.add_request(Request("a", [1], GREEDY))
    r = Request("b", [1], GREEDY)
    s.add_request(r)
    run_step(s)
    s.finish_request(r, FinishReason.ABORT)
    assert r.status is RequestStatus.FINISHED
    assert s.num_waiting == 0


@pytest.mark.parametrize("policy", list(SchedulingPolicy))
def test_many_requests_all_finish_under_pressure(policy):
    s = make(num_blocks=6, block_size=4, max_num_batched_tokens=6, policy=policy)
    reqs = [
        Request(
            str(i),
            list(range(1, 2 + i % 7)),
            SamplingParams(max_tokens=5),
            priority=i % 3,
            tenant=f"t{i % 4}",
            weight=1.0 + i % 2,
        )
        for i in range(12)
    ]
    for r in reqs:
        s.add_request(r)
    for _ in range(500):
        if not s.has_unfinished():
            break
        run_step(s)
    assert all(r.num_output_tokens == 5 for r in reqs)
    assert s.block_manager.num_free_blocks == 6


def _served(s: Scheduler, steps: int) -> Counter[str]:
    """Tokens computed per tenant over `steps` steps."""
    served: Counter[str] = Counter()
    for _ in range(steps):
        for sr in run_step(s).scheduled:
            served[sr.request.tenant] += sr.num_new_tokens
    return served


def _flood(s: Scheduler, tenant: str, n: int, weight: float = 1.0, t0: float = 0.0) -> None:
    for i in range(n):
        s.add_request(
            Request(
                f"{tenant}{i}",
                [1, 2, 3, 4],
                SamplingParams(max_tokens=8),
                tenant=tenant,
                weight=weight,
                arrival_time=t0 + i,
            )
        )


def test_fair_policy_shares_the_engine_by_weight():
    s = make(num_blocks=512, max_num_seqs=4, policy=SchedulingPolicy.FAIR)
    _flood(s, "free", 200, weight=1.0)  # arrives first: fcfs would serve it alone
    _flood(s, "gold", 200, weight=3.0, t0=1000.0)
    served = _served(s, 300)
    assert 2.6 <= served["gold"] / served["free"] <= 3.4, served


def test_fcfs_ignores_weight():
    s = make(num_blocks=512, max_num_seqs=4, policy=SchedulingPolicy.FCFS)
    _flood(s, "free", 200, weight=1.0)
    _flood(s, "gold", 200, weight=3.0, t0=1000.0)
    assert _served(s, 100)["gold"] == 0  # the contrast that makes the test above meaningful


def test_fair_policy_idle_tenant_banks_no_credit():
    s = make(num_blocks=512, max_num_seqs=4, policy=SchedulingPolicy.FAIR)
    _flood(s, "busy", 200)
    _served(s, 200)  # busy runs alone and accumulates virtual time
    _flood(s, "late", 200, t0=1e6)
    served = _served(s, 200)
    # the late tenant joins at busy's virtual time: an even split, not a monopoly
    assert 0.7 <= served["late"] / served["busy"] <= 1.4, served


def test_fair_policy_puts_priority_before_share():
    s = make(num_blocks=512, max_num_seqs=1, policy=SchedulingPolicy.FAIR)
    heavy = Request("heavy", [1, 2], GREEDY, tenant="a", priority=-1, arrival_time=5.0)
    s.add_request(Request("light", [1, 2], GREEDY, tenant="b", arrival_time=0.0))
    s.add_request(heavy)
    assert [sr.request.request_id for sr in run_step(s).scheduled] == ["heavy"]


def test_fair_policy_preempts_the_tenant_furthest_ahead():
    s = make(num_blocks=6, block_size=4, max_num_seqs=2, policy=SchedulingPolicy.FAIR)
    ahead = Request("ahead", [1] * 8, SamplingParams(max_tokens=12), tenant="a", arrival_time=0)
    behind = Request("behind", [1] * 8, SamplingParams(max_tokens=12), tenant="b", weight=4.0)
    s.add_request(ahead)
    s.add_request(behind)
    preempted: list[str] = []
    while s.has_unfinished():
        preempted += run_step(s).preempted_ids
    assert preempted
    assert set(preempted) == {"ahead"}


def _finish_alone(s: Scheduler, r: Request) -> None:
    s.add_request(r)
    while not r.is_finished:
        run_step(s)


def test_a_repeated_prefix_is_served_from_the_cache():
    s = make(num_blocks=64, block_size=4, cache_namespace="m|bf16")
    prompt = list(range(1, 15))  # 3 full blocks + 2 tokens
    _finish_alone(s, Request("a", prompt, GREEDY, cache_salt="t1"))
    again = Request("b", prompt, GREEDY, cache_salt="t1")
    s.add_request(again)
    out = run_step(s)
    assert again.num_cached_tokens == 12  # three blocks, not the partial one
    assert out.scheduled[0].num_new_tokens == 2
    other = Request("c", prompt, GREEDY, cache_salt="t2")  # another tenant: no hit
    _finish_alone(s, other)
    assert other.num_cached_tokens == 0
    exact = Request("d", prompt[:12], GREEDY, cache_salt="t1")  # all full blocks cached
    s.add_request(exact)
    run_step(s)
    assert exact.num_cached_tokens == 8  # the last token is always computed
    s.block_manager.check_integrity()


def test_generated_tokens_are_cached_too():
    s = make(num_blocks=64, block_size=4)
    first = Request("a", [1, 2, 3], SamplingParams(max_tokens=9, temperature=0.0))
    _finish_alone(s, first)  # 3 prompt + 9 generated: blocks of tokens 0..11, 2 computed
    follow_up = Request("b", [*first.all_token_ids, 5], GREEDY)
    s.add_request(follow_up)
    run_step(s)
    assert follow_up.num_cached_tokens == 8
    s.block_manager.check_integrity()


def test_caching_off_means_no_hits():
    s = make(num_blocks=64, block_size=4)
    s.block_manager.enable_caching = False
    _finish_alone(s, Request("a", list(range(1, 15)), GREEDY))
    again = Request("b", list(range(1, 15)), GREEDY)
    s.add_request(again)
    run_step(s)
    assert again.num_cached_tokens == 0


def _disk_backed(tmp_path, **cfg):
    """A scheduler over 8 device blocks of 4 tokens, with a disk tier (no host tier), and
    that tier's store."""
    import torch

    from kvstore.base import KVCacheSpec
    from kvstore.connector import TierConnector
    from kvstore.device_pool import DeviceKVPool
    from kvstore.tiers import KVOffloader, TieredKVStore

    pool = DeviceKVPool(KVCacheSpec(1, 1, 16, 4, torch.float32), 8, torch.device("cpu"))
    store = TieredKVStore(
        pool.spec.bytes_per_block, host_blocks=0, disk_blocks=16, disk_dir=tmp_path
    )
    bm = BlockManager(8, 4, connector=TierConnector(KVOffloader(pool, store)))
    return Scheduler(SchedulerConfig(**cfg), bm, max_model_len=32, cache_namespace="m"), store


def _push_to_disk(s: Scheduler, prompt: list[int]) -> None:
    """Serve `prompt` once, then a longer request that takes every block: its pages end up
    on disk."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    _finish_alone(s, Request("doc", prompt, params))
    _finish_alone(s, Request("filler", list(range(100, 128)), params))
    assert s.block_manager.lookup(s._block_hashes(Request("probe", prompt, params))) == []
    connector = s.block_manager.connector
    connector.offloader.store.disk.reap(wait=True)  # written: reads go to the file


def test_a_request_waiting_for_a_slot_has_its_disk_pages_read_meanwhile(tmp_path):
    from tests.unit.kvstore.test_disk import HeldReaders

    s, store = _disk_backed(tmp_path, max_num_seqs=1)
    doc = list(range(1, 14))  # three full blocks
    _push_to_disk(s, doc)
    disk = store.disk
    held = HeldReaders(store)
    runner = Request("runner", [50, 51, 52], SamplingParams(max_tokens=6, ignore_eos=True))
    s.add_request(runner)
    run_step(s)
    reader = Request("reader", doc, GREEDY)
    s.add_request(reader)
    run_step(s)
    assert reader.status is RequestStatus.WAITING and len(disk.open_fetches) == 1
    held.release()
    for _ in range(50):
        disk.wait_reads(0.1)
    assert disk.open_fetches[0].done, "read while the runner holds the only slot"
    while not runner.is_finished:
        run_step(s)
    run_step(s)
    assert reader.status is RequestStatus.RUNNING
    assert reader.num_cached_tokens == reader.num_cached_disk_tokens == 12
    assert not disk.open_fetches
    store.close()


def test_a_request_whose_pages_are_being_read_keeps_its_place(tmp_path):
    from tests.unit.kvstore.test_disk import HeldReaders

    s, store = _disk_backed(tmp_path, max_num_seqs=1, policy=SchedulingPolicy.FCFS)
    doc = list(range(1, 14))
    _push_to_disk(s, doc)
    held = HeldReaders(store)
    reader = Request("reader", doc, GREEDY)
    late = [Request(f"late{i}", [60 + i, 61, 62], GREEDY) for i in range(2)]
    for r in (reader, *late):
        s.add_request(r)
    out = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["late0"]  # not held up
    assert [r.request_id for r in s.waiting] == ["reader", "late1"]
    held.release()
    for _ in range(50):
        s.block_manager.wait_below(0.1)
    while not late[0].is_finished:
        run_step(s)
    out = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["reader"]
    assert reader.num_cached_disk_tokens == 12
    store.close()


@pytest.mark.parametrize(("cap", "first_step"), [(2, ["qa"]), (4, ["qa", "qb"])])
def test_a_busy_step_admits_pages_from_host_up_to_its_cap(cap, first_step):
    """Two documents in host RAM, two blocks each, and a request decoding: with a cap of two
    loaded blocks a step, the second reader waits (in its place) for the next step; with
    four, both join the first."""
    import torch

    from kvstore.base import KVCacheSpec
    from kvstore.connector import TierConnector
    from kvstore.device_pool import DeviceKVPool
    from kvstore.tiers import KVOffloader, TieredKVStore

    pool = DeviceKVPool(KVCacheSpec(1, 1, 16, 4, torch.float32), 12, torch.device("cpu"))
    store = TieredKVStore(pool.spec.bytes_per_block, host_blocks=16)
    bm = BlockManager(12, 4, connector=TierConnector(KVOffloader(pool, store)))
    config = SchedulerConfig(max_loaded_blocks_per_step=cap)
    s = Scheduler(config, bm, max_model_len=48, cache_namespace="m")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    docs = {"qa": list(range(1, 10)), "qb": list(range(20, 29))}
    for name, doc in docs.items():
        _finish_alone(s, Request(f"{name}-doc", doc, params))
    _finish_alone(s, Request("filler", list(range(100, 144)), params))  # every block
    runner = Request("runner", [50, 51, 52], SamplingParams(max_tokens=20, ignore_eos=True))
    s.add_request(runner)
    run_step(s)
    readers = {name: Request(name, [*doc, 99], params) for name, doc in docs.items()}
    for r in readers.values():
        s.add_request(r)
    out = run_step(s)
    assert [sr.request.request_id for sr in out.scheduled] == ["runner", *first_step]
    out = run_step(s)
    assert {r.request_id for r in s.running} == {"runner", "qa", "qb"}
    assert all(r.num_cached_host_tokens == 8 for r in readers.values())
    bm.check_integrity()
