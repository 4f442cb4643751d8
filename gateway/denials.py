"""What admission refuses, in words: the 403 for a model outside a key's list, and the
message of each 429 (rate limits, KV budget, and the budgets, with what the request may
cost against what is left)."""

from __future__ import annotations

from gateway.errors import APIError
from gateway.prepare import Job
from policies.admission import Charge, Decision, DenyReason
from tenants.keys import AuthContext
from tenants.records import Policy, nanos_to_usd


def check_key_model(auth: AuthContext, job: Job) -> None:
    """403 unless the key's own limits include the job's model and adapter."""
    adapter = None if job.lora is None else job.lora.name
    check_key_access(auth, job.model, job.base_model, adapter)


def check_key_access(auth: AuthContext, requested: str, model_id: str, adapter: str | None) -> None:
    """403 unless the key's own limits include the model (by the name asked for, or the
    served id) or, for an adapter request, the adapter."""
    limits = auth.key.limits
    if limits is None:
        return
    if adapter is not None:
        if not limits.allows_adapter(adapter):
            raise APIError(
                403,
                f"this API key may not use the adapter '{adapter}'",
                type="permission_error",
                code="model_not_allowed",
                param="model",
            )
    elif not (limits.allows_model(requested) or limits.allows_model(model_id)):
        raise APIError(
            403,
            f"this API key may not use the model '{requested}'",
            type="permission_error",
            code="model_not_allowed",
            param="model",
        )


def _budget_denial(decision: Decision, job: Job | None, charge: Charge | None) -> str:
    is_key = decision.reason is DenyReason.KEY_BUDGET
    hold = None if charge is None else (charge.key_budget if is_key else charge.tenant_budget)
    owner = "this API key's" if is_key else "this tenant's"
    left = nanos_to_usd(decision.budget_left_nanos or 0)
    cost = nanos_to_usd(0 if charge is None else charge.cost_nanos)
    what = ""
    if job is not None:
        what = (
            f" ({job.num_prompt_tokens} prompt tokens + {job.num_choices} x {job.max_tokens} "
            f"max_tokens at the prices of '{job.model}')"
        )
    limit = "" if hold is None else f" of ${nanos_to_usd(hold.limit_nanos)}"
    period = "" if hold is None else f" for {_PERIOD_NAMES.get(hold.label[0], 'its period')}"
    return (
        f"This request may cost up to ${cost}{what}, but {owner} budget{limit}{period} "
        f"has ${left} left; lower max_tokens, or ask for a higher budget."
    )


_PERIOD_NAMES = {"d": "today (UTC)", "m": "this month (UTC)", "l": "its lifetime"}


def denial(
    decision: Decision, job: Job | None, policy: Policy, charge: Charge | None = None
) -> str:
    """Why a request was refused, and what it asked for against the limit when it can
    never fit (so no retry would help)."""
    reason = decision.reason.value if decision.reason is not None else "rate_limit"
    if reason in ("tenant_budget", "key_budget"):
        return _budget_denial(decision, job, charge)
    if decision.hard and job is not None and reason == "tpm" and decision.tokens:
        return (
            f"This request needs {job.num_prompt_tokens + job.num_choices * job.max_tokens} "
            f"tokens ({job.num_prompt_tokens} prompt + {job.num_choices} x {job.max_tokens} "
            f"max_tokens), more than your plan's {decision.tokens.limit} tokens per minute; "
            "it can never be admitted: lower max_tokens or shorten the prompt."
        )
    if decision.hard and job is not None and reason == "kv_budget":
        return (
            f"This request may hold {job.kv_tokens} tokens of KV cache, more than your plan's "
            f"KV-cache budget of {policy.kv_budget_tokens}; it can never be admitted: lower "
            "max_tokens, n or the prompt."
        )
    return _DENIAL[reason]


_DENIAL = {
    "rpm": "Rate limit reached for requests per minute; retry after the indicated time.",
    "tpm": "Rate limit reached for tokens per minute; retry after the indicated time.",
    "concurrency": "Too many concurrent requests for this tenant; retry after the indicated time.",
    "key_rpm": "Rate limit reached for this API key's requests per minute; retry after the "
    "indicated time.",
    "key_tpm": "Rate limit reached for this API key's tokens per minute; retry after the "
    "indicated time.",
    "key_concurrency": "Too many concurrent requests for this API key; retry after the "
    "indicated time.",
    "kv_budget": "This tenant's KV-cache budget is in use by other requests; retry after the "
    "indicated time.",
    "rate_limit": "Rate limit reached.",
}
