"""The allocation rules (docs/explanation/allocation.md), as pure functions.

Let M be the limiter's ``max_concurrent``, r_w a workload's reservation, c_w its ceiling and a_w
its active slots. The shared capacity is S = M - sum(r_w). Workload w has room iff
``a_w < c_w and (a_w < r_w or sum_v max(0, a_v - r_v) < S)``.

A slot counts against its workload's reservation first and against the shared capacity only
beyond it, so a reserved slot is never lent: other workloads can only ever take from S.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, TypeVar

import attrs

from .rates import Bank, BucketRule, Cost

__all__ = (
    "Rules",
    "WorkloadRule",
    "allocate",
    "has_room",
    "occupied",
    "shared_in_use",
    "slots_tried",
)

E = TypeVar("E")


@attrs.frozen(kw_only=True)
class WorkloadRule:
    """The part of a workload's settings that allocation needs."""

    ceiling: int
    reserved: int
    priority: int
    max_queued: int | None = None  # waiting requests of this workload; None: unbounded


@attrs.frozen(kw_only=True)
class Rules:
    """Validated limits: the input of every allocation decision."""

    max_concurrent: int
    workloads: Mapping[str, WorkloadRule]
    # Rate limits, by bucket key (see slotwise._core.rates.bucket_key); none by default.
    buckets: Mapping[str, BucketRule] = attrs.field(factory=dict)
    shared: int = attrs.field(init=False)

    @shared.default
    def _shared(self) -> int:
        return self.max_concurrent - sum(w.reserved for w in self.workloads.values())


def shared_in_use(rules: Rules, active: Mapping[str, int]) -> int:
    """How much of the shared capacity S the active slots occupy."""
    return sum(
        max(0, active.get(name, 0) - rule.reserved) for name, rule in rules.workloads.items()
    )


def occupied(rules: Rules, active: Mapping[str, int]) -> int:
    """The slots taken or set aside: those held, and the reservations not in use, which no
    other workload can take (a reserved slot is never lent)."""
    unused = sum(
        max(0, rule.reserved - active.get(name, 0)) for name, rule in rules.workloads.items()
    )
    return sum(active.values()) + unused


def slots_tried(rules: Rules, active: Mapping[str, int]) -> int:
    """What a grant tries of the provider, for an adaptive limit: the slots occupied once it
    was granted (`occupied`), at most the limit in force. A reserved slot may be granted while
    leases from before a decrease still fill the limit; its success proves only the limit."""
    return min(occupied(rules, active), rules.max_concurrent)


def has_room(
    rules: Rules, active: Mapping[str, int], workload: str, shared_used: int | None = None
) -> bool:
    """Whether one more slot of ``workload`` may be granted now.

    ``shared_used`` is ``shared_in_use(rules, active)`` when the caller keeps it up to date.
    """
    rule = rules.workloads[workload]
    held = active.get(workload, 0)
    if held >= rule.ceiling:
        return False
    if held < rule.reserved:
        return True
    if shared_used is None:
        shared_used = shared_in_use(rules, active)
    return shared_used < rules.shared


_EMPTY: Any = object()


def allocate(
    rules: Rules,
    active: Mapping[str, int],
    queues: Mapping[str, Collection[E]],
    order: Callable[[E], Any],
    *,
    bank: Bank | None = None,
    cost: Callable[[E], Cost] | None = None,
    blocked: Callable[[E, list[str], float], object] | None = None,
    shared_used: int | None = None,
) -> list[E]:
    """Return the queued requests to grant now, in grant order.

    Args:
        rules: The limits.
        active: Active (valid) slots per workload. Not modified.
        queues: Each workload's waiting requests in arrival order, each a collection that
            can be iterated more than once. Only the heads that are granted are read, so a
            long queue costs nothing.
        order: The waiting-time key of a request: a smaller key has waited longer. Among
            workloads of equal priority the head with the smallest key goes first.
        bank: The rate buckets, refilled to now; the costs of the granted requests are taken
            from it. None (or empty): no rate limits.
        cost: A request's cost in each kind of bucket (needed with a bank).
        blocked: Called for each head that has a slot but must wait for buckets, with the
            keys of those buckets and the seconds until the decision about it can change:
            until its buckets hold its cost, or sooner until a limiter bucket it claims
            does (the claim lifts then); ``inf`` when it waits behind an earlier claim.
        shared_used: ``shared_in_use(rules, active)``, when the caller keeps it up to date.

    Repeatedly, among the workloads that have room and waiters, the one with the highest
    priority is served (a tie goes to the head that has waited longest), until no workload
    with waiters has room. The result satisfies "no waiter while its workload has room".

    With rate limits, a head with room whose buckets lack its cost waits, and so does its
    whole workload (arrival order); the limiter's buckets it lacks are claimed for it, so no
    request after it in that order (of a lower priority, or later at the same priority)
    takes from them while they lack its cost. A workload's own buckets serve that workload
    only.
    """
    if shared_used is None:
        shared_used = shared_in_use(rules, active)
    rated = bank is not None and bool(bank)
    if len(queues) == 1 and not rated:
        # One workload waiting and no rates: its heads in order while it has room (the
        # hand-off of most limiters), without choosing among workloads.
        ((name, queue),) = queues.items()
        rule = rules.workloads[name]
        held = active.get(name, 0)
        lone: list[E] = []
        for head in queue:
            if held >= rule.ceiling or (held >= rule.reserved and shared_used >= rules.shared):
                break  # has_room(), inlined
            lone.append(head)
            if held >= rule.reserved:
                shared_used += 1
            held += 1
        return lone
    # Without reservations a full shared capacity leaves no workload any room.
    unreserved = rules.shared == rules.max_concurrent
    if unreserved and shared_used >= rules.shared:
        return []
    workloads = rules.workloads
    if unreserved and not rated and shared_used == rules.shared - 1:
        # One slot left and no reservations (a slot released under a full limiter).
        return _best_head(workloads, queues, active, order)
    counts = dict(active)
    heads: dict[str, E] = {}
    keys: dict[str, Any] = {}  # each head's order(), asked once
    for name, queue in queues.items():
        for head in queue:
            heads[name] = head
            keys[name] = order(head)
            break
    cursors: dict[str, Iterator[E]] = {}  # past the heads granted, made when first needed
    claimed: set[str] = set()
    grants: list[E] = []
    while heads:
        # has_room(), inlined: this scan runs for every grant among several workloads.
        full = shared_used >= rules.shared
        best: str | None = None
        best_priority = 0
        best_key: Any = None
        for name in heads:
            rule = workloads[name]
            held = counts.get(name, 0)
            if held >= rule.ceiling or (full and held >= rule.reserved):
                continue
            priority = rule.priority
            if (
                best is None
                or priority > best_priority
                or (priority == best_priority and keys[name] < best_key)
            ):
                best, best_priority, best_key = name, priority, keys[name]
        if best is None:
            break
        if rated:
            assert bank is not None
            assert cost is not None
            price = cost(heads[best])
            needs = list(bank.applying(best, price))
            short = [key for key, bucket, units in needs if not bucket.holds(units)]
            behind = [key for key, _, _ in needs if key in claimed]
            if short or behind:
                claims = [key for key in short if key in price]  # the limiter's own
                claimed.update(claims)
                if blocked is not None:
                    waits = {k: b.wait(u) for k, b, u in needs if k in short}
                    wait = min([max(waits.values(), default=math.inf), *(waits[k] for k in claims)])
                    blocked(heads[best], short + behind, wait)
                del heads[best]  # the rest of its workload waits behind it
                continue
            bank.take(best, price)
        grants.append(heads[best])
        held = counts.get(best, 0)
        if held >= rules.workloads[best].reserved:
            shared_used += 1
        counts[best] = held + 1
        if unreserved and shared_used >= rules.shared:
            break
        cursor = cursors.get(best)
        if cursor is None:
            cursor = cursors[best] = iter(queues[best])
            next(cursor)  # the head just granted
        following = next(cursor, _EMPTY)
        if following is _EMPTY:
            del heads[best]
        else:
            heads[best] = following
            keys[best] = order(following)
    return grants


def _best_head(
    workloads: Mapping[str, WorkloadRule],
    queues: Mapping[str, Collection[E]],
    active: Mapping[str, int],
    order: Callable[[E], Any],
) -> list[E]:
    """The one grant of allocate() when one slot is left and nothing is reserved: the head
    with room of the highest priority, then first in order(), found in one pass."""
    best: list[E] = []
    best_priority = 0
    best_key: Any = None
    for name, queue in queues.items():
        for head in queue:
            rule = workloads[name]
            if active.get(name, 0) < rule.ceiling:
                key = order(head)
                if (
                    not best
                    or rule.priority > best_priority
                    or (rule.priority == best_priority and key < best_key)
                ):
                    best, best_priority, best_key = [head], rule.priority, key
            break
    return best
