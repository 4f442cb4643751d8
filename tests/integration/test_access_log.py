"""The access log over real HTTP: one JSON line per tenant API request, served or refused,
streamed or not, that never holds a key secret or prompt text; and engine workers logging
in the gateway's JSON format."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.logs import ACCESS_LOGGER, formatter
from tests.integration.conftest import TINY_WORKER


@pytest.fixture
def access_lines() -> Iterator[io.StringIO]:
    """What the access logger writes, as the JSON lines a gateway writes to stderr."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter(json=True))
    logger = logging.getLogger(ACCESS_LOGGER)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield out
    logger.removeHandler(handler)
    logger.setLevel(level)


def line_of(out: io.StringIO, request_id: str) -> dict:
    """The access line of one request: written as its response ends, so waited for."""
    deadline = time.monotonic() + 30
    while True:
        for text in out.getvalue().splitlines():
            line = json.loads(text)
            if line.get("request_id") == request_id:
                return line
        assert time.monotonic() < deadline, f"no access line for {request_id}"
        time.sleep(0.05)


def chat(prompt: str, **extra: object) -> dict:
    return {
        "model": "default",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": prompt}],
        **extra,
    }


def test_access_lines_for_served_and_refused_requests(tiny_gateway, access_lines):
    gw = tiny_gateway
    tid, key = gw.new_tenant(rpm=2)
    prompt = f"canary-{uuid.uuid4().hex}"
    auth = {"authorization": f"Bearer {key}"}
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        model_id = http.get("/v1/models", headers=auth).json()["data"][0]["id"]
        served = http.post("/v1/chat/completions", json=chat(prompt), headers=auth)
        assert served.status_code == 200
        with http.stream(
            "POST", "/v1/chat/completions", json=chat(prompt, stream=True), headers=auth
        ) as streamed:
            assert streamed.status_code == 200
            streamed.read()
        limited = http.post("/v1/chat/completions", json=chat(prompt), headers=auth)
        assert limited.status_code == 429  # the third request of a 2 rpm plan
        bad_key = http.post(
            "/v1/chat/completions",
            json=chat(prompt),
            headers={"authorization": f"Bearer sk-strata-{'x' * 43}"},
        )
        assert bad_key.status_code == 401
        bad_input = http.post(
            "/v1/chat/completions", json=chat(prompt, max_tokens="4"), headers=auth
        )
        assert bad_input.status_code == 400

    usage = served.json()["usage"]
    line = line_of(access_lines, served.headers["x-request-id"])
    assert line["logger"] == ACCESS_LOGGER
    assert (line["tenant_id"], line["model"], line["status"]) == (tid, model_id, 200)
    assert line["key_id"].startswith("key_")
    assert (line["stream"], line["finish"], line["rejection"]) == (False, "length", None)
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    assert line["completion_tokens"] == usage["completion_tokens"] == 4
    assert line["cached_tokens"] is not None
    assert line["latency_ms"] >= line["ttft_ms"] > 0

    line = line_of(access_lines, streamed.headers["x-request-id"])
    assert (line["stream"], line["status"], line["finish"]) == (True, 200, "length")
    assert line["completion_tokens"] == 4
    assert line["ttft_ms"] > 0

    line = line_of(access_lines, limited.headers["x-request-id"])
    assert (line["status"], line["rejection"], line["tenant_id"]) == (429, "rate_limit_rpm", tid)
    assert line["model"] == model_id
    assert line["completion_tokens"] is None

    line = line_of(access_lines, bad_key.headers["x-request-id"])
    assert (line["status"], line["rejection"], line["tenant_id"]) == (401, "invalid_api_key", None)

    line = line_of(access_lines, bad_input.headers["x-request-id"])
    assert (line["status"], line["rejection"], line["tenant_id"]) == (400, "invalid_value", tid)

    text = access_lines.getvalue()
    assert prompt not in text
    assert key not in text and "x" * 43 not in text
    assert "Bearer" not in text


def test_tokenizer_routes_are_logged_too(tiny_gateway, access_lines):
    tid, key = tiny_gateway.new_tenant()
    with httpx.Client(base_url=tiny_gateway.url, timeout=60) as http:
        r = http.post(
            "/tokenize",
            json={"model": "default", "prompt": "hello"},
            headers={"authorization": f"Bearer {key}"},
        )
    assert r.status_code == 200
    line = line_of(access_lines, r.headers["x-request-id"])
    assert (line["path"], line["tenant_id"], line["status"]) == ("/tokenize", tid, 200)


def test_workers_log_json_lines_as_gateways_do(tmp_path: Path, strata_cache_dir: Path):
    sock = tmp_path / "w.sock"
    env = dict(
        os.environ,
        STRATA_CACHE_DIR=str(strata_cache_dir),
        STRATA_LOG_LEVEL="INFO",
        STRATA_LOG_FORMAT="json",
    )
    env.pop("STRATA_WORKER_SECRET", None)
    env.pop("STRATA_REDIS_URL", None)
    with (tmp_path / "stderr").open("w+") as err:
        command = [sys.executable, "-m", "gateway.cli", "engine", "--listen", f"unix://{sock}"]
        proc = subprocess.Popen(
            [*command, *TINY_WORKER],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            deadline = time.monotonic() + 120
            while not sock.exists():
                assert proc.poll() is None, "the worker exited"
                assert time.monotonic() < deadline, "the worker did not come up"
                time.sleep(0.05)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        err.seek(0)
        lines = [json.loads(text) for text in err.read().splitlines() if text.strip()]
    serving = [ln for ln in lines if ln["logger"] == "engine.worker"]
    assert serving, lines
    assert all({"event", "level", "timestamp"} <= ln.keys() for ln in lines)
