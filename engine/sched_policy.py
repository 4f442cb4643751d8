"""Scheduling policies: the order waiting requests are admitted and running ones preempted.

A policy is a `RequestQueue` for the waiting side plus a rule for ranking running requests.
New policies (tenant fair share) plug in through `create_policy`.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
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


class Policy:
    """A waiting queue plus the rule that picks which running request to preempt."""

    def __init__(self, kind: SchedulingPolicy) -> None:
        self.kind = kind

    def new_queue(self) -> RequestQueue:
        return PriorityQueue() if self.kind is SchedulingPolicy.PRIORITY else FCFSQueue()

    def pick_victim(self, running: list[Request]) -> Request:
        """The running request to preempt first: the newest (fcfs) or least urgent."""
        if self.kind is SchedulingPolicy.PRIORITY:
            return max(running, key=_priority_key)
        return running[-1]

    def order_running(self, running: list[Request]) -> None:
        """Sort `running` in place so the most deserving requests get the token budget."""
        if self.kind is SchedulingPolicy.PRIORITY:
            running.sort(key=_priority_key)


def create_policy(kind: SchedulingPolicy) -> Policy:
    return Policy(kind)
