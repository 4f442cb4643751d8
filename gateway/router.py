"""Which worker of a model serves a request: the routing policies (pure functions over a
snapshot of the candidates).

`kv_aware` (the default) weighs the prefill a worker's cached prefix saves, by the tier each
block is in (a block in the fleet's remote tier saves some prefill on every worker), against
the work already waiting there, in tokens of prefill: a request goes where its prompt costs
least, its own prefill counted twice since it also delays whatever queues behind it, so a
worker far busier than the others loses even with the document cached (llm-d's precise
prefix scorer and Dynamo's KV router weigh the same two).
`least_loaded` takes the worker with the fewest requests; `round_robin` takes turns.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.kv_index import PrefixHit

# of one block's prefill, what a hit in each tier saves (a copy up costs the rest)
TIER_SAVING = {"device": 1.0, "host": 0.8, "disk": 0.5, "remote": 0.4}
# what other work on a worker costs a new request, in tokens of prefill
WAITING_TOKENS = 256  # a request queued there by another gateway (its prompt unknown here)
RUNNING_TOKENS = 16  # a request decoding there: its share of each step
KV_FULL = 0.9  # past this KV usage a worker is penalized (it would preempt or queue)
# the request's own prefill counts this many times over the work ahead of it: the work ahead
# delays only this request, its prefill delays it and the requests that queue behind it
# there (about one under load); so a document stays on the worker that holds it while that
# worker finishes another prompt, instead of being prefilled again on an idle one
PREFILL_WEIGHT = 2.0


class RoutingPolicy(enum.Enum):
    KV_AWARE = "kv_aware"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True)
class Candidate:
    """A worker able to serve the request, with what this gateway knows of its load."""

    worker_id: str
    num_in_flight: int = 0  # requests this gateway has there
    # prefill of those still waiting for their first output: their prompt tokens less the
    # cached prefix each was routed to
    queued_tokens: int = 0
    num_running: int = 0  # from its heartbeat (every gateway's requests)
    num_waiting: int = 0
    kv_usage: float = 0.0  # blocks used / total, from its heartbeat
    hit: PrefixHit = field(default_factory=PrefixHit)


def saved_tokens(hit: PrefixHit, block_size: int) -> float:
    """Prefill tokens a cached prefix saves, each block weighed by its tier."""
    return block_size * (
        hit.device * TIER_SAVING["device"]
        + hit.host * TIER_SAVING["host"]
        + hit.disk * TIER_SAVING["disk"]
        + hit.remote * TIER_SAVING["remote"]
    )


def prefill_tokens(c: Candidate, prompt_tokens: int, block_size: int) -> float:
    """The request's own prefill on `c`: its prompt less what `c`'s cached prefix saves."""
    return max(prompt_tokens - saved_tokens(c.hit, block_size), 0.0)


def cost(c: Candidate, prompt_tokens: int, block_size: int) -> float:
    """Tokens of prefill-equivalent work of this request on `c`: its own uncached prefill
    (weighed by PREFILL_WEIGHT) plus the work ahead of it there."""
    prefill = PREFILL_WEIGHT * prefill_tokens(c, prompt_tokens, block_size)
    others_waiting = max(c.num_waiting - c.num_in_flight, 0)
    backlog = c.queued_tokens + WAITING_TOKENS * others_waiting + RUNNING_TOKENS * c.num_running
    total = prefill + backlog
    if c.kv_usage > KV_FULL:
        total *= 1.0 + 10.0 * (c.kv_usage - KV_FULL)
    return total


def choose(
    policy: RoutingPolicy,
    candidates: Sequence[Candidate],
    *,
    prompt_tokens: int,
    block_size: int,
    turn: int,
) -> Candidate:
    """The candidate that serves the request. `turn` (a counter the caller advances)
    breaks ties and drives round robin, so equal workers share the work."""
    assert candidates, "no candidate to choose from"
    n = len(candidates)
    ordered = [candidates[(turn + i) % n] for i in range(n)]  # ties go to the next in turn
    if policy is RoutingPolicy.ROUND_ROBIN:
        return ordered[0]
    if policy is RoutingPolicy.LEAST_LOADED:
        return min(ordered, key=lambda c: c.num_in_flight + c.num_running + c.num_waiting)
    return min(ordered, key=lambda c: (cost(c, prompt_tokens, block_size), c.num_in_flight))
