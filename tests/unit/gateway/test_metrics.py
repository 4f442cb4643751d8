"""The engine figures in /metrics: summed over workers, by tenant and tier."""

from __future__ import annotations

import msgspec

from engine.protocol import EngineStats
from gateway.metrics import GatewayMetrics


def _stats(**fields: object) -> EngineStats:
    """An idle worker's figures, with `fields` in place of its own."""
    idle = EngineStats(
        num_waiting=0, num_running=0, num_kv_blocks_total=100, num_kv_blocks_used=0,
        num_kv_blocks_free=100, kv_block_size=16, num_preemptions=0, num_steps=0,
        num_generated_tokens=0,
    )  # fmt: skip
    return msgspec.structs.replace(idle, **fields)


def _values(metrics: GatewayMetrics) -> dict[str, float]:
    lines = metrics.render().decode().splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines if line[:1] != "#"}


def test_two_workers_figures_add_up_by_tier_and_tenant() -> None:
    metrics = GatewayMetrics()
    a = _stats(
        num_running=3, num_loading=1, num_preemptions=2, kv_bytes_per_token=18_432,
        num_cache_hit_blocks={"device": 5, "host": 4, "disk": 0},
        num_kv_spilled_blocks={"host": 10, "disk": 3}, num_kv_dropped_blocks=1,
        kv_blocks_by_tenant={"t1": {"device": 2, "host": 7}},
    )  # fmt: skip
    b = _stats(
        num_running=1, num_kv_disk_write_errors=2, kv_bytes_per_token=9_216,
        num_cache_hit_blocks={"device": 1, "host": 0, "disk": 6},
        num_kv_spilled_blocks={"host": 4, "disk": 0},
        kv_blocks_by_tenant={"t1": {"device": 1}, "t2": {"disk": 4}},
    )  # fmt: skip
    metrics.set_engine([a, b])
    v = _values(metrics)
    assert v["strata:num_requests_running"] == 4
    assert v["strata:num_requests_loading_kv"] == 1
    assert v["strata:num_preemptions"] == 2
    assert v['strata:kv_cache_hit_blocks{tier="device"}'] == 6
    assert v['strata:kv_cache_hit_blocks{tier="host"}'] == 4
    assert v['strata:kv_cache_hit_blocks{tier="disk"}'] == 6
    assert v['strata:kv_spilled_blocks{tier="host"}'] == 14
    assert v['strata:kv_spilled_blocks{tier="disk"}'] == 3
    assert v["strata:kv_dropped_blocks"] == 1
    assert v["strata:kv_disk_write_errors"] == 2
    assert v['strata:kv_blocks{tenant="t1",tier="device"}'] == 3
    assert v['strata:kv_blocks{tenant="t1",tier="host"}'] == 7
    assert v['strata:kv_blocks{tenant="t2",tier="disk"}'] == 4
    assert v["strata:kv_cache_bytes_per_token"] == 18_432


def test_a_tenant_whose_blocks_are_gone_drops_out() -> None:
    metrics = GatewayMetrics()
    metrics.set_engine([_stats(kv_blocks_by_tenant={"t1": {"device": 2}, "t2": {"host": 1}})])
    metrics.set_engine([_stats(kv_blocks_by_tenant={"t2": {"host": 1}})])
    v = _values(metrics)
    assert 'strata:kv_blocks{tenant="t1",tier="device"}' not in v
    assert v['strata:kv_blocks{tenant="t2",tier="host"}'] == 1
