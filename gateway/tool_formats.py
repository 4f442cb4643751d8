"""Models' own tool-call syntax, for chat templates that render `tools`: which syntax a
template teaches, the grammar that constrains a reply to it, and the parsing of a reply (whole
or streamed) into text and calls, as vLLM's tool parsers read them.

- hermes (Qwen2.5, Hermes, and templates that say `<tool_call>`): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, after any text;
- llama3_json (Llama 3.1+): the reply is `{"name": ..., "parameters": {...}}`, several
  joined by `; `, maybe after `<|python_tag|>`;
- mistral: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from typing import Any

from gateway.openai_types import AssistantMessage, FunctionCall, ToolCall


class ToolFormat(enum.Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"


_PROBE = {
    "type": "function",
    "function": {
        "name": "strata_probe_tool",
        "description": "",
        "parameters": {"type": "object", "properties": {}},
    },
}
_PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# free text of a reply that may also call (llguidance regexes: `&` and `~` are and / not)
_ANY_TEXT = r"/(.|\n)+/"


def template_format(template: str | None, renders_tools: bool) -> ToolFormat | None:
    """The syntax a chat template teaches its model; None when it renders no tools or its
    syntax is not one of these (then tools are described in a system message instead)."""
    if template is None or not renders_tools:
        return None
    if "<tool_call>" in template:
        return ToolFormat.HERMES
    if "[TOOL_CALLS]" in template:
        return ToolFormat.MISTRAL
    if _PYTHON_TAG in template or '"parameters"' in template:
        return ToolFormat.LLAMA3_JSON
    return None


def probe_tools() -> list[dict[str, Any]]:
    """A tool list to render a template with, to see whether it shows tools at all."""
    return [_PROBE]


def call_schema(tools: list[dict[str, Any]], fmt: ToolFormat) -> dict[str, Any]:
    """The JSON Schema of one call of any of `tools` ({"name", "parameters"} each) as `fmt`
    writes it."""
    key = "parameters" if fmt is ToolFormat.LLAMA3_JSON else "arguments"
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t["name"]}, key: t["parameters"]},
            "required": ["name", key],
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def call_grammar(
    tools: list[dict[str, Any]],
    fmt: ToolFormat,
    parallel: bool,
    answer: bool,
    mistral_token: int | None,
) -> str:
    """The Lark grammar of a reply that calls `tools` in `fmt` (one call unless `parallel`),
    or with `answer`, that may also be text (before the calls, in hermes)."""
    body = f"%json {json.dumps(call_schema(tools, fmt), ensure_ascii=False)}"
    if fmt is ToolFormat.HERMES:
        # with `answer`, text may come first: one lexeme reads it up to the first marker
        # (a text lexeme that stopped before `<` could not know whether a marker follows)
        first = "OPEN" if answer else '"<tool_call>\\n"'
        rest = ' ("\\n" call)*' if parallel else ""
        rules = [
            f'calls: {first} body "\\n</tool_call>"{rest}',
            'call: "<tool_call>\\n" body "\\n</tool_call>"',
            "OPEN: /(.|\\n)*<tool_call>\\n/ & ~/(.|\\n)*<tool_call>(.|\\n)*<tool_call>\\n/",
        ]
        text = f"TEXT: {_ANY_TEXT} & ~/(.|\\n)*<tool_call>(.|\\n)*/"
        start = "start: TEXT | calls" if answer else "start: calls"
    elif fmt is ToolFormat.LLAMA3_JSON:
        rules = ['calls: body ("; " body)*' if parallel else "calls: body"]
        text = f"TEXT: {_ANY_TEXT} & ~/[ \\t\\n]*[{{<](.|\\n)*/"
        start = "start: TEXT | calls" if answer else "start: calls"
    else:
        opener = f"<[{mistral_token}]>" if mistral_token is not None else '"[TOOL_CALLS]"'
        items = 'body (", " body)*' if parallel else "body"
        rules = [f'calls: {opener} "[" {items} "]"']
        text = f"TEXT: {_ANY_TEXT} & ~/(.|\\n)*\\[TOOL_CALLS\\](.|\\n)*/"
        start = "start: TEXT | calls" if answer else "start: calls"
    return "\n".join([start, *rules, f"body: {body}", *([text] if answer else [])]) + "\n"


def parse_native(
    text: str, finish_reason: str | None, fmt: ToolFormat
) -> tuple[AssistantMessage, str | None]:
    """A reply in `fmt` as OpenAI's message: its calls (finish reason "tool_calls") and the
    text before them, or all of it as text when it holds no whole call."""
    content, calls = _split(text, fmt)
    if not calls:
        return AssistantMessage(content=text), finish_reason
    tool_calls = [
        ToolCall(
            id=f"call_{uuid.uuid4().hex[:24]}",
            function=FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False)),
        )
        for name, args in calls
    ]
    return AssistantMessage(content=content or None, tool_calls=tool_calls), "tool_calls"


def _split(text: str, fmt: ToolFormat) -> tuple[str, list[tuple[str, Any]]]:
    """The text before the calls, and the calls (name, arguments); no calls if any is cut."""
    if fmt is ToolFormat.HERMES:
        found = list(_HERMES_CALL.finditer(text))
        start = text.find("<tool_call>")
        if not found:
            return text, []
        return text[:start].strip(), _calls([_loads(m[1]) for m in found], "arguments")
    if fmt is ToolFormat.MISTRAL:
        start = text.find("[TOOL_CALLS]")
        body = text[start + len("[TOOL_CALLS]") :] if start >= 0 else text.lstrip()
        value = _loads(body) if body.startswith("[") else None
        calls = _calls(value, "arguments") if isinstance(value, list) else []
        return (text[:start].strip() if start >= 0 else ""), calls
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    values: list[Any] = []
    decoder, at = json.JSONDecoder(), 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        values.append(value)
        at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
    return "", _calls(values, "parameters")


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _calls(values: Any, key: str) -> list[tuple[str, Any]]:
    calls = []
    for value in values if isinstance(values, list) else []:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return []
        calls.append((value["name"], value.get(key, value.get("arguments", {}))))
    return calls


_MARKERS = {ToolFormat.HERMES: "<tool_call>", ToolFormat.MISTRAL: "[TOOL_CALLS]"}


class NativeReplyStream:
    """A native-format reply read as it streams: text is released as it comes, up to where
    calls start (a marker, or for llama3_json a reply that opens with `{`); what follows is
    held (`unreleased`) and read whole at the end."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.released = 0  # characters of `text` released as content
        self.calls = False  # calls have started: nothing more is released

    @property
    def unreleased(self) -> str:
        return self.text[self.released :]

    def feed(self, delta: str) -> str | None:
        """The reply's new text to release (maybe ""), or None once calls have started."""
        self.text += delta
        if self.calls:
            return None
        if self.fmt is ToolFormat.LLAMA3_JSON:
            head = self.text.lstrip()
            if not head or _PYTHON_TAG.startswith(head[: len(_PYTHON_TAG)]):
                return ""  # undecided: a call may be starting
            if head.startswith(("{", _PYTHON_TAG)):
                self.calls = True
                return None
            return self._release(len(self.text))
        marker = _MARKERS[self.fmt]
        found = self.text.find(marker, self.released)
        if found >= 0:
            self.calls = True
            return self._release(found)
        # hold back a tail that could be the start of the marker
        keep = next((k for k in range(len(marker) - 1, 0, -1) if self.text.endswith(marker[:k])), 0)
        return self._release(len(self.text) - keep)

    def _release(self, end: int) -> str:
        out = self.text[self.released : end]
        self.released = max(self.released, end)
        return out
