"""`strata serve --demo` as an operator runs it: embedded store, engine worker and gateway
from one command, a demo key printed once, a fleet secret made up for its own worker, and a
clean shutdown of every child on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis

from engine.client import EngineClient
from engine.handshake import ClientAuth, SecretRefusedError
from gateway.serve import STOP_BUDGET_S


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_serve(tmp_path, strata_cache_dir, *extra: str) -> tuple[subprocess.Popen[str], str, str]:
    """`strata serve --demo` on a free port: the process, the demo key and the API's URL."""
    port = _free_port()
    env = dict(
        os.environ,
        STRATA_CACHE_DIR=str(strata_cache_dir),
        STRATA_LOG_LEVEL="INFO",
        STRATA_DATA_DIR=str(tmp_path / "data"),
    )
    env.pop("STRATA_ADMIN_TOKEN", None)
    env.pop("STRATA_REDIS_URL", None)
    env.pop("STRATA_WORKER_SECRET", None)
    log = (tmp_path / "serve.log").open("a")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--demo",
            "--port",
            str(port),
            "--kv-cache-gb",
            "0.25",
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    log.close()
    assert proc.stdout is not None
    key = url = None
    deadline = time.monotonic() + 180
    while url is None:
        assert time.monotonic() < deadline, "serve did not come up"
        line = proc.stdout.readline()
        assert line, f"serve exited early with {proc.poll()}"
        if match := re.search(r"demo tenant key \(.*kept in .*demo_key\): (\S+)", line):
            key = match.group(1)
        if match := re.search(r"serving .* at (http://\S+/v1)", line):
            url = match.group(1)
    assert key is not None
    return proc, key, url


def _stop(proc: subprocess.Popen[str], tmp_path: Path, timeout: float = STOP_BUDGET_S + 15) -> None:
    """SIGTERM `serve`, which must exit 0; a stop that hangs or fails shows what `serve`
    logged (and its children are killed, so that nothing outlives the test). `serve` bounds
    its own stop (`STOP_BUDGET_S`) below `timeout`, so a hang shows its own account first."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        left = _children(proc.pid)
        for pid in (*left, proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        code = proc.wait()
        tail = (tmp_path / "serve.log").read_text(errors="replace")[-6000:]
        pytest.fail(f"serve did not stop within {timeout:.0f}s; children {left}; log:\n{tail}")
    if code != 0:
        tail = (tmp_path / "serve.log").read_text(errors="replace")[-6000:]
        pytest.fail(f"serve stopped with {code}; log:\n{tail}")


def _children(pid: int) -> dict[int, str]:
    """The command lines of a process's children, by pid."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out[int(entry)] = f.read().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
    return out


def environ_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().partition("=")[::2] for e in entries if e)


async def check_the_worker_asks_for(secret: str, sock: Path) -> None:
    with pytest.raises(SecretRefusedError):
        await EngineClient(f"unix://{sock}").connect()
    client = EngineClient(f"unix://{sock}", auth=ClientAuth(secret=secret))
    assert (await client.connect()).model_id
    await client.close()


def test_serve_demo_end_to_end(tmp_path, strata_cache_dir):
    proc, key, url = _start_serve(tmp_path, strata_cache_dir)
    try:
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
        assert oct((tmp_path / "data" / "demo_key").stat().st_mode & 0o777) == "0o600"

        # the operator prices the model /v1/models lists; the request above, sent as
        # `default`, is billed at that price
        admin = httpx.Client(
            base_url=url.removesuffix("/v1"),
            timeout=30,
            headers={"authorization": f"Bearer {token}"},
        )
        (listed,) = client.models.list().data
        price = {"model": listed.id, "prompt_per_m": 2.0, "completion_per_m": 8.0}
        assert admin.put("/admin/prices/", json=price).status_code == 200
        deadline = time.monotonic() + 10
        while not (rows := admin.get("/admin/usage/export").json()):
            assert time.monotonic() < deadline, "the request was not billed"
            time.sleep(0.2)
        (row,) = rows
        assert row["model"] == listed.id and row["priced"] is True
        want = (row["prompt_tokens"] * 2.0 + row["completion_tokens"] * 8.0) / 1e6
        assert float(row["cost_total"]) == pytest.approx(want) and want > 0
        admin.close()

        # the worker got a made-up fleet secret through its environment, never its command
        # line, and asks every client for it; its socket and the data directory are private
        (worker,) = [p for p, cmd in _children(proc.pid).items() if " engine " in cmd]
        secret = environ_of(worker)["STRATA_WORKER_SECRET"]
        assert len(secret) >= 32
        for pid in (proc.pid, *_children(proc.pid)):
            assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        sock = tmp_path / "data" / "engine.sock"
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "data").stat().st_mode) == 0o700
        asyncio.run(check_the_worker_asks_for(secret, sock))

        # the embedded store dies: it is restarted from its AOF and serving carries on
        (store_pid,) = [p for p, cmd in _children(proc.pid).items() if "valkey-server" in cmd]
        os.kill(store_pid, signal.SIGKILL)
        body = {"model": "default", "messages": question, "max_tokens": 2}
        deadline = time.monotonic() + 30
        while True:
            r = httpx.post(
                f"{url}/chat/completions",
                json=body,
                timeout=60,
                headers={"authorization": f"Bearer {key}"},
            )
            if r.status_code == 200:
                break
            assert r.status_code == 503, r.text  # only while the store is down
            assert time.monotonic() < deadline, "the store did not come back"
            time.sleep(0.5)
        (new_pid,) = [p for p, cmd in _children(proc.pid).items() if "valkey-server" in cmd]
        assert new_pid != store_pid
    finally:
        _stop(proc, tmp_path)

    # a second start prints the same demo key: nothing new minted
    again, same_key, url = _start_serve(tmp_path, strata_cache_dir)
    try:
        assert same_key == key
        token = (tmp_path / "data" / "admin_token").read_text().strip()
        with httpx.Client(
            base_url=url.removesuffix("/v1"),
            timeout=30,
            headers={"authorization": f"Bearer {token}"},
        ) as admin:
            (tenant,) = admin.get("/admin/tenants/").json()
            assert len(admin.get(f"/admin/tenants/{tenant['id']}/keys").json()) == 1
    finally:
        _stop(again, tmp_path)
    # every child is gone: the store's and the worker's sockets were removed
    assert not (tmp_path / "data" / "engine.sock").exists()
    assert not (tmp_path / "data" / "store" / "store.sock").exists()
    assert (tmp_path / "data" / "store" / "appendonlydir").is_dir()


def test_serve_runs_a_worker_per_model_and_routes_by_model(tmp_path, strata_cache_dir):
    proc, key, url = _start_serve(
        tmp_path, strata_cache_dir, "--model", "synthetic:tiny", "--model", "default"
    )
    try:
        headers = {"authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
            ids = {m["id"] for m in http.get("/models").json()["data"]}
            assert ids == {"synthetic:tiny", "SmolLM2-135M-Instruct"}
            for model, served in (
                ("default", "synthetic:tiny"),  # the first --model
                ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
            ):
                r = http.post(
                    "/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2}
                )
                assert r.status_code == 200, r.text
                assert r.json()["model"] == served
        token = (tmp_path / "data" / "admin_token").read_text().strip()
        admin = httpx.get(
            url.removesuffix("/v1") + "/admin/workers/",
            timeout=30,
            headers={"authorization": f"Bearer {token}"},
        ).json()
        assert sorted((w["worker_id"], w["model"]) for w in admin) == [
            ("local-0", "synthetic:tiny"),
            ("local-1", "SmolLM2-135M-Instruct"),
        ]
    finally:
        _stop(proc, tmp_path)


def test_serve_starts_an_embedded_remote_tier_its_workers_share(tmp_path, strata_cache_dir):
    proc, key, url = _start_serve(
        tmp_path,
        strata_cache_dir,
        *("--model", "synthetic:tiny", "--workers", "2", "--block-size", "4"),
        *("--kv-remote-url", "embedded", "--kv-remote-gb", "0.01"),
    )
    try:
        remote = (tmp_path / "data" / "kv-remote" / "store.sock").resolve()
        workers = [p for p, cmd in _children(proc.pid).items() if " engine " in f" {cmd} "]
        assert len(workers) == 2
        for pid in workers:  # each worker was handed the embedded store's address
            assert f"--kv-remote-url=unix://{remote}" in Path(f"/proc/{pid}/cmdline").read_text()
        client = redis.Redis(unix_socket_path=str(remote))
        config = client.config_get("maxmemory*")
        assert config["maxmemory-policy"] == "allkeys-lru"
        assert int(config["maxmemory"]) == int(0.01 * (1 << 30))
        headers = {"authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
            prompt = "The harbour master logs every ship that enters the port. " * 3
            body = {"model": "default", "prompt": prompt, "max_tokens": 2}
            r = http.post("/completions", json=body)
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 30
        while not client.keys("strata:kvp:*"):  # the prompt's blocks, written behind
            assert time.monotonic() < deadline, "no page reached the remote tier"
            time.sleep(0.05)
    finally:
        _stop(proc, tmp_path)
