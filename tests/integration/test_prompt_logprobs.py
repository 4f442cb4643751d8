"""Scoring prompts (SamplingParams.prompt_logprobs) on the real SmolLM2 in fp32: parity with
transformers, and the same scores however the prompt is chunked, preempted or cached."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm import LLM
from engine.protocol import FinishReason, InvalidRequestError, SamplingParams, TokenLogprob

PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
    "Photosynthesis is the process by which green plants turn light into sugar. " * 3,
]
SCORE = SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=3)


def scores(llm: LLM, prompts: list[str], params: SamplingParams = SCORE):
    return [c.prompt_logprobs for c in llm.generate(prompts, params)]


def assert_close(got: list[list[TokenLogprob]], want: list[list[TokenLogprob]], tol: float):
    assert [[lp.token_id for lp in row] for row in got] == [
        [lp.token_id for lp in row] for row in want
    ]
    for g_row, w_row in zip(got, want, strict=True):
        for g, w in zip(g_row, w_row, strict=True):
            assert abs(g.logprob - w.logprob) < tol
            assert g.top_ids[:1] == w.top_ids[:1]
            assert len(g.top_logprobs) == len(w.top_logprobs)


@pytest.fixture
def llm(make_core, smollm2_fp32):
    return LLM(core=make_core(), tokenizer=smollm2_fp32[1])


def test_prompt_scores_match_transformers(llm, hf_smollm2):
    results = llm.generate(PROMPTS, SCORE)
    for prompt, result in zip(PROMPTS, results, strict=True):
        ids = llm.tokenizer.encode(prompt)
        assert result.token_ids == [] and result.text == ""
        assert result.finish_reason is FinishReason.LENGTH
        with torch.inference_mode():
            ref = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), -1)
        assert [lp.token_id for lp in result.prompt_logprobs] == ids[1:]
        for pos, lp in enumerate(result.prompt_logprobs):
            assert abs(lp.logprob - ref[pos, ids[pos + 1]].item()) < 1e-3
            top = torch.topk(ref[pos], 3)
            assert lp.top_ids[0] == top.indices[0].item()
            assert (
                max(abs(a - b) for a, b in zip(lp.top_logprobs, top.values.tolist(), strict=True))
                < 1e-3
            )
    assert llm.core.stats().num_generated_tokens == 0
    llm.core.check_integrity()


def test_scores_agree_with_the_logprobs_of_generated_tokens(llm):
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    (generated,) = llm.generate([PROMPTS[0]], params)
    (scored,) = llm.generate([generated.prompt_token_ids + generated.token_ids], SCORE)
    tail = scored.prompt_logprobs[-len(generated.token_ids) :]
    assert [lp.token_id for lp in tail] == generated.token_ids
    for s, g in zip(tail, generated.logprobs, strict=True):
        assert abs(s.logprob - g.logprob) < 1e-4
        assert s.top_ids[:2] == g.top_ids


def test_scoring_while_generating_changes_no_tokens(llm):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    plain = llm.generate(PROMPTS, params)
    scored = llm.generate(
        PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    )
    assert [c.token_ids for c in scored] == [c.token_ids for c in plain]
    for c in scored:
        assert len(c.prompt_logprobs) == len(c.prompt_token_ids) - 1
        assert all(lp.top_ids == [] for lp in c.prompt_logprobs)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_gives_the_same_scores(make_core, smollm2_fp32, llm, chunk):
    prompts = PROMPTS[:1] if chunk == 1 else PROMPTS
    cfg = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=chunk))
    chunked = LLM(core=make_core(cfg), tokenizer=smollm2_fp32[1])
    assert_close(scores(chunked, prompts), scores(llm, prompts), 1e-4)
    chunked.core.check_integrity()


def test_preemption_and_cached_prefixes_give_the_same_scores(make_core, smollm2_fp32, llm):
    reference = scores(llm, PROMPTS)
    # a tiny pool: requests are preempted mid-prompt and recomputed
    tiny = LLM(
        core=make_core(EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8))),
        tokenizer=smollm2_fp32[1],
    )
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    assert_close(scores(tiny, PROMPTS, params), reference, 1e-4)
    assert tiny.core.stats().num_preemptions > 0
    tiny.core.check_integrity()
    # every prompt's KV is in the prefix cache: scoring must still compute every position
    warm = LLM(core=make_core(), tokenizer=smollm2_fp32[1])
    warm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0))
    results = warm.generate(PROMPTS, SCORE)
    assert all(c.num_cached_tokens == 0 for c in results)
    assert_close([c.prompt_logprobs for c in results], reference, 1e-4)
    # a plain request right after still hits the cache
    (again,) = warm.generate(PROMPTS[2:], SamplingParams(max_tokens=1, temperature=0.0))
    assert again.num_cached_tokens >= 16


def test_bad_scoring_requests_are_refused(llm):
    core = llm.core
    with pytest.raises(InvalidRequestError, match="max_tokens") as err:
        core.add_request("a", [1, 2, 3], SamplingParams(max_tokens=0))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError, match="prompt_logprobs") as err:
        core.add_request("b", [1, 2, 3], SamplingParams(prompt_logprobs=21))
    assert err.value.param == "prompt_logprobs"
    (one,) = llm.generate([[5]], SCORE)  # a one-token prompt has nothing to score
    assert one.prompt_logprobs == [] and one.token_ids == []
    assert not core.has_unfinished()
