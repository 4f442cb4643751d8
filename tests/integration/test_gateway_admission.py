"""Every admission outcome through the real gateway: exact statuses, bodies and headers."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"


def chat(max_tokens: int = 4, content: str = "Say hi.", **extra) -> dict:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


def post(gateway, key: str | None, body, *, path: str = "/v1/chat/completions", **kw):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=gateway.url, timeout=120) as http:
        if isinstance(body, bytes | str):
            return http.post(
                path, content=body, headers={**headers, "content-type": "application/json"}, **kw
            )
        return http.post(path, json=body, headers=headers, **kw)


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_ok_carries_request_id_and_rate_limit_headers(gateway):
    _, key = gateway.new_tenant(rpm=100, tpm=50_000)
    r = post(gateway, key, chat())
    assert r.status_code == 200
    assert r.headers["x-request-id"] == r.json()["id"]
    assert r.headers["x-ratelimit-limit-requests"] == "100"
    assert r.headers["x-ratelimit-remaining-requests"] == "99"
    assert r.headers["x-ratelimit-limit-tokens"] == "50000"
    assert int(r.headers["x-ratelimit-remaining-tokens"]) < 50000
    assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    # Server-Timing splits the time into the engine's part and the gateway's own
    parts = (part.strip().split(";dur=") for part in r.headers["server-timing"].split(","))
    timing = {name: float(dur) for name, dur in parts}
    assert set(timing) == {"engine", "gateway"}
    assert timing["engine"] > 0 and timing["gateway"] > 0
    assert timing["engine"] + timing["gateway"] <= r.elapsed.total_seconds() * 1e3


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({}, "missing_api_key"),
        ({"authorization": "Basic abc"}, "missing_api_key"),
        ({"authorization": "Bearer sk-strata-notakey"}, "invalid_api_key"),
    ],
)
def test_missing_or_invalid_key_is_401(gateway, headers, reason):
    with httpx.Client(base_url=gateway.url) as http:
        r = http.post("/v1/chat/completions", json=chat(), headers=headers)
    assert r.status_code == 401
    err = error_of(r)
    assert err["type"] == "authentication_error"
    assert err["code"] == reason
    assert r.headers["x-request-id"]


def test_revoked_expired_and_disabled_are_401(gateway):
    tid, key = gateway.new_tenant()
    with gateway.admin() as admin:
        key_id = admin.get(f"/admin/tenants/{tid}/keys").json()[0]["id"]
        assert admin.post(f"/admin/keys/{key_id}/revoke").status_code == 200
        assert post(gateway, key, chat()).status_code == 401
        short = admin.post(f"/admin/tenants/{tid}/keys", json={"expires_in_s": 0.5}).json()
        assert post(gateway, short["secret"], chat()).status_code == 200
        time.sleep(0.7)
        r = post(gateway, short["secret"], chat())
        assert r.status_code == 401
        assert "expired" in error_of(r)["message"]
        live = admin.post(f"/admin/tenants/{tid}/keys", json={}).json()["secret"]
        assert admin.patch(f"/admin/tenants/{tid}", json={"disabled": True}).status_code == 200
        assert post(gateway, live, chat()).status_code == 401


def test_model_not_allowed_is_403_and_unknown_model_400(gateway):
    _, key = gateway.new_tenant(allowed_models=["some-other-model"])
    r = post(gateway, key, chat())
    assert r.status_code == 403
    assert error_of(r)["type"] == "permission_error"
    _, key = gateway.new_tenant()
    r = post(gateway, key, {**chat(), "model": "gpt-17"})
    assert r.status_code == 404
    assert error_of(r)["code"] == "model_not_found"


def test_prompt_over_the_context_cap_is_413(gateway):
    _, key = gateway.new_tenant(max_context_tokens=20)
    r = post(gateway, key, chat(content="word " * 50))
    assert r.status_code == 413
    assert error_of(r)["code"] == "context_length_exceeded"


def test_max_tokens_cap(gateway):
    _, key = gateway.new_tenant(max_tokens=8)
    r = post(gateway, key, chat(max_tokens=9))
    assert r.status_code == 400
    assert error_of(r)["param"] == "max_tokens"
    ok = post(gateway, key, {k: v for k, v in chat().items() if k != "max_tokens"})
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] <= 8


def test_rpm_denial_has_retry_after(gateway):
    _, key = gateway.new_tenant(rpm=2)
    assert [post(gateway, key, chat()).status_code for _ in range(2)] == [200, 200]
    r = post(gateway, key, chat())
    assert r.status_code == 429
    err = error_of(r)
    assert err["type"] == "rate_limit_error"
    assert err["code"] == "rate_limit_rpm"
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-should-retry" not in r.headers


def test_tpm_soft_and_hard_denials(gateway):
    _, key = gateway.new_tenant(tpm=120)
    assert post(gateway, key, chat(max_tokens=60)).status_code == 200
    r = post(gateway, key, chat(max_tokens=60))
    assert r.status_code == 429
    assert error_of(r)["code"] == "rate_limit_tpm"
    assert "retry-after" in r.headers
    _, small = gateway.new_tenant(tpm=10)
    r = post(gateway, small, chat(max_tokens=60))  # can never fit in a 10-token bucket
    assert r.status_code == 429
    assert error_of(r)["type"] == "insufficient_quota"
    assert r.headers["x-should-retry"] == "false"


async def _hold_stream(gateway, key):
    """Open a long streaming request and read its first event; returns the open response."""
    client = httpx.AsyncClient(base_url=gateway.url, timeout=120)
    # greedy SmolLM2 keeps counting for hundreds of tokens: seconds of generation
    body = {
        "model": MODEL,
        "prompt": "1, 2, 3, 4, 5, 6,",
        "max_tokens": 300,
        "temperature": 0,
        "stream": True,
    }
    request = client.build_request(
        "POST", "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
    )
    response = await client.send(request, stream=True)
    assert response.status_code == 200
    lines = response.aiter_lines()
    while not (await anext(lines)).startswith("data:"):
        pass
    response.held_lines = lines  # dropping the iterator would close the stream
    return client, response


async def test_concurrency_and_kv_budget_denials(gateway):
    for policy, code in (
        ({"max_concurrent": 1}, "rate_limit_concurrency"),
        ({"kv_budget_tokens": 420}, "rate_limit_kv_budget"),
    ):
        _, key = gateway.new_tenant(**policy)
        client, held = await _hold_stream(gateway, key)
        try:
            r = await asyncio.to_thread(post, gateway, key, chat(max_tokens=100))
            assert r.status_code == 429
            assert error_of(r)["code"] == code
            assert "retry-after" in r.headers
        finally:
            await held.aclose()
            await client.aclose()
        # the slot comes back once the stream is gone
        deadline = time.monotonic() + 5
        while (r := await asyncio.to_thread(post, gateway, key, chat())).status_code == 429:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert r.status_code == 200
    _, key = gateway.new_tenant(kv_budget_tokens=30)
    r = post(gateway, key, chat(max_tokens=100))
    assert r.status_code == 429
    assert r.headers["x-should-retry"] == "false"


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'{"model": "SmolLM2-135M-Instruct", "messages": "hi"}',
        b'{"model": 5, "messages": []}',
        b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], '
        b'"max_tokens": -3}',
        b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], '
        b'"max_tokens": 100000000}',
        b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], '
        b'"temperature": "hot"}',
        b'{"model": "SmolLM2-135M-Instruct", '
        b'"messages": [{"role": "user", "content": "\xff\xfe"}]}',
        b'{"model": "SmolLM2-135M-Instruct", "messages": []}',
        b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], '
        b'"top_p": 0}',
        b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], '
        b'"n": 1000}',
    ],
)
def test_bad_input_is_4xx_never_5xx(gateway, body):
    _, key = gateway.new_tenant()
    r = post(gateway, key, body)
    assert r.status_code == 400, r.text
    assert error_of(r)["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": "5"}, "max_tokens"),  # a numeric string is not an integer
        ({"stream": "true"}, "stream"),
        ({"temperature": "0.5"}, "temperature"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ],
)
def test_a_wrong_type_is_400_naming_the_field(gateway, change, param):
    """As OpenAI's API does: no coercion of strings into numbers or booleans, and only its
    roles."""
    _, key = gateway.new_tenant()
    r = post(gateway, key, {**chat(), **change})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["param"], err["code"]) == (param, "invalid_value")
    assert f"'{param}'" in err["message"]


@pytest.mark.parametrize(
    "change",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": 0},
        {"min_p": 2},
        {"frequency_penalty": 5},
        {"presence_penalty": -3},
        {"repetition_penalty": 0},
        {"seed": 2**70},
        {"stop": ["ok", ""]},
    ],
)
def test_an_out_of_range_sampling_parameter_is_400_naming_it(gateway, change):
    _, key = gateway.new_tenant()
    r = post(gateway, key, {**chat(), **change})
    assert r.status_code == 400, r.text
    (param,) = change
    assert error_of(r)["param"] == param
    assert error_of(r)["message"].startswith(param)


def test_malformed_json_says_so_and_the_admin_api_is_strict_too(gateway):
    _, key = gateway.new_tenant()
    r = post(gateway, key, b'{"model": "x", "messages": [')
    assert r.status_code == 400
    assert error_of(r)["code"] == "invalid_json"
    assert "not valid JSON" in error_of(r)["message"]
    with gateway.admin() as admin:
        bad = admin.post("/admin/tenants/", json={"name": "strict", "policy": {"rpm": "5"}})
        assert bad.status_code == 400
        assert error_of(bad)["param"] == "policy.rpm"
        good = admin.post("/admin/tenants/", json={"name": "strict", "policy": {"rpm": 5}})
        assert good.is_success


def test_huge_body_is_413(gateway):
    _, key = gateway.new_tenant()
    big = b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * (10 << 20) + b'"}]}'
    r = post(gateway, key, big)
    assert r.status_code == 413
    assert error_of(r)["code"] == "request_too_large"
    assert post(gateway, key, chat()).status_code == 200  # and the gateway is fine


def test_unknown_route_and_method_are_openai_shaped(gateway):
    with httpx.Client(base_url=gateway.url) as http:
        assert error_of(http.get("/v1/nope"))["type"] == "not_found_error"
        r = http.get("/v1/chat/completions")
        assert r.status_code in (401, 405)
        error_of(r)


def test_policy_admin_round_trip_and_kv_bytes(gateway):
    tid, key = gateway.new_tenant(kv_budget_tokens=1000)
    with gateway.admin() as admin:
        view = admin.get(f"/admin/tenants/{tid}/policy").json()
        # SmolLM2 in bf16: 30 layers x K and V x 3 KV heads x 64 dims x 2 bytes
        assert view["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2
        assert view["kv_budget_bytes"] == 1000 * view["kv_bytes_per_token"]
        bad = admin.patch(f"/admin/tenants/{tid}/policy", json={"rpm": -1})
        assert bad.status_code == 400
        assert admin.get(f"/admin/tenants/{tid}/policy").json()["policy"]["rpm"] is None
        assert admin.patch(f"/admin/tenants/{tid}/policy", json={"rpm": 1}).status_code == 200
    # the new limit applies at once (the policy change invalidates cached auth)
    assert post(gateway, key, chat()).status_code == 200
    r = post(gateway, key, chat())
    assert r.status_code == 429
    assert error_of(r)["code"] == "rate_limit_rpm"
