"""`strata serve --demo` as an operator runs it: embedded store, engine worker and gateway
from one command, a demo key printed once, and a clean shutdown of every child on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_demo_end_to_end(tmp_path, strata_cache_dir):
    port = _free_port()
    env = dict(
        os.environ,
        STRATA_CACHE_DIR=str(strata_cache_dir),
        STRATA_LOG_LEVEL="WARNING",
        STRATA_DATA_DIR=str(tmp_path / "data"),
    )
    env.pop("STRATA_ADMIN_TOKEN", None)
    env.pop("STRATA_REDIS_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--demo", "--port", str(port),
         "--kv-cache-gb", "0.25"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        key = url = None
        deadline = time.monotonic() + 180
        while url is None:
            assert time.monotonic() < deadline, "serve did not come up"
            line = proc.stdout.readline()
            assert line, f"serve exited early with {proc.poll()}"
            if match := re.search(r"demo tenant key \(shown once\): (\S+)", line):
                key = match.group(1)
            if match := re.search(r"serving .* at (http://\S+/v1)", line):
                url = match.group(1)
        assert key is not None
        assert key.startswith("sk-strata-")
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(
            model="default", messages=question, max_tokens=30, temperature=0
        )
        assert "Paris" in reply.choices[0].message.content
        # the gateway process itself never loads torch (its engine worker does): it starts
        # in a fraction of the time and holds a fraction of the memory
        with open(f"/proc/{proc.pid}/maps") as maps:
            assert "libtorch" not in maps.read()
        token = (tmp_path / "data" / "admin_token").read_text().strip()
        assert oct((tmp_path / "data" / "admin_token").stat().st_mode & 0o777) == "0o600"
        tenants = httpx.get(
            url.removesuffix("/v1") + "/admin/tenants/",
            headers={"authorization": f"Bearer {token}"},
            timeout=30,
        )
        assert [t["name"] for t in tenants.json()] == ["demo"]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0
    # every child is gone: the store's and the worker's sockets were removed
    assert not (tmp_path / "data" / "engine.sock").exists()
    assert not (tmp_path / "data" / "store" / "store.sock").exists()
    assert (tmp_path / "data" / "store" / "appendonlydir").is_dir()
