"""/metrics: the engine figures by worker (totals as counters), per-tenant KV blocks summed
over workers, tenants' names, and no `_created` series."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.protocol import EngineStats
from gateway.metrics import GatewayMetrics
from tenants.records import UsageRecord

A, B = "tcp://worker-0:7000", "tcp://worker-1:7000"


def _stats(**fields: object) -> EngineStats:
    """An idle worker's figures, with `fields` in place of its own."""
    idle = EngineStats(
        num_waiting=0,
        num_running=0,
        num_kv_blocks_total=100,
        num_kv_blocks_used=0,
        num_kv_blocks_free=100,
        kv_block_size=16,
        num_preemptions=0,
        num_steps=0,
        num_generated_tokens=0,
    )
    return msgspec.structs.replace(idle, **fields)


def _values(metrics: GatewayMetrics) -> dict[str, float]:
    lines = metrics.render().decode().splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines if line[:1] != "#"}


def _types(metrics: GatewayMetrics) -> dict[str, str]:
    families = text_string_to_metric_families(metrics.render().decode())
    return {f.name: f.type for f in families}


def test_each_workers_figures_carry_its_address() -> None:
    metrics = GatewayMetrics()
    a = _stats(
        num_running=3,
        num_loading=1,
        num_preemptions=2,
        kv_bytes_per_token=18_432,
        num_cache_hit_blocks={"device": 5, "host": 4, "disk": 0},
        num_kv_spilled_blocks={"host": 10, "disk": 3},
        num_kv_dropped_blocks=1,
        num_kv_host_blocks_total=50,
        num_kv_host_blocks_used=7,
        num_draft_tokens=40,
        num_accepted_draft_tokens=31,
    )
    b = _stats(
        num_running=1,
        num_kv_disk_write_errors=2,
        num_kv_disk_checksum_failures=3,
        num_kv_disk_pages_recovered=40,
        num_kv_disk_pages_rejected=5,
        num_kv_pages_received=12,
        num_kv_pages_refused=1,
    )
    metrics.set_engine({A: a, B: b})
    v = _values(metrics)
    assert v[f'strata:num_requests_running{{worker="{A}"}}'] == 3
    assert v[f'strata:num_requests_running{{worker="{B}"}}'] == 1
    assert v[f'strata:num_requests_loading_kv{{worker="{A}"}}'] == 1
    assert v[f'strata:num_preemptions_total{{worker="{A}"}}'] == 2
    assert v[f'strata:kv_cache_hit_blocks_total{{tier="host",worker="{A}"}}'] == 4
    assert v[f'strata:kv_spilled_blocks_total{{tier="disk",worker="{A}"}}'] == 3
    assert v[f'strata:kv_dropped_blocks_total{{worker="{A}"}}'] == 1
    assert v[f'strata:kv_disk_write_errors_total{{worker="{B}"}}'] == 2
    assert v[f'strata:kv_disk_checksum_failures_total{{worker="{B}"}}'] == 3
    assert v[f'strata:kv_disk_pages_recovered_total{{worker="{B}"}}'] == 40
    assert v[f'strata:kv_disk_pages_rejected_total{{worker="{B}"}}'] == 5
    assert v[f'strata:kv_pages_received_total{{worker="{B}"}}'] == 12
    assert v[f'strata:kv_pages_refused_total{{worker="{B}"}}'] == 1
    assert v[f'strata:spec_decode_num_draft_tokens_total{{worker="{A}"}}'] == 40
    assert v[f'strata:spec_decode_num_accepted_tokens_total{{worker="{A}"}}'] == 31
    assert v[f'strata:kv_cache_bytes_per_token{{worker="{A}"}}'] == 18_432
    # blocks by tier: the tiers a worker has (A a host pool, B none)
    assert v[f'strata:kv_blocks_capacity{{tier="device",worker="{A}"}}'] == 100
    assert v[f'strata:kv_blocks_used{{tier="host",worker="{A}"}}'] == 7
    assert v[f'strata:kv_blocks_capacity{{tier="host",worker="{A}"}}'] == 50
    assert f'strata:kv_blocks_capacity{{tier="host",worker="{B}"}}' not in v
    assert f'strata:kv_blocks_capacity{{tier="disk",worker="{A}"}}' not in v


def test_totals_since_start_are_counters_and_no_created_series() -> None:
    metrics = GatewayMetrics()
    metrics.set_engine({A: _stats(num_preemptions=1)})
    record = UsageRecord(
        request_id="r1",
        tenant_id="t1",
        key_id="k1",
        model="m",
        prompt_tokens=3,
        completion_tokens=2,
        status="stop",
        e2e_ms=5.0,
    )
    metrics.finished(record, first_token_at=None, started=0.0)
    metrics.rejected("t1", "rpm")
    types = _types(metrics)
    for name in (
        "strata:num_preemptions",
        "strata:kv_cache_hit_blocks",
        "strata:kv_disk_write_errors",
        "strata:spec_decode_num_draft_tokens",
        "strata:request_success",
        "strata:request_rejected",
    ):
        assert types[name] == "counter", name
    assert types["strata:num_requests_running"] == "gauge"
    assert types["strata:e2e_request_latency_seconds"] == "histogram"
    text = metrics.render().decode()
    assert "strata:request_success_total{" in text
    assert "strata:e2e_request_latency_seconds_count{" in text
    assert "_created" not in text


def test_per_tenant_blocks_add_up_over_workers_and_drop_out_when_gone() -> None:
    metrics = GatewayMetrics()
    a = _stats(kv_blocks_by_tenant={"t1": {"device": 2, "host": 7}})
    b = _stats(kv_blocks_by_tenant={"t1": {"device": 1}, "t2": {"disk": 4}})
    metrics.set_engine({A: a, B: b})
    v = _values(metrics)
    assert v['strata:kv_blocks{tenant="t1",tier="device"}'] == 3
    assert v['strata:kv_blocks{tenant="t1",tier="host"}'] == 7
    assert v['strata:kv_blocks{tenant="t2",tier="disk"}'] == 4
    metrics.set_engine({B: _stats(kv_blocks_by_tenant={"t2": {"host": 1}})})
    v = _values(metrics)
    assert 'strata:kv_blocks{tenant="t1",tier="device"}' not in v
    assert f'strata:num_requests_running{{worker="{A}"}}' not in v  # A did not answer
    assert v['strata:kv_blocks{tenant="t2",tier="host"}'] == 1


def test_kv_residency_is_a_counter_per_worker_tenant_and_tier() -> None:
    metrics = GatewayMetrics()
    a = _stats(kv_byte_seconds_by_tenant={"t1": {"device": 2.5e9, "host": 1e9}})
    b = _stats(kv_byte_seconds_by_tenant={"t1": {"disk": 4e6}})
    metrics.set_engine({A: a, B: b})
    v = _values(metrics)
    name = "strata:kv_residency_byte_seconds_total"
    assert v[f'{name}{{tenant="t1",tier="device",worker="{A}"}}'] == 2.5e9
    assert v[f'{name}{{tenant="t1",tier="host",worker="{A}"}}'] == 1e9
    assert v[f'{name}{{tenant="t1",tier="disk",worker="{B}"}}'] == 4e6
    assert _types(metrics)["strata:kv_residency_byte_seconds"] == "counter"


def test_tenant_info_names_each_tenant_until_the_next_refresh() -> None:
    metrics = GatewayMetrics()
    assert metrics.tenant_names_due(now=0.0)
    metrics.set_tenant_names({"t_1": "Acme", "t_2": 'Quote "Co"'}, now=100.0)
    assert not metrics.tenant_names_due(now=110.0)
    assert metrics.tenant_names_due(now=130.0)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    info = families["strata:tenant_info"]
    assert info.type == "gauge"
    assert {(s.labels["tenant"], s.labels["name"], s.value) for s in info.samples} == {
        ("t_1", "Acme", 1.0),
        ("t_2", 'Quote "Co"', 1.0),
    }
    metrics.set_tenant_names({"t_2": "Renamed"}, now=130.0)  # t_1 was deleted
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert [s.labels for s in families["strata:tenant_info"].samples] == [
        {"tenant": "t_2", "name": "Renamed"}
    ]


def test_a_process_counts_its_responses_and_its_start_under_its_index() -> None:
    metrics = GatewayMetrics(process_index=3)
    metrics.responded()
    metrics.responded()
    values = _values(metrics)
    assert values['strata:gateway_responses_total{process="3"}'] == 2
    assert values['strata:gateway_process_starts_total{process="3"}'] == 1


def test_metrics_shared_between_processes_need_their_mode_chosen_before_import(tmp_path) -> None:
    """Without PROMETHEUS_MULTIPROC_DIR at import, values live in this process only: a
    scrape would read one process's share as if it were the replica's."""
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        GatewayMetrics(shared_dir=str(tmp_path))


def test_the_fleet_view_by_model_and_state_and_the_registry_only_where_there_is_one() -> None:
    from gateway.metrics import FleetView

    metrics = GatewayMetrics(process_index=1)
    assert not any(name.startswith("strata:fleet") for name in _values(metrics))  # no view yet
    view = FleetView(
        registry_up=False,
        workers={("m", "serving"): 2, ("m", "drained"): 1},
        dropped={"invalid_record": 3, "unknown_worker": 0},
    )
    metrics.set_fleet(view)
    values = _values(metrics)
    assert values['strata:fleet_registry_up{process="1"}'] == 0
    assert values['strata:fleet_workers{model="m",process="1",state="serving"}'] == 2
    assert values['strata:fleet_workers{model="m",process="1",state="drained"}'] == 1
    assert values['strata:fleet_dropped_messages_total{process="1",reason="invalid_record"}'] == 3
    assert _types(metrics)["strata:fleet_dropped_messages"] == "counter"
    metrics.set_fleet(FleetView(registry_up=None, workers={}, dropped={}))
    assert not any(name.startswith("strata:fleet_registry_up") for name in _values(metrics))
