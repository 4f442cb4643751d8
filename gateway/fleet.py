"""The gateway's view of the fleet: the engine workers it may send requests to, grouped by
the model they serve, from static addresses (`--engine`) and from the store's registry
(engine/fleet.py), with the KV blocks each reports; and which worker serves a request.

A registry worker joins the view once its sealed record verifies with the fleet secret and
its connection proves the secret too; it leaves when its connection ends (it died), when
its record expires (it stopped beating), on its `leave` event, or when its model's shape
disagrees with the workers already serving that model id. The view is refreshed every
`REFRESH_S` and on every join event; with the store out of reach the gateway keeps routing
on the last view (`registry_ok` says so). `on_lost` hears of each worker that left because
its connection ended or its heartbeat stopped (gateway/alerts.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import shutil
import tempfile
import time
from collections import Counter as Tally
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import msgspec
import redis.asyncio as aioredis

from engine.block_hash import prompt_keys
from engine.client import EngineClient
from engine.fleet import (
    DRAINED,
    EVENTS,
    KV_EVENTS,
    WORKERS,
    KVEvent,
    WorkerRecord,
    model_shape,
    record_key,
    snapshot_key,
    unseal,
)
from engine.handshake import ClientAuth, FleetSecretError
from engine.protocol import EngineDeadError, EngineStats, ModelInfo
from engine.tokenizer import Tokenizer
from gateway.kv_index import KVIndex
from gateway.metrics import FleetView
from gateway.prepare import Preparer
from gateway.router import Candidate, RoutingPolicy, choose, prefill_tokens
from tenants.store import cancel_and_wait

log = logging.getLogger(__name__)

REFRESH_S = 0.5


class NoWorkerError(EngineDeadError):
    """Every worker of the model is down or draining."""


@dataclass
class WorkerHandle:
    """One worker as this gateway sees it."""

    worker_id: str
    address: str
    client: EngineClient
    static: bool = False  # given by --engine: never leaves the view
    record: WorkerRecord | None = None  # a registry worker's latest record
    drained: bool = False
    # prefill of this gateway's requests there awaiting a first output (their prompt tokens
    # less the cached prefix each was routed to)
    queued_tokens: int = 0

    @property
    def model_id(self) -> str | None:
        info = self.client.info
        return info.model_id if info is not None else None

    @property
    def role(self) -> str:
        """both, prefill or decode: as its greeting said, else its record."""
        info = self.client.info
        if info is not None:
            return info.role
        return self.record.role if self.record is not None else "both"

    @property
    def kv_remote_id(self) -> str:
        """The digest naming its remote KV tier's store, as its greeting said ("": none)."""
        info = self.client.info
        return info.kv_remote_id if info is not None else ""

    @property
    def usable(self) -> bool:
        """Takes new requests: not drained, and connected or not known to be down."""
        return not self.drained and (self.client.connected or self.client.last_error is None)

    def candidate(self, index: KVIndex, keys: Sequence[int]) -> Candidate:
        rec = self.record
        return Candidate(
            worker_id=self.worker_id,
            num_in_flight=self.client.num_in_flight,
            queued_tokens=self.queued_tokens,
            num_running=rec.num_running if rec else 0,
            num_waiting=rec.num_waiting if rec else 0,
            kv_usage=rec.num_kv_blocks_used / rec.num_kv_blocks_total
            if rec and rec.num_kv_blocks_total
            else 0.0,
            hit=index.prefix(self.worker_id, keys),
        )


@dataclass
class ModelGroup:
    """The workers of one model and what the gateway needs to prepare its requests."""

    model_id: str
    info: ModelInfo
    tokenizer: Tokenizer
    shape: str
    preparer: Preparer
    workers: dict[str, WorkerHandle] = field(default_factory=dict)

    @property
    def available(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.usable]


class Fleet:
    """Workers by model; routing; the KV index. Open with `start`, close with `close`."""

    def __init__(
        self,
        *,
        addresses: Sequence[str],
        auth: ClientAuth,
        redis: aioredis.Redis | None,
        cache_dir: str,
        policy: RoutingPolicy = RoutingPolicy.KV_AWARE,
        default_model: str = "default",
        aliases: Mapping[str, str] | None = None,
        disagg_min_prompt_tokens: int = 512,
        disagg_transport: str = "auto",
    ) -> None:
        self.auth = auth
        # a prompt with this many tokens to compute on a decode worker is prefilled on a
        # prefill worker (docs/design/disaggregation.md)
        self.disagg_min_prompt_tokens = disagg_min_prompt_tokens
        self.disagg_transport = disagg_transport  # auto, gateway or remote
        self.store = redis  # drains are kept there, for every gateway to see
        self.default_model = default_model  # an id, or the spec the default's workers run
        self.aliases = dict(aliases or {})  # alias -> a model id, or "default"
        self._first_model: str | None = None
        self._specs: dict[str, str] = {}  # what workers were started with -> their model id
        self.redis = redis if auth.secret is not None else None  # a registry needs the secret
        self.cache_dir = Path(cache_dir)
        self.policy = policy
        self.index = KVIndex()
        self.groups: dict[str, ModelGroup] = {}
        self.workers: dict[str, WorkerHandle] = {}
        self.registry_ok = self.redis is not None
        self.num_invalid_records = 0
        self.num_bad_events = 0
        self._turn = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._refresh_now = asyncio.Event()
        self._refused: dict[str, float] = {}  # worker id -> when it may be tried again
        # prefill workers being connected again
        self._reconnecting: dict[str, asyncio.Task[None]] = {}
        self.on_lost: Callable[[WorkerHandle], None] | None = None
        for address in addresses:
            handle = WorkerHandle(address, address, self._client(address), static=True)
            self.workers[handle.worker_id] = handle

    def _client(self, address: str) -> EngineClient:
        return EngineClient(address, connect_timeout=2.0, auth=self.auth)

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self, timeout: float = 60.0) -> None:
        """Connect the static workers and start watching the registry; return once some
        model has a worker (EngineDeadError after `timeout` seconds)."""
        if self.store is not None:
            self._tasks.append(asyncio.create_task(self._watch_registry(), name="fleet-registry"))
        if self.redis is not None:
            self._tasks.append(asyncio.create_task(self._listen(), name="fleet-events"))
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            for handle in [h for h in self.workers.values() if h.static]:
                if handle.model_id is None or not handle.client.connected:
                    with contextlib.suppress(EngineDeadError, TimeoutError):
                        await self._join(handle)
            if self.groups:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise EngineDeadError("no engine worker became reachable")
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        for group in self.groups.values():
            group.preparer.close()
        await asyncio.gather(*(cancel_and_wait(task) for task in self._tasks))
        for handle in self.workers.values():
            await handle.client.close()

    # -- joining and leaving --------------------------------------------------------------

    async def _join(self, handle: WorkerHandle) -> None:
        """Connect (the handshake proves the fleet secret both ways), check the model, and
        add the worker to its model's group (a new group fetches the tokenizer)."""
        async with asyncio.timeout(10.0):
            info = await handle.client.connect()
        if handle.record is not None and handle.record.model_id != info.model_id:
            raise EngineDeadError(
                f"{handle.worker_id} registered {handle.record.model_id} but serves {info.model_id}"
            )
        shape = model_shape(info)
        group = self.groups.get(info.model_id)
        if group is not None and group.shape != shape:
            raise EngineDeadError(
                f"{handle.worker_id} serves {info.model_id} with other shapes than the "
                "workers already serving that model id"
            )
        if group is None:
            tokenizer = await self._tokenizer(handle.client, info)
            if info.model_id not in self.groups:
                self._first_model = self._first_model or info.model_id
                self._specs.setdefault(info.model_spec, info.model_id)
                self.groups[info.model_id] = ModelGroup(
                    info.model_id, info, tokenizer, shape, Preparer(tokenizer, info)
                )
            group = self.groups[info.model_id]
        group.workers[handle.worker_id] = handle
        self.index.add_worker(handle.worker_id)
        if not handle.static:  # a registry worker whose connection ends leaves the view
            handle.client.on_disconnect = partial(self._on_disconnect, handle)
        if not handle.static:
            await self._load_snapshot(handle.worker_id)
        log.info("worker %s (%s) serves %s", handle.worker_id, handle.address, info.model_id)

    async def _tokenizer(self, client: EngineClient, info: ModelInfo) -> Tokenizer:
        """The model's tokenizer, as its worker hands it over, kept under the cache dir."""
        files = await client.tokenizer_files()
        return await asyncio.to_thread(_tokenizer_from_files, self.cache_dir, files)

    def _on_disconnect(self, handle: WorkerHandle, reason: str) -> None:
        if self.workers.get(handle.worker_id) is handle:
            self._leave(handle.worker_id, reason, lost=True)
            self._refused.pop(handle.worker_id, None)  # back with its next heartbeat

    def _leave(self, worker_id: str, reason: str, *, lost: bool = False) -> None:
        handle = self.workers.get(worker_id)
        if handle is None or handle.static:
            return
        del self.workers[worker_id]
        self.index.forget(worker_id)
        for group in self.groups.values():
            group.workers.pop(worker_id, None)
        asyncio.get_running_loop().create_task(handle.client.close())
        log.warning("worker %s left the fleet (%s)", worker_id, reason)
        if lost and self.on_lost is not None:
            self.on_lost(handle)

    # -- the registry ---------------------------------------------------------------------

    async def _watch_registry(self) -> None:
        while True:
            try:
                await self.refresh()
                if not self.registry_ok:
                    log.warning("fleet registry reachable again")
                self.registry_ok = True
            except (aioredis.RedisError, OSError) as exc:
                if self.registry_ok:
                    log.warning("fleet registry unreachable (%s); routing on the last view", exc)
                self.registry_ok = False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REFRESH_S):
                    await self._refresh_now.wait()
            self._refresh_now.clear()

    async def refresh(self) -> None:
        """Read the registry once: add workers whose sealed record verifies, drop those
        whose record expired, update records and drain flags (without the fleet secret,
        only the drain flags of the --engine workers)."""
        assert self.store is not None
        if self.redis is None or self.auth.secret is None:
            drained = {d.decode() for d in cast(set[bytes], await self.store.smembers(DRAINED))}
            for static in self.workers.values():
                static.drained = static.worker_id in drained
            return
        now_ms = int(time.time() * 1000)
        members = cast(list[bytes], await self.redis.zrangebyscore(WORKERS, now_ms, "+inf"))
        ids = [m.decode() for m in members]
        drained = {d.decode() for d in cast(set[bytes], await self.redis.smembers(DRAINED))}
        blobs: list[bytes | None] = []
        if ids:
            blobs = cast(list[bytes | None], await self.redis.mget([record_key(i) for i in ids]))
        live: dict[str, WorkerRecord] = {}
        for worker_id, blob in zip(ids, blobs, strict=True):
            record = None if blob is None else unseal(blob, self.auth.secret)
            if record is None or record.worker_id != worker_id:
                if blob is not None:
                    self.num_invalid_records += 1
                continue
            live[worker_id] = record
        for worker_id in [w for w, h in self.workers.items() if not h.static]:
            if worker_id not in live:
                if worker_id not in ids:
                    self._leave(worker_id, "its heartbeat stopped", lost=True)
                else:
                    self._leave(worker_id, "its record is invalid")
        for worker_id, record in live.items():
            handle = self.workers.get(worker_id)
            if handle is not None and handle.address != record.address:
                self._leave(worker_id, "it moved")
                handle = None
            if handle is None:
                if self._refused.get(worker_id, 0.0) > time.monotonic():
                    continue
                handle = WorkerHandle(worker_id, record.address, self._client(record.address))
                handle.record = record
                try:
                    await self._join(handle)
                except (EngineDeadError, TimeoutError) as exc:
                    self._refused[worker_id] = time.monotonic() + 5.0
                    log.warning("not routing to worker %s: %s", worker_id, exc)
                    await handle.client.close()
                    continue
                self.workers[worker_id] = handle
            handle.record = record
        for handle in self.workers.values():
            handle.drained = handle.worker_id in drained

    async def _listen(self) -> None:
        """Join/leave/drain events (refresh at once) and KV events (the index)."""
        assert self.redis is not None
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(EVENTS, KV_EVENTS)
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
                    if message is not None:
                        await self._on_message(message)
            except (aioredis.RedisError, OSError):
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(aioredis.RedisError, OSError):
                    await pubsub.aclose()

    async def _on_message(self, message: Mapping[str, Any]) -> None:
        channel, data = message["channel"], bytes(message["data"])
        if channel == EVENTS:
            kind, _, worker_id = data.decode(errors="replace").partition(" ")
            if kind == "leave":
                self._leave(worker_id, "it stopped")
            self._refresh_now.set()
            return
        try:
            event = msgspec.msgpack.decode(data, type=KVEvent)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.num_bad_events += 1
            return
        if not self.index.apply(event):
            await self._load_snapshot(event.worker_id)

    async def _load_snapshot(self, worker_id: str) -> None:
        if self.redis is None:
            return
        with contextlib.suppress(aioredis.RedisError, OSError):
            blob = cast(bytes | None, await self.redis.get(snapshot_key(worker_id)))
            if blob is None:
                return
            try:
                snapshot = msgspec.msgpack.decode(blob, type=KVEvent)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.num_bad_events += 1
                return
            if snapshot.worker_id == worker_id and self.index.known(worker_id):
                self.index.load(snapshot)

    # -- names --------------------------------------------------------------------------

    @property
    def default_model_id(self) -> str | None:
        """The model `default` names: the one given (by id, or by the spec its workers were
        started with), else the first to join."""
        if self.default_model in self.groups:
            return self.default_model
        return self._specs.get(self.default_model, self._first_model)

    def resolve(self, name: str) -> ModelGroup | None:
        """The model a request's `model` names: its id, `default` (or the default's spec),
        or an operator's alias; None for anything else."""
        if name in self.groups:
            return self.groups[name]
        target = self.aliases.get(name, name)
        if target in ("default", self.default_model):
            target = self.default_model_id or ""
        return self.groups.get(target)

    def aliases_of(self, model_id: str) -> tuple[str, ...]:
        """Every other name that resolves to `model_id`."""
        names = {"default", self.default_model, *self.aliases}
        return tuple(sorted(n for n in names if n != model_id and self._target(n) == model_id))

    def _target(self, name: str) -> str | None:
        target = self.aliases.get(name, name)
        if target in ("default", self.default_model):
            return self.default_model_id or (target if target in self.groups else None)
        return target

    def all_aliases(self) -> dict[str, str]:
        """Every alias of a served model -> that model's id (for reading old records)."""
        return {a: m for m in self.groups for a in self.aliases_of(m)}

    # -- routing --------------------------------------------------------------------------

    async def route(
        self,
        group: ModelGroup,
        *,
        token_ids: Sequence[int],
        cache_salt: str,
        lora_key: str,
        exclude: Sequence[str] = (),
    ) -> tuple[WorkerHandle, int]:
        """The worker of `group` that serves a prompt of `token_ids` for the tenant whose
        salt is `cache_salt`, by the gateway's policy, and the prompt tokens it is expected
        to compute (those not in its cached prefix); the blocks are then expected there.
        When none is usable, the ones that were down are tried again first (a restarted
        worker is back at once). Raises NoWorkerError when none is usable."""
        workers = [w for w in group.available if w.worker_id not in exclude]
        if not workers:
            down = [
                w for w in group.workers.values() if not w.drained and w.worker_id not in exclude
            ]
            await asyncio.gather(*(_try_connect(w.client, 1.0) for w in down))
            workers = [w for w in group.available if w.worker_id not in exclude]
        if not workers:
            raise NoWorkerError(f"no worker of {group.model_id} is available")
        # prefill workers run whole requests only when no other worker can
        workers = [w for w in workers if w.role != "prefill"] or workers
        keys = prompt_keys(
            group.info.cache_namespace, cache_salt, lora_key, token_ids, group.info.kv_block_size
        )
        worker, prefill = self._choose(group, workers, keys, len(token_ids))
        self.index.expect(worker.worker_id, keys)
        return worker, prefill

    def _choose(
        self, group: ModelGroup, workers: Sequence[WorkerHandle], keys: Sequence[int], n: int
    ) -> tuple[WorkerHandle, int]:
        """The worker of `workers` the policy picks for a prompt of `n` tokens whose block
        keys are `keys`, and the tokens it would compute."""
        by_id = {w.worker_id: w for w in workers}
        chosen = choose(
            self.policy,
            [w.candidate(self.index, keys) for w in workers],
            prompt_tokens=n,
            block_size=group.info.kv_block_size,
            turn=self._turn,
        )
        self._turn += 1
        return by_id[chosen.worker_id], round(prefill_tokens(chosen, n, group.info.kv_block_size))

    def _reconnected(self, worker_id: str, _: asyncio.Task[None]) -> None:
        self._reconnecting.pop(worker_id, None)

    def through_remote(self, prefill: WorkerHandle, worker: WorkerHandle) -> bool:
        """Whether `prefill` hands its pages to `worker` through the remote KV tier rather
        than through this gateway: never with the `gateway` transport; with `remote`,
        whenever both have a remote tier; with `auto`, when both report the same store."""
        mine, theirs = prefill.kv_remote_id, worker.kv_remote_id
        if self.disagg_transport == "gateway" or not (mine and theirs):
            return False
        return self.disagg_transport == "remote" or mine == theirs

    def prefill_worker(
        self,
        group: ModelGroup,
        worker: WorkerHandle,
        num_prefill_tokens: int,
        *,
        token_ids: Sequence[int],
        cache_salt: str,
        lora_key: str,
    ) -> WorkerHandle | None:
        """The prefill worker that computes the prompt's KV for `worker`, a decode worker
        that would compute `num_prefill_tokens` of it itself; None where the prompt stays
        there: a worker that is not a decode worker, a prompt mostly cached there or shorter
        than `disagg_min_prompt_tokens`, or no prefill worker available."""
        if worker.role != "decode" or num_prefill_tokens < self.disagg_min_prompt_tokens:
            return None
        prefills = [w for w in group.available if w.role == "prefill"]
        for down in [w for w in prefills if not w.client.connected]:  # back for later prompts
            if down.worker_id not in self._reconnecting:
                task = asyncio.create_task(_try_connect(down.client, 1.0))
                self._reconnecting[down.worker_id] = task
                task.add_done_callback(partial(self._reconnected, down.worker_id))
        prefills = [w for w in prefills if w.client.connected]
        if not prefills:
            return None
        keys = prompt_keys(
            group.info.cache_namespace, cache_salt, lora_key, token_ids, group.info.kv_block_size
        )
        chosen, _ = self._choose(group, prefills, keys, len(token_ids))
        return chosen

    # -- operations -----------------------------------------------------------------------

    async def set_drained(self, worker_id: str, drained: bool) -> WorkerHandle:
        """Drain a worker (it takes no new requests; its running ones finish) or undrain it,
        on every gateway: the flag is kept in the store. KeyError for a worker not in view."""
        handle = self.workers[worker_id]
        if self.store is not None:
            async with self.store.pipeline(transaction=True) as pipe:
                if drained:
                    pipe.sadd(DRAINED, worker_id)
                else:
                    pipe.srem(DRAINED, worker_id)
                pipe.publish(EVENTS, f"{'drain' if drained else 'undrain'} {worker_id}")
                await pipe.execute()
        handle.drained = drained
        return handle

    async def ready(self, timeout: float = 1.0) -> bool:
        """Whether some worker is reachable (busy or not); the workers not connected are
        tried together, so a restarted one is picked up."""
        await asyncio.gather(
            *(
                _try_connect(h.client, timeout)
                for h in self.workers.values()
                if not h.client.connected
            )
        )
        return any(h.client.connected for h in self.workers.values())

    def errors(self) -> list[str]:
        """Why workers are out of reach, one line each, without their addresses (for /ready):
        a fleet secret error by name, anything else as 'unreachable'."""
        return [
            h.client.last_error.reason
            if isinstance(h.client.last_error, FleetSecretError)
            else "unreachable"
            for h in self.workers.values()
            if h.client.last_error is not None
        ]

    def view(self) -> FleetView:
        """This gateway's view of the fleet, for its metrics."""
        workers: Tally[tuple[str, str]] = Tally()
        for h in self.workers.values():
            state = "drained" if h.drained else "serving" if h.client.connected else "down"
            workers[(h.model_id or "unknown", state)] += 1
        return FleetView(
            registry_up=self.registry_ok if self.redis is not None else None,
            workers=dict(workers),
            dropped={
                "invalid_record": self.num_invalid_records,
                "malformed_event": self.num_bad_events,
                "unknown_worker": self.index.num_dropped,
            },
        )

    async def stats(self) -> dict[str, EngineStats]:
        """Each connected worker's figures, by worker id."""
        out = {}
        for handle in list(self.workers.values()):
            if handle.client.connected:
                with contextlib.suppress(EngineDeadError, TimeoutError):
                    async with asyncio.timeout(1.0):
                        out[handle.worker_id] = await handle.client.stats()
        return out


async def _try_connect(client: EngineClient, timeout: float) -> None:
    with contextlib.suppress(EngineDeadError, TimeoutError):
        async with asyncio.timeout(timeout):
            await client.connect()


def _tokenizer_from_files(cache_dir: Path, files: Mapping[str, bytes]) -> Tokenizer:
    """A tokenizer from the files a worker sent, kept under `cache_dir` by their digest."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name])
    directory = cache_dir / "gateway-tokenizers" / digest.hexdigest()[:16]
    if not (directory / "tokenizer.json").exists():
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=directory.parent))
        for name, data in files.items():
            (staging / Path(name).name).write_bytes(data)
        try:
            staging.rename(directory)
        except OSError:  # another process (a replica, a sibling) put it there first
            shutil.rmtree(staging, ignore_errors=True)
    return Tokenizer.from_dir(str(directory))
