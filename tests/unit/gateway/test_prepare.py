"""The Preparer turns a validated body into an engine job, with the tenant's scheduling."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest

from engine.protocol import ModelInfo, Scheduling
from gateway import prepare
from gateway.errors import APIError
from gateway.openai_types import ChatCompletionRequest, ChatMessage, CompletionRequest, TextPart
from gateway.prepare import Preparer
from tenants.records import Policy, Tenant

INFO = ModelInfo(
    model_id="smollm2",
    vocab_size=49152,
    max_model_len=2048,
    eos_token_ids=[2],
    kv_block_size=16,
    kv_bytes_per_token=23040,
    dtype="bfloat16",
    device="cpu",
)


@pytest.fixture
def preparer(smollm2_tokenizer) -> Iterator[Preparer]:
    preparer = Preparer(smollm2_tokenizer, INFO)
    yield preparer
    preparer.close()


def tenant(tenant_id: str = "acme", **policy) -> Tenant:
    return Tenant(
        id=tenant_id,
        name="Acme",
        created_at=0.0,
        policy=Policy(**policy),
        cache_salt=f"secret-of-{tenant_id}",
    )


async def test_job_carries_the_tenants_priority_and_weight(preparer):
    body = ChatCompletionRequest(model="default", messages=[ChatMessage(role="user", content="hi")])
    job = await preparer.chat(body, tenant(priority=3, weight=2.5), "chatcmpl-1")
    assert job.scheduling == Scheduling(
        priority=3, tenant="acme", weight=2.5, cache_salt="tenant:secret-of-acme"
    )
    body = CompletionRequest(model="smollm2", prompt="hi")
    job = await preparer.completion(body, tenant(), "c-2")
    assert job.scheduling.weight == 1.0 and job.scheduling.priority == 0
    assert job.scheduling.kv_host_tokens is None and job.scheduling.kv_disk_tokens is None


async def test_job_carries_the_tenants_kv_tier_allowances(preparer):
    body = CompletionRequest(model="default", prompt="hi")
    caps = tenant(kv_host_tokens=4096, kv_disk_tokens=0, kv_remote_tokens=8192)
    job = await preparer.completion(body, caps, "c-1")
    sched = job.scheduling
    assert (sched.kv_host_tokens, sched.kv_disk_tokens, sched.kv_remote_tokens) == (4096, 0, 8192)


def test_kv_tier_allowances_must_not_be_negative():
    from tenants.records import RecordError

    with pytest.raises(RecordError, match="kv_host_tokens"):
        Policy(kv_host_tokens=-1)
    with pytest.raises(RecordError, match="kv_remote_tokens"):
        Policy(kv_remote_tokens=-1)
    assert Policy(kv_disk_tokens=0).kv_disk_tokens == 0  # 0 = nothing on disk


async def test_cache_salt_is_per_tenant_unless_both_share_a_namespace(preparer):
    body = CompletionRequest(model="default", prompt="hi")

    async def salt(t: Tenant) -> str:
        return (await preparer.completion(body, t, "c-1")).scheduling.cache_salt

    assert await salt(tenant("a")) != await salt(tenant("b"))
    shared = [tenant(t, shared_cache_namespace="public-rag") for t in ("a", "b")]
    assert await salt(shared[0]) == await salt(shared[1]) != await salt(tenant("a"))


async def test_the_context_cap(preparer):
    long = CompletionRequest(model="default", prompt="word " * 100)
    with pytest.raises(APIError) as err:
        await preparer.completion(long, tenant(max_context_tokens=10), "c-2")
    assert err.value.status == 413


async def test_kv_reservation_counts_whole_blocks(preparer):
    body = CompletionRequest(model="default", prompt="hi", max_tokens=20, n=2)
    job = await preparer.completion(body, tenant(), "c-1")
    per_choice = job.num_prompt_tokens + 20
    assert job.kv_block_size == INFO.kv_block_size == 16
    assert job.kv_tokens == 2 * -(-per_choice // 16) * 16  # rounded up, per choice
    assert job.kv_tokens % 16 == 0 and job.kv_tokens >= 2 * per_choice


async def test_a_batch_of_prompts_is_one_job(preparer, smollm2_tokenizer):
    texts = ["The capital of France is", "Once upon a time"]
    body = CompletionRequest(model="default", prompt=texts, max_tokens=20, n=2, echo=True)
    job = await preparer.completion(body, tenant(), "c-1")
    assert job.prompts == [smollm2_tokenizer.encode(t) for t in texts]
    assert job.echo_texts == texts
    assert job.num_choices == 4 and [job.prompt_of(c) for c in range(4)] == [0, 0, 1, 1]
    assert job.num_prompt_tokens == sum(len(p) for p in job.prompts)  # each prompt once
    assert job.kv_tokens == 2 * sum(-(-(len(p) + 20) // 16) * 16 for p in job.prompts)
    ids = CompletionRequest(model="default", prompt=[[1, 2, 3], [4, 5]], echo=True)
    job = await preparer.completion(ids, tenant(), "c-2")
    assert job.prompts == [[1, 2, 3], [4, 5]]
    assert job.echo_texts == [smollm2_tokenizer.decode(p) for p in job.prompts]


@pytest.mark.parametrize(
    ("prompt", "n", "message"),
    [
        (["a", [1, 2]], 1, "a list of strings"),
        ([1, "a"], 1, "a list of strings"),
        ([], 1, "empty"),
        ([[1], []], 1, "empty"),
        (["a"] * 65, 1, "between 1 and 64 prompts"),
        (["a"] * 9, 16, "prompts x n"),
        ([[1, 49152]], 1, "out of the vocabulary"),
    ],
)
async def test_bad_prompt_batches_are_refused(preparer, prompt, n, message):
    body = CompletionRequest(model="default", prompt=prompt, n=n)
    with pytest.raises(APIError, match=message) as err:
        await preparer.completion(body, tenant(), "c-1")
    assert err.value.status == 400


async def test_long_prompts_are_tokenized_off_the_event_loop(preparer, smollm2_tokenizer):
    """While a long prompt is tokenized, other coroutines (every open stream) keep running;
    the tokens are the same as inline."""
    text = "The quick brown fox jumps over the lazy dog. " * 150  # ~7 KB, ~1,500 tokens
    body = CompletionRequest(model="default", prompt=text)
    events: list[str] = []

    async def prepare() -> None:
        job = await preparer.completion(body, tenant(), "c-1")
        events.append("prepared")
        assert job.prompts == [smollm2_tokenizer.encode(text)]

    async def other_stream() -> None:
        await asyncio.sleep(0)
        events.append("other stream ran")

    await asyncio.gather(prepare(), other_stream())
    assert events == ["other stream ran", "prepared"]
    # a short prompt is tokenized inline: nothing else runs before it is done
    events.clear()
    body = CompletionRequest(model="default", prompt="hi")

    async def prepare_short() -> None:
        await preparer.completion(body, tenant(), "c-2")
        events.append("prepared")

    await asyncio.gather(prepare_short(), other_stream())
    assert events == ["prepared", "other stream ran"]


def chat_with(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="default", messages=[ChatMessage(role="user", content="hi")], **extra
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat_with(functions=[{"name": "f"}]), "functions"),
        (chat_with(function_call="auto"), "function_call"),
        (CompletionRequest(model="default", prompt="hi", suffix="end"), "suffix"),
        (CompletionRequest(model="default", prompt="hi", best_of=3), "best_of"),
    ],
)
async def test_parameters_strata_does_not_implement_are_refused_not_ignored(preparer, body, param):
    prepare = preparer.chat if isinstance(body, ChatCompletionRequest) else preparer.completion
    with pytest.raises(APIError) as err:
        await prepare(body, tenant(), "r-1")
    assert (err.value.status, err.value.param, err.value.code) == (
        400,
        param,
        "unsupported_parameter",
    )


async def test_neutral_values_of_those_parameters_are_accepted(preparer):
    neutral = chat_with(
        tools=[],
        tool_choice="none",
        function_call="none",
        response_format={"type": "text"},
        logit_bias={},
    )
    assert (await preparer.chat(neutral, tenant(), "r-1")).prompts[0]
    completion = CompletionRequest(model="default", prompt="hi", best_of=2, n=2, suffix="")
    assert (await preparer.completion(completion, tenant(), "r-2")).prompts[0]


async def test_response_formats_reach_the_engine_as_json_schemas(preparer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    formats = {
        "text": ({"type": "text"}, None),
        "json_object": ({"type": "json_object"}, {"type": "object"}),
        "json_schema": (
            {"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}},
            schema,
        ),
        "no schema": ({"type": "json_schema", "json_schema": {"name": "any"}}, True),
    }
    for response_format, expected in formats.values():
        job = await preparer.chat(chat_with(response_format=response_format), tenant(), "r-1")
        given = job.params.json_schema
        assert (given if given is None else json.loads(given)) == expected
        body = CompletionRequest(model="default", prompt="hi", response_format=response_format)
        assert (await preparer.completion(body, tenant(), "r-2")).params.json_schema == given


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        ({"type": "xml"}, "response_format.type must be"),
        ({"type": "json_schema"}, "json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "name must be"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "name must be"),
    ],
)
async def test_bad_response_formats_are_a_400_naming_the_problem(
    preparer, response_format, message
):
    with pytest.raises(APIError, match=message) as err:
        await preparer.chat(chat_with(response_format=response_format), tenant(), "r-1")
    assert (err.value.status, err.value.param) == (400, "response_format")


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "array", "uniqueItems": True}, "keyword 'uniqueItems' is not supported"),
        ({"$ref": "#/$defs/B"}, "'/\\$defs/B' does not exist"),
    ],
)
async def test_schemas_are_compiled_once_admitted_off_the_loop_and_refused_by_name(
    preparer, schema, message, monkeypatch
):
    response_format = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema}}
    job = await preparer.chat(chat_with(response_format=response_format), tenant(), "r-1")
    loop_thread = threading.get_ident()
    compiled_on: list[int] = []
    real_check = prepare.check

    def spy(*args):
        compiled_on.append(threading.get_ident())
        return real_check(*args)

    monkeypatch.setattr(prepare, "check", spy)
    with pytest.raises(APIError, match=message) as err:
        await preparer.check_grammar(job)
    assert (err.value.status, err.value.param) == (400, "response_format")
    assert len(compiled_on) == 1 and compiled_on[0] != loop_thread


async def test_logit_bias_and_min_tokens_reach_the_engine(preparer):
    job = await preparer.chat(
        chat_with(logit_bias={"42": -100.0, "7": 2.5}, min_tokens=3), tenant(), "r-1"
    )
    assert job.params.logit_bias == {42: -100.0, 7: 2.5} and job.params.min_tokens == 3


@pytest.mark.parametrize(
    ("bias", "min_tokens", "param"),
    [
        ({"x": 1.0}, None, "logit_bias"),
        ({"49152": 1.0}, None, "logit_bias"),
        ({"1": 101.0}, None, "logit_bias"),
        ({str(i): 1.0 for i in range(301)}, None, "logit_bias"),
        (None, 50, "min_tokens"),  # above max_tokens
        (None, -1, "min_tokens"),
    ],
)
async def test_bad_logit_bias_and_min_tokens_are_refused(preparer, bias, min_tokens, param):
    body = CompletionRequest(
        model="default", prompt="hi", max_tokens=10, logit_bias=bias, min_tokens=min_tokens
    )
    with pytest.raises(APIError) as err:
        await preparer.completion(body, tenant(), "r-1")
    assert (err.value.status, err.value.param) == (400, param)


async def test_non_text_content_parts_are_refused(preparer):
    image = TextPart(type="image_url")
    body = ChatCompletionRequest(
        model="default",
        messages=[
            ChatMessage(role="system", content="be brief"),
            ChatMessage(role="user", content=[TextPart(type="text", text="what is it?"), image]),
        ],
    )
    with pytest.raises(APIError) as err:
        await preparer.chat(body, tenant(), "r-1")
    assert err.value.param == "messages[1].content" and "image_url" in str(err.value.message)
