"""The allocation rules on hand-made cases: ``has_room`` and ``allocate``.

The README's example limiter is used throughout: 8 slots, ``interactive`` reserves 2 with
priority 10, ``background`` has a ceiling of 6.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from slotwise._core.rules import Rules, WorkloadRule, allocate, has_room, shared_in_use

SEED = Rules(
    max_concurrent=8,
    workloads={
        "interactive": WorkloadRule(ceiling=8, reserved=2, priority=10),
        "background": WorkloadRule(ceiling=6, reserved=0, priority=0),
    },
)


def rules(max_concurrent: int, **workloads: tuple[int, int, int]) -> Rules:
    """Rules from ``name=(ceiling, reserved, priority)``."""
    return Rules(
        max_concurrent=max_concurrent,
        workloads={
            name: WorkloadRule(ceiling=ceiling, reserved=reserved, priority=priority)
            for name, (ceiling, reserved, priority) in workloads.items()
        },
    )


def requests(workload: str, *arrivals: int) -> list[tuple[str, int]]:
    """Queued requests of one workload, each ``(workload, arrival)``."""
    return [(workload, arrival) for arrival in arrivals]


def arrival(request: tuple[str, int]) -> int:
    return request[1]


def grant(
    limits: Rules, active: Mapping[str, int], **queues: list[tuple[str, int]]
) -> list[tuple[str, int]]:
    return allocate(limits, active, queues, arrival)


# -- the README's example --------------------------------------------------------------------


def test_shared_capacity_is_what_reservations_leave() -> None:
    assert SEED.shared == 6
    assert rules(5, a=(5, 2, 0), b=(5, 3, 0)).shared == 0


def test_background_never_exceeds_its_ceiling_even_with_no_interactive_waiting() -> None:
    granted = grant(SEED, {}, background=requests("background", *range(10)))
    assert granted == requests("background", *range(6))
    assert not has_room(SEED, {"background": 6}, "background")
    assert not has_room(SEED, {"background": 6, "interactive": 0}, "background")


def test_two_interactive_start_immediately_while_background_holds_six() -> None:
    active = {"background": 6, "interactive": 0}
    assert has_room(SEED, active, "interactive")
    assert has_room(SEED, {"background": 6, "interactive": 1}, "interactive")
    granted = grant(SEED, active, interactive=requests("interactive", 1, 2, 3))
    assert granted == requests("interactive", 1, 2)
    # The 8 slots are all taken: the third interactive request waits.
    assert not has_room(SEED, {"background": 6, "interactive": 2}, "interactive")


def test_interactive_beyond_its_reservation_uses_the_shared_capacity() -> None:
    # With no background work, interactive may take all 8 slots.
    assert grant(SEED, {}, interactive=requests("interactive", *range(10))) == requests(
        "interactive", *range(8)
    )
    # 3 interactive hold 2 reserved + 1 shared: background can only get 5 of the 6 shared.
    active = {"interactive": 3}
    assert shared_in_use(SEED, active) == 1
    assert grant(SEED, active, background=requests("background", *range(10))) == requests(
        "background", *range(5)
    )


def test_unused_reservation_stays_idle() -> None:
    limits = rules(8, reserved=(8, 2, 0), other=(8, 0, 5))
    assert grant(limits, {}, other=requests("other", *range(10))) == requests("other", *range(6))
    assert not has_room(limits, {"other": 6}, "other")
    assert not has_room(limits, {"other": 6, "reserved": 0}, "other")
    # The reserved slots are still there for their own workload.
    assert grant(limits, {"other": 6}, reserved=requests("reserved", 1, 2, 3)) == requests(
        "reserved", 1, 2
    )


def test_a_workload_at_its_ceiling_never_blocks_another() -> None:
    # background arrived first and has waiters, but it is at its ceiling.
    granted = grant(
        SEED,
        {"background": 6},
        background=requests("background", 0, 1, 2),
        interactive=requests("interactive", 3),
    )
    assert granted == requests("interactive", 3)


def test_a_high_priority_workload_at_its_ceiling_never_blocks_a_lower_one() -> None:
    limits = rules(4, high=(1, 0, 10), low=(4, 0, 0))
    granted = grant(
        limits,
        {},
        high=requests("high", 0, 1, 2),
        low=requests("low", 3, 4, 5, 6),
    )
    assert granted == [("high", 0), ("low", 3), ("low", 4), ("low", 5)]


# -- grant order ---------------------------------------------------------------------------


def test_higher_priority_is_served_first_whatever_the_arrival() -> None:
    granted = grant(
        SEED,
        {"background": 5, "interactive": 0},
        background=requests("background", 0, 1),
        interactive=requests("interactive", 5, 6),
    )
    # 3 slots free: interactive first (both), then one background.
    assert granted == [("interactive", 5), ("interactive", 6), ("background", 0)]


def test_a_priority_tie_goes_to_the_request_that_waited_longest() -> None:
    limits = rules(4, a=(4, 0, 1), b=(4, 0, 1))
    granted = grant(limits, {}, a=requests("a", 0, 3, 4), b=requests("b", 1, 2, 5))
    assert granted == [("a", 0), ("b", 1), ("b", 2), ("a", 3)]


def test_within_a_workload_arrival_order() -> None:
    limits = rules(3, only=(3, 0, 0))
    assert grant(limits, {}, only=requests("only", 7, 8, 9, 10)) == requests("only", 7, 8, 9)


def test_nothing_free_grants_nothing() -> None:
    assert grant(SEED, {"interactive": 2, "background": 6}, interactive=requests("x", 1)) == []
    assert grant(SEED, {"interactive": 8}, background=requests("background", 1)) == []


def test_empty_queues_grant_nothing() -> None:
    assert grant(SEED, {}) == []
    assert grant(SEED, {}, interactive=[], background=[]) == []


def test_allocate_leaves_the_active_counts_alone() -> None:
    active = {"background": 2}
    grant(SEED, active, background=requests("background", *range(5)))
    assert active == {"background": 2}


class Endless:
    """A workload's queue without end: iterating it again starts from its head again."""

    def __init__(self, workload: str) -> None:
        self.workload = workload

    def __iter__(self) -> Iterator[tuple[str, int]]:
        n = 0
        while True:
            yield (self.workload, n)
            n += 1

    def __len__(self) -> int:
        return sys.maxsize

    def __contains__(self, item: object) -> bool:
        return isinstance(item, tuple) and item[0] == self.workload


def test_allocate_reads_only_the_heads_it_grants() -> None:
    granted = allocate(SEED, {}, {"background": Endless("background")}, arrival)
    assert granted == [("background", n) for n in range(6)]
    # Among several workloads: interactive first (priority), background in what is left.
    granted = allocate(
        SEED,
        {},
        {"background": Endless("background"), "interactive": Endless("interactive")},
        arrival,
    )
    assert granted == [("interactive", n) for n in range(8)]
    granted = allocate(
        SEED,
        {"interactive": 3},
        {"background": Endless("background"), "interactive": Endless("interactive")},
        arrival,
    )
    assert granted == [("interactive", n) for n in range(5)]


# -- has_room, formula by formula ------------------------------------------------------------


@pytest.mark.parametrize(
    ("active", "workload", "expected"),
    [
        ({}, "interactive", True),
        ({}, "background", True),
        ({"interactive": 2}, "interactive", True),  # beyond its reservation: shared
        ({"interactive": 8}, "interactive", False),  # the limiter is full
        ({"interactive": 2, "background": 6}, "interactive", False),
        ({"interactive": 1, "background": 6}, "interactive", True),  # its reservation
        ({"interactive": 1, "background": 6}, "background", False),  # ceiling
        ({"interactive": 4, "background": 3}, "background", True),  # shared 2 + 3 < 6
        ({"interactive": 4, "background": 4}, "background", False),  # shared 2 + 4 = 6
        ({"interactive": 4, "background": 4}, "interactive", False),
    ],
)
def test_has_room(active: dict[str, int], workload: str, expected: bool) -> None:
    assert has_room(SEED, active, workload) is expected


def test_a_full_reservation_can_be_used_when_the_shared_capacity_is_exhausted() -> None:
    limits = rules(3, a=(3, 1, 0), b=(3, 1, 0))
    assert has_room(limits, {"a": 2, "b": 0}, "b")  # b's reservation
    assert not has_room(limits, {"a": 2, "b": 0}, "a")  # shared (1) is in use by a
    assert grant(limits, {"a": 2}, a=requests("a", 0), b=requests("b", 1, 2)) == [("b", 1)]


def test_every_slot_reserved_means_no_sharing() -> None:
    limits = rules(4, a=(2, 2, 0), b=(2, 2, 0))
    assert limits.shared == 0
    assert grant(limits, {}, a=requests("a", *range(5)), b=requests("b", 9)) == [
        ("a", 0),
        ("a", 1),
        ("b", 9),
    ]


# -- allocate against its definition, on random cases ----------------------------------------


def by_definition(
    limits: Rules, active: Mapping[str, int], queues: Mapping[str, list[tuple[str, int]]]
) -> list[tuple[str, int]]:
    """The module's rule, step by step: while a workload with waiters has room, grant the head
    of the one with the highest priority (a tie: the head that has waited longest)."""
    counts = dict(active)
    waiting = {name: list(queue) for name, queue in queues.items()}
    granted = []
    while True:
        with_room = [n for n, q in waiting.items() if q and has_room(limits, counts, n)]
        if not with_room:
            return granted
        best = max(with_room, key=lambda n: (limits.workloads[n].priority, -waiting[n][0][1]))
        granted.append(waiting[best].pop(0))
        counts[best] = counts.get(best, 0) + 1


@st.composite
def cases(
    draw: st.DrawFn, one_left: bool = False
) -> tuple[Rules, dict[str, int], dict[str, list[tuple[str, int]]]]:
    """Random rules, counts and queues; ``one_left``: no reservations and one slot left (the
    case `allocate` decides in one pass), with ties of priority more often than not."""
    names = ["a", "b", "c", "d"][: draw(st.integers(1, 4))]
    if one_left:
        active = {name: draw(st.integers(0, 3)) for name in names}
        total = sum(active.values()) + 1
    else:
        total = draw(st.integers(1, 8))
    workloads = {}
    for name in names:
        if one_left:
            ceiling = draw(st.integers(max(active[name], 1), total))
            reserved, priority = 0, draw(st.integers(0, 1))
        else:
            ceiling = draw(st.integers(1, total))
            reserved = draw(st.integers(0, ceiling)) if draw(st.booleans()) else 0
            priority = draw(st.integers(0, 2))
        workloads[name] = WorkloadRule(ceiling=ceiling, reserved=reserved, priority=priority)
    assume(sum(rule.reserved for rule in workloads.values()) <= total)
    limits = Rules(max_concurrent=total, workloads=workloads)
    if not one_left:
        active = {name: draw(st.integers(0, rule.ceiling)) for name, rule in workloads.items()}
    assume(shared_in_use(limits, active) <= limits.shared)
    arrivals = draw(st.permutations(range(12)))[: draw(st.integers(0, 12))]
    queues: dict[str, list[tuple[str, int]]] = {}
    for n in arrivals:
        name = draw(st.sampled_from(names))
        queues.setdefault(name, []).append((name, n))
    for queue in queues.values():
        queue.sort(key=arrival)  # each workload's queue in arrival order
    for name in names:  # some workloads with nobody waiting, given as empty queues
        if draw(st.booleans()):
            queues.setdefault(name, [])
    return limits, active, queues


@settings(max_examples=500, deadline=None)
@given(st.one_of(cases(), cases(one_left=True)))
def test_allocate_grants_what_its_definition_grants(
    case: tuple[Rules, dict[str, int], dict[str, list[tuple[str, int]]]],
) -> None:
    limits, active, queues = case
    expected = by_definition(limits, active, queues)
    assert allocate(limits, active, queues, arrival) == expected
    shared = shared_in_use(limits, active)
    assert allocate(limits, active, queues, arrival, shared_used=shared) == expected
