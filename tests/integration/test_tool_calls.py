"""Tool calling with the OpenAI SDK over real HTTP, the real model behind the gateway: calls
come back in OpenAI's shape with arguments that match their tool's schema, streamed or not,
and a conversation carrying calls and their results goes on."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": WEATHER_ARGS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone.",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 30}},
                "required": ["zone"],
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(gateway):
    tenant = gateway.new_tenant(rpm=1000, tpm=1_000_000, max_concurrent=16)
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=tenant[1], max_retries=0)


def create(client, **kw):
    kw = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 120, "temperature": 0} | kw
    return client.chat.completions.create(**kw)


def test_required_tool_choice_returns_calls_whose_arguments_match_their_schema(client):
    reply = create(client, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        schema = next(
            t["function"]["parameters"]
            for t in TOOLS
            if t["function"]["name"] == call.function.name
        )
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_named_tool_is_the_one_called_once_without_parallel_calls(client):
    reply = create(
        client,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time" and "zone" in json.loads(call.function.arguments)


def test_streamed_calls_arrive_whole_in_one_chunk(client):
    stream = create(client, tool_choice="required", stream=True)
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    (last,) = [c for c in chunks if c.choices[0].delta.tool_calls]
    assert last.choices[0].finish_reason == "tool_calls"
    calls = last.choices[0].delta.tool_calls
    assert [c.index for c in calls] == list(range(len(calls)))
    assert all(c.id.startswith("call_") and json.loads(c.function.arguments) for c in calls)


def test_auto_answers_in_text_or_calls_and_a_conversation_with_results_goes_on(client):
    first = create(client, tool_choice="auto").choices[0]
    assert (first.finish_reason == "tool_calls") == bool(first.message.tool_calls)
    if not first.message.tool_calls:
        assert first.message.content  # text it chose to write instead
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "18 degrees and sunny"},
    ]
    after = create(client, messages=history, tool_choice="auto").choices[0]
    assert after.finish_reason in ("stop", "tool_calls", "length")
    assert after.message.content or after.message.tool_calls
    plain = create(client, messages=history, tool_choice="none", max_tokens=20).choices[0]
    assert plain.message.content and not plain.message.tool_calls


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools[0].function.name",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": {"type": "array", "uniqueItems": True}},
                            },
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tool_requests_are_a_400_naming_the_field(client, extra, param):
    kw = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4} | extra
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kw)
    assert err.value.body["param"] == param


def test_a_text_answer_streams_as_it_is_written(client, smollm2_tokenizer):
    (content,) = smollm2_tokenizer.encode("content", add_special_tokens=False)
    kw = {"tool_choice": "auto", "logit_bias": {str(content): 100}, "max_tokens": 60}
    whole = create(client, **kw).choices[0]  # the bias steers it to answer in text
    assert whole.message.content and not whole.message.tool_calls
    chunks = [c for c in create(client, stream=True, **kw) if c.choices]
    pieces = [c.choices[0].delta.content for c in chunks[1:] if c.choices[0].delta.content]
    assert len(pieces) > 3  # not held to the end
    assert "".join(pieces) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_tokenize_counts_the_tools_as_a_request_bills_them(client, gateway):
    import httpx

    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    with httpx.Client(
        base_url=gateway.url, headers={"authorization": f"Bearer {client.api_key}"}
    ) as http:
        counted = http.post("/tokenize", json=body).json()["count"]
        plain = http.post("/tokenize", json={"model": MODEL, "messages": ASK}).json()["count"]
    reply = create(client, tool_choice="required", max_tokens=1)
    assert counted == reply.usage.prompt_tokens > plain + 50


# -- a template that renders tools: the model's own syntax ---------------------------------

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions. Their signatures:\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\nFor each call, "
    'write <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}{%- else %}{{ message.content }}{%- endif %}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture
def hermes(smollm2_tokenizer, smollm2_fp32):
    """A gateway preparer and an engine over the real model, its chat template one that
    renders tools in hermes syntax (as Qwen2.5's does)."""
    import asyncio

    from engine.protocol import ModelInfo
    from gateway.prepare import Preparer

    tokenizer = smollm2_tokenizer.with_chat_template(HERMES_TEMPLATE)
    info = ModelInfo(
        model_id=MODEL,
        vocab_size=tokenizer.vocab_size,
        max_model_len=2048,
        eos_token_ids=sorted(tokenizer.eos_token_ids),
        kv_block_size=16,
        kv_bytes_per_token=1,
        dtype="float32",
        device="cpu",
    )
    preparer = Preparer(tokenizer, info)
    yield preparer, asyncio.run, tokenizer
    preparer.close()


def test_a_template_with_tools_gets_calls_in_its_own_syntax(hermes, make_core):
    import msgspec

    from engine.llm import LLM
    from gateway.openai_types import ChatCompletionRequest
    from gateway.tool_formats import ToolFormat
    from tenants.records import Tenant

    preparer, run, tokenizer = hermes
    assert preparer.tool_format is ToolFormat.HERMES
    tenant = msgspec.convert({"id": "t", "name": "t", "created_at": 0.0, "policy": {}}, Tenant)
    body = msgspec.convert(
        {
            "model": MODEL,
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 120,
            "temperature": 0,
        },
        ChatCompletionRequest,
    )
    job = run(preparer.chat(body, tenant, "chatcmpl-1"))
    run(preparer.check_grammar(job))
    assert job.tools is not None and job.params.grammar is not None
    prompt = tokenizer.decode(job.prompts[0], skip_special_tokens=False)
    assert "<tools>" in prompt and '"get_weather"' in prompt  # the template shows the tools
    assert "You can call these functions" not in prompt  # not the JSON-object scheme's
    llm = LLM(core=make_core(), tokenizer=tokenizer)
    (out,) = llm.generate([job.prompts[0]], job.params)
    assert out.text.startswith("<tool_call>\n")
    message, finish = job.tools.parse_reply(out.text, "stop")
    assert finish == "tool_calls" and message.tool_calls
    for call in message.tool_calls:
        schema = next(
            t["function"]["parameters"]
            for t in TOOLS
            if t["function"]["name"] == call.function.name
        )
        jsonschema.validate(json.loads(call.function.arguments), schema)
