"""The console's pure parts: its signed session cookie, where sign-in may lead, pagination,
usage buckets and form reading."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest

from engine.protocol import EngineStats
from gateway.admin_access import AdminPrincipal
from gateway.metrics import GatewayMetrics
from gateway.ui.forms import FormError
from gateway.ui.overview import kv_tiers, read_figures
from gateway.ui.render import ago, paginate
from gateway.ui.session import decode_session, encode_session, new_session, session_key
from gateway.ui.signin import next_path
from gateway.ui.tenants import policy_from_form
from gateway.ui.usage import usage_series
from tenants.admin_tokens import Role
from tenants.records import UsageRecord

KEY = session_key("the-admin-token-0123")


def test_a_session_round_trips_through_its_cookie() -> None:
    session = new_session(signed_in=True, now=1000.0)
    assert decode_session(encode_session(session, KEY), KEY, now=1001.0) == session


def test_a_session_carries_who_signed_in_and_their_role() -> None:
    principal = AdminPrincipal("adm_0123456789abcdef", Role.VIEWER)
    session = new_session(signed_in=True, now=1000.0, principal=principal, name="ops")
    decoded = decode_session(encode_session(session, KEY), KEY, now=1001.0)
    assert decoded is not None
    assert (decoded.actor, decoded.name, decoded.role) == (principal.actor, "ops", Role.VIEWER)
    anonymous = new_session(signed_in=False, now=1000.0)
    assert (anonymous.actor, anonymous.role) == (None, None)


def test_a_tampered_session_is_refused() -> None:
    value = encode_session(new_session(signed_in=False, now=1000.0), KEY)
    forged = encode_session(new_session(signed_in=True, now=1000.0), KEY)
    spliced = value.split(".")[0][:-2] + "xx." + value.split(".")[1]
    assert decode_session(spliced, KEY, now=1001.0) is None
    mixed = forged.split(".")[0] + "." + value.split(".")[1]
    assert decode_session(mixed, KEY, now=1001.0) is None
    assert decode_session("not a cookie", KEY, now=1001.0) is None
    assert decode_session("", KEY, now=1001.0) is None


def test_a_new_admin_token_signs_everyone_out() -> None:
    value = encode_session(new_session(signed_in=True, now=1000.0), KEY)
    assert decode_session(value, session_key("another-admin-token-99"), now=1001.0) is None


def test_an_expired_session_is_refused() -> None:
    session = new_session(signed_in=True, now=1000.0)
    value = encode_session(session, KEY)
    assert decode_session(value, KEY, now=session.expires_at) is None


@pytest.mark.parametrize(
    ("asked", "goes_to"),
    [
        ("/ui/tenants", "/ui/tenants"),
        ("/ui/usage?tenant=a", "/ui/usage?tenant=a"),
        ("https://evil.example/", "/ui"),
        ("//evil.example/ui", "/ui"),
        ("/ui//evil.example", "/ui"),
        ("/ui/signin", "/ui"),
        ("/admin/tenants", "/ui"),
        (None, "/ui"),
    ],
)
def test_sign_in_leads_only_to_console_pages(asked: str | None, goes_to: str) -> None:
    assert next_path(asked) == goes_to


def test_pages_cover_every_item_once() -> None:
    items = list(range(45))
    pages = [paginate(items, n, per_page=20) for n in (1, 2, 3)]
    assert [list(p.items) for p in pages] == [items[:20], items[20:40], items[40:]]
    assert (pages[2].first, pages[2].last, pages[2].num_pages) == (41, 45, 3)
    assert list(paginate(items, 99, per_page=20).items) == items[40:]  # clamped to the last
    assert list(paginate(items, 0, per_page=20).items) == items[:20]
    empty = paginate([], 1)
    assert (empty.total, empty.first, empty.num_pages) == (0, 0, 1)


def test_dates_read_as_people_say_them() -> None:
    assert ago(1000.0, now=1010.0) == "just now"
    assert ago(1000.0, now=1000.0 + 180) == "3 minutes ago"
    assert ago(1000.0, now=1000.0 + 86400 * 2) == "2 days ago"
    assert ago(1000.0 + 3600, now=1000.0) == "in 1 hour"
    assert ago(None) == "—"


async def _records(*finished: tuple[float, int, int]) -> AsyncIterator[UsageRecord]:
    for i, (at, prompt, completion) in enumerate(finished):
        yield UsageRecord(
            request_id=f"r{i}",
            tenant_id="t",
            key_id="k",
            model="m",
            prompt_tokens=prompt,
            completion_tokens=completion,
            finished_at=at,
        )


async def test_usage_falls_into_its_buckets() -> None:
    records = _records((3600.0, 10, 1), (7199.0, 5, 2), (7200.0, 7, 3), (99999.0, 1, 1))
    series = await usage_series(records, 3600, 3600, 3)
    assert series.starts == [3600, 7200, 10800]
    assert series.requests == [2, 1, 0]
    assert series.prompt_tokens == [15, 7, 0]
    assert series.completion_tokens == [3, 3, 0]
    assert (series.num_requests, series.num_tokens) == (3, 28)


def test_policy_form_reads_blanks_as_unlimited() -> None:
    policy = policy_from_form({"rpm": "600", "tpm": "", "allowed_models": "a, b", "weight": "2"})
    assert (policy.rpm, policy.tpm, policy.allowed_models, policy.weight) == (
        600,
        None,
        ["a", "b"],
        2.0,
    )


@pytest.mark.parametrize(
    ("form", "field"),
    [
        ({"rpm": "0"}, "rpm"),
        ({"tpm": "lots"}, "tpm"),
        ({"weight": "0"}, "weight"),
        ({"priority": "5000"}, "priority"),
        ({"on_store_unavailable": "maybe"}, "on_store_unavailable"),
        ({"allowed_models": "bad name"}, "allowed_models"),
    ],
)
def test_a_refused_policy_value_names_its_field(form: dict[str, str], field: str) -> None:
    with pytest.raises(FormError) as refused:
        policy_from_form(form)
    assert refused.value.field == field


def _stats(**fields: int) -> EngineStats:
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


def test_overview_reads_what_the_metrics_counted() -> None:
    metrics = GatewayMetrics()
    for status, e2e_ms in (("stop", 100.0), ("length", 300.0), ("error", 2000.0)):
        rec = UsageRecord(
            request_id=status,
            tenant_id="t",
            key_id="k",
            model="m",
            prompt_tokens=10,
            completion_tokens=4,
            status=status,  # type: ignore[arg-type]
            e2e_ms=e2e_ms,
        )
        metrics.finished(rec, None, 0.0)
    metrics.rejected("t", "rpm")
    figures = read_figures(metrics)
    assert (figures.num_requests, figures.num_errors, figures.num_rejected) == (3, 1, 1)
    assert (figures.prompt_tokens, figures.generation_tokens) == (30, 12)
    assert figures.by_status == {"error": 1, "length": 1, "stop": 1}
    assert figures.e2e.mean_s == pytest.approx(0.8)
    assert figures.e2e.p95_s == 2.5  # the bucket holding the slowest
    assert figures.ttft.num_observed == 0


def test_kv_tiers_sum_the_workers_and_skip_absent_tiers() -> None:
    stats = {
        "a": _stats(num_kv_blocks_used=10, num_kv_host_blocks_total=50, num_kv_host_blocks_used=5),
        "b": _stats(num_kv_blocks_used=30),
    }
    tiers = {t.tier: (t.used, t.total) for t in kv_tiers(stats)}
    assert tiers == {"device": (40, 200), "host": (5, 50)}
