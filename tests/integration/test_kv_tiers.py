"""Host and disk tiers on the real SmolLM2: pages that leave the device and come back give
the same tokens as recomputing them, in full precision and in FP8, including for live
requests preempted for space."""

from __future__ import annotations

import dataclasses
import time

import pytest

from engine.config import CacheConfig, EngineConfig, KVCacheDtype
from engine.llm import LLM
from engine.protocol import SamplingParams
from kvstore.tiers import Tier

DOCS = [
    "Photosynthesis converts light energy into chemical energy stored in glucose. " * 6,
    "The Roman Empire reached its greatest extent under the emperor Trajan in 117 AD. " * 6,
    "A compiler translates source code into machine code through several passes. " * 6,
]
QUESTIONS = ["Summarize this.", "What is the main subject?"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def tiny_tiers(tmp_path, kv: KVCacheDtype, **overrides) -> CacheConfig:
    """A device pool that holds about one document, one host page per document block, and
    a disk: every document's pages leave the device between its questions."""
    page = 16 * 2 * 30 * 3 * (68 if kv is KVCacheDtype.FP8_E4M3 else 256)
    tiers = CacheConfig(
        num_blocks=14,
        kv_cache_dtype=kv,
        host_memory_bytes=6 * page,
        disk_bytes=64 * 4096 * -(-page // 4096),
        disk_path=str(tmp_path),
    )
    return dataclasses.replace(tiers, **overrides)


@pytest.mark.parametrize(
    ("kv", "load"),
    [(KVCacheDtype.AUTO, "sync"), (KVCacheDtype.FP8_E4M3, "sync"), (KVCacheDtype.AUTO, "thread")],
)  # "thread": pages arrive layer by layer on a worker thread while the step computes
def test_pages_back_from_host_and_disk_give_the_tokens_of_a_recompute(
    make_core, smollm2_fp32, tmp_path, kv, load
):
    prompts = [f"{doc}\n{q}" for q in QUESTIONS for doc in DOCS]  # documents interleaved
    recompute = CacheConfig(kv_cache_dtype=kv, enable_prefix_caching=False)
    cold = LLM(core=make_core(EngineConfig(cache=recompute)), tokenizer=smollm2_fp32[1])
    reference = [cold.generate([p], GREEDY)[0].token_ids for p in prompts]

    tiered = LLM(
        core=make_core(EngineConfig(cache=tiny_tiers(tmp_path, kv, kv_load=load))),
        tokenizer=smollm2_fp32[1],
    )
    assert tiered.core.pool.loads.backend == load
    offloader = tiered.core.block_manager.connector.offloader
    assert offloader is not None and offloader.in_place == (load == "thread")  # host rows
    outs = [tiered.generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in outs] == reference
    second_round = outs[len(DOCS) :]
    assert all(o.num_cached_tokens >= 64 for o in second_round)
    host = sum(o.num_cached_host_tokens for o in second_round)
    disk = sum(o.num_cached_disk_tokens for o in second_round)
    assert host > 0 and disk > 0  # both tiers served pages
    for o in second_round:
        assert o.num_cached_host_tokens + o.num_cached_disk_tokens <= o.num_cached_tokens
    stats = tiered.core.stats()
    assert stats.num_cache_hit_blocks["host"] * 16 == host
    assert stats.num_cache_hit_blocks["disk"] * 16 == disk
    assert stats.num_kv_host_blocks_used == 6 and stats.num_kv_disk_blocks_used > 0
    # every page now below the device went down through host RAM, to disk when it filled
    spilled = stats.num_kv_spilled_blocks
    assert spilled["host"] >= 6 + stats.num_kv_disk_blocks_used
    assert spilled["disk"] >= stats.num_kv_disk_blocks_used
    assert stats.num_kv_dropped_blocks == 0 and stats.num_kv_disk_write_errors == 0
    tiered.core.check_integrity()


def test_preempted_requests_swap_through_the_tiers(make_core, smollm2_fp32, tmp_path):
    prompts = [f"{doc}\n{q}" for doc in DOCS for q in QUESTIONS]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = LLM(core=make_core(), tokenizer=smollm2_fp32[1])
    reference = [c.token_ids for c in roomy.generate(prompts, params)]
    cache = tiny_tiers(tmp_path, KVCacheDtype.AUTO, num_blocks=16, kv_load="thread")
    tiny = LLM(core=make_core(EngineConfig(cache=cache)), tokenizer=smollm2_fp32[1])
    assert [c.token_ids for c in tiny.generate(prompts, params)] == reference
    stats = tiny.core.stats()
    assert stats.num_preemptions > 0
    # resumed requests found their full blocks again, some below the device
    assert stats.num_cache_hit_blocks["host"] + stats.num_cache_hit_blocks["disk"] > 0
    tiny.core.check_integrity()
    assert stats.num_kv_blocks_used == 0


def test_blocks_are_accounted_per_tenant_and_tier_allowances_hold(
    make_core, smollm2_fp32, tmp_path
):
    from engine.protocol import Scheduling

    llm = LLM(
        core=make_core(EngineConfig(cache=tiny_tiers(tmp_path, KVCacheDtype.AUTO))),
        tokenizer=smollm2_fp32[1],
    )
    acme = Scheduling(tenant="acme", cache_salt="a")
    beta = Scheduling(tenant="beta", cache_salt="b", kv_host_tokens=0, kv_disk_tokens=32)
    for doc in DOCS:  # acme reads every document; beta's cache may not use host RAM
        llm.generate([f"{doc}\n{QUESTIONS[0]}"], GREEDY, scheduling=acme)
    for doc in DOCS:
        llm.generate([f"{doc}\n{QUESTIONS[0]}"], GREEDY, scheduling=beta)
    llm.generate([f"{DOCS[0]}\n{QUESTIONS[1]}"], GREEDY, scheduling=acme)  # evicts beta's
    started = time.monotonic()
    before = llm.core.stats()
    time.sleep(0.2)
    after = llm.core.stats()
    elapsed = time.monotonic() - started  # the two samples lie between 0.2 s and this apart
    by_tenant = after.kv_blocks_by_tenant
    assert by_tenant == before.kv_blocks_by_tenant  # nothing ran in between
    assert by_tenant["acme"]["device"] > 0 and by_tenant["acme"]["host"] > 0
    assert "host" not in by_tenant["beta"]  # 0 tokens of host RAM
    assert by_tenant["beta"]["disk"] == 2  # 32 tokens = 2 blocks on disk, no more
    # the residency meter charged what each tenant held in each tier while it waited
    page = llm.core.pool.spec.bytes_per_block
    for tenant, tiers in by_tenant.items():
        for tier, pages in tiers.items():
            charged = after.kv_byte_seconds_by_tenant[tenant][
                tier
            ] - before.kv_byte_seconds_by_tenant.get(tenant, {}).get(tier, 0.0)
            assert pages * page * 0.2 <= charged <= pages * page * elapsed, (tenant, tier)
    assert "host" not in after.kv_byte_seconds_by_tenant["beta"]
    total = sum(t.get("device", 0) for t in by_tenant.values())
    assert total <= llm.core.stats().num_kv_blocks_total
    llm.core.check_integrity()


def test_spill_ahead_saves_pages_before_their_blocks_are_reused(make_core, smollm2_fp32, tmp_path):
    """With --kv-spill-ahead the engine saves cooling pages between steps: allocations that
    reuse their blocks copy nothing more, and the document comes back from host RAM."""
    cache = CacheConfig(
        num_blocks=24,
        host_memory_bytes=64 << 20,
        disk_bytes=0,
        disk_path=str(tmp_path),
        spill_ahead=True,
    )
    llm = LLM(core=make_core(EngineConfig(cache=cache)), tokenizer=smollm2_fp32[1])
    assert llm.core.spill_watermark == 24
    bm, tiers = llm.core.block_manager, llm.core.tiers
    assert tiers is not None
    docs = [f"Document {d}: " + f"fact {d} about the ocean and the tide. " * 20 for d in range(2)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    first = llm.generate([docs[0]], params)[0]
    full_blocks = len(first.prompt_token_ids) // 16
    assert bm.num_spilled_ahead >= full_blocks - 1  # saved as they cooled
    ahead, saved = bm.num_spilled_ahead, tiers.num_spilled[Tier.HOST]
    llm.generate([docs[1]], params)  # takes over most of docs[0]'s blocks
    assert bm.num_evicted_blocks > 0
    new_saves = tiers.num_spilled[Tier.HOST] - saved
    assert new_saves == bm.num_spilled_ahead - ahead, "the allocation itself copied nothing"
    again = llm.generate([docs[0]], params)[0]
    assert again.num_cached_host_tokens > 0
    assert again.num_cached_tokens >= 16 * (full_blocks - 1)
    llm.core.check_integrity()


def test_the_native_layer_stack_waits_for_pages_loading_on_a_thread(
    strata_cache_dir, tmp_path, monkeypatch
):
    """bf16 runs every layer in one kernel call (where the CPU has the native stack): it
    starts once every layer's pages are in, and gives the tokens of the synchronous loads.
    The worker's copies are slowed, so that a step that did not wait would read empty pages."""
    import time

    from engine.factory import create_engine
    from kvstore import transfer

    copy = transfer._scatter

    def slow(*args):
        time.sleep(0.002)
        copy(*args)

    monkeypatch.setattr(transfer, "_scatter", slow)

    prompts = [f"{doc}\n{q}" for q in QUESTIONS for doc in DOCS]
    runs = {}
    for load in ("sync", "thread"):
        cache = tiny_tiers(tmp_path / load, KVCacheDtype.AUTO, kv_load=load)
        config = EngineConfig(dtype="bfloat16", cache=cache, cache_dir=str(strata_cache_dir))
        core, tokenizer = create_engine(config, progress=False)
        llm = LLM(core=core, tokenizer=tokenizer)
        outs = [llm.generate([p], GREEDY)[0] for p in prompts]
        runs[load] = [o.token_ids for o in outs]
        assert sum(o.num_cached_host_tokens + o.num_cached_disk_tokens for o in outs) > 0
        core.check_integrity()
    assert runs["thread"] == runs["sync"]


def test_a_failed_page_load_fails_its_step_and_the_engine_goes_on(
    make_core, smollm2_fp32, tmp_path, monkeypatch
):
    from engine.protocol import FinishReason
    from kvstore import transfer

    core = make_core(EngineConfig(cache=tiny_tiers(tmp_path, KVCacheDtype.AUTO, kv_load="thread")))
    llm = LLM(core=core, tokenizer=smollm2_fp32[1])
    tokenize = smollm2_fp32[1].encode
    for doc in DOCS:  # the first document's pages end up below the device
        llm.generate([f"{doc}\n{QUESTIONS[0]}"], GREEDY)
    question = tokenize(f"{DOCS[0]}\n{QUESTIONS[1]}")
    reference = LLM(core=make_core(), tokenizer=smollm2_fp32[1])

    def broken(dst, src, index):
        raise RuntimeError("DMA error")

    with monkeypatch.context() as m:
        m.setattr(transfer, "_scatter", broken)
        core.add_request("hit", question, GREEDY)
        outs = core.step()
    (failed,) = [o for o in outs if o.request_id == "hit"]
    assert failed.finish_reason is FinishReason.ERROR and "DMA error" in (failed.error or "")
    assert not core.has_unfinished() and not core.pool.loads.pending
    core.check_integrity()
    # the next request over the same document computes what it could not load, correctly
    (again,) = llm.generate([f"{DOCS[0]}\n{QUESTIONS[1]}"], GREEDY)
    want = reference.generate([f"{DOCS[0]}\n{QUESTIONS[1]}"], GREEDY)[0].token_ids
    assert again.token_ids == want, again.finish_reason
    core.check_integrity()


def _run_out(core, tokens: dict[str, list[int]]) -> dict:
    """Step until every request finishes, adding their new tokens to `tokens`; the final
    output of each."""
    final = {}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out
    return final


def test_a_request_whose_pages_are_on_disk_waits_without_stalling_the_batch(
    make_core, smollm2_fp32, tmp_path
):
    """The disk's reads are held: the running request keeps decoding a token per step while
    the one over a document on disk waits, in its place; released, it loads the pages read
    ahead and gives the tokens of a fresh engine."""
    import threading

    from kvstore.disk import _READ_THREADS

    core = make_core(
        EngineConfig(cache=tiny_tiers(tmp_path, KVCacheDtype.AUTO, host_memory_bytes=0))
    )
    llm = LLM(core=core, tokenizer=smollm2_fp32[1])
    for doc in DOCS:  # the first document's pages end up on disk only
        llm.generate([f"{doc}\n{QUESTIONS[0]}"], GREEDY)
    tokenize = smollm2_fp32[1].encode
    question = f"{DOCS[0]}\n{QUESTIONS[1]}"
    assert core.tiers is not None and core.tiers.disk is not None
    gate = threading.Event()
    for _ in range(_READ_THREADS):
        core.tiers.disk._readers.submit(gate.wait)

    talk = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    core.add_request("running", tokenize("Tell me about the sea."), talk)
    core.step()  # its prefill
    core.add_request("reader", tokenize(question), GREEDY)
    tokens: dict[str, list[int]] = {"running": [], "reader": []}
    for _ in range(6):
        outs = {o.request_id: o for o in core.step()}
        assert "reader" not in outs and len(outs["running"].new_token_ids) == 1
        assert [r.request_id for r in core.scheduler.waiting] == ["reader"]
    assert core.stats().kv_disk_read_ahead_bytes > 0
    gate.set()
    reader = _run_out(core, tokens)["reader"]
    want = LLM(core=make_core(), tokenizer=smollm2_fp32[1]).generate([question], GREEDY)
    assert tokens["reader"] == want[0].token_ids
    assert reader.num_cached_disk_tokens >= 64
    assert core.stats().kv_disk_read_ahead_bytes == 0
    core.check_integrity()


def _held_page_copies(monkeypatch):
    """Hold the worker thread's page copies until the returned event is set."""
    import threading

    from kvstore import transfer

    gate = threading.Event()
    copy = transfer._scatter

    def held(*args):
        assert gate.wait(60), "page copies held too long"
        copy(*args)

    monkeypatch.setattr(transfer, "_scatter", held)
    return gate


def _running_beside_a_host_load(make_core, smollm2_fp32, tmp_path, monkeypatch):
    """A core whose first document is in host RAM, a request decoding, and `reader` over
    that document admitted while its page copies are held (the returned event); and the
    running request's first token."""
    cache = tiny_tiers(
        tmp_path,
        KVCacheDtype.AUTO,
        kv_load="thread",
        disk_bytes=0,
        host_memory_bytes=40 * 16 * 2 * 30 * 3 * 256,
    )
    core = make_core(EngineConfig(cache=cache))
    llm = LLM(core=core, tokenizer=smollm2_fp32[1])
    for doc in DOCS:  # the first document's pages leave the device
        llm.generate([f"{doc}\n{QUESTIONS[0]}"], GREEDY)
    gate = _held_page_copies(monkeypatch)
    tokenize = smollm2_fp32[1].encode
    talk = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    core.add_request("running", tokenize("Tell me about the sea."), talk)
    (first,) = core.step()  # its prefill
    core.add_request("reader", tokenize(f"{DOCS[0]}\n{QUESTIONS[1]}"), GREEDY)
    return core, gate, first.new_token_ids


def test_a_request_loading_from_host_waits_outside_the_running_batch(
    make_core, smollm2_fp32, tmp_path, monkeypatch
):
    """While its page copies are held, the request over a document in host RAM waits
    outside the batch, its blocks held, and the running request decodes a token per step
    without waiting for them; released, it joins and gives the tokens of a fresh engine."""
    core, gate, first = _running_beside_a_host_load(make_core, smollm2_fp32, tmp_path, monkeypatch)
    tokens: dict[str, list[int]] = {"running": first, "reader": []}
    for _ in range(4):
        outs = {o.request_id: o for o in core.step()}
        assert "reader" not in outs and len(outs["running"].new_token_ids) == 1
        tokens["running"] += outs["running"].new_token_ids
        assert [r.request_id for r in core.scheduler.loading] == ["reader"]
        stats = core.stats()
        assert core.pool.loads.pending and (stats.num_running, stats.num_loading) == (2, 1)
    core.check_integrity()
    gate.set()
    reader = _run_out(core, tokens)["reader"]
    fresh = LLM(core=make_core(), tokenizer=smollm2_fp32[1])
    question = f"{DOCS[0]}\n{QUESTIONS[1]}"
    assert tokens["reader"] == fresh.generate([question], GREEDY)[0].token_ids
    talk = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    assert tokens["running"] == fresh.generate(["Tell me about the sea."], talk)[0].token_ids
    assert reader.num_cached_host_tokens >= 64
    core.check_integrity()


def test_aborting_a_request_while_its_pages_load_waits_for_the_copies(
    make_core, smollm2_fp32, tmp_path, monkeypatch
):
    """Its blocks go back only once the copies into them are done; the running request
    goes on."""
    import threading

    core, gate, _ = _running_beside_a_host_load(make_core, smollm2_fp32, tmp_path, monkeypatch)
    core.step()
    assert [r.request_id for r in core.scheduler.loading] == ["reader"]
    threading.Timer(0.3, gate.set).start()
    out = core.abort_request("reader")
    assert out is not None and out.finished
    assert not core.pool.loads.pending and not core.scheduler.loading
    stats = core.stats()
    assert (stats.num_running, stats.num_loading) == (1, 0)
    core.check_integrity()
    while core.has_unfinished():
        core.step()
    core.check_integrity()
