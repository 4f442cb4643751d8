import json
import math

import pytest
import torch

from engine.protocol import SamplingParams
from engine.request import Request
from engine.sampler import build_sampling_batch, sample

V = 32


def reqs(*params: SamplingParams, outputs=None):
    out = []
    for i, p in enumerate(params):
        r = Request(str(i), [1, 2, 3], p)
        for t in (outputs or {}).get(i, []):
            r.append_token(t)
        out.append(r)
    return out


def run(requests, logits, gen=None):
    batch = build_sampling_batch(requests, V, torch.device("cpu"))
    return sample(logits.clone(), batch, gen)


def test_greedy_is_argmax():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    out = run(reqs(*[SamplingParams(temperature=0.0)] * 4), logits)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_one_and_tiny_top_p_reduce_to_greedy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, V, generator=g)
    for _ in range(20):
        out = run(
            reqs(
                SamplingParams(temperature=1.5, top_k=1),
                SamplingParams(temperature=1.5, top_p=1e-6),
            ),
            logits,
            g,
        )
        assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_restricts_support():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, V, generator=g)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    seen = {
        int(run(reqs(SamplingParams(temperature=5.0, top_k=3)), logits, g).token_ids[0])
        for _ in range(200)
    }
    assert seen <= allowed
    assert len(seen) == 3


def test_min_p_drops_unlikely_tokens():
    logits = torch.full((1, V), -10.0)
    logits[0, 5] = 5.0
    logits[0, 6] = 4.5
    g = torch.Generator().manual_seed(3)
    seen = {
        int(run(reqs(SamplingParams(temperature=1.0, min_p=0.1)), logits, g).token_ids[0])
        for _ in range(200)
    }
    assert seen == {5, 6}


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (V - 3)]))
    g = torch.Generator().manual_seed(4)
    counts = torch.zeros(V)
    for _ in range(3000):
        counts[run(reqs(SamplingParams(temperature=1.0)), logits, g).token_ids[0]] += 1
    freq = counts[:3] / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.04)


def test_seeded_rows_are_reproducible_and_independent_of_batch_mates():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, V, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draws(batch_params, row):
        rs = reqs(*batch_params)
        return [int(run(rs, logits[: len(rs)], g).token_ids[row]) for _ in range(30)]

    alone = draws([seeded], 0)
    assert alone == draws([seeded], 0)
    # same request in slot 1 next to different mates: identical stream
    logits[1] = logits[0]
    assert draws([SamplingParams(temperature=0.7), seeded, SamplingParams(seed=9)], 1) == alone
    other_seed = draws([SamplingParams(temperature=1.0, seed=4321)], 0)
    assert other_seed != alone


def test_frequency_and_presence_penalties():
    logits = torch.zeros(1, V)
    logits[0, 4] = 1.0
    logits[0, 5] = 0.9
    p = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    out = run(reqs(p, outputs={0: [4]}), logits)
    assert int(out.token_ids[0]) == 5  # 1.0 - 0.5 < 0.9
    p = SamplingParams(temperature=0.0, presence_penalty=0.05)
    out = run(reqs(p, outputs={0: [4, 4, 4]}), logits)
    assert int(out.token_ids[0]) == 4  # presence ignores the count: 0.95 > 0.9


def test_repetition_penalty_covers_prompt_tokens():
    logits = torch.zeros(1, V)
    logits[0, 2] = 2.0  # token 2 is in the prompt [1, 2, 3]
    logits[0, 9] = 1.5
    out = run(reqs(SamplingParams(temperature=0.0, repetition_penalty=2.0)), logits)
    assert int(out.token_ids[0]) == 9


def test_logprobs_are_raw_log_softmax():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, V, generator=g)
    out = run(
        reqs(SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0)), logits
    )
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs is not None
    assert out.top_ids is not None
    assert out.top_logprobs is not None
    assert math.isclose(float(out.logprobs[0]), float(ref[0].max()), rel_tol=1e-5)
    assert out.top_ids[0].tolist() == torch.topk(ref[0], 3).indices.tolist()


def test_top_p_applies_per_row_in_a_mixed_batch():
    row = torch.log(torch.tensor([0.4, 0.35, 0.25] + [1e-9] * (V - 3)))
    logits = torch.stack([row, row])
    g = torch.Generator().manual_seed(5)
    seen: list[set[int]] = [set(), set()]
    for _ in range(300):
        params = (SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0))
        for i, t in enumerate(run(reqs(*params), logits, g).token_ids.tolist()):
            seen[i].add(t)
    assert seen == [{0, 1}, {0, 1, 2}]


def test_logit_bias_steers_its_own_row_and_leaves_logprobs_raw():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(7))
    top, low = logits[0].argmax().item(), logits[0].argmin().item()
    out = run(
        reqs(
            SamplingParams(temperature=0.0, logit_bias={top: -100.0}, logprobs=1),
            SamplingParams(temperature=0.0, logit_bias={low: 100.0}),
            SamplingParams(temperature=0.0),
        ),
        logits,
    )
    banned_winner = logits[0].clone()
    banned_winner[top] -= 100
    assert out.token_ids[0].item() == banned_winner.argmax().item() != top
    assert out.token_ids[1].item() == low != logits[1].argmax().item()
    assert out.token_ids[2].item() == logits[2].argmax().item()
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs is not None
    assert math.isclose(out.logprobs[0].item(), raw[0, out.token_ids[0]].item(), abs_tol=1e-6)


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    logits = torch.zeros(3, V)
    logits[:, 5] = 10.0  # EOS is by far the likeliest token
    logits[:, 6] = 5.0
    params = SamplingParams(temperature=0.0, min_tokens=2)
    stop_id = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(6,))
    requests = reqs(params, params, stop_id, outputs={1: [9, 9]})
    batch = build_sampling_batch(requests, V, torch.device("cpu"), frozenset({5}))
    out = sample(logits.clone(), batch)
    # row 0 has no output yet: EOS is held back; row 1 reached min_tokens; row 2 also bans 6
    assert out.token_ids.tolist() == [6, 5, 0]


# -- response formats -----------------------------------------------------------------------

JV = 262  # the 256 bytes, then '{"', 'Paris', 'true', '}', a special token, a stop token
JSON_VOCAB: list[bytes | None] = [bytes((b,)) for b in range(256)]
JSON_VOCAB += [b'{"', b"Paris", b"true", b"}", None, None]
OPEN, PARIS, TRUE, STOP = 256, 257, 258, 261


@pytest.fixture(scope="module")
def grammars():
    from engine.config import GrammarBackend
    from engine.structured.backend import Vocabulary
    from engine.structured.compilers import make_compiler

    specials = {260: "<|x|>", STOP: "<|end|>"}
    vocab = Vocabulary(JSON_VOCAB, specials, STOP, lambda t: list(t.encode()))
    return make_compiler(GrammarBackend.LLGUIDANCE, vocab)


def constrained(grammars, schema: dict, **params) -> Request:
    text = json.dumps(schema)
    r = Request("r", [1, 2, 3], SamplingParams(json_schema=text, **params))
    r.matcher = grammars.matcher(text, None, frozenset({STOP}))
    return r


def run_constrained(requests, logits, gen=None):
    batch = build_sampling_batch(requests, JV, torch.device("cpu"), frozenset({STOP}))
    return sample(logits.clone(), batch, gen, argmax=lambda x: x.argmax(dim=-1))


def test_a_greedy_row_takes_its_best_token_the_grammar_allows(grammars):
    logits = torch.zeros(2, JV)
    logits[:, PARIS] = 9.0  # what the model wants, and JSON does not start so
    logits[:, STOP] = 8.0  # nor is an empty output a value
    logits[:, OPEN] = 5.0
    logits[:, ord("{")] = 4.0
    free = reqs(SamplingParams(temperature=0.0))[0]
    row = constrained(grammars, {"type": "object"}, temperature=0.0, logprobs=1)
    out = run_constrained([row, free], logits)
    assert out.token_ids.tolist() == [OPEN, PARIS]
    # the logprobs reported are the model's own, before the grammar's mask
    assert out.top_ids is not None and out.top_ids[0].tolist() == [PARIS]


def test_a_sampled_row_draws_from_its_distribution_restricted_to_allowed_tokens(grammars):
    probs = torch.full((JV,), 1e-9)
    probs[PARIS], probs[ord("1")], probs[ord("2")] = 0.7, 0.2, 0.1
    logits = probs.log().expand(3000, JV)
    rows = [
        constrained(grammars, {"type": "integer"}, temperature=1.0, seed=i) for i in range(3000)
    ]
    tokens = run_constrained(rows, logits).token_ids.tolist()
    assert set(tokens) <= {ord(c) for c in "0123456789-"}
    share = tokens.count(ord("1")) / len(tokens)
    assert abs(share - 2 / 3) < 0.05  # 0.2 / (0.2 + 0.1)


def test_filters_apply_to_the_allowed_tokens_only(grammars):
    logits = torch.zeros(1, JV)
    logits[0, PARIS], logits[0, ord("7")], logits[0, ord("3")] = 9.0, 2.0, 1.0
    row = constrained(grammars, {"type": "integer"}, temperature=1.0, top_k=1, seed=0)
    assert run_constrained([row], logits).token_ids.tolist() == [ord("7")]


def test_a_seeded_constrained_row_repeats_whatever_its_batch(grammars):
    logits = torch.randn(4, JV, generator=torch.Generator().manual_seed(0))
    params = {"temperature": 1.0, "seed": 11}
    alone = run_constrained([constrained(grammars, {"type": "object"}, **params)], logits[:1])
    mates = [
        constrained(grammars, {"type": "object"}, **params),
        *reqs(SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)),
        constrained(grammars, {"type": "integer"}, temperature=0.5),
    ]
    batch = run_constrained(mates, logits)
    assert batch.token_ids[0] == alone.token_ids[0]


def test_the_mask_is_applied_to_the_constrained_rows_only_in_one_op():
    from engine.structured.bitmask import apply_bitmask, unpack_refused_on_device

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 70, generator=gen)
    bits = torch.randint(0, 2, (2, 96), generator=gen)  # [C, 3 words x 32]: token t's bit
    bits[:, 31] = 1  # bit 31 makes a word negative: still read right
    words = (bits.view(2, 3, 32) << torch.arange(32)).sum(-1)  # [C, 3] as unsigned values
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    masked = logits.clone()
    apply_bitmask(masked, torch.tensor([3, 1]), bitmask)
    for row, c in ((3, 0), (1, 1)):
        want = torch.where(bits[c, :70].bool(), logits[row], float("-inf"))
        assert torch.equal(masked[row], want)
    assert torch.equal(masked[[0, 2, 4]], logits[[0, 2, 4]])
    every = logits[:2].clone()
    apply_bitmask(every, None, bitmask)
    assert torch.equal(every[0], torch.where(bits[0, :70].bool(), logits[0], float("-inf")))
    # what a CUDA bitmask goes through, on the CPU: the same bits
    assert torch.equal(unpack_refused_on_device(bitmask), bits == 0)
