"""Structured output with the real model: the engine's output is JSON of the requested schema,
in a batch as alone, and the OpenAI SDK's `response_format` works over real HTTP."""

from __future__ import annotations

import datetime
import json

import jsonschema
import openai
import pydantic
import pytest

from engine.llm import LLM
from engine.protocol import FinishReason, InvalidRequestError, SamplingParams

MODEL = "SmolLM2-135M-Instruct"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "population", "landmarks", "capital"],
}
PROMPTS = [
    "Describe Paris as JSON.",
    "Give me a JSON object about Tokyo.",
    "Tell me a joke.",
    "What is 2 + 2?",
]


def city_params(**kw) -> SamplingParams:
    kw = {"max_tokens": 160, "temperature": 0.0} | kw
    return SamplingParams(json_schema=json.dumps(CITY), **kw)


@pytest.fixture
def llm(make_core, smollm2_fp32):
    return LLM(core=make_core(), tokenizer=smollm2_fp32[1])


def test_greedy_output_is_json_of_the_schema_and_ends_with_the_value(llm):
    # room for the longest value: three 40-character strings of two-token characters
    outs = llm.generate(PROMPTS, city_params(max_tokens=400), chat=True)
    for out in outs:
        jsonschema.validate(json.loads(out.text), CITY)
        assert out.finish_reason is FinishReason.STOP
        assert len(out.token_ids) < 400
    free = llm.generate(PROMPTS[2:], SamplingParams(max_tokens=20, temperature=0.0), chat=True)
    assert not free[0].text.lstrip().startswith("{")  # the format, not the prompt, made it JSON


def test_a_constrained_request_gets_the_same_tokens_alone_and_in_a_mixed_batch(llm):
    alone = llm.generate(PROMPTS[:1], city_params(), chat=True)[0].token_ids
    mixed = [
        city_params(),
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, json_schema='{"type": "object"}'),
        city_params(temperature=0.9, seed=3),
    ]
    outs = llm.generate(PROMPTS, mixed, chat=True)
    assert outs[0].token_ids == alone
    assert isinstance(json.loads(outs[2].text), dict)
    again = llm.generate(PROMPTS[3:], [city_params(temperature=0.9, seed=3)], chat=True)[0]
    assert again.token_ids == outs[3].token_ids  # seeded sampling under a grammar repeats
    if outs[3].finish_reason is FinishReason.STOP:
        jsonschema.validate(json.loads(outs[3].text), CITY)


def test_greedy_takes_the_models_likeliest_token_the_grammar_allows_at_every_step(llm):
    """The rule the hand-written engine followed too, so where both allow the same tokens
    their greedy outputs agree: the model's own choice when the grammar allows it, else its
    likeliest allowed token. Checked against the model's own logprobs (top 20), replaying
    the grammar over the output."""
    import torch

    from engine.structured.backend import mask_words

    (out,) = llm.generate(PROMPTS[:1], city_params(logprobs=20), chat=True)
    assert llm.core.grammars is not None
    stops = frozenset(llm.core.eos_token_ids)
    replay = llm.core.grammars.matcher(json.dumps(CITY), None, stops)
    bitmask = torch.zeros(1, mask_words(llm.core.vocab_size), dtype=torch.int32)
    num_free = 0
    for token, scores in zip(out.token_ids, out.logprobs, strict=True):
        bitmask.zero_()
        replay.fill_mask(bitmask, 0)
        words = bitmask[0].tolist()
        allowed = [t for t in scores.top_ids if words[t >> 5] >> (t & 31) & 1]
        if token in scores.top_ids:  # the likeliest allowed of the model's top 20
            assert allowed[0] == token
            assert scores.logprob == scores.top_logprobs[scores.top_ids.index(token)]
        else:  # or the grammar allowed none of them
            assert not allowed and scores.logprob <= scores.top_logprobs[-1]
        num_free += scores.top_ids[0] == token  # the model's own choice stood
        replay.accept(token)
    assert 0 < num_free < len(out.token_ids)  # the grammar chose some tokens, not all


def test_preempted_constrained_requests_resume_their_grammar(make_core, smollm2_fp32, llm):
    from engine.config import CacheConfig, EngineConfig

    roomy = llm.generate(PROMPTS, city_params(), chat=True)
    tiny = LLM(
        core=make_core(EngineConfig(cache=CacheConfig(num_blocks=16))), tokenizer=smollm2_fp32[1]
    )
    squeezed = tiny.generate(PROMPTS, city_params(), chat=True)
    assert tiny.core.stats().num_preemptions > 0
    assert [c.token_ids for c in squeezed] == [c.token_ids for c in roomy]
    tiny.core.check_integrity()


def test_an_engine_without_a_vocabulary_refuses_response_formats(smollm2_fp32):
    from engine.config import EngineConfig
    from engine.core import EngineCore

    model, tokenizer, model_id = smollm2_fp32
    core = EngineCore(
        model, EngineConfig(), model_id=model_id, eos_token_ids=tokenizer.eos_token_ids
    )
    with pytest.raises(InvalidRequestError) as err:
        core.add_request("r", [1, 2], city_params())
    assert err.value.param == "response_format" and not core.has_unfinished()


# -- over HTTP, with the OpenAI SDK --------------------------------------------------------


class Landmark(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    year_built: int = pydantic.Field(ge=1000, le=2025)
    opened: datetime.date
    rating: float = pydantic.Field(ge=0, le=5)


class CityFacts(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    landmarks: list[Landmark] = pydantic.Field(max_length=2)


@pytest.fixture(scope="module")
def client(gateway):
    tenant = gateway.new_tenant(rpm=1000, tpm=1_000_000, max_concurrent=16)
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=tenant[1], max_retries=0)


def test_the_sdks_parse_helper_gets_an_instance_of_its_model(client):
    reply = client.beta.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Give facts about Paris as JSON."}],
        response_format=CityFacts,
        max_tokens=200,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    facts = choice.message.parsed
    assert isinstance(facts, CityFacts) and facts.city
    assert all(1000 <= mark.year_built <= 2025 for mark in facts.landmarks)


def test_json_mode_streams_an_object(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": "What is the capital of France? Answer with "
                'a JSON object of one member, "capital".',
            }
        ],
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_keyword_the_engine_cannot_enforce_is_a_400_naming_it(client):
    bad = {
        "type": "json_schema",
        "json_schema": {
            "name": "tags",
            "schema": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        },
    }
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], response_format=bad
        )
    assert err.value.body["param"] == "response_format"
    assert "'uniqueItems' is not supported" in err.value.body["message"]


def test_a_refused_schema_is_settled_and_frees_what_admission_reserved(gateway):
    """The grammar is compiled after admission: a refusal there must give the tenant's
    concurrency back (one slot here), or every later request would be turned away."""
    _, key = gateway.new_tenant(rpm=1000, tpm=1_000_000, max_concurrent=1)
    solo = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}
    for _ in range(3):
        with pytest.raises(openai.BadRequestError):
            solo.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], response_format=bad
            )
    ok = solo.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert ok.choices[0].finish_reason in ("length", "stop")


NESTED = "^((a?){255}){8}$"  # 4,090 automaton states; compiled up front it took 1.66 s


def test_adversarial_patterns_hold_up_no_other_tenant(gateway, client):
    """Four copies of a pattern whose automaton once took seconds to build, in four
    requests at once, while /health is polled and another tenant asks for four tokens: the
    grammars compile off the event loop and off the engine's step loop, so neither waits
    for them. (The old compile held /health for 5.4 s and the other request for 11.5 s; the
    bounds here are generous for a slow shared machine.)"""
    import asyncio

    import httpx

    fields = {f"f{i}": {"type": "string", "pattern": NESTED} for i in range(4)}
    schema = {"type": "object", "properties": fields, "required": list(fields)}
    attack = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    }
    _, other_key = gateway.new_tenant(rpm=1000, tpm=1_000_000, max_concurrent=4)
    small = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def timed(http: httpx.AsyncClient, method: str, url: str, **kw) -> float:
        started = asyncio.get_running_loop().time()
        reply = await http.request(method, url, **kw)
        assert reply.status_code == 200, reply.text
        return asyncio.get_running_loop().time() - started

    async def run() -> tuple[float, float, float]:
        mine = {"authorization": f"Bearer {client.api_key}"}
        theirs = {"authorization": f"Bearer {other_key}"}
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            alone = await timed(http, "POST", "/v1/chat/completions", json=small, headers=theirs)
            attacks = [
                asyncio.create_task(
                    timed(http, "POST", "/v1/chat/completions", json=attack, headers=mine)
                )
                for _ in range(4)
            ]
            health = [await timed(http, "GET", "/health") for _ in range(5)]
            other = await timed(http, "POST", "/v1/chat/completions", json=small, headers=theirs)
            await asyncio.gather(*attacks)
        return alone, max(health), other

    alone, health, other = asyncio.run(run())
    assert health < 1.0, f"/health took {health:.2f} s beside the patterns"
    assert other < 3 * alone + 2.0, f"{other:.2f} s beside the patterns, {alone:.2f} s alone"


def test_an_unsupported_schema_is_a_400_and_the_gateway_serves_on(client):
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "ref", "schema": {"type": "string", "format": "uri-reference"}},
    }
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], response_format=bad
        )
    assert err.value.body["param"] == "response_format"
    assert "'uri-reference' is not supported" in err.value.body["message"]
    ok = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert ok.choices[0].message.content


def test_the_benchmark_runs_both_ways_and_checks_every_output(tmp_path, capsys, strata_cache_dir):
    from bench import structured_output

    summary = structured_output.main(
        [
            "--quick",
            "--batches",
            "2",
            "--max-tokens",
            "80",
            "--backends",
            "llguidance",
            "--cache-dir",
            str(strata_cache_dir),
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert summary["ratio"]["llguidance"]["2"] > 0
    (written,) = tmp_path.glob("structured_output-cpu-*.json")
    record = json.loads(written.read_text())
    assert record["throughput"]["llguidance"]["2"]["valid_outputs"].split("/")[1] == "2"
    assert set(record["adversarial"]["nested_optional"]) >= {"pattern", "llguidance"}
    corpus = record["corpus"]["llguidance"]
    assert corpus["compiled"] + corpus["refused"] == record["corpus"]["num_schemas"]
    assert "keyword/uniqueItems" in corpus["refusals"]
