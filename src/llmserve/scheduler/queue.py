"""Waiting queues: first come first served, or by priority (lower value first,
ties by arrival time, as vLLM's ``--scheduling-policy priority``)."""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator

from llmserve.scheduler.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


class RequestQueue:
    """The waiting queue.

    ``fcfs``: arrival order; :meth:`prepend` puts a preempted request back at
    the head. ``priority``: always sorted by ``(priority, arrival_time)``, so a
    preempted request returns to its place by key.
    """

    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {policy!r}")
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._keys: list[tuple[int, float, int]] = []
        self._sorted: list[Request] = []
        self._counter = itertools.count()

    def _insort(self, req: Request) -> None:
        key = (*req.sort_key(), next(self._counter))
        i = bisect.bisect(self._keys, key)
        self._keys.insert(i, key)
        self._sorted.insert(i, req)

    def add(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.append(req)
        else:
            self._insort(req)

    def prepend(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.appendleft(req)
        else:
            self._insort(req)

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._sorted[0]

    def pop(self) -> Request:
        if self.policy == "fcfs":
            return self._fifo.popleft()
        self._keys.pop(0)
        return self._sorted.pop(0)

    def remove(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.remove(req)
            return
        i = self._sorted.index(req)
        del self._sorted[i]
        del self._keys[i]

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._sorted)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Request]:
        return iter(self._fifo if self.policy == "fcfs" else self._sorted)

    def __getitem__(self, i: int) -> Request:
        return self._fifo[i] if self.policy == "fcfs" else self._sorted[i]
