"""Tool calling's plan (the reply schema and the tools' description), the rendering of a
conversation with calls in it, and the parsing of replies into OpenAI's message."""

from __future__ import annotations

import json

import msgspec
import pytest

from engine.config import GrammarBackend
from engine.structured import SchemaError, check
from engine.structured.backend import Vocabulary, mask_words
from engine.structured.compilers import make_compiler
from gateway.errors import APIError
from gateway.openai_types import ChatMessage, NamedToolChoice, Tool, ToolName
from gateway.tool_formats import NativeReplyStream, ToolFormat, parse_native, template_format
from gateway.tools import ReplyStream, parse_reply, plan_tools, render_messages

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def tools(*specs) -> list[Tool]:
    return msgspec.convert(list(specs), list[Tool])


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice(type="function", function=ToolName(name=name))


BYTES = make_compiler(
    GrammarBackend.LLGUIDANCE,
    Vocabulary(
        [*(bytes((b,)) for b in range(256)), None], {256: "<|end|>"}, 256, lambda t: [*t.encode()]
    ),
)


def allows_text(text: str, schema_text: str | None = None, grammar: str | None = None) -> bool:
    """Whether a reply's text is one the grammar allows whole (over a vocabulary of bytes)."""
    import torch

    m = BYTES.matcher(schema_text, grammar, frozenset({256}))
    mask = torch.zeros(1, mask_words(257), dtype=torch.int32)
    for byte in [*text.encode(), 256]:
        m.fill_mask(mask, 0)
        if not mask[0, byte >> 5].item() >> (byte & 31) & 1:
            return False
        m.accept(byte)
    return True


def allows(schema_text: str | None, reply: object) -> bool:
    return allows_text(json.dumps(reply), schema_text)


CALL = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}]}
TWO_CALLS = {"tool_calls": [{"name": "get_time", "arguments": {}}, CALL["tool_calls"][0]]}
ANSWER = {"content": "It is sunny."}


@pytest.mark.parametrize(
    ("choice", "parallel", "allowed", "refused"),
    [
        (None, True, [CALL, TWO_CALLS, ANSWER], [{"tool_calls": []}]),
        ("auto", True, [CALL, ANSWER], []),
        ("required", True, [CALL, TWO_CALLS], [ANSWER]),
        ("required", False, [CALL], [TWO_CALLS, ANSWER]),
        (
            named("get_time"),
            True,
            [{"tool_calls": [{"name": "get_time", "arguments": {}}]}],
            [CALL, ANSWER],
        ),
    ],
)
def test_the_reply_schema_allows_what_the_tool_choice_allows(choice, parallel, allowed, refused):
    plan = plan_tools(tools(WEATHER, CLOCK), choice, parallel)
    assert plan is not None
    for reply in allowed:
        assert allows(plan.schema, reply), reply
    for reply in refused:
        assert not allows(plan.schema, reply), reply
    bad_arguments = {"tool_calls": [{"name": "get_weather", "arguments": {"unit": "C"}}]}
    assert not allows(plan.schema, bad_arguments)  # the tool's own schema: city is required
    assert "get_weather" in plan.instructions and "The weather in a city now." in plan.instructions


def test_no_plan_without_tools_or_with_tool_choice_none():
    assert plan_tools(None, None, True) is None
    assert plan_tools([], "none", True) is None
    assert plan_tools(tools(WEATHER), "none", True) is None


@pytest.mark.parametrize(
    ("specs", "choice", "param", "message"),
    [
        (
            [{"type": "function", "function": {"name": "get weather"}}],
            None,
            "tools[0].function.name",
            "tool names must be",
        ),
        ([CLOCK, CLOCK], None, "tools[1]", "two tools are named 'get_time'"),
        ([CLOCK], named("get_weather"), "tool_choice", "not in tools"),
        ([], "required", "tool_choice", "tool_choice needs tools"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(specs, choice, param, message):
    with pytest.raises(APIError, match=message) as err:
        plan_tools(tools(*specs), choice, True)
    assert (err.value.status, err.value.param) == (400, param)


def test_calls_in_the_conversation_are_shown_as_the_model_writes_them():
    plan = plan_tools(tools(WEATHER), "auto", True)
    assert plan is not None
    messages = msgspec.convert(
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C, sunny"},
        ],
        list[ChatMessage],
    )
    rendered = render_messages(messages, plan)
    assert rendered[0] == {"role": "system", "content": plan.instructions}
    assert json.loads(rendered[2]["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    }
    assert rendered[3] == {"role": "tool", "content": "12 C, sunny"}
    with_system = render_messages(
        [ChatMessage(role="system", content="Be brief."), *messages], plan
    )
    assert with_system[0]["content"] == "Be brief.\n\n" + plan.instructions
    assert len(with_system) == 4


def test_replies_become_openai_messages():
    message, finish = parse_reply(json.dumps(TWO_CALLS), "stop")
    assert finish == "tool_calls" and message.content is None
    assert [c.function.name for c in message.tool_calls or []] == ["get_time", "get_weather"]
    assert json.loads(message.tool_calls[1].function.arguments) == {"city": "Oslo", "unit": "C"}
    assert len({c.id for c in message.tool_calls}) == 2
    assert all(c.id.startswith("call_") for c in message.tool_calls)
    message, finish = parse_reply(json.dumps(ANSWER), "stop")
    assert (message.content, message.tool_calls, finish) == ("It is sunny.", None, "stop")
    cut = '{"tool_calls": [{"name": "get_wea'
    message, finish = parse_reply(cut, "length")
    assert (message.content, finish) == (cut, "length")


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_a_streamed_text_answer_is_released_as_it_comes(step):
    answer = 'Say "hi"\n\\ then 😀 and \u00e9.'
    text = json.dumps({"content": answer})  # escapes, and a surrogate pair for the emoji
    stream = ReplyStream()
    released = [stream.feed(text[i : i + step]) for i in range(0, len(text), step)]
    assert released[0] is None or step > 4  # undecided until the key is read
    assert "".join(r or "" for r in released) == answer
    calls = ReplyStream()
    assert [calls.feed(part) for part in ('{"', "tool", '_calls": [')] == [None, None, None]
    assert parse_reply('{"content": "cut sh', "length")[0].content == "cut sh"


def test_tools_with_their_own_definitions_keep_them_apart():
    """Two tools (as pydantic writes nested models) whose $defs share a name and differ."""
    point = {
        "$defs": {
            "P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
        },
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/P"}},
        "required": ["at"],
    }
    label = {
        "$defs": {"P": {"type": "string", "maxLength": 3}},
        "type": "object",
        "properties": {"text": {"$ref": "#/$defs/P"}},
        "required": ["text"],
    }
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    specs = [
        {"type": "function", "function": {"name": n, "parameters": p}}
        for n, p in (("move", point), ("say", label), ("grow", tree))
    ]
    plan = plan_tools(tools(*specs), "required", True)
    assert plan is not None
    call = lambda name, args: {"tool_calls": [{"name": name, "arguments": args}]}  # noqa: E731
    assert allows(plan.schema, call("move", {"at": {"x": 3}}))
    assert not allows(plan.schema, call("move", {"at": "abc"}))
    assert allows(plan.schema, call("say", {"text": "abc"}))
    assert not allows(plan.schema, call("say", {"text": {"x": 3}}))
    assert allows(plan.schema, call("grow", {"kids": [{"kids": []}, {}]}))
    assert '"#/$defs/P"' in plan.instructions  # the model reads each tool as it was given


def test_a_schema_the_engine_cannot_enforce_is_refused_naming_its_tool():
    unique = {"type": "object", "properties": {"n": {"type": "array", "uniqueItems": True}}}
    bad = {"type": "function", "function": {"name": "f", "parameters": unique}}
    plan = plan_tools(tools(WEATHER, bad), "auto", True)
    assert plan is not None
    with pytest.raises(SchemaError) as found:
        check(plan.schema, None)
    err = plan.refusal(found.value)
    assert (err.status, err.param) == (400, "tools[1].function.parameters")
    assert "'uniqueItems' is not supported" in err.message


# -- the model's own call syntax ------------------------------------------------------------

HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}'
MISTRAL_CALL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'


@pytest.mark.parametrize(
    ("fmt", "choice", "parallel", "allowed", "refused"),
    [
        (
            ToolFormat.HERMES,
            "required",
            True,
            [HERMES_CALL, HERMES_CALL + "\n" + HERMES_CALL.replace("Oslo", "Rome")],
            ["Sure.", HERMES_CALL.replace('"city": "Oslo"', '"town": "Oslo"')],
        ),
        (
            ToolFormat.HERMES,
            "auto",
            False,
            ["It is sunny.", "Let me check.\n" + HERMES_CALL],
            [HERMES_CALL + "\n" + HERMES_CALL],
        ),
        (
            ToolFormat.LLAMA3_JSON,
            "required",
            True,
            [LLAMA_CALL, f"{LLAMA_CALL}; {LLAMA_CALL}"],
            ['{"name": "get_weather", "arguments": {"city": "Oslo"}}'],
        ),
        (ToolFormat.LLAMA3_JSON, "auto", True, ["Hello there.", LLAMA_CALL], ["{oops"]),
        (ToolFormat.MISTRAL, "required", False, [MISTRAL_CALL], ["Hi", "[TOOL_CALLS][]"]),
        (named("get_time"), None, True, [], []),
    ],
)
def test_native_grammars_allow_the_models_own_syntax(fmt, choice, parallel, allowed, refused):
    if not isinstance(fmt, ToolFormat):
        plan = plan_tools(tools(WEATHER, CLOCK), fmt, True, ToolFormat.HERMES)
        assert plan is not None and plan.grammar is not None
        assert allows_text(
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', grammar=plan.grammar
        )
        assert not allows_text(HERMES_CALL, grammar=plan.grammar)
        return
    plan = plan_tools(tools(WEATHER, CLOCK), choice, parallel, fmt)
    assert plan is not None and plan.schema is None and plan.grammar is not None
    assert [t["function"]["name"] for t in plan.tools] == ["get_weather", "get_time"]
    for text in allowed:
        assert allows_text(text, grammar=plan.grammar), text
    for text in refused:
        assert not allows_text(text, grammar=plan.grammar), text


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        (ToolFormat.HERMES, "Checking.\n" + HERMES_CALL, "Checking.", [("get_weather", "Oslo")]),
        (
            ToolFormat.LLAMA3_JSON,
            f"<|python_tag|>{LLAMA_CALL}; {LLAMA_CALL}",
            None,
            [("get_weather", "Oslo")] * 2,
        ),
        (ToolFormat.MISTRAL, MISTRAL_CALL, None, [("get_weather", "Oslo")]),
        (
            ToolFormat.MISTRAL,
            MISTRAL_CALL.removeprefix("[TOOL_CALLS]"),
            None,
            [("get_weather", "Oslo")],
        ),
        (ToolFormat.HERMES, '<tool_call>\n{"name": "get_wea', None, []),
        (ToolFormat.LLAMA3_JSON, "Just text.", None, []),
    ],
)
def test_native_replies_become_openai_messages(fmt, text, content, calls):
    message, finish = parse_native(text, "stop", fmt)
    if not calls:
        assert (message.content, message.tool_calls, finish) == (text, None, "stop")
        return
    assert finish == "tool_calls" and message.content == content
    got = [
        (c.function.name, json.loads(c.function.arguments)["city"])
        for c in message.tool_calls or []
    ]
    assert got == calls


@pytest.mark.parametrize("step", [1, 3, 8])
def test_native_streams_release_text_up_to_the_calls(step):
    text = "Let me look <that> up.\n" + HERMES_CALL
    reader = NativeReplyStream(ToolFormat.HERMES)
    released = [reader.feed(text[i : i + step]) for i in range(0, len(text), step)]
    assert "".join(r or "" for r in released) == "Let me look <that> up.\n"
    assert reader.unreleased == HERMES_CALL
    llama = NativeReplyStream(ToolFormat.LLAMA3_JSON)
    assert [llama.feed(p) for p in (" ", '{"na', "me")] == ["", None, None]
    assert NativeReplyStream(ToolFormat.LLAMA3_JSON).feed("Hi there") == "Hi there"


def test_native_turns_keep_calls_and_results_as_templates_read_them():
    plan = plan_tools(tools(WEATHER), "auto", True, ToolFormat.HERMES)
    messages = msgspec.convert(
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C, sunny"},
        ],
        list[ChatMessage],
    )
    rendered = render_messages(messages, plan)
    assert len(rendered) == 3 and rendered[0] == {"role": "user", "content": "Weather in Oslo?"}
    assert rendered[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Oslo"},
    }
    assert rendered[2] == {"role": "tool", "content": "12 C, sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    ("template", "renders", "fmt"),
    [
        ("{{ tools }}<tool_call>", True, ToolFormat.HERMES),
        ("{{ tools }}[TOOL_CALLS]", True, ToolFormat.MISTRAL),
        ('{{ tools }}<|python_tag|>"parameters"', True, ToolFormat.LLAMA3_JSON),
        ("{{ tools }} call me", True, None),
        ("<tool_call>", False, None),
    ],
)
def test_the_call_syntax_is_the_templates_own(template, renders, fmt):
    assert template_format(template, renders) is fmt
