"""Tool calling (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`) for any model, through
structured output: in the model's own call syntax where its chat template has one that
gateway/tool_formats.py knows, else as one constrained JSON object described in a system
message. Replies come back in OpenAI's shape. Details: docs/structured-output.md.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.structured import SchemaError, check
from gateway.errors import APIError, bad_request
from gateway.openai_types import (
    AssistantMessage,
    ChatMessage,
    FunctionCall,
    NamedToolChoice,
    Tool,
    ToolCall,
    too_deep,
)
from gateway.tool_formats import NativeReplyStream, ToolFormat, call_grammar, parse_native

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How a request's tools shape its prompt and its output: the JSON-object scheme
    (`schema`, `instructions`) or the model's own syntax (`native`, `grammar`, `tools`)."""

    schema: str | None  # the JSON Schema the reply must match, as text
    instructions: str | None  # the system message that describes the tools
    native: ToolFormat | None = None
    grammar: str | None = None  # the Lark grammar a native reply must match
    tools: list[dict[str, Any]] = field(default_factory=list)  # for the chat template
    # each tool's name and parameters schema, to name the one a compile refuses
    parameters: tuple[tuple[str, Any], ...] = ()

    def parse_reply(
        self, text: str, finish_reason: str | None
    ) -> tuple[AssistantMessage, str | None]:
        if self.native is not None:
            return parse_native(text, finish_reason, self.native)
        return parse_reply(text, finish_reason)

    def reader(self) -> ReplyStream | NativeReplyStream:
        return ReplyStream() if self.native is None else NativeReplyStream(self.native)

    def refusal(self, exc: SchemaError) -> APIError:
        """A 400 naming the tool whose parameters the reply's grammar could not take (found
        by compiling each alone: call it off the event loop)."""
        for i, (_, parameters) in enumerate(self.parameters):
            try:
                check(json.dumps(parameters), None)
            except SchemaError as own:
                return bad_request(str(own), param=f"tools[{i}].function.parameters")
        return bad_request(f"the tools' schemas together: {exc}", param="tools")


def plan_tools(
    tools: list[Tool] | None,
    choice: str | NamedToolChoice | None,
    parallel: bool,
    native: ToolFormat | None = None,
    mistral_token: int | None = None,
) -> ToolPlan | None:
    """The plan for a request's tools, in the template's own syntax `native` where it has
    one; None when no tool may be called. Raises a 400 naming the field for a bad tool or
    choice (schemas are compiled later, after admission: `ToolPlan.refusal`)."""
    if choice is not None and not tools:
        if choice == "none":
            return None
        raise bad_request("tool_choice needs tools", param="tool_choice")
    if not tools or choice == "none":
        return None
    table = _tool_table(tools)
    names = list(table)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in table:
            raise bad_request(
                f"tool_choice names '{choice.function.name}', which is not in tools",
                param="tool_choice",
            )
        names = [choice.function.name]
    answer = choice in (None, "auto")
    parameters = tuple((name, spec["parameters"]) for name, spec in table.items())
    if native is not None:
        chosen = [table[n] for n in names]
        grammar = call_grammar(chosen, native, parallel, answer, mistral_token)
        listed = [{"type": "function", "function": spec} for spec in table.values()]
        return ToolPlan(None, None, native, grammar, listed, parameters)
    schema = json.dumps(_reply_schema([table[n] for n in names], parallel, answer))
    listing = json.dumps(list(table.values()), ensure_ascii=False)
    shape = '{"tool_calls": [{"name": <function name>, "arguments": <arguments object>}]}'
    instructions = (
        f"You can call these functions (their arguments are described as JSON Schema):\n"
        f"{listing}\n\nReply with one JSON object: {shape} to call "
        + ("functions" if parallel else "one function")
        + (', or {"content": <your answer>} to answer without calling one.' if answer else ".")
    )
    return ToolPlan(schema=schema, instructions=instructions, parameters=parameters)


def _tool_table(tools: list[Tool]) -> dict[str, dict[str, Any]]:
    """Each tool by name, as the model is told of it; a 400 for a bad or repeated name."""
    table: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.function
        if not _NAME.fullmatch(fn.name):
            raise bad_request(
                "tool names must be 1 to 64 letters, digits, '_' or '-'",
                param=f"tools[{i}].function.name",
            )
        if fn.name in table:
            raise bad_request(f"two tools are named '{fn.name}'", param=f"tools[{i}]")
        parameters = fn.parameters if fn.parameters is not None else _EMPTY_ARGUMENTS
        table[fn.name] = {
            "name": fn.name,
            "description": fn.description or "",
            "parameters": parameters,
        }
    return table


def _reply_schema(tools: list[dict[str, Any]], parallel: bool, answer: bool) -> dict[str, Any]:
    """The JSON Schema of a reply that calls `tools` (or, with `answer`, answers in text).
    Each tool's own definitions move to the root, renamed per tool, with its references."""
    options: list[dict[str, Any]] = []
    definitions: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        parameters, own = _hoisted(tool["parameters"], f"tool{i}.")
        definitions |= own
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
            }
        )
    calls = {
        "type": "array",
        "items": {"anyOf": options},
        "minItems": 1,
        **({} if parallel else {"maxItems": 1}),
    }
    reply: dict[str, Any] = {
        "type": "object",
        "properties": {"tool_calls": calls},
        "required": ["tool_calls"],
    }
    if answer:
        text = {
            "type": "object",
            "properties": {"content": {"type": "string"}},
            "required": ["content"],
        }
        reply = {"anyOf": [reply, text]}
    return reply | ({"$defs": definitions} if definitions else {})


def _hoisted(schema: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """A tool's parameters schema without its definitions, its references rewritten to
    `#/$defs/<prefix><name>` (`#` itself to `#/$defs/<prefix>`), and the definitions so
    named, for the reply schema's root to hold."""
    found_root = False

    def rewrite(node: Any) -> Any:
        nonlocal found_root
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key in ("$defs", "definitions"):
                continue
            if key == "$ref" and isinstance(value, str):
                if value == "#":
                    found_root = True
                    value = f"#/$defs/{prefix}"
                elif value.startswith(("#/$defs/", "#/definitions/")):
                    value = f"#/$defs/{prefix}{value.split('/', 2)[2]}"
            out[key] = rewrite(value)
        return out

    definitions = {}
    if isinstance(schema, dict):
        for key in ("$defs", "definitions"):
            for name, sub in (schema.get(key) or {}).items():
                definitions[f"{prefix}{name}"] = rewrite(sub)
    body = rewrite(schema)
    if found_root:
        definitions[prefix] = body
    return body, definitions


def render_messages(messages: list[ChatMessage], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it: assistant turns' calls in the JSON the
    model writes, and the tools' description first (in the system message, if there is one);
    or, for a template with its own syntax, calls and results as templates take them."""
    if plan is not None and plan.native is not None:
        return [_native_turn(m) for m in messages]
    rendered = []
    for m in messages:
        content = m.text()
        if m.tool_calls:
            calls = [
                {"name": c.function.name, "arguments": _arguments(c.function.arguments)}
                for c in m.tool_calls
            ]
            content = json.dumps({"tool_calls": calls}, ensure_ascii=False)
        rendered.append({"role": m.role, "content": content})
    if plan is not None and plan.instructions is not None:
        if rendered and rendered[0]["role"] in ("system", "developer"):
            first = rendered[0]
            rendered[0] = {**first, "content": f"{first['content']}\n\n{plan.instructions}"}
        else:
            rendered.insert(0, {"role": "system", "content": plan.instructions})
    return rendered


def _native_turn(m: ChatMessage) -> dict[str, Any]:
    """A turn as templates that render tools read it (transformers' convention: a call's
    arguments as an object, a tool result with the id of the call it answers)."""
    turn: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        turn["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": _arguments(c.function.arguments),
                },
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        turn["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        turn["name"] = m.name
    return turn


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text  # shown as the client sent it
    return text if too_deep(value) else value


def parse_reply(text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
    """A constrained reply as OpenAI's message and finish reason. A reply cut short (by
    max_tokens or a stop string) is not a whole object: a text answer keeps what it had
    written, and cut calls come back as their raw text."""
    try:
        reply = json.loads(text)
    except ValueError:
        opening = _CONTENT_OPENING.match(text)
        if opening is not None:
            return AssistantMessage(content=_decode(text[opening.end() :])[0]), finish_reason
        return AssistantMessage(content=text), finish_reason
    if isinstance(reply, dict) and isinstance(reply.get("tool_calls"), list):
        calls = [
            ToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}",
                function=FunctionCall(
                    name=call["name"], arguments=json.dumps(call["arguments"], ensure_ascii=False)
                ),
            )
            for call in reply["tool_calls"]
        ]
        return AssistantMessage(content=None, tool_calls=calls), "tool_calls"
    if isinstance(reply, dict) and isinstance(reply.get("content"), str):
        return AssistantMessage(content=reply["content"]), finish_reason
    return AssistantMessage(content=text), finish_reason


_CONTENT_OPENING = re.compile(r'\s*\{\s*"content"\s*:\s*"')
_ESCAPED = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class ReplyStream:
    """A tool-calling reply read as it streams. Once it has opened a text answer
    (`{"content": "`), the answer's characters are released as they arrive; calls are
    released only whole, at the end (`feed` returns None for them)."""

    def __init__(self) -> None:
        self.text = ""
        self.start: int | None = None  # where the answer's string starts in `text`
        self.read = 0  # of that string, the characters decoded so far
        self.closed = False  # its closing quote has come
        self.calls = False  # the reply is calls (or cannot be an answer)

    @property
    def unreleased(self) -> str:
        """The reply's text not released as an answer (all of it, unless it is one)."""
        return self.text if self.start is None else ""

    def feed(self, delta: str) -> str | None:
        """The answer's new text (maybe ""), or None while the reply is not known to be one."""
        self.text += delta
        if self.start is None and not self.calls:
            opening = _CONTENT_OPENING.match(self.text)
            if opening is not None:
                self.start = opening.end()
            elif not '{"content":"'.startswith(re.sub(r"\s+", "", self.text)):
                self.calls = True
        if self.start is None:
            return None
        if self.closed:
            return ""
        decoded, used, self.closed = _decode(self.text[self.start + self.read :])
        self.read += used
        return decoded


def _decode(body: str) -> tuple[str, int, bool]:
    """The start of a JSON string's body, decoded: (text, characters used, whether the
    closing quote came). An escape not yet whole is left for the next call."""
    out: list[str] = []
    i = 0
    while i < len(body):
        char = body[i]
        if char == '"':
            return "".join(out), i + 1, True
        if char != "\\":
            out.append(char)
            i += 1
            continue
        if i + 1 >= len(body):
            break
        if body[i + 1] != "u":
            out.append(_ESCAPED.get(body[i + 1], body[i + 1]))
            i += 2
            continue
        if i + 6 > len(body):
            break
        code = int(body[i + 2 : i + 6], 16)
        if 0xD800 <= code < 0xDC00:  # the high half of a pair: the low half must follow
            if i + 12 > len(body) and body[i + 6 : i + 8] in ("\\u", "\\", ""):
                break
            low = body[i + 8 : i + 12] if body[i + 6 : i + 8] == "\\u" else ""
            if len(low) == 4 and 0xDC00 <= int(low, 16) < 0xE000:
                out.append(chr(0x10000 + ((code - 0xD800) << 10) + int(low, 16) - 0xDC00))
                i += 12
                continue
            code = 0xFFFD
        elif 0xDC00 <= code < 0xE000:
            code = 0xFFFD  # a lone low half
        out.append(chr(code))
        i += 6
    return "".join(out), i, False
