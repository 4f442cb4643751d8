"""Routing policies: the cached prefix against the work waiting, fewest requests, turns."""

from __future__ import annotations

from gateway.kv_index import PrefixHit
from gateway.router import Candidate, RoutingPolicy, choose, cost, prefill_tokens

KV, LEAST, RR = RoutingPolicy.KV_AWARE, RoutingPolicy.LEAST_LOADED, RoutingPolicy.ROUND_ROBIN


def pick(policy, candidates, prompt_tokens=2048, turn=0) -> str:
    return choose(
        policy, candidates, prompt_tokens=prompt_tokens, block_size=16, turn=turn
    ).worker_id


def test_kv_aware_goes_where_the_document_is_cached():
    holder = Candidate("a", hit=PrefixHit(device=120))
    idle = Candidate("b")
    assert pick(KV, [idle, holder]) == "a"
    assert pick(LEAST, [idle, Candidate("a", num_in_flight=1, hit=PrefixHit(device=120))]) == "b"


def test_a_faster_tier_wins_over_a_slower_one():
    on_device = Candidate("a", hit=PrefixHit(device=100))
    on_disk = Candidate("b", hit=PrefixHit(disk=100))
    assert pick(KV, [on_disk, on_device]) == "a"
    assert cost(on_disk, 2048, 16) < cost(Candidate("c"), 2048, 16)  # disk still beats nothing


def test_a_remote_tier_hit_counts_below_a_disk_hit_and_above_nothing():
    on_disk = Candidate("a", hit=PrefixHit(disk=100))
    remote = Candidate("b", hit=PrefixHit(remote=100))
    assert pick(KV, [remote, on_disk]) == "a"
    assert cost(remote, 2048, 16) < cost(Candidate("c"), 2048, 16)
    # an idle worker that can fetch the document beats a busy one that holds it on disk
    busy = Candidate("d", num_running=4, queued_tokens=1024, hit=PrefixHit(disk=100))
    assert pick(KV, [busy, remote]) == "b"


def test_a_worker_far_busier_loses_even_with_the_prefix():
    busy = Candidate("a", num_in_flight=20, queued_tokens=40_000, hit=PrefixHit(device=128))
    idle = Candidate("b")
    assert pick(KV, [busy, idle]) == "b"


def test_a_document_waits_for_its_worker_to_finish_one_other_prompt():
    # the holder computes another 2,048-token prompt first; an idle worker would prefill
    # this document again, finishing no sooner and holding a second copy of it
    holder = Candidate("a", num_in_flight=1, queued_tokens=2048, hit=PrefixHit(device=127))
    idle = Candidate("b")
    assert pick(KV, [idle, holder]) == "a"


def test_queued_work_counts_only_the_uncached_prompt():
    assert prefill_tokens(Candidate("a", hit=PrefixHit(device=120)), 2000, 16) == 80
    assert prefill_tokens(Candidate("a", hit=PrefixHit(device=200)), 2000, 16) == 0
    assert prefill_tokens(Candidate("a"), 2000, 16) == 2000


def test_a_nearly_full_kv_pool_is_avoided():
    full = Candidate("a", kv_usage=0.99, hit=PrefixHit(device=10))
    roomy = Candidate("b", kv_usage=0.2, hit=PrefixHit(device=10))
    assert pick(KV, [full, roomy]) == "b"


def test_ties_and_round_robin_take_turns():
    workers = [Candidate("a"), Candidate("b"), Candidate("c")]
    assert [pick(RR, workers, turn=t) for t in range(4)] == ["a", "b", "c", "a"]
    assert [pick(KV, workers, turn=t) for t in range(3)] == ["a", "b", "c"]
    assert [pick(LEAST, workers, turn=t) for t in range(3)] == ["a", "b", "c"]
