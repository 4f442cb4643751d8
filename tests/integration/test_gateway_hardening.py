"""Bad input gets a clear 4xx and leaves the server serving; secrets stay secret. Each case
is one a pass over a running server found: against the real app, store and worker."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.integration.conftest import GatewayServer, gateway_settings

MODEL = "SmolLM2-135M-Instruct"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def tenant(gateway):
    return gateway.new_tenant(rpm=10_000, tpm=10_000_000, max_concurrent=64)


def post(gateway, key: str, path: str, body: object) -> httpx.Response:
    with httpx.Client(base_url=gateway.url, timeout=120) as http:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return http.post(
            path,
            content=content,
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        )


def error_of(response: httpx.Response) -> dict:
    return response.json()["error"]


def test_the_admin_api_never_shows_a_tenants_cache_salt(gateway):
    with gateway.admin() as admin:
        created = admin.post("/admin/tenants/", json={"name": "salted"})
        tid = created.json()["id"]
        answers = [
            created,
            admin.get(f"/admin/tenants/{tid}"),
            admin.get("/admin/tenants/"),
            admin.patch(f"/admin/tenants/{tid}", json={"name": "renamed"}),
            admin.post(f"/admin/tenants/{tid}/rotate-cache-salt"),
        ]
    for answer in answers:
        assert answer.status_code in (200, 201), answer.text
        assert "cache_salt" not in answer.text and "salt" not in answer.json()


def test_rotating_the_cache_salt_ends_the_tenants_prefix_hits(gateway):
    tid, key = gateway.new_tenant()
    document = "The sea is wide and deep. " * 40
    body = {"model": MODEL, "prompt": document, "max_tokens": 1, "temperature": 0}

    def cached() -> int:
        r = post(gateway, key, "/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0  # its own prompt again: a hit
    with gateway.admin() as admin:
        assert admin.post(f"/admin/tenants/{tid}/rotate-cache-salt").status_code == 200
    time.sleep(0.5)  # the replica's cached authentication is invalidated
    assert cached() == 0  # a fresh salt: the old pages are another tenant's now
    assert cached() > 0


def test_a_long_user_field_is_refused(gateway, tenant):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 1, "user": "u" * 257}
    r = post(gateway, tenant[1], "/v1/chat/completions", body)
    assert r.status_code == 400 and error_of(r)["param"] == "user"
    body["user"] = "u" * 256
    assert post(gateway, tenant[1], "/v1/chat/completions", body).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            b'{"model": "default", "messages": [], "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            None,
        ),
        (
            "/v1/chat/completions",
            {
                "model": "default",
                "messages": HELLO,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": json.loads('{"a":' * 100 + "1" + "}" * 100),
                    },
                },
            },
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "default",
                "messages": HELLO,
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": json.loads('{"a":' * 100 + "[]" + "}" * 100),
                        },
                    }
                ],
            },
            "tools",
        ),
        (
            "/tokenize",
            b'{"model": "default", "prompt": "hi", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            None,
        ),
    ],
    ids=["body", "response_format", "tool_parameters", "tokenize"],
)
def test_deeply_nested_json_is_a_400(gateway, tenant, path, body, param):
    r = post(gateway, tenant[1], path, body)
    assert r.status_code == 400, r.text
    assert error_of(r)["code"] == "json_too_deep" and error_of(r)["param"] == param


def test_deeply_nested_tool_call_arguments_are_read_as_text(gateway, tenant):
    deep = "[" * 3000 + "]" * 3000
    messages = [
        {"role": "user", "content": "Call f."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": deep}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    r = post(gateway, tenant[1], "/tokenize", {"model": "default", "messages": messages})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf"])
def test_non_finite_times_are_a_400(gateway, tenant, value):
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        usage = http.get(
            "/v1/usage", params={"start": value}, headers={"authorization": f"Bearer {tenant[1]}"}
        )
    with gateway.admin() as admin:
        export = admin.get("/admin/usage/export", params={"end": value})
    for r in (usage, export):
        assert r.status_code == 400 and "finite" in error_of(r)["message"]


def test_names_ending_in_a_newline_are_refused(gateway):
    with gateway.admin() as admin:
        r = admin.post("/admin/tenants/", json={"name": "acme\n"})
        assert r.status_code == 400
        assert admin.post("/admin/tenants/", json={"name": "a", "id": "t1\n"}).status_code == 400


def test_a_deleted_tenants_id_is_never_given_out_again(gateway):
    with gateway.admin() as admin:
        created = admin.post("/admin/tenants/", json={"name": "gone", "id": "t-retired-1"})
        assert created.status_code == 201
        assert admin.delete("/admin/tenants/t-retired-1").status_code == 204
        again = admin.post("/admin/tenants/", json={"name": "new", "id": "t-retired-1"})
    assert again.status_code == 409 and "never reused" in error_of(again)["message"]


def test_tokenize_is_counted_against_the_request_rate(gateway):
    _, key = gateway.new_tenant(rpm=2)
    codes = [
        post(gateway, key, "/tokenize", {"model": "default", "prompt": "hi"}).status_code
        for _ in range(3)
    ]
    assert codes == [200, 200, 429]


def test_a_request_that_can_never_fit_says_what_it_asked_for(gateway):
    _, key = gateway.new_tenant(tpm=100)
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 500}
    r = post(gateway, key, "/v1/chat/completions", body)
    assert r.status_code == 429 and r.headers["x-should-retry"] == "false"
    message = error_of(r)["message"]
    assert "500 max_tokens" in message and "100 tokens per minute" in message
    assert "retry after" not in message and "retry-after" not in r.headers


async def test_a_huge_conversation_does_not_hold_other_requests(gateway, tenant):
    messages = [{"role": "user", "content": ""}] * 60_000
    body = json.dumps({"model": "default", "messages": messages}).encode()
    assert len(body) < 2 * 1024 * 1024
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as http:
        headers = {"authorization": f"Bearer {tenant[1]}", "content-type": "application/json"}
        big = asyncio.create_task(http.post("/tokenize", content=body, headers=headers))
        waits = []
        while not big.done():
            start = time.perf_counter()
            assert (await http.get("/health")).status_code == 200
            waits.append(time.perf_counter() - start)
            await asyncio.sleep(0.01)
        assert (await big).status_code == 200
    assert len(waits) >= 3
    assert max(waits) < 0.3, f"/health waited {max(waits):.2f}s behind the conversation"


def test_metrics_can_require_a_token(store_server, smollm2_worker, strata_cache_dir):
    settings = gateway_settings(
        store_server.url, smollm2_worker, strata_cache_dir, metrics_token="metrics-secret-0123"
    )
    server = GatewayServer(settings)
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/metrics").status_code == 401
            wrong = http.get("/metrics", headers={"authorization": "Bearer nope"})
            assert wrong.status_code == 401
            right = http.get("/metrics", headers={"authorization": "Bearer metrics-secret-0123"})
            assert right.status_code == 200 and "strata:" in right.text
            assert http.get("/health").status_code == 200  # probes stay open
    finally:
        server.stop()


async def test_keys_salts_and_prompts_stay_out_of_logs_and_errors(gateway, caplog, redis_client):
    from tenants import keyspace

    tid, key = gateway.new_tenant(tpm=50)
    salt = keyspace.decode_tenant(await redis_client.get(keyspace.tenant(tid))).cache_salt
    secret_prompt = "zebra umbrella 7731 lighthouse"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": secret_prompt}]}
    unknown_key = "sk-strata-" + "A" * 43
    cases = [
        (key, {**chat, "max_tokens": 2}),  # served
        (key, {**chat, "max_tokens": 500}),  # can never fit the tpm
        (key, {**chat, "model": "no-such-model"}),
        (key, {**chat, "temperature": "hot"}),
        (key, {**chat, "messages": [{"role": "wizard", "content": secret_prompt}]}),
        (unknown_key, chat),
    ]
    answers = []
    with caplog.at_level("DEBUG"):
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as http:
            for secret, body in cases:
                answers.append(
                    await http.post(
                        "/v1/chat/completions",
                        json=body,
                        headers={"authorization": f"Bearer {secret}"},
                    )
                )
            answers.append(
                await http.post(
                    "/v1/completions",
                    content=b'{"prompt": "' + secret_prompt.encode() + b'",',
                    headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
                )
            )
        await asyncio.sleep(0.5)  # the ledger writer and releases log after the responses
    assert [a.status_code for a in answers] == [200, 429, 404, 400, 400, 401, 400]
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    for text in [a.text for a in answers[1:]] + [logged]:
        for secret in (key, unknown_key, key[10:30], salt, secret_prompt, "7731 lighthouse"):
            assert secret not in text
