"""The gateway's KV index: deltas in order, gaps asking for a snapshot, strays dropped, the
longest prefix by tier, and blocks just sent counted until the worker reports them."""

from __future__ import annotations

from engine.block_hash import prompt_keys
from engine.fleet import KVEvent
from gateway.kv_index import EXPECTED_S, KVIndex, PrefixHit


def event(seq: int, added=None, removed=None, worker="w1") -> KVEvent:
    return KVEvent(worker_id=worker, seq=seq, added=added or {}, removed=removed or {})


def test_a_prefix_counts_each_block_in_its_fastest_tier_and_stops_at_a_miss():
    index = KVIndex()
    index.add_worker("w1")
    assert index.apply(event(1, added={"device": [1, 2], "host": [3], "disk": [4, 6]}))
    assert index.prefix("w1", [1, 2, 3, 4, 5, 6]) == PrefixHit(device=2, host=1, disk=1)
    assert index.apply(event(2, added={"host": [1]}, removed={"device": [1]}))  # spilled
    assert index.prefix("w1", [1, 2, 3]) == PrefixHit(device=1, host=2, disk=0)  # 1 on host
    assert index.prefix("w2", [1]) == PrefixHit()  # unknown worker: nothing


def test_a_gap_asks_for_the_snapshot_and_old_events_are_ignored():
    index = KVIndex()
    index.add_worker("w1")
    assert index.apply(event(1, added={"device": [1]}))
    assert not index.apply(event(3, added={"device": [2]}))  # 2 was missed
    assert index.num_gaps == 1 and index.prefix("w1", [1, 2]).blocks == 1
    index.load(KVEvent(worker_id="w1", seq=3, snapshot=True, added={"device": [1, 2]}))
    assert index.prefix("w1", [1, 2]).blocks == 2
    assert index.apply(event(2, removed={"device": [1]}))  # older than the snapshot: no-op
    assert index.prefix("w1", [1, 2]).blocks == 2
    assert index.apply(event(4, removed={"device": [1]}))
    assert index.prefix("w1", [1, 2]).blocks == 0


def test_events_of_workers_not_in_the_fleet_are_dropped_and_counted():
    index = KVIndex()
    assert index.apply(event(1, added={"device": [1]}, worker="stranger"))
    assert index.num_dropped == 1 and not index.known("stranger")


def test_blocks_sent_to_a_worker_count_until_it_reports_them_or_they_age_out():
    now = [100.0]
    index = KVIndex(clock=lambda: now[0])
    index.add_worker("w1")
    index.expect("w1", [7, 8])
    assert index.prefix("w1", [7, 8, 9]) == PrefixHit(device=2)
    now[0] += EXPECTED_S + 1
    assert index.prefix("w1", [7, 8]) == PrefixHit()


def test_another_tenants_identical_prompt_matches_nothing():
    index = KVIndex()
    index.add_worker("w1")
    prompt = list(range(64))
    mine = prompt_keys("m|bf16", "tenant:a", "", prompt, 16)
    theirs = prompt_keys("m|bf16", "tenant:b", "", prompt, 16)
    index.apply(event(1, added={"device": mine}))
    assert index.prefix("w1", mine).blocks == 4
    assert index.prefix("w1", theirs).blocks == 0


def test_blocks_in_the_remote_tier_are_a_hit_on_every_worker():
    index = KVIndex()
    for w in ("w1", "w2"):
        index.add_worker(w)
    assert index.apply(event(1, added={"device": [1, 2], "remote": [1, 2, 3]}, worker="w1"))
    assert index.apply(event(1, added={"device": [1]}, worker="w2"))
    # w2 has block 1 itself; 2 and 3 are in the store w1 saved them to; 4 is nowhere
    assert index.prefix("w2", [1, 2, 3, 4]) == PrefixHit(device=1, remote=2)
    assert index.prefix("w1", [1, 2, 3]) == PrefixHit(device=2, remote=1)
    assert index.apply(event(2, removed={"remote": [2]}, worker="w1"))  # evicted for a quota
    assert index.prefix("w2", [1, 2, 3]) == PrefixHit(device=1)
