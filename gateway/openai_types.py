"""OpenAI wire shapes for the endpoints Strata serves, as msgspec Structs.

Requests are decoded strictly for types, as OpenAI's API does: a wrong type is a 400 (`"5"`
is not an integer; see gateway/app.py), and unknown fields are tolerated. Responses are
encoded with `omit_defaults` where OpenAI omits fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class TextPart(msgspec.Struct, kw_only=True):
    type: str
    text: str = ""


MAX_USER_CHARS = 256  # `user` is stored in every ledger record
MAX_JSON_DEPTH = 64  # nesting of a body's free-form JSON (schemas, tool arguments)


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether lists and objects in `value` nest more than `limit` levels (iterative: a
    value too deep for recursion is answered too)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if p.type == "text")


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class ToolName(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: ToolName


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: Annotated[str, msgspec.Meta(max_length=MAX_USER_CHARS)] | None = None
    # token id (as a string) -> bias in [-100, 100], added to its logit before sampling
    logit_bias: dict[str, float] | None = None
    # extensions vLLM users expect
    min_tokens: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema"}}
    response_format: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI features Strata does not implement: read only to refuse them (gateway/prepare.py)
    functions: list[Any] | None = None
    function_call: Any = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # a text, token ids, or a batch: a list of texts or of token-id lists
    prompt: str | list[int | str | list[int]]
    logprobs: int | None = None
    echo: bool = False
    # as on chat (an extension vLLM also offers)
    response_format: dict[str, Any] | None = None
    # not implemented: read only to refuse them, as for chat
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a text prompt, or chat messages rendered by the model's template."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for a prompt (a template writes its own)
    add_generation_prompt: bool = True  # for messages
    # with messages: the tools' description counts, as it does in a chat request
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str
    tokens: list[int]


# -- responses ----------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0
    # Strata's breakdown of cached_tokens: KV copied back from host RAM or from disk (the
    # rest was still in device memory)
    cached_tokens_host: int = 0
    cached_tokens_disk: int = 0


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobContent(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprobContent]


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None = ""  # None when the turn calls tools
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    # what ended it, as vLLM reports: the stop string or stop token id (null for EOS,
    # the end of turn and length)
    stop_reason: int | str | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True):
    index: int
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    # what ended it, as vLLM reports: the stop string or stop token id (null for EOS,
    # the end of turn and length)
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    # with echo, the prompt's tokens come first; its first token has no logprob (null)
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    # what ended it, as vLLM reports: the stop string or stop token id (null for EOS,
    # the end of turn and length)
    stop_reason: int | str | None = None


class Completion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int
    owned_by: str
    object: str = "model"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None  # the context, prompt and completion together (vLLM)


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct, kw_only=True):
    error: ErrorInfo


ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "insufficient_quota",
    "server_error",
    "service_unavailable",
]

JSONDict = dict[str, Any]


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str
