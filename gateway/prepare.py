"""Turn an OpenAI request into a `Job`: validated sampling parameters, exact prompt tokens,
and every policy check that needs no store round trip (model ACL, token caps, context caps).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.protocol import (
    MAX_LOGPROBS,
    InvalidRequestError,
    LoRARequest,
    ModelInfo,
    SamplingParams,
    Scheduling,
)
from engine.structured import SchemaError, check
from engine.tokenizer import ChatTemplateError, Tokenizer
from gateway.errors import APIError, bad_request
from gateway.openai_types import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    Tool,
)
from gateway.tool_formats import ToolFormat, probe_tools, template_format
from gateway.tools import ToolPlan, plan_tools, render_messages
from tenants.records import Tenant

Endpoint = Literal["chat.completions", "completions"]
MAX_N = 16
MAX_PROMPTS = 64  # prompts in one completions request (each with n choices)
MAX_CHOICES = 128  # prompts x n
MAX_STOP = 4
MAX_COMPLETION_LOGPROBS = 5
# Longer prompt texts are tokenized on a worker thread (the tokenizer releases the GIL), so
# a long RAG context never stalls the event loop that every other stream shares; shorter
# ones (under ~1 ms of work) cost less inline than the thread hop would.
INLINE_TOKENIZE_CHARS = 2048
INLINE_RENDER_MESSAGES = 32  # longer conversations are rendered on a worker thread too
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class Job:
    """One admitted-to-be request, everything decided except the rate limits."""

    request_id: str
    endpoint: Endpoint
    model: str  # as responses name it: the canonical model id, or the adapter asked for
    base_model: str  # the canonical id of the model that runs it (what the ledger bills)
    prompts: list[list[int]]  # token ids: one prompt, or several (completions)
    params: SamplingParams
    n: int  # choices per prompt
    stream: bool
    include_usage: bool
    user: str | None
    scheduling: Scheduling
    echo_texts: list[str] | None = None  # completions with echo=True: each prompt's text
    # n > 1: a prompt's other choices start once its first choice has computed the prompt,
    # whose KV they then take from the prefix cache instead of computing it again each
    staggered: bool = False
    prefilled: dict[int, asyncio.Event] = field(default_factory=dict)  # by prompt
    kv_block_size: int = 1  # the engine's KV block, the unit its caches are held in
    lora: LoRARequest | None = None  # the adapter it runs through (None: the base model)
    tools: ToolPlan | None = None  # chat with callable tools: replies are parsed for calls
    created: int = field(default_factory=lambda: int(time.time()))
    started_at: float = field(default_factory=time.time)
    started: float = field(default_factory=time.perf_counter)

    @property
    def num_prompt_tokens(self) -> int:
        """Billed prompt tokens: each prompt once, however many choices it has."""
        return sum(len(p) for p in self.prompts)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, choice: int) -> int:
        """The prompt a choice answers: choices are numbered prompt by prompt (OpenAI's
        order), `n` per prompt."""
        return choice // self.n

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def kv_tokens(self) -> int:
        """KV the job may hold at its peak, in whole blocks (as the engine allocates and
        reports it), counted in tokens: every choice's prompt plus max_tokens."""
        bs = self.kv_block_size
        blocks = sum(-(-(len(p) + self.max_tokens) // bs) for p in self.prompts)
        return self.n * blocks * bs


def cache_salt(tenant: Tenant) -> str:
    """The prefix-cache salt: the tenant's secret one, or its opted-in shared namespace."""
    shared = tenant.policy.shared_cache_namespace
    return f"shared:{shared}" if shared is not None else f"tenant:{tenant.cache_salt}"


def new_request_id(endpoint: Endpoint) -> str:
    prefix = "chatcmpl" if endpoint == "chat.completions" else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex}"


class Preparer:
    """Validation and tokenization for one served model (the fleet has resolved, and
    checked the plan for, the name a request gave). `close()` stops its tokenizer threads."""

    def __init__(self, tokenizer: Tokenizer, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        # response formats are compiled here, one at a time, after admission
        self._grammars = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.tool_format = _tool_format(tokenizer)
        marker = tokenizer.token_id("[TOOL_CALLS]")  # mistral's, where it is a special token
        self._tool_calls_token = marker if marker in tokenizer.all_special_ids else None

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._grammars.shutdown(wait=False, cancel_futures=True)

    def plan_tools(
        self, tools: list[Tool] | None, choice: str | NamedToolChoice | None, parallel: bool
    ) -> ToolPlan | None:
        """A request's tool plan, in the model's own call syntax where its template has one."""
        return plan_tools(tools, choice, parallel, self.tool_format, self._tool_calls_token)

    async def check_grammar(self, job: Job) -> None:
        """Compile the job's response format (or tool calls' grammar) once, on the grammar
        thread, never on the event loop; call it after admission. Raises a 400 naming what
        is refused, or saying the grammar is over its compile budget."""
        params = job.params
        if not params.is_constrained:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._grammars, check, params.json_schema, params.grammar)
        except SchemaError as exc:
            if job.tools is None:
                raise bad_request(f"response_format: {exc}", param="response_format") from None
            raise await loop.run_in_executor(self._grammars, job.tools.refusal, exc) from None

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; long texts are tokenized off the event loop."""
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._threads, self.tokenizer.encode, text, add_special_tokens
        )

    async def chat_ids(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: ToolPlan | None = None,
    ) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template (with the
        description of `tools`, when some may be called)."""
        if not messages:
            raise bad_request("messages must not be empty", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message.content, list):
                continue
            for part in message.content:
                if part.type != "text":
                    raise bad_request(
                        f"content parts of type '{part.type}' are not supported by this model "
                        "(text only)",
                        param=f"messages[{i}].content",
                    )
        native = {"tools": tools.tools} if tools is not None and tools.native is not None else {}

        def render() -> list[int]:
            rendered = render_messages(messages, tools)
            text = self.tokenizer.apply_chat_template(
                rendered, add_generation_prompt=add_generation_prompt, **native
            )
            # as Tokenizer.encode_chat: templates write their own BOS
            return self.tokenizer.encode(text, add_special_tokens=False)

        try:
            if (
                len(messages) <= INLINE_RENDER_MESSAGES
                and sum(len(m.text()) for m in messages) <= INLINE_TOKENIZE_CHARS
            ):
                return render()
            # many or long messages: the template and the tokenizer run on a worker thread,
            # so one conversation of 50,000 messages does not hold every other stream
            return await asyncio.get_running_loop().run_in_executor(self._threads, render)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from exc

    async def chat(
        self,
        body: ChatCompletionRequest,
        tenant: Tenant,
        request_id: str,
        lora: LoRARequest | None = None,
        started: float | None = None,
    ) -> Job:
        """The job of a chat request; `started` (perf_counter) is when the request arrived,
        so its latency counts the preparation too."""
        _refuse_unsupported(body)
        tools = self.plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        json_schema = _json_schema(body.response_format)
        grammar = None
        if tools is not None:
            if json_schema is not None:
                raise bad_request(
                    "response_format and callable tools together are not supported",
                    param="response_format",
                )
            json_schema, grammar = tools.schema, tools.grammar
        prompt_ids = await self.chat_ids(body.messages, tools=tools)
        logprobs = None
        if body.logprobs:
            logprobs = body.top_logprobs or 0
            if not 0 <= logprobs <= MAX_LOGPROBS:
                raise bad_request(
                    f"top_logprobs must be between 0 and {MAX_LOGPROBS}", param="top_logprobs"
                )
        elif body.top_logprobs is not None:
            raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
        max_tokens = body.max_completion_tokens or body.max_tokens
        return self._job(
            body,
            tenant,
            request_id,
            "chat.completions",
            [prompt_ids],
            max_tokens,
            logprobs,
            json_schema=json_schema,
            grammar=grammar,
            lora=lora,
            tools=tools,
            started=started,
        )

    async def completion(
        self,
        body: CompletionRequest,
        tenant: Tenant,
        request_id: str,
        lora: LoRARequest | None = None,
        started: float | None = None,
    ) -> Job:
        """The job of a completions request (`started` as for `chat`)."""
        _refuse_unsupported(body)
        prompts, texts = await self._prompts(body.prompt, body.echo)
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise bad_request(
                f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}", param="logprobs"
            )
        # echo with logprobs scores the prompt too, as does echo with max_tokens 0 (the
        # prompt alone comes back)
        scoring = None
        if body.echo and (body.logprobs is not None or body.max_tokens == 0):
            scoring = body.logprobs or 0
        return self._job(
            body,
            tenant,
            request_id,
            "completions",
            prompts,
            body.max_tokens,
            body.logprobs,
            prompt_logprobs=scoring,
            json_schema=_json_schema(body.response_format),
            lora=lora,
            echo_texts=texts,
            started=started,
        )

    async def _prompts(
        self, prompt: str | list[int | str | list[int]], echo: bool
    ) -> tuple[list[list[int]], list[str] | None]:
        """A completion's prompts as token ids (one text, a list of texts, one list of token
        ids, or a list of them), and their texts when they are echoed."""
        items: list[str] | list[list[int]]
        if isinstance(prompt, str):
            items = [prompt]
        elif all(isinstance(p, int) for p in prompt):
            items = [[p for p in prompt if isinstance(p, int)]]  # one prompt of token ids
        elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            items = prompt  # type: ignore[assignment]  # checked just above
        else:
            raise bad_request(
                "prompt must be a string, a list of strings, a list of token ids, or a list of "
                "lists of token ids",
                param="prompt",
            )
        if not 1 <= len(items) <= MAX_PROMPTS:
            raise bad_request(f"between 1 and {MAX_PROMPTS} prompts per request", param="prompt")
        ids: list[list[int]] = []
        texts: list[str] = []
        for item in items:
            if isinstance(item, str):
                ids.append(await self.encode(item))
                texts.append(item)
                continue
            if any(not 0 <= t < self.info.vocab_size for t in item):
                raise bad_request("prompt token ids are out of the vocabulary", param="prompt")
            ids.append(list(item))
            if echo:
                texts.append(self.tokenizer.decode(item))
        return ids, texts if echo else None

    def _job(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        tenant: Tenant,
        request_id: str,
        endpoint: Endpoint,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        json_schema: str | None = None,
        grammar: str | None = None,
        lora: LoRARequest | None = None,
        tools: ToolPlan | None = None,
        echo_texts: list[str] | None = None,
        started: float | None = None,
    ) -> Job:
        """`json_schema` or `grammar`: what the output must be (from response_format, or the
        reply format of callable tools); `lora`: the adapter it runs through."""
        policy = tenant.policy
        if not all(prompts):
            raise bad_request("the prompt is empty", param="prompt")
        if not 1 <= body.n <= MAX_N:
            raise bad_request(f"n must be between 1 and {MAX_N}", param="n")
        if len(prompts) * body.n > MAX_CHOICES:
            raise bad_request(f"prompts x n must be at most {MAX_CHOICES}", param="n")
        num_prompt = max(len(p) for p in prompts)  # the longest decides the limits
        if policy.max_context_tokens is not None and num_prompt > policy.max_context_tokens:
            raise APIError(
                413,
                f"the prompt has {num_prompt} tokens; your plan allows {policy.max_context_tokens}",
                code="context_length_exceeded",
                param="messages",
            )
        room = self.info.max_model_len - num_prompt
        if room < 1:
            raise bad_request(
                f"the prompt has {num_prompt} tokens; this model's context is "
                f"{self.info.max_model_len} tokens",
                code="context_length_exceeded",
            )
        if max_tokens is not None:
            if max_tokens < (0 if prompt_logprobs is not None else 1):
                rule = (
                    "at least 1" if endpoint == "chat.completions" else "at least 1 (0 with echo)"
                )
                raise bad_request(f"max_tokens must be {rule}", param="max_tokens")
            if policy.max_tokens is not None and max_tokens > policy.max_tokens:
                raise bad_request(
                    f"max_tokens exceeds your plan's cap of {policy.max_tokens}",
                    param="max_tokens",
                    code="max_tokens_exceeded",
                )
            if max_tokens > room:
                raise bad_request(
                    f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds this "
                    f"model's context of {self.info.max_model_len} tokens",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
        else:
            max_tokens = min(room, policy.max_tokens or room)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stop) > MAX_STOP:
            raise bad_request(f"at most {MAX_STOP} stop sequences", param="stop")
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k,
                min_p=body.min_p or 0.0,
                seed=body.seed,
                frequency_penalty=body.frequency_penalty or 0.0,
                presence_penalty=body.presence_penalty or 0.0,
                repetition_penalty=(
                    1.0 if body.repetition_penalty is None else body.repetition_penalty
                ),
                stop=stop,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=_logit_bias(body.logit_bias),
                min_tokens=body.min_tokens or 0,
                json_schema=json_schema,
                grammar=grammar,
            )
            params.validate(self.info.vocab_size)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # worth it when the cache can serve at least one block (a prompt being scored takes
        # no hits for what it has not scored)
        staggered = (
            body.n > 1
            and self.info.prefix_caching
            and prompt_logprobs is None
            and max(len(p) for p in prompts) > self.info.kv_block_size
        )
        return Job(
            request_id=request_id,
            endpoint=endpoint,
            model=self.info.model_id if lora is None else body.model,
            lora=lora,
            base_model=self.info.model_id,
            prompts=prompts,
            params=params,
            n=body.n,
            stream=body.stream,
            include_usage=include_usage,
            user=body.user,
            kv_block_size=self.info.kv_block_size,
            staggered=staggered,
            scheduling=Scheduling(
                priority=policy.priority,
                tenant=tenant.id,
                weight=policy.weight,
                cache_salt=cache_salt(tenant),
                kv_host_tokens=policy.kv_host_tokens,
                kv_disk_tokens=policy.kv_disk_tokens,
                kv_remote_tokens=policy.kv_remote_tokens,
            ),
            tools=tools,
            echo_texts=echo_texts,
            started=time.perf_counter() if started is None else started,
        )


def _tool_format(tokenizer: Tokenizer) -> ToolFormat | None:
    """The call syntax the model's chat template teaches, if it renders tools at all."""
    probe = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.apply_chat_template(probe)
        shown = tokenizer.apply_chat_template(probe, tools=probe_tools())
    except ChatTemplateError:
        return None
    renders = shown != plain and probe_tools()[0]["function"]["name"] in shown
    return template_format(tokenizer.chat_template, renders)


def _json_schema(response_format: dict[str, Any] | None) -> str | None:
    """OpenAI's response_format as the JSON Schema text the engine constrains output with:
    None for text, any object for `json_object`, the given schema for `json_schema`."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind != "json_schema":
        raise bad_request(
            "response_format.type must be 'text', 'json_object' or 'json_schema'",
            param="response_format",
        )
    assert response_format is not None
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object", param="response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise bad_request(
            "response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-'",
            param="response_format",
        )
    return json.dumps(spec.get("schema", True))


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings."""
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids", param="logit_bias") from None


def _refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """OpenAI parameters Strata does not implement are a 400, not silently ignored: a client
    that sets them relies on what they do. Their neutral values (no functions, `"none"`,
    one candidate) are accepted."""
    if isinstance(body, ChatCompletionRequest):
        given = {
            "functions": bool(body.functions),
            "function_call": body.function_call not in (None, "none"),
        }
    else:
        given = {
            "suffix": bool(body.suffix),
            "best_of": body.best_of not in (None, 1, body.n),
        }
    for name, used in given.items():
        if used:
            raise bad_request(
                f"'{name}' is not supported by this server",
                param=name,
                code="unsupported_parameter",
            )
