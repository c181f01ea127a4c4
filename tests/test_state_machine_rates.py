"""Rates, pauses and a changing limit in the allocation rules, checked on the pure
``LimiterState`` by a Hypothesis state machine with a virtual clock.

The machine keeps its own model of every bucket (full at the start, refilling continuously,
charged at each grant, corrected after the fact), of the pause and of the queues, written
from the sentences of API.md rather than from the code, and checks after every step:

- no grant while a pause is in force;
- at every grant, every bucket the request draws from holds its cost (so in any window of
  ``per`` seconds the grants never take more than the capacity plus what refilled), and no
  grant exceeds the limit in force (``max_concurrent`` as an adaptive limit has set it) or a
  workload's ceiling;
- no waiter is left waiting while its workload has room, its buckets hold its cost and no
  request before it (in priority, then arrival order) has claimed one of the limiter's
  buckets it needs;
- grants follow priority, then the longest wait, then arrival, buckets permitting;
- the adaptive limit stays between its floor and ``max_concurrent``, falls only on pushback
  and climbs only on success;
- the state's bucket levels are the model's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from slotwise import ConcurrencyConfigError, ConcurrencyQueueFullError
from slotwise._core.rates import BucketRule, bucket_key
from slotwise._core.rules import Rules, WorkloadRule
from slotwise._core.state import LimiterState, Ticket

NAMES = ("alpha", "beta", "gamma")
STEPS = st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 5.0])
EPSILON = 1e-6


@st.composite
def limits(draw: st.DrawFn) -> Rules:
    """Small limits with rate buckets on the limiter and some workloads."""
    total = draw(st.sampled_from([1, 2, 3, 4, 6]))
    count = draw(st.sampled_from([1, 2, 3]))
    workloads: dict[str, WorkloadRule] = {}
    unreserved = total
    buckets: dict[str, BucketRule] = {}
    per = draw(st.sampled_from([1.0, 2.0, 5.0]))
    requests = draw(st.none() | st.integers(1, 4))
    tokens = draw(st.none() | st.integers(5, 40))
    if requests is not None:
        buckets["requests"] = BucketRule(kind="requests", capacity=requests, per=per)
    if tokens is not None:
        buckets["tokens"] = BucketRule(kind="tokens", capacity=tokens, per=per)
    for name in NAMES[:count]:
        ceiling = draw(st.just(total) | st.integers(1, total))
        reserved = draw(st.just(0) | st.integers(0, min(ceiling, unreserved)))
        unreserved -= reserved
        priority = draw(st.sampled_from([0, 0, 1, 2]))
        workloads[name] = WorkloadRule(ceiling=ceiling, reserved=reserved, priority=priority)
        if draw(st.booleans()):
            kind = draw(st.sampled_from(["requests", "tokens"]))
            capacity = draw(st.integers(1, 3) if kind == "requests" else st.integers(3, 20))
            buckets[bucket_key(name, kind)] = BucketRule(kind=kind, capacity=capacity, per=per)
    return Rules(max_concurrent=total, workloads=workloads, buckets=buckets)


def room(rules: Rules, active: Mapping[str, int], workload: str) -> bool:
    """The slot rule, with the limit in force: a_w < c_w and (a_w < r_w or lent < S)."""
    rule = rules.workloads[workload]
    a_w = active[workload]
    lent = sum(max(0, active[v] - r.reserved) for v, r in rules.workloads.items())
    shared = rules.max_concurrent - sum(r.reserved for r in rules.workloads.values())
    return a_w < rule.ceiling and (a_w < rule.reserved or lent < shared)


@attrs.define
class ModelBucket:
    capacity: int
    per: float
    level: float
    updated: float

    def at(self, now: float) -> float:
        if now <= self.updated:
            return self.level
        return min(
            float(self.capacity), self.level + (now - self.updated) * self.capacity / self.per
        )

    def set(self, now: float, level: float) -> None:
        self.level, self.updated = level, now


@attrs.define(eq=False)
class Waiting:
    ticket: Ticket
    arrival: int
    tokens: int


class RatesMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.arrivals = 0
        self.rules = Rules(max_concurrent=1, workloads={})
        self.state: LimiterState
        self.buckets: dict[str, ModelBucket] = {}
        self.queues: dict[str, list[Waiting]] = {}
        self.held: dict[str, tuple[str, int]] = {}  # lease id -> (workload, tokens)
        self.paused_until = -math.inf
        self.floor: int | None = None

    @initialize(rules=limits(), adaptive=st.booleans())
    def setup(self, rules: Rules, adaptive: bool) -> None:
        reserved = sum(r.reserved for r in rules.workloads.values())
        self.floor = max(1, reserved) if adaptive else None
        self.rules = rules
        self.state = LimiterState(
            rules,
            max_queued=None,
            lease_ttl=1e9,
            adaptive=None if self.floor is None else (self.floor, 0.5),
        )
        self.buckets = {
            key: ModelBucket(capacity=b.capacity, per=b.per, level=float(b.capacity), updated=0.0)
            for key, b in rules.buckets.items()
        }
        self.queues = {name: [] for name in rules.workloads}

    # -- the model ------------------------------------------------------------------------

    def in_force(self) -> Rules:
        return attrs.evolve(self.rules, max_concurrent=self.state.rules.max_concurrent)

    def active(self) -> dict[str, int]:
        counts = dict.fromkeys(self.rules.workloads, 0)
        for workload, _ in self.held.values():
            counts[workload] += 1
        return counts

    def draws(self, workload: str, tokens: int) -> list[tuple[str, int]]:
        """The buckets a request takes from, with its cost in each."""
        cost = {"requests": 1, "tokens": tokens}
        return [
            (key, units)
            for kind, units in cost.items()
            if units > 0
            for key in (kind, bucket_key(workload, kind))
            if key in self.buckets
        ]

    def order(self) -> list[str]:
        """Workloads with waiters, in the order the rules serve their heads."""
        heads = [(name, queue[0]) for name, queue in self.queues.items() if queue]
        heads.sort(key=lambda h: (-self.rules.workloads[h[0]].priority, h[1].arrival))
        return [name for name, _ in heads]

    def eligible(self, active: Mapping[str, int]) -> list[str]:
        """The workloads whose head could be granted now, in serving order: room, buckets
        holding its cost, and no claim by an earlier blocked head on a limiter bucket."""
        rules = self.in_force()
        if self.now < self.paused_until:
            return []
        claimed: set[str] = set()
        found = []
        for name in self.order():
            if not room(rules, active, name):
                continue
            head = self.queues[name][0]
            needs = self.draws(name, head.tokens)
            short = [k for k, u in needs if self.buckets[k].at(self.now) < u - EPSILON]
            if short or any(k in claimed for k, _ in needs):
                claimed.update(k for k in short if k in ("requests", "tokens"))
                continue
            found.append(name)
        return found

    def check_grants(self, granted: list[Ticket]) -> None:
        active = self.active()
        for ticket in granted:
            assert self.now >= self.paused_until, "a grant during a pause"
            workload = ticket.workload
            queue = self.queues[workload]
            assert queue
            assert queue[0].ticket is ticket, "within a workload, arrival order"
            eligible = self.eligible(active)
            assert eligible, f"{workload!r} was granted, but nothing could be"
            assert eligible[0] == workload, (
                f"{workload!r} went before {eligible[0]!r}, which came first in order"
            )
            head = queue.pop(0)
            for key, units in self.draws(workload, head.tokens):
                bucket = self.buckets[key]
                bucket.set(self.now, bucket.at(self.now) - units)
            assert ticket.lease is not None
            self.held[ticket.lease.lease_id] = (workload, head.tokens)
            active[workload] += 1
        assert not self.eligible(active), "a waiter waits although it could be granted"

    # -- operations -----------------------------------------------------------------------

    @rule(workload=st.sampled_from(NAMES), tokens=st.sampled_from([0, 0, 1, 3, 8, 50]))
    def submit(self, workload: str, tokens: int) -> None:
        workloads = list(self.rules.workloads)
        workload = workloads[NAMES.index(workload) % len(workloads)]
        waiting = {w.ticket for q in self.queues.values() for w in q}
        try:
            ticket, granted = self.state.submit(workload, self.now, tokens=tokens)
        except ConcurrencyConfigError:
            assert any(
                units > self.buckets[key].capacity for key, units in self.draws(workload, tokens)
            ), "refused a request that fits its buckets"
            return
        except ConcurrencyQueueFullError:
            raise AssertionError("no max_queued here") from None
        self.arrivals += 1
        self.queues[workload].append(Waiting(ticket=ticket, arrival=self.arrivals, tokens=tokens))
        earlier = [t for t in granted if t in waiting]
        if ticket.lease is not None:
            granted = [*earlier, ticket] if ticket not in granted else granted
        # Grants come in serving order; the newcomer (last to arrive) can only be last.
        self.check_grants(sorted(granted, key=lambda t: t is ticket))

    @rule(index=st.integers(0, 100))
    def release(self, index: int) -> None:
        if not self.held:
            return
        lease_id = sorted(self.held)[index % len(self.held)]
        del self.held[lease_id]
        before = self.state.rules.max_concurrent
        granted = self.state.release(lease_id, self.now)
        after = self.state.rules.max_concurrent
        assert after in (before, before + 1), "a release changed the limit by more than one"
        self.check_grants(granted)

    @rule(step=STEPS)
    def advance(self, step: float) -> None:
        self.now += step
        self.check_grants(self.state.tick(self.now))

    @rule(workload=st.sampled_from(NAMES), delta=st.sampled_from([-5, -1, 1, 7]))
    def correct_tokens(self, workload: str, delta: int) -> None:
        workloads = list(self.rules.workloads)
        workload = workloads[NAMES.index(workload) % len(workloads)]
        for key in ("tokens", bucket_key(workload, "tokens")):
            bucket = self.buckets.get(key)
            if bucket is not None:
                bucket.set(self.now, min(float(bucket.capacity), bucket.at(self.now) - delta))
        self.check_grants(self.state.charge(workload, "tokens", delta, self.now))

    @rule(index=st.integers(0, 100), retry_after=st.none() | st.sampled_from([0.0, 0.5, 3.0]))
    def throttle(self, index: int, retry_after: float | None) -> None:
        lease_id = sorted(self.held)[index % len(self.held)] if self.held else None
        before = self.state.rules.max_concurrent
        result = self.state.throttle(lease_id, retry_after, self.now, jitter=1.0)
        if retry_after is not None:
            assert result.paused_until >= self.now + retry_after
        else:
            assert result.paused_until >= self.now + 1.0 - EPSILON
        self.paused_until = max(self.paused_until, result.paused_until)
        after = self.state.rules.max_concurrent
        assert after <= before, "pushback raised the limit"
        if result.limit is not None:
            assert result.limit == (before, after)

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def buckets_agree_with_the_model(self) -> None:
        if not hasattr(self, "state"):
            return
        self.state.bank.refill(self.now)
        for key, bucket in self.state.bank.buckets.items():
            assert abs(bucket.level - self.buckets[key].at(self.now)) < 1e-6, key

    @invariant()
    def the_limit_in_force_stays_in_its_bounds(self) -> None:
        if not hasattr(self, "state"):
            return
        limit = self.state.rules.max_concurrent
        if self.floor is None:
            assert limit == self.rules.max_concurrent
        else:
            assert self.floor <= limit <= self.rules.max_concurrent

    @invariant()
    def queues_agree_with_the_model(self) -> None:
        if not hasattr(self, "state"):
            return
        for name, queue in self.queues.items():
            assert list(self.state.queues[name].values()) == [w.ticket for w in queue]
        assert set(self.state.leases) == set(self.held)


RatesMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_rates_pauses_and_limits = RatesMachine.TestCase


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(1, 10**6),
    per=st.floats(0.01, 3600.0),
    start=st.floats(0.0, 1e7),
    spent=st.floats(0.0, 1.0),
    needed=st.floats(0.0, 1.0),
)
def test_a_request_short_of_tokens_is_granted_by_the_refill_it_waits_for(
    capacity: int, per: float, start: float, spent: float, needed: float
) -> None:
    # The shell wakes a waiter at next_wake() and ticks: each wake must come later than the
    # last (a wake at `now` spins forever on a virtual clock), and the refill it waits for
    # must grant it, whatever float rounding does to the level.
    rules = Rules(
        max_concurrent=2,
        workloads={"w": WorkloadRule(ceiling=2, reserved=0, priority=0)},
        buckets={"tokens": BucketRule(kind="tokens", capacity=capacity, per=per)},
    )
    state = LimiterState(rules, max_queued=None, lease_ttl=1e12)
    first, _ = state.submit("w", start, tokens=max(1, round(spent * capacity)))
    assert first.lease is not None
    ticket, _ = state.submit("w", start, tokens=max(1, round(needed * capacity)))
    now = start
    for _ in range(3):
        if ticket.lease is not None:
            return
        wake = state.next_wake(now)
        assert wake is not None
        assert wake > now
        now = wake
        state.tick(now)
    assert ticket.lease is not None


def test_a_grant_lost_to_a_stall_is_refused_when_its_bucket_was_made_too_small() -> None:
    # A request of 60 tokens is granted while its waiter stalls; set_limits() makes the
    # bucket hold 50, and the lease runs out before the waiter resumes. Put back in its
    # queue it would overdraw the bucket: it is refused, as waiting requests were, and its
    # tokens come back.
    def rules(capacity: int) -> Rules:
        return Rules(
            max_concurrent=1,
            workloads={"w": WorkloadRule(ceiling=1, reserved=0, priority=0)},
            buckets={"tokens": BucketRule(kind="tokens", capacity=capacity, per=60.0)},
        )

    state = LimiterState(rules(100), max_queued=None, lease_ttl=5.0)
    holder, _ = state.submit("w", 0.0, tokens=1)
    waiter, _ = state.submit("w", 0.0, tokens=60)
    assert holder.lease is not None
    assert waiter.lease is None
    assert state.release(holder.lease.lease_id, 1.0) == [waiter]
    granted, refused = state.reconfigure(rules(50), None, 2.0)
    assert (granted, refused) == ([], [])  # it holds a lease: no waiter to refuse

    state.tick(10.0)  # its lease runs out unrenewed
    assert state.regrant(waiter, 10.0) == []
    assert isinstance(waiter.refused, ConcurrencyConfigError)
    assert "can never be granted" in str(waiter.refused)
    assert state.queued == 0
    assert state.bank.buckets["tokens"].level >= 0
