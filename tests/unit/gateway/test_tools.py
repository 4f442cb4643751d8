"""Tool calling's plan (the reply schema and the tools' description), the rendering of a
conversation with calls in it, and the parsing of replies into OpenAI's message."""

from __future__ import annotations

import json

import msgspec
import pytest

from engine.structured import JsonMatcher, grammar_for
from gateway.errors import APIError
from gateway.openai_types import ChatMessage, NamedToolChoice, Tool, ToolName
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


def allows(schema_text: str, reply: object) -> bool:
    matcher = JsonMatcher(grammar_for(schema_text))
    state = matcher.advance(matcher.start, json.dumps(reply).encode())
    return state is not None and matcher.can_end(state)


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
        (named("get_time"), True, [{"tool_calls": [{"name": "get_time", "arguments": {}}]}],
         [CALL, ANSWER]),
    ],
)  # fmt: skip
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
        ([{"type": "function", "function": {"name": "get weather"}}], None,
         "tools[0].function.name", "tool names must be"),
        ([CLOCK, CLOCK], None, "tools[1]", "two tools are named 'get_time'"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "properties": {"n": {"type": "integer", "multipleOf": 2}}}}}], None,
         "tools[0].function.parameters", "'multipleOf' is not supported"),
        ([CLOCK], named("get_weather"), "tool_choice", "not in tools"),
        ([], "required", "tool_choice", "tool_choice needs tools"),
    ],
)  # fmt: skip
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
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1",
             "type": "function", "function": {"name": "get_weather",
                                              "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C, sunny"},
        ],
        list[ChatMessage],
    )  # fmt: skip
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
    label = {"$defs": {"P": {"type": "string", "maxLength": 3}},
             "type": "object", "properties": {"text": {"$ref": "#/$defs/P"}},
             "required": ["text"]}  # fmt: skip
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    specs = [{"type": "function", "function": {"name": n, "parameters": p}}
             for n, p in (("move", point), ("say", label), ("grow", tree))]  # fmt: skip
    plan = plan_tools(tools(*specs), "required", True)
    assert plan is not None
    call = lambda name, args: {"tool_calls": [{"name": name, "arguments": args}]}  # noqa: E731
    assert allows(plan.schema, call("move", {"at": {"x": 3}}))
    assert not allows(plan.schema, call("move", {"at": "abc"}))
    assert allows(plan.schema, call("say", {"text": "abc"}))
    assert not allows(plan.schema, call("say", {"text": {"x": 3}}))
    assert allows(plan.schema, call("grow", {"kids": [{"kids": []}, {}]}))
    assert '"#/$defs/P"' in plan.instructions  # the model reads each tool as it was given
