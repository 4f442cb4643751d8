"""The Preparer turns a validated body into an engine job, with the tenant's scheduling."""

from __future__ import annotations

import pytest

from engine.protocol import ModelInfo, Scheduling
from gateway.errors import APIError
from gateway.openai_types import ChatCompletionRequest, ChatMessage, CompletionRequest
from gateway.prepare import Preparer
from tenants.records import Policy, Tenant

INFO = ModelInfo(
    model_id="smollm2", vocab_size=49152, max_model_len=2048, eos_token_ids=[2],
    kv_block_size=16, kv_bytes_per_token=23040, dtype="bfloat16", device="cpu",
)  # fmt: skip


@pytest.fixture
def preparer(smollm2_tokenizer) -> Preparer:
    return Preparer(smollm2_tokenizer, INFO, aliases=("default",))


def tenant(**policy) -> Tenant:
    return Tenant(id="acme", name="Acme", created_at=0.0, policy=Policy(**policy))


def test_job_carries_the_tenants_priority_and_weight(preparer):
    body = ChatCompletionRequest(model="default", messages=[ChatMessage(role="user", content="hi")])
    job = preparer.chat(body, tenant(priority=3, weight=2.5), "chatcmpl-1")
    assert job.scheduling == Scheduling(priority=3, tenant="acme", weight=2.5)
    job = preparer.completion(CompletionRequest(model="smollm2", prompt="hi"), tenant(), "c-2")
    assert job.scheduling == Scheduling(priority=0, tenant="acme", weight=1.0)


def test_unknown_model_and_context_cap(preparer):
    with pytest.raises(APIError) as err:
        preparer.completion(CompletionRequest(model="gpt-9", prompt="hi"), tenant(), "c-1")
    assert err.value.status == 400
    long = CompletionRequest(model="default", prompt="word " * 100)
    with pytest.raises(APIError) as err:
        preparer.completion(long, tenant(max_context_tokens=10), "c-2")
    assert err.value.status == 413
