"""The Backlog (slotwise._core.backlog) grants what `allocate` grants, whatever was done to it
before: a Hypothesis state machine applies random operations to a Backlog and to a plain model
(sorted lists and counts), and compares every grant with `allocate` on the model's state.
"""

from __future__ import annotations

from collections import deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from slotwise._core.backlog import Backlog
from slotwise._core.rules import Rules, WorkloadRule, allocate, shared_in_use

NAMES = ("a", "b", "c", "d")


@st.composite
def limits(draw: st.DrawFn) -> Rules:
    """Random rules over 1 to 4 workloads: in half the cases no reservations (the heap),
    in the others reservations where they fit (`allocate` itself)."""
    total = draw(st.integers(1, 6))
    reserving = draw(st.booleans())
    workloads = {}
    for name in NAMES[: draw(st.integers(1, len(NAMES)))]:
        ceiling = draw(st.integers(1, total))
        reserved = draw(st.integers(0, ceiling)) if reserving else 0
        workloads[name] = WorkloadRule(
            ceiling=ceiling, reserved=reserved, priority=draw(st.integers(-1, 2))
        )
    while sum(rule.reserved for rule in workloads.values()) > total:
        name = max(workloads, key=lambda n: workloads[n].reserved)
        rule = workloads[name]
        workloads[name] = WorkloadRule(
            ceiling=rule.ceiling, reserved=rule.reserved - 1, priority=rule.priority
        )
    return Rules(max_concurrent=total, workloads=workloads)


class BacklogMachine(RuleBasedStateMachine):
    """The Backlog against the model, after every operation."""

    def __init__(self) -> None:
        super().__init__()
        self.rules = Rules(max_concurrent=1, workloads={})
        self.backlog = Backlog(self.rules)
        self.queues: dict[str, list[int]] = {}
        self.active: dict[str, int] = {}
        self.issued: set[int] = set()

    @initialize(rules=limits())
    def start(self, rules: Rules) -> None:
        self.rules = rules
        self.backlog = Backlog(rules)

    def names(self) -> list[str]:
        return list(self.rules.workloads)

    @rule(data=st.data(), request=st.integers(0, 200))
    def add(self, data: st.DataObject, request: int) -> None:
        if request in self.issued:
            return  # requests are unique
        self.issued.add(request)
        name = data.draw(st.sampled_from(self.names()))
        self.backlog.add(name, request)
        self.queues.setdefault(name, []).append(request)
        self.queues[name].sort()

    @precondition(lambda self: self.queues)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.queues)))
        request = data.draw(st.sampled_from(self.queues[name]))
        self.backlog.remove(name, request)
        self.queues[name].remove(request)
        if not self.queues[name]:
            del self.queues[name]

    @rule(data=st.data())
    def clear(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self.names()))
        assert list(self.backlog.clear(name)) == self.queues.pop(name, [])

    @precondition(lambda self: self.queues)
    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        """A grant outside the rules (the ToolBox's first call when the rules leave the
        batch no room)."""
        name = data.draw(st.sampled_from(sorted(self.queues)))
        assert self.backlog.take(name) == self.queues[name].pop(0)
        if not self.queues[name]:
            del self.queues[name]
        self.active[name] = self.active.get(name, 0) + 1

    @precondition(lambda self: any(self.active.values()))
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, held in self.active.items() if held)))
        self.backlog.end(name)
        self.active[name] -= 1

    @rule()
    def grant(self) -> None:
        expected = allocate(
            self.rules, dict(self.active), {n: list(q) for n, q in self.queues.items()}, int
        )
        assert self.backlog.grant() == expected
        for request in expected:
            name = next(n for n, queue in self.queues.items() if queue[0] == request)
            self.queues[name].pop(0)
            if not self.queues[name]:
                del self.queues[name]
            self.active[name] = self.active.get(name, 0) + 1

    @invariant()
    def same_state(self) -> None:
        backlog = self.backlog
        assert {n: list(q) for n, q in backlog.queues.items()} == self.queues
        assert {n: held for n, held in backlog.active.items() if held} == {
            n: held for n, held in self.active.items() if held
        }
        assert backlog.shared_used == shared_in_use(self.rules, self.active)
        assert bool(backlog) == bool(self.queues)
        assert all((name in backlog) == (name in self.queues) for name in NAMES)


TestBacklog = BacklogMachine.TestCase
TestBacklog.settings = settings(max_examples=400, stateful_step_count=40, deadline=None)


def test_an_unreserved_backlog_grants_by_priority_then_order() -> None:
    """A hand-made case of the heap: equal priorities go by request, a higher priority first,
    a full workload is passed over until one of its slots ends."""
    rules = Rules(
        max_concurrent=3,
        workloads={
            "low": WorkloadRule(ceiling=3, reserved=0, priority=0),
            "high": WorkloadRule(ceiling=1, reserved=0, priority=1),
        },
    )
    backlog = Backlog(rules)
    for name, request in [("low", 1), ("high", 4), ("low", 2), ("high", 3), ("low", 5)]:
        backlog.add(name, request)
    assert backlog.grant() == [3, 1, 2]  # high's head, then low's in order; high is full
    backlog.end("low")
    assert backlog.grant() == [5]  # high is still full: low's next
    backlog.end("high")
    assert backlog.grant() == [4]
    assert not backlog
    assert backlog.queues == {}
    assert backlog.active == {"low": 2, "high": 1}


def test_a_removed_head_is_never_granted() -> None:
    rules = Rules(
        max_concurrent=2, workloads={"a": WorkloadRule(ceiling=2, reserved=0, priority=0)}
    )
    backlog = Backlog(rules)
    for request in (1, 2, 3):
        backlog.add("a", request)
    backlog.remove("a", 1)
    assert backlog.clear("a") == deque([2, 3])
    backlog.add("a", 7)
    assert backlog.grant() == [7]
