"""Disaggregated prefill in a worker: a prefill worker computes the KV of a long prompt's
full blocks and reads their pages out as blobs (kvstore/page_blob.py); a decode worker
checks such blobs (off the engine thread) and takes them into its host tier under their
block hashes (on it), so that the request sent after them finds its prefix there and loads
it layer by layer. The flow, and why the
gateway carries the pages: docs/design/disaggregation.md.

The prefill covers the blocks a decode worker's prefix hit may use: every full block
before the prompt's last token (the scheduler's own rule, engine/scheduler.py). The decode
worker computes the rest and the first token's logits, as it would after any prefix hit.

A `remote` prefill (the remote transport) sends no pages when it can help it: it makes
sure they are in the worker's remote tier (saving those not known to be there) and answers
once the store has taken them, within the tier's timeout, with their number; pages the
store did not take in time are sent back as blobs after all.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.block_hash import chain_hashes, namespace, root_hash
from engine.core import EngineCore
from engine.protocol import FinishReason, RequestOutput, SamplingParams
from engine.wire import Pages, Prefill
from kvstore.page_blob import PageBlobError, pack_page, unpack_page

log = logging.getLogger(__name__)

# a prefill runs the prompt's blocks and samples one token nobody reads
PREFILL_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
MAX_FRAME_PAYLOAD = 32 << 20  # bytes of pages per `Pages` frame, at most (one page at least)


def prefill_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """Tokens of a prompt a prefill worker computes: its full blocks before its last token
    (what a decode worker's prefix hit can take)."""
    return (num_prompt_tokens - 1) // block_size * block_size


@dataclass
class _Job:
    hashes: list[bytes]
    owner: str
    remote: bool = False  # answer with the pages' number once they are in the remote tier
    deadline: float = 0.0  # monotonic: past it, the pages not yet stored are sent instead


class PrefillJobs:
    """The prefills a worker runs for its clients (by request id, connection included):
    started as requests of their own, answered with their pages once they finish. Used on
    the engine thread only."""

    def __init__(self, core: EngineCore, send: Callable[[str, Pages], None]) -> None:
        """`send(request_id, pages)`: hand a reply to the request's connection."""
        self.core = core
        self.send = send
        self._jobs: dict[str, _Job] = {}
        self._saving: dict[str, _Job] = {}  # remote prefills whose saves are in flight

    def start(self, request_id: str, msg: Prefill) -> None:
        """Queue the prefill of `msg` (a prompt too short to have a block is answered at
        once with no pages). Raises InvalidRequestError as `add_request` does."""
        core, bs = self.core, self.core.block_manager.block_size
        tokens = msg.prompt_token_ids[: prefill_tokens(len(msg.prompt_token_ids), bs)]
        if not tokens or not core.config.cache.enable_prefix_caching:
            self.send(request_id, Pages(msg.request_id, [], last=True))
            return
        sched = msg.scheduling
        core.add_request(request_id, tokens, PREFILL_PARAMS, scheduling=sched, lora=msg.lora)
        space = namespace(
            core.scheduler.cache_namespace,
            sched.cache_salt,
            "" if msg.lora is None else msg.lora.key,
        )
        hashes = chain_hashes(root_hash(space), tokens, bs, 0)
        self._jobs[request_id] = _Job(hashes, sched.tenant, remote=msg.remote)

    @property
    def saving(self) -> bool:
        """Whether a remote prefill waits for its saves (`poll` it)."""
        return bool(self._saving)

    def poll(self) -> None:
        """Answer the remote prefills whose pages the store has taken, or whose wait is
        over."""
        remote = self.core.tiers.remote if self.core.tiers is not None else None
        now = time.monotonic()
        for request_id, job in list(self._saving.items()):
            if remote is None or now >= job.deadline or not any(map(remote.queued, job.hashes)):
                del self._saving[request_id]
                self._send_pages(request_id, job)

    def forget(self, gone: Callable[[str], bool]) -> None:
        """Stop waiting for the saves of the remote prefills whose request id `gone` names
        (aborted, or their connection closed): nobody reads their answer."""
        self._saving = {rid: job for rid, job in self._saving.items() if not gone(rid)}

    def settle(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Answer the prefills among `outputs` that finished (their pages, read out now,
        while their blocks are still cached); returns the other outputs."""
        if not self._jobs:
            return outputs
        rest = []
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:
                rest.append(out)
            elif out.finished:
                del self._jobs[out.request_id]
                self._answer(out, job)
        return rest

    def _answer(self, out: RequestOutput, job: _Job) -> None:
        client_id = out.request_id.partition("/")[2]
        if out.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            error = out.error or "the prefill was aborted"
            self.send(out.request_id, Pages(client_id, [], last=True, error=error))
            return
        remote = self.core.tiers.remote if self.core.tiers is not None else None
        if job.remote and remote is not None:
            save_pages(self.core, job.hashes, job.owner)
            job.deadline = time.monotonic() + remote.config.timeout_s
            self._saving[out.request_id] = job
            self.poll()
            return
        self._send_pages(out.request_id, job)

    def _send_pages(self, request_id: str, job: _Job) -> None:
        """Answer the prefill: with the number of its pages in the remote tier when all of
        them are there, else with the pages themselves."""
        client_id = request_id.partition("/")[2]
        remote = self.core.tiers.remote if self.core.tiers is not None else None
        saved = 0
        if job.remote and remote is not None:
            saved = sum(1 for _ in itertools.takewhile(remote.stored, job.hashes))
            if saved == len(job.hashes):
                self.send(request_id, Pages(client_id, [], last=True, saved=saved))
                return
            log.warning(
                "prefill %s: %d of %d pages in the remote tier; sending them instead",
                client_id,
                saved,
                len(job.hashes),
            )
        blobs = export_pages(self.core, job.hashes, job.owner)
        if len(blobs) < len(job.hashes):
            log.warning("prefill %s: %d of %d pages", client_id, len(blobs), len(job.hashes))
        per_frame = max(1, MAX_FRAME_PAYLOAD // self.core.pool.spec.bytes_per_block)
        for start in range(0, max(1, len(blobs)), per_frame):
            last = start + per_frame >= len(blobs)
            batch = blobs[start : start + per_frame]
            self.send(request_id, Pages(client_id, batch, last, saved=saved if last else 0))


def save_pages(core: EngineCore, hashes: Sequence[bytes], owner: str) -> None:
    """Queue saves to the remote tier of the device pages of the longest cached prefix of
    `hashes` that the store is not known to hold (written behind)."""
    remote = core.tiers.remote if core.tiers is not None else None
    blocks = core.block_manager.lookup(list(hashes))
    if remote is None or not blocks:
        return
    todo = [(b, k) for b, k in zip(blocks, hashes, strict=False) if not remote.knows(k)]
    if todo:
        rows = core.pool.read_pages([b for b, _ in todo]).cpu()
        for (_, key), row in zip(todo, rows, strict=True):
            remote.save(key, row, owner)


def export_pages(core: EngineCore, hashes: Sequence[bytes], owner: str) -> list[bytes]:
    """Blobs of the device pages of the longest cached prefix of `hashes` (changes
    nothing)."""
    blocks = core.block_manager.lookup(list(hashes))
    if not blocks:
        return []
    rows = core.pool.read_pages(blocks).cpu()  # [n, bytes_per_block] uint8
    return [
        pack_page(core.page_format, key, owner, row.numpy().tobytes())
        for key, row in zip(hashes, rows, strict=False)
    ]


@dataclass(frozen=True)
class CheckedPages:
    """The pages of a `PutPages` that passed their checks, as (block hash, owner, page
    bytes), in order, and how many did not."""

    pages: list[tuple[bytes, str, torch.Tensor]]
    num_refused: int


def check_pages(core: EngineCore, blobs: Sequence[bytes]) -> CheckedPages:
    """Check `blobs` against the worker's page format (header and CRC-32). Reads nothing
    the engine thread changes, so it runs off it: only the copies into the tier are left to
    the engine thread (`PageImports.take`)."""
    pages, refused = [], 0
    for blob in blobs:
        try:
            if core.tiers is None:
                raise PageBlobError("this worker has no tier to take pages into")
            page = unpack_page(blob, core.page_format, core.pool.spec.bytes_per_block)
        except PageBlobError as exc:
            refused += 1
            log.warning("refused a prefilled KV page: %s", exc)
            continue
        data = torch.frombuffer(bytearray(page.payload), dtype=torch.uint8)
        pages.append((page.key, page.owner, data))
    return CheckedPages(pages, refused)


@dataclass
class PageImports:
    """Pages a decode worker took into its tiers, and those it refused (torn, corrupt or
    of another format: misses, computed again)."""

    num_taken: int = 0
    num_refused: int = 0

    def take(self, core: EngineCore, checked: CheckedPages) -> None:
        """Put each checked page into the host tier (or disk, without one) under its block
        hash, unless a tier or the device holds it already. On the engine thread."""
        self.num_refused += checked.num_refused
        self.num_taken += len(checked.pages)
        tiers = core.tiers
        if tiers is None:
            return
        cached = core.block_manager.cached_hashes()
        for key, owner, data in checked.pages:
            if key not in cached and tiers.tier_of(key) is None:
                tiers.put(key, data, owner=owner)
