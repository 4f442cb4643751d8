"""The OpenAI-compatible surface: chat and text completions, models, the tenant's usage."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from litestar import Controller, MediaType, Request, Response, get, post
from litestar.params import FromPath, FromQuery, JSONBody
from litestar.response import Stream

from gateway.auth import auth_of, gateway_state, requires_api_key
from gateway.errors import APIError, bad_request
from gateway.fleet import ModelGroup
from gateway.logs import bind_request
from gateway.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from gateway.pipeline import Tally
from gateway.prepare import Job, new_request_id
from gateway.responses import Renderer
from gateway.routes import time_window, usage_export
from gateway.state import GatewayState

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def respond(
    gw: GatewayState, request: Request[Any, Any, Any], job: Job, group: ModelGroup
) -> Response[Any]:
    """Admit the job (and choose its worker), then stream it or run it to completion."""
    bind_request(job.request_id, auth_of(request).tenant.id)
    ticket = await gw.pipeline.admit(auth_of(request), job)
    try:  # a response format is compiled once admitted (a refusal settles the job)
        await group.preparer.check_grammar(job)
    except APIError:
        gw.pipeline.settle(job, ticket, Tally(status="error"))
        raise
    request.state.response_headers = {"x-request-id": job.request_id, **ticket.headers}
    renderer = Renderer(group.tokenizer)
    if job.stream:
        return Stream(
            renderer.stream(gw.pipeline, job, ticket),
            media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )
    results, tally = await gw.pipeline.complete(job, ticket)
    request.state.response_headers["server-timing"] = tally.server_timing(job.started)
    if job.endpoint == "chat.completions":
        return Response(renderer.chat_completion(job, results, tally))
    return Response(renderer.completion(job, results, tally))


async def _visible_models(request: Request[Any, Any, Any]) -> list[ModelCard]:
    """Every served model and every adapter of one that the caller's plan allows."""
    gw, tenant = gateway_state(request), auth_of(request).tenant
    policy, created = tenant.policy, int(gw.started_at)
    cards = [
        ModelCard(
            id=model_id,
            created=created,
            owned_by="strata",
            root=model_id,
            max_model_len=group.info.max_model_len,
        )
        for model_id, group in sorted(gw.fleet.groups.items())
        if policy.allows_model(model_id)
    ]
    for adapter in await gw.registry.list_adapters(tenant.id):
        group = gw.fleet.resolve(adapter.base_model)
        if group is not None and policy.allows_adapter(adapter.name):
            cards.append(
                ModelCard(
                    id=adapter.name,
                    created=int(adapter.created_at),
                    owned_by="strata",
                    root=group.model_id,
                    parent=group.model_id,
                    max_model_len=group.info.max_model_len,
                )
            )
    return cards


def _start_request(request: Request[Any, Any, Any], rid: str) -> float:
    request.state.response_headers = {"x-request-id": rid}
    return time.perf_counter()


class OpenAIController(Controller):
    path = "/v1"
    guards = [requires_api_key]  # noqa: RUF012  (Litestar reads class attributes)
    tags = ["openai"]  # noqa: RUF012

    @post("/chat/completions", status_code=200)
    async def chat_completions(
        self, request: Request[Any, Any, Any], data: JSONBody[ChatCompletionRequest]
    ) -> Response[Any]:
        gw, rid = gateway_state(request), new_request_id("chat.completions")
        started = _start_request(request, rid)
        tenant = auth_of(request).tenant
        group, lora = await gw.adapters.resolve(data.model, tenant)
        job = await group.preparer.chat(data, tenant, rid, lora)
        job.started = started  # e2e and TTFT include tokenization
        return await respond(gw, request, job, group)

    @post("/completions", status_code=200)
    async def completions(
        self, request: Request[Any, Any, Any], data: JSONBody[CompletionRequest]
    ) -> Response[Any]:
        gw, rid = gateway_state(request), new_request_id("completions")
        started = _start_request(request, rid)
        tenant = auth_of(request).tenant
        group, lora = await gw.adapters.resolve(data.model, tenant)
        job = await group.preparer.completion(data, tenant, rid, lora)
        job.started = started  # e2e and TTFT include tokenization
        return await respond(gw, request, job, group)

    @get("/models")
    async def models(self, request: Request[Any, Any, Any]) -> ModelList:
        return ModelList(data=await _visible_models(request))

    @get("/models/{model_id:str}")
    async def model(self, request: Request[Any, Any, Any], model_id: FromPath[str]) -> ModelCard:
        """One model the tenant may use (OpenAI's retrieve), or a 404."""
        for card in await _visible_models(request):
            if card.id == model_id:
                return card
        raise APIError(
            404,
            f"The model '{model_id}' does not exist or you do not have access to it.",
            type="not_found_error", code="model_not_found", param="model",
        )  # fmt: skip

    @get("/usage")
    async def usage(
        self,
        request: Request[Any, Any, Any],
        start: FromQuery[str | None] = None,
        end: FromQuery[str | None] = None,
        granularity: FromQuery[Literal["request", "hour", "day"]] = "day",
    ) -> Response[Any]:
        """The caller's own usage (never another tenant's), as a JSON array: the last 30 days
        unless `start` / `end` (unix seconds or ISO 8601) say otherwise."""
        gw, tenant = gateway_state(request), auth_of(request).tenant
        start_s, end_s = time_window(start, end, span_s=30 * 86400)
        body = await usage_export(
            gw, tenant.id, start_s, end_s, fmt="json", granularity=granularity
        )
        return Stream(body, media_type=MediaType.JSON)


class TokenizerController(Controller):
    """vLLM's tokenizer endpoints, for clients that count or build token ids themselves:
    the served model's tokenizer, for the base model or any adapter the caller may use."""

    guards = [requires_api_key]  # noqa: RUF012  (Litestar reads class attributes)
    tags = ["tokenizer"]  # noqa: RUF012

    @staticmethod
    async def _group(request: Request[Any, Any, Any], model: str) -> tuple[GatewayState, Any]:
        """The gateway and the model group `model` names (404 and 403 as for a request)."""
        gw, tenant = gateway_state(request), auth_of(request).tenant
        group, _ = await gw.adapters.resolve(model, tenant)
        return gw, group

    @post("/tokenize", status_code=200)
    async def tokenize(
        self, request: Request[Any, Any, Any], data: JSONBody[TokenizeRequest]
    ) -> TokenizeResponse:
        """Counted against the tenant's request rate and concurrency like any request."""
        gw, group = await self._group(request, data.model)
        preparer = group.preparer
        if (data.prompt is None) == (data.messages is None):
            raise bad_request("give either prompt or messages", param="prompt")
        rid = f"tok-{uuid.uuid4().hex}"
        async with gw.pipeline.admitted(auth_of(request), rid) as headers:
            request.state.response_headers = {"x-request-id": rid, **headers}
            if data.prompt is not None:
                ids = await preparer.encode(data.prompt, data.add_special_tokens)
            else:
                assert data.messages is not None
                tools = preparer.plan_tools(data.tools, data.tool_choice, data.parallel_tool_calls)
                ids = await preparer.chat_ids(data.messages, data.add_generation_prompt, tools)
        info = preparer.info
        return TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids)

    @post("/detokenize", status_code=200)
    async def detokenize(
        self, request: Request[Any, Any, Any], data: JSONBody[DetokenizeRequest]
    ) -> DetokenizeResponse:
        _, group = await self._group(request, data.model)
        if any(not 0 <= t < group.info.vocab_size for t in data.tokens):
            raise bad_request("tokens are out of the vocabulary", param="tokens")
        text = group.tokenizer.decode(data.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text)
