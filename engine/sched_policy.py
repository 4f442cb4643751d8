"""Scheduling policies (`fcfs`, `priority`, `fair`): the order waiting requests are admitted
in and running ones are preempted in. `fair` shares the engine between tenants by weighted
virtual time. The design is in docs/design/scheduler.md.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Iterator

from engine.config import SchedulingPolicy
from engine.request import Request


class RequestQueue(ABC):
    """Waiting requests in admission order."""

    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def readd_preempted(self, request: Request) -> None:
        """Put back a request the scheduler preempted; it should not lose its place."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def readd_preempted(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


def _priority_key(request: Request) -> tuple[int, float, str]:
    # lower value = more urgent; ties broken by arrival
    return (request.priority, request.arrival_time, request.request_id)


class PriorityQueue(RequestQueue):
    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, str], Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (_priority_key(request), request))

    def readd_preempted(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[1] for e in sorted(self._heap, key=lambda e: e[0]))


class Policy(ABC):
    """A waiting queue plus the rank that orders running requests and picks victims.

    Subclasses define `new_queue` and `pick_victim`; the hooks default to doing nothing.
    """

    @abstractmethod
    def new_queue(self) -> RequestQueue: ...

    @abstractmethod
    def pick_victim(self, running: list[Request]) -> Request:
        """The running request to preempt first."""

    def order_running(self, running: list[Request]) -> None:  # noqa: B027 (optional hook)
        """Sort `running` in place so the most deserving requests get the token budget."""

    def on_arrival(self, request: Request) -> None:  # noqa: B027 (optional hook)
        """A request entered the engine (called before it joins the waiting queue)."""

    def on_finish(self, request: Request) -> None:  # noqa: B027 (optional hook)
        """A request left the engine for good."""

    def charge(self, request: Request, num_tokens: int) -> None:  # noqa: B027 (optional hook)
        """The engine computed `num_tokens` tokens for `request` this step."""


class FCFSPolicy(Policy):
    def new_queue(self) -> RequestQueue:
        return FCFSQueue()

    def pick_victim(self, running: list[Request]) -> Request:
        return running[-1]  # running is in admission order: the newest


class PriorityPolicy(Policy):
    def new_queue(self) -> RequestQueue:
        return PriorityQueue()

    def pick_victim(self, running: list[Request]) -> Request:
        return max(running, key=_priority_key)

    def order_running(self, running: list[Request]) -> None:
        running.sort(key=_priority_key)


class FairSharePolicy(Policy):
    """Priority classes, then weighted fair share between tenants (see the module doc)."""

    def __init__(self) -> None:
        self._vtime: dict[str, float] = {}
        self._active: Counter[str] = Counter()  # requests in the engine per tenant

    def rank(self, request: Request) -> tuple[int, float, float, str]:
        return (
            request.priority,
            self._vtime.get(request.tenant, 0.0),
            request.arrival_time,
            request.request_id,
        )

    def virtual_time(self, tenant: str) -> float:
        return self._vtime.get(tenant, 0.0)

    def new_queue(self) -> RequestQueue:
        return FairQueue(self)

    def pick_victim(self, running: list[Request]) -> Request:
        return max(running, key=self.rank)

    def order_running(self, running: list[Request]) -> None:
        running.sort(key=self.rank)

    def on_arrival(self, request: Request) -> None:
        tenant = request.tenant
        if not self._active[tenant]:
            if not self._active:
                self._vtime.clear()  # the engine went idle: everyone starts level again
            floor = min(
                (self._vtime.get(t, 0.0) for t, n in self._active.items() if n),
                default=0.0,
            )
            self._vtime[tenant] = max(self._vtime.get(tenant, 0.0), floor)
        self._active[tenant] += 1

    def on_finish(self, request: Request) -> None:
        self._active[request.tenant] -= 1
        if self._active[request.tenant] <= 0:
            del self._active[request.tenant]

    def charge(self, request: Request, num_tokens: int) -> None:
        vtime = self._vtime.get(request.tenant, 0.0)
        self._vtime[request.tenant] = vtime + num_tokens / request.weight


class FairQueue(RequestQueue):
    """FCFS per tenant; across tenants the head with the best fair-share rank goes first."""

    def __init__(self, policy: FairSharePolicy) -> None:
        self._policy = policy
        self._by_tenant: dict[str, deque[Request]] = {}
        self._len = 0

    def add(self, request: Request) -> None:
        self._by_tenant.setdefault(request.tenant, deque()).append(request)
        self._len += 1

    def readd_preempted(self, request: Request) -> None:
        self._by_tenant.setdefault(request.tenant, deque()).appendleft(request)
        self._len += 1

    def peek(self) -> Request:
        return min((q[0] for q in self._by_tenant.values()), key=self._policy.rank)

    def pop(self) -> Request:
        request = self.peek()
        self.remove(request)
        return request

    def remove(self, request: Request) -> None:
        queue = self._by_tenant[request.tenant]
        queue.remove(request)
        self._len -= 1
        if not queue:
            del self._by_tenant[request.tenant]

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted((r for q in self._by_tenant.values() for r in q), key=self._policy.rank))


def create_policy(kind: SchedulingPolicy) -> Policy:
    if kind is SchedulingPolicy.FAIR:
        return FairSharePolicy()
    if kind is SchedulingPolicy.PRIORITY:
        return PriorityPolicy()
    return FCFSPolicy()
