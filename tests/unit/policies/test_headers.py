import pytest

from policies.admission import BucketState, Decision, DenyReason
from policies.headers import format_reset, rate_limit_headers


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (-3.0, "0s"),
        (0.0001, "1ms"),
        (0.02, "20ms"),
        (0.999, "999ms"),
        (0.9991, "1s"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (7.66, "7.66s"),
        (59.9999, "1m0s"),
        (60.0, "1m0s"),
        (360.0, "6m0s"),
        (361.25, "6m1.25s"),
        (3600.0, "1h0m0s"),
        (3723.5, "1h2m3.5s"),
    ],
)
def test_format_reset_matches_openai_style(seconds, text):
    assert format_reset(seconds) == text


REQUESTS = BucketState(limit=60, remaining=59, reset_s=1.0)
TOKENS = BucketState(limit=150_000, remaining=149_000, reset_s=0.4)


def test_allowed_request_reports_both_dimensions_and_no_retry_headers():
    decision = Decision(
        allowed=True, reason=None, retry_after_s=None, hard=False, requests=REQUESTS, tokens=TOKENS
    )
    assert rate_limit_headers(decision) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "150000",
        "x-ratelimit-remaining-tokens": "149000",
        "x-ratelimit-reset-tokens": "400ms",
    }


def test_unlimited_dimensions_are_omitted():
    only_tokens = Decision(
        allowed=True, reason=None, retry_after_s=None, hard=False, requests=None, tokens=TOKENS
    )
    headers = rate_limit_headers(only_tokens)
    assert set(headers) == {
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    }
    unlimited = Decision(
        allowed=True, reason=None, retry_after_s=None, hard=False, requests=None, tokens=None
    )
    assert rate_limit_headers(unlimited) == {}


@pytest.mark.parametrize(("retry_after_s", "header"), [(0.2, "1"), (12.3, "13"), (30.0, "30")])
def test_soft_denial_sends_retry_after_rounded_up(retry_after_s, header):
    decision = Decision(
        allowed=False,
        reason=DenyReason.RPM,
        retry_after_s=retry_after_s,
        hard=False,
        requests=BucketState(limit=60, remaining=0, reset_s=60.0),
        tokens=None,
    )
    headers = rate_limit_headers(decision)
    assert headers["retry-after"] == header
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == "1m0s"
    assert "x-should-retry" not in headers


def test_hard_denial_tells_clients_not_to_retry():
    decision = Decision(
        allowed=False,
        reason=DenyReason.TPM,
        retry_after_s=None,
        hard=True,
        requests=None,
        tokens=BucketState(limit=1000, remaining=1000, reset_s=0.0),
    )
    headers = rate_limit_headers(decision)
    assert headers["x-should-retry"] == "false"
    assert "retry-after" not in headers
    assert headers["x-ratelimit-reset-tokens"] == "0s"


def test_concurrency_denial_has_retry_after_but_no_extra_dimension():
    decision = Decision(
        allowed=False,
        reason=DenyReason.CONCURRENCY,
        retry_after_s=1.0,
        hard=False,
        requests=None,
        tokens=None,
    )
    assert rate_limit_headers(decision) == {"retry-after": "1"}
