"""Prompt-lookup drafting, acceptance, and the scheduler's share of speculative decoding."""

import random

import pytest

from engine.block_manager import BlockManager
from engine.config import ConfigError, SchedulerConfig, SpeculativeConfig
from engine.protocol import FinishReason, SamplingParams
from engine.request import Request
from engine.scheduler import Scheduler
from engine.speculative import DraftGate, NgramIndex, accept, draftable

GREEDY = SamplingParams(max_tokens=64, temperature=0.0)


def brute_force(tokens: list[int], min_n: int, max_n: int) -> int | None:
    """The definition of a lookup: the longest suffix (max_n down to min_n) that occurred
    earlier, and the index of what followed its latest earlier occurrence."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # an occurrence ending before the last
            if tokens[end - n : end] == suffix:
                return end
    return None


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix():
    index = NgramIndex(1, 3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    # "5 6" occurred at 0 and 4; the latest (4) was followed by 8 2 5
    assert index.propose(tokens, 3) == [8, 2, 5]
    assert index.propose(tokens, 6) == [8, 2, 5, 6, 8, 2]  # on past the end, repeating
    tokens += [9]  # "6 9" never occurred, nor "5 6 9"; "9" neither
    assert index.propose(tokens, 3) == []
    tokens += [7]  # "9 7" no; "7" occurred at 2, followed by 1 5 6
    assert index.propose(tokens, 2) == [1, 5]


def test_the_suffix_never_matches_itself_and_min_n_is_respected():
    assert NgramIndex(2, 4).propose([1, 2, 3], 4) == []
    assert NgramIndex(2, 4).propose([1, 2, 1], 4) == []  # only a 1-gram repeats
    assert NgramIndex(1, 4).propose([1, 2, 1], 4) == [2, 1, 2, 1]


def test_incremental_indexing_matches_the_definition():
    rng = random.Random(0)
    for trial in range(40):
        min_n, max_n = rng.choice([(1, 3), (2, 4), (3, 3)])
        index = NgramIndex(min_n, max_n)
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
        for _ in range(30):
            assert index.lookup(tokens) == brute_force(tokens, min_n, max_n), trial
            tokens += [rng.randrange(4) for _ in range(rng.randrange(1, 4))]


def test_drafts_keep_following_the_place_being_copied():
    index = NgramIndex(2, 2)
    #          0  1  2  3  4  5  6  7  8  9 10 11 12 13
    tokens = [1, 2, 3, 4, 5, 6, 9, 1, 2, 7, 7, 4, 1, 2]
    # "1 2" last occurred at 7, followed by 7 7 4 ...
    assert index.propose(tokens, 2) == [7, 7]
    tokens += [3, 4]  # but the sequence went on as at 0: 1 2 3 4
    assert index.propose(tokens, 2) == [5, 6]  # "3 4" occurred only at 2
    tokens += [5, 6]  # it is copying from 2 on: the drafts follow it...
    assert index.propose(tokens, 3) == [9, 1, 2]
    tokens += [9, 1, 2]  # ...on to what followed there (7 7, from 9)...
    assert index.propose(tokens, 2) == [7, 7]
    assert index.lookup(tokens) == 14  # ...where an n-gram lookup jumps to "1 2" at 12
    tokens += [8]  # the copy broke off: back to lookups ("2 8" never occurred)
    assert index.propose(tokens, 2) == []


def test_acceptance_keeps_drafts_up_to_the_first_the_model_disagrees_with():
    # the model's token after the known ones is 4; after draft j it would say verified[j]
    assert accept(4, [4, 5, 6], [5, 6, 7]) == [4, 5, 6, 7]  # all drafts, plus one
    assert accept(4, [4, 9, 6], [5, 6, 7]) == [4, 5]  # draft 2 refused: the model's 5
    assert accept(3, [4, 5, 6], [5, 6, 7]) == [3]  # the first draft refused


def test_only_requests_sampled_from_each_positions_logits_are_drafted_for():
    assert draftable(GREEDY, 0)
    assert draftable(SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=1), 0)
    for params in (
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, json_schema='{"type": "object"}'),
    ):
        assert not draftable(params, 0), params
    held = SamplingParams(temperature=0.0, min_tokens=5)
    assert not draftable(held, 4) and draftable(held, 5)


def test_options_are_checked():
    with pytest.raises(ConfigError):
        SpeculativeConfig(num_speculative_tokens=-1)
    with pytest.raises(ConfigError):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ConfigError):
        SpeculativeConfig(max_step_drafts=0)


def make(k=4, num_blocks=64, block_size=4, max_model_len=None, **cfg):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(
        SchedulerConfig(**cfg),
        bm,
        max_model_len=max_model_len or num_blocks * block_size,
        speculative=SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1),
    )


def step(s: Scheduler, model: dict[int, int]):
    """One step with a stand-in model whose next token after t is model[t]: drafts are
    checked against it as the runner and core would, and the tokens appended."""
    out = s.schedule()
    rejected, new_tokens = {}, {}
    for sr in out.scheduled:
        if not sr.completes_sequence:
            continue
        r = sr.request
        first = model[r.all_token_ids[-1]]
        tokens = accept(first, sr.draft_token_ids, [model[d] for d in sr.draft_token_ids])
        rejected[r.request_id] = len(sr.draft_token_ids) - (len(tokens) - 1)
        new_tokens[r.request_id] = tokens
    s.advance(out, rejected)
    for sr in out.scheduled:
        r = sr.request
        for token in new_tokens.get(r.request_id, []):
            r.append_token(token)
            if s.check_stop(r, frozenset({0})):
                break
        if sr.completes_sequence and not r.is_finished:
            assert r.num_computed_tokens == r.num_tokens - 1
    s.block_manager.check_integrity()
    return out


CYCLE = {1: 2, 2: 3, 3: 1}  # a model that repeats 1 2 3 forever


def test_a_repeating_sequence_is_drafted_and_every_draft_accepted():
    s = make(k=4)
    req = Request("a", [1, 2, 3, 1, 2, 3, 1], GREEDY)
    s.add_request(req)
    step(s, CYCLE)  # the prompt: no drafts in a prefill step
    assert req.output_token_ids == [2]
    out = step(s, CYCLE)
    assert out.scheduled[0].draft_token_ids == [3, 1, 2, 3]
    assert out.scheduled[0].num_new_tokens == 5
    assert req.output_token_ids == [2, 3, 1, 2, 3, 1]  # four drafts and the model's token


def test_refused_drafts_are_not_credited():
    s = make(k=4)
    req = Request("a", [1, 2, 3, 1, 2, 3, 1, 2], GREEDY)
    s.add_request(req)
    step(s, CYCLE)
    # the drafts say 3 1 2 3 ... but this model continues 1 -> 5 after a 3
    liar = {**CYCLE, 1: 5, 5: 6, 6: 7}
    out = step(s, liar)
    assert out.scheduled[0].draft_token_ids == [1, 2, 3, 1]
    assert req.output_token_ids == [3, 1, 5]  # draft 1 kept, draft 2 refused
    assert req.num_computed_tokens == req.num_tokens - 1


def test_drafts_stay_within_max_tokens_context_and_budget():
    s = make(k=4, max_num_batched_tokens=3)
    req = Request("a", [1, 2, 3, 1, 2, 3, 1], SamplingParams(max_tokens=4, temperature=0.0))
    s.add_request(req)
    drafted = [len(step(s, CYCLE).scheduled[0].draft_token_ids) for _ in range(4)]
    # prompt chunks of 3, 3, then its last token with 2 drafts (the budget's 3 tokens); then
    # one more token makes max_tokens: no room for drafts
    assert drafted == [0, 0, 2, 0]
    assert req.output_token_ids == [2, 3, 1, 2] and req.is_finished  # exactly max_tokens

    s = make(k=4, max_model_len=10)
    req = Request("b", [1, 2, 3, 1, 2, 3, 1], GREEDY)
    s.add_request(req)
    step(s, CYCLE)
    out = step(s, CYCLE)
    assert len(out.scheduled[0].draft_token_ids) == 1  # position 9 is the last
    assert req.num_tokens == 10 and req.is_finished


def test_eos_among_accepted_tokens_ends_the_request_there():
    s = make(k=4)
    req = Request("a", [1, 2, 3, 0, 7, 1, 2], GREEDY)
    s.add_request(req)
    model = {2: 3, 3: 0, 0: 7, 7: 1, 1: 2}
    step(s, model)  # -> 3
    out = step(s, model)
    # drafts 0 7 1 2 (what followed "1 2 3" before) are all the model's tokens, but the
    # first of them is EOS: the request ends there, with nothing after it
    assert out.scheduled[0].draft_token_ids == [0, 7, 1, 2]
    assert req.output_token_ids == [3, 0]
    assert req.is_finished and req.finish_reason is FinishReason.STOP


def test_drafts_never_take_blocks_a_request_would_be_preempted_for():
    # 3 blocks of 4 tokens: a 7-token prompt plus its next token fill two; drafts would
    # need the third, which the other request holds
    s = make(k=4, num_blocks=3)
    a = Request("a", [1, 2, 3, 1, 2, 3, 1], GREEDY)
    b = Request("b", [9, 9, 9], GREEDY)
    s.add_request(a)
    s.add_request(b)
    step(s, {**CYCLE, 9: 9})
    out = step(s, {**CYCLE, 9: 9})
    drafted = {sr.request.request_id: sr.draft_token_ids for sr in out.scheduled}
    assert drafted["a"] == [] and not out.preempted_ids
    assert s.num_preemptions == 0


def test_running_requests_share_the_steps_drafts():
    for num, share in ((1, 4), (2, 4), (3, 2), (4, 2), (5, 1), (8, 1), (9, 0)):
        s = make(k=4)  # 8 drafts per step
        for i in range(num):
            s.add_request(Request(f"r{i}", [1, 2, 3, 1, 2, 3, 1], GREEDY))
        step(s, CYCLE)
        out = step(s, CYCLE)
        assert [len(sr.draft_token_ids) for sr in out.scheduled] == [share] * num


def test_a_request_drafts_less_after_a_miss_and_more_after_a_full_hit():
    s = make(k=4)
    req = Request("a", [1, 2, 3, 1, 2, 3, 1], GREEDY)
    s.add_request(req)
    step(s, CYCLE)
    liar = {**CYCLE, 2: 1}  # after 1 2 comes 1, not the 3 the drafts say
    lengths = [len(step(s, m).scheduled[0].draft_token_ids) for m in (liar, CYCLE, CYCLE, CYCLE)]
    # 4 drafts (3 ...) refused at once; then 1 (kept); then 2, then 4
    assert lengths == [4, 1, 2, 4]


# DraftGate: drafting goes on only while drafted steps produce more tokens per second


def test_the_gate_tries_drafting_then_plain_steps_then_follows_the_faster():
    gate = DraftGate(probe_every=4, samples=2)
    for _ in range(2):
        assert gate.allow(1)  # drafts first, until there are two samples
        gate.record(1, 0.020, 3, drafted=True)  # 150 tokens/s
    gate.record(1, 0.900, 1, drafted=False)  # a plain step slowed by something else
    assert not gate.allow(1)  # one plain sample is not enough
    gate.record(1, 0.010, 1, drafted=False)  # 100 tokens/s
    gate.record(1, 0.010, 1, drafted=False)  # the median leaves the outlier out
    assert gate.rate(1, drafted=False) == pytest.approx(100)
    decisions = [gate.allow(1) for _ in range(8)]
    assert decisions == [True, True, True, False] * 2  # every 4th decision probes the loser
    for _ in range(8):  # drafted steps turn slow: 3 tokens in 40 ms
        gate.record(1, 0.040, 3, drafted=True)
    assert gate.rate(1, drafted=True) == pytest.approx(75)
    assert [gate.allow(1) for _ in range(8)] == [False, False, False, True] * 2


def test_the_gate_judges_each_batch_size_apart():
    gate = DraftGate(samples=1)
    for batch, drafted_seconds in ((1, 0.012), (8, 0.080)):
        gate.record(batch, drafted_seconds, 2 * batch, drafted=True)
        gate.record(batch, 0.010, batch, drafted=False)
    assert gate.allow(1)  # 2 tokens in 12 ms beat 1 in 10 ms
    assert not gate.allow(8) and not gate.allow(5)  # 16 in 80 ms lose to 8 in 10 ms
    assert gate.allow(2) and gate.allow(16)  # sizes not seen yet: drafts first
