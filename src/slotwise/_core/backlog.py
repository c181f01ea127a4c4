"""A backlog: requests waiting by workload and the slots they hold, granted as `allocate`
grants, with what a grant needs kept up to date between grants.

A tool batch (slotwise.tools) keeps its calls not started yet in one: each call end frees a
slot and asks for the next call, and a pass of `allocate` over every pool for each of
those is most of the batch's own cost.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from typing import final

from .rules import Rules, allocate

__all__ = ("Backlog",)


@final
class Backlog:
    """Waiting requests by workload, and the active slots granted from them, under fixed
    rules.

    A request is an int that is also its order key: a smaller one has waited longer, and
    each workload's requests are kept in that order. `grant()` grants (and counts) what
    `allocate(rules, active, queues, int, shared_used=shared_used)` returns for the state
    before it. Without reservations, the heads that may have room are kept in a heap as
    they change, so that a grant takes a few heap operations instead of a pass over every
    workload; with reservations, `grant()` asks `allocate` itself.

    Args:
        rules: The limits; a workload named in any call must be one of its workloads.
    """

    __slots__ = (
        "_heap",
        "_of",
        "_offered",
        "_unreserved",
        "active",
        "queues",
        "rules",
        "shared_used",
    )

    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self.queues: dict[str, deque[int]] = {}  # only workloads with waiting requests
        self.active: dict[str, int] = {}
        self.shared_used = 0  # shared_in_use(rules, active), kept up to date
        self._unreserved = rules.shared == rules.max_concurrent
        # Without reservations: (-priority, request, workload) for each head of a workload
        # with room, and `_offered` names them (request by workload), so that an entry it does
        # not name (its request granted or removed, its workload full) is dropped unread when
        # it comes to the top.
        self._heap: list[tuple[int, int, str]] = []
        self._offered: dict[str, int] = {}
        self._of: dict[int, str] = {}  # each request's workload (for `allocate`'s grants)

    def __bool__(self) -> bool:
        """Whether any request waits."""
        return bool(self.queues)

    def __contains__(self, workload: object) -> bool:
        """Whether a request of ``workload`` waits."""
        return workload in self.queues

    def add(self, workload: str, request: int) -> None:
        """Queue ``request`` (not queued yet) in its place in ``workload``'s order."""
        self._of[request] = workload
        queue = self.queues.get(workload)
        if queue is None:
            self.queues[workload] = deque((request,))
        elif queue[-1] < request:
            queue.append(request)
            return  # not the head: the head is unchanged
        else:
            bisect.insort(queue, request)
            if queue[0] != request:
                return
        self._offer(workload)

    def remove(self, workload: str, request: int) -> None:
        """Take ``request`` out of ``workload``'s queue, ungranted."""
        queue = self.queues[workload]
        head = queue[0] == request
        queue.remove(request)
        if not queue:
            del self.queues[workload]
        if head:
            self._offer(workload)

    def clear(self, workload: str) -> deque[int]:
        """Take every request of ``workload`` out, ungranted, and return them in order."""
        self._offered.pop(workload, None)
        return self.queues.pop(workload, deque())

    def take(self, workload: str) -> int:
        """Grant the head of ``workload``'s queue, whatever the rules say, and count it."""
        queue = self.queues[workload]
        request = queue.popleft()
        held = self.active.get(workload, 0)
        if held >= self.rules.workloads[workload].reserved:
            self.shared_used += 1
        self.active[workload] = held + 1
        if not queue:
            del self.queues[workload]
        self._offer(workload)
        return request

    def end(self, workload: str) -> None:
        """A slot of ``workload`` granted here was released: uncount it."""
        held = self.active[workload] - 1
        self.active[workload] = held
        rule = self.rules.workloads[workload]
        if held >= rule.reserved:
            self.shared_used -= 1
        if held + 1 == rule.ceiling:  # it was full: its head may have room now
            self._offer(workload)

    def grant(self) -> list[int]:
        """Grant and count the requests that `allocate` grants now, in grant order."""
        if not self.queues:
            return []
        if not self._unreserved:
            granted = allocate(
                self.rules, self.active, self.queues, int, shared_used=self.shared_used
            )
            for request in granted:
                self.take(self._of[request])  # heads, in their queues' order
            return granted
        heap = self._heap
        offered = self._offered
        shared = self.rules.shared
        granted = []
        while heap and self.shared_used < shared:
            _, request, workload = heapq.heappop(heap)
            if offered.get(workload) == request:  # else stale
                granted.append(self.take(workload))
        return granted

    def _offer(self, workload: str) -> None:
        """Keep the heap up to date with ``workload``: its head is offered iff it has one and
        room (without reservations)."""
        queue = self.queues.get(workload)
        rule = self.rules.workloads[workload]
        if queue and self._unreserved and self.active.get(workload, 0) < rule.ceiling:
            if self._offered.get(workload) != queue[0]:
                self._offered[workload] = queue[0]
                heapq.heappush(self._heap, (-rule.priority, queue[0], workload))
        else:
            self._offered.pop(workload, None)
