"""The OpenAI-compatible surface: chat and text completions, models, the tenant's usage."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from litestar import Controller, MediaType, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody
from litestar.response import Stream

from gateway.access_log import access_logged
from gateway.adapters import AdapterResolver
from gateway.auth import auth_of, requires_api_key
from gateway.errors import APIError, bad_request
from gateway.fleet import Fleet, ModelGroup
from gateway.logs import bind_request
from gateway.metrics import GatewayMetrics
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
from gateway.pipeline import Pipeline, Tally
from gateway.prepare import Job, new_request_id
from gateway.responses import Renderer
from gateway.routes import time_window, usage_export
from tenants.ledger import Ledger
from tenants.registry import TenantRegistry

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


Req = Request[Any, Any, Any]


async def respond(pipeline: Pipeline, request: Req, job: Job, group: ModelGroup) -> Response[Any]:
    """Admit the job (and choose its worker), then stream it or run it to completion."""
    bind_request(job.request_id, auth_of(request).tenant.id)
    request.state.job = job  # for the access log, as is the ticket
    ticket = await pipeline.admit(auth_of(request), job)
    request.state.ticket = ticket
    try:  # a response format is compiled once admitted (a refusal settles the job)
        await group.preparer.check_grammar(job)
    except APIError:
        pipeline.settle(job, ticket, Tally(status="error"))
        raise
    request.state.response_headers = {"x-request-id": job.request_id, **ticket.headers}
    renderer = Renderer(group.tokenizer)
    if job.stream:
        return Stream(
            renderer.stream(pipeline.stream(job, ticket)),
            media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )
    results, tally = await pipeline.complete(job, ticket)
    request.state.response_headers["server-timing"] = tally.server_timing(job.started)
    if job.endpoint == "chat.completions":
        return Response(renderer.chat_completion(job, results, tally))
    return Response(renderer.completion(job, results, tally))


async def _visible_models(
    request: Req, fleet: Fleet, registry: TenantRegistry, started_at: float
) -> list[ModelCard]:
    """Every served model and every adapter of one that the caller's plan allows."""
    tenant = auth_of(request).tenant
    policy, created = tenant.policy, int(started_at)
    cards = [
        ModelCard(
            id=model_id,
            created=created,
            owned_by="strata",
            root=model_id,
            max_model_len=group.info.max_model_len,
        )
        for model_id, group in sorted(fleet.groups.items())
        if policy.allows_model(model_id)
    ]
    for adapter in await registry.list_adapters(tenant.id):
        group = fleet.resolve(adapter.base_model)
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


def _start_request(request: Req, rid: str) -> float:
    request.state.response_headers = {"x-request-id": rid}
    return time.perf_counter()


class OpenAIController(Controller):
    path = "/v1"
    guards = [requires_api_key]  # noqa: RUF012  (Litestar reads class attributes)
    middleware = [access_logged]  # noqa: RUF012
    tags = ["openai"]  # noqa: RUF012

    @post("/chat/completions", status_code=200)
    async def chat_completions(
        self,
        request: Req,
        adapters: NamedDependency[AdapterResolver],
        pipeline: NamedDependency[Pipeline],
        data: JSONBody[ChatCompletionRequest],
    ) -> Response[Any]:
        rid = new_request_id("chat.completions")
        started = _start_request(request, rid)
        tenant = auth_of(request).tenant
        group, lora = await adapters.resolve(data.model, tenant)
        job = await group.preparer.chat(data, tenant, rid, lora, started)
        return await respond(pipeline, request, job, group)

    @post("/completions", status_code=200)
    async def completions(
        self,
        request: Req,
        adapters: NamedDependency[AdapterResolver],
        pipeline: NamedDependency[Pipeline],
        data: JSONBody[CompletionRequest],
    ) -> Response[Any]:
        rid = new_request_id("completions")
        started = _start_request(request, rid)
        tenant = auth_of(request).tenant
        group, lora = await adapters.resolve(data.model, tenant)
        job = await group.preparer.completion(data, tenant, rid, lora, started)
        return await respond(pipeline, request, job, group)

    @get("/models")
    async def models(
        self,
        request: Req,
        fleet: NamedDependency[Fleet],
        registry: NamedDependency[TenantRegistry],
        started_at: NamedDependency[float],
    ) -> ModelList:
        return ModelList(data=await _visible_models(request, fleet, registry, started_at))

    @get("/models/{model_id:str}")
    async def model(
        self,
        request: Req,
        fleet: NamedDependency[Fleet],
        registry: NamedDependency[TenantRegistry],
        started_at: NamedDependency[float],
        model_id: FromPath[str],
    ) -> ModelCard:
        """One model the tenant may use (OpenAI's retrieve), or a 404."""
        for card in await _visible_models(request, fleet, registry, started_at):
            if card.id == model_id:
                return card
        raise APIError(
            404,
            f"The model '{model_id}' does not exist or you do not have access to it.",
            type="not_found_error",
            code="model_not_found",
            param="model",
        )

    @get("/usage")
    async def usage(
        self,
        request: Req,
        registry: NamedDependency[TenantRegistry],
        ledger: NamedDependency[Ledger],
        fleet: NamedDependency[Fleet],
        metrics: NamedDependency[GatewayMetrics],
        start: FromQuery[str | None] = None,
        end: FromQuery[str | None] = None,
        granularity: FromQuery[Literal["request", "hour", "day"]] = "day",
    ) -> Response[Any]:
        """The caller's own usage (never another tenant's), as a JSON array: the last 30 days
        unless `start` / `end` (unix seconds or ISO 8601) say otherwise."""
        tenant = auth_of(request).tenant
        start_s, end_s = time_window(start, end, span_s=30 * 86400)
        body = await usage_export(
            registry,
            ledger,
            fleet,
            metrics,
            tenant.id,
            start_s,
            end_s,
            fmt="json",
            granularity=granularity,
        )
        return Stream(body, media_type=MediaType.JSON)


class TokenizerController(Controller):
    """vLLM's tokenizer endpoints, for clients that count or build token ids themselves:
    the served model's tokenizer, for the base model or any adapter the caller may use."""

    guards = [requires_api_key]  # noqa: RUF012  (Litestar reads class attributes)
    middleware = [access_logged]  # noqa: RUF012
    tags = ["tokenizer"]  # noqa: RUF012

    @post("/tokenize", status_code=200)
    async def tokenize(
        self,
        request: Req,
        adapters: NamedDependency[AdapterResolver],
        pipeline: NamedDependency[Pipeline],
        data: JSONBody[TokenizeRequest],
    ) -> TokenizeResponse:
        """Counted against the tenant's request rate and concurrency like any request."""
        group, _ = await adapters.resolve(data.model, auth_of(request).tenant)
        preparer = group.preparer
        if (data.prompt is None) == (data.messages is None):
            raise bad_request("give either prompt or messages", param="prompt")
        rid = f"tok-{uuid.uuid4().hex}"
        async with pipeline.admitted(auth_of(request), rid) as headers:
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
        self,
        request: Req,
        adapters: NamedDependency[AdapterResolver],
        data: JSONBody[DetokenizeRequest],
    ) -> DetokenizeResponse:
        group, _ = await adapters.resolve(data.model, auth_of(request).tenant)
        if any(not 0 <= t < group.info.vocab_size for t in data.tokens):
            raise bad_request("tokens are out of the vocabulary", param="tokens")
        text = group.tokenizer.decode(data.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text)
