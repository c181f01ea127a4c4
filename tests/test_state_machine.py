"""The allocation rules (docs/explanation/allocation.md), checked on the pure ``LimiterState`` by a Hypothesis
state machine.

The machine keeps its own model of the queues and leases, written from the rules' sentences
rather than from the code under test, and after every operation checks:

- the number of valid leases never exceeds ``max_concurrent``, nor any workload's ceiling;
- reservations are never lent: ``sum_v max(0, a_v - r_v) <= S``;
- no waiter is left waiting while its workload has room;
- grants follow priority, then the longest wait, then arrival: at each step of a grant list
  no other eligible head has a higher priority, or the same priority and an earlier arrival;
- every granted request is reported in exactly one grant list;
- lease ids are never reused;
- ``active`` and ``queued`` agree with the leases and queues.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import attrs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from slotwise import ConcurrencyConfigError, ConcurrencyQueueFullError
from slotwise._core.rules import Rules, WorkloadRule
from slotwise._core.state import LimiterState, Ticket

NAMES = ("alpha", "beta", "gamma", "delta")
# Multiples of a half second: lease ends and clock steps often coincide exactly, so the
# boundary (a lease is valid while ``now < expires_at``) is exercised.
STEPS = st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 10.0])


@st.composite
def limits(draw: st.DrawFn) -> Rules:
    """Random valid limits: 1-4 workloads, ``max_concurrent`` 1-8.

    The draws lean towards what makes waiters compete: small limits that fill up soon, the
    default settings (no ceiling of its own, nothing reserved) and equal priorities.
    """
    total = draw(st.sampled_from([1, 2, 3, 3, 4, 4, 6, 8]))
    count = draw(st.sampled_from([1, 2, 2, 3, 4]))
    unreserved = total
    workloads: dict[str, WorkloadRule] = {}
    for name in NAMES[:count]:
        ceiling = draw(st.just(total) | st.integers(1, total))
        reserved = draw(st.just(0) | st.integers(0, min(ceiling, unreserved)))
        unreserved -= reserved
        priority = draw(st.sampled_from([0, 0, 1, 2]))
        workloads[name] = WorkloadRule(ceiling=ceiling, reserved=reserved, priority=priority)
    return Rules(max_concurrent=total, workloads=workloads)


def has_room(rules: Rules, active: Mapping[str, int], workload: str) -> bool:
    """The rule: a_w < c_w and (a_w < r_w or sum_v max(0, a_v - r_v) < S)."""
    rule = rules.workloads[workload]
    a_w = active[workload]
    beyond_reservations = sum(max(0, active[v] - r.reserved) for v, r in rules.workloads.items())
    shared = rules.max_concurrent - sum(r.reserved for r in rules.workloads.values())
    return a_w < rule.ceiling and (a_w < rule.reserved or beyond_reservations < shared)


@attrs.define
class Held:
    """A lease as the model sees it."""

    workload: str
    expires_at: float


@attrs.define(eq=False)
class Waiting:
    """A waiting request as the model sees it."""

    ticket: Ticket
    arrival: int
    since: float


class LimiterStateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.arrivals = 0
        self.config = Rules(max_concurrent=1, workloads={})
        self.state: LimiterState
        self.ttl = 1.0
        self.max_queued: int | None = None
        # The model.
        self.queues: dict[str, list[Waiting]] = {}
        self.held: dict[str, Held] = {}
        self.issued: set[str] = set()
        self.tickets: list[Ticket] = []  # every ticket ever submitted, granted or not

    @initialize(
        rules=limits(),
        max_queued=st.none() | st.integers(0, 4),
        ttl=st.sampled_from([0.5, 1.0, 2.0, 5.0]),
    )
    def setup(self, rules: Rules, max_queued: int | None, ttl: float) -> None:
        self.config = rules
        self.max_queued = max_queued
        self.ttl = ttl
        self.state = LimiterState(rules, max_queued=max_queued, lease_ttl=ttl)
        self.queues = {name: [] for name in rules.workloads}

    # -- model helpers ------------------------------------------------------------------

    def active(self) -> dict[str, int]:
        counts = dict.fromkeys(self.config.workloads, 0)
        for lease in self.held.values():
            counts[lease.workload] += 1
        return counts

    def waiting(self) -> list[Waiting]:
        return [w for queue in self.queues.values() for w in queue]

    def sweep(self) -> None:
        """Forget the leases whose time is up, as ``expire`` does."""
        for lease_id, lease in list(self.held.items()):
            if lease.expires_at <= self.now:
                del self.held[lease_id]

    def check_grants(self, granted: list[Ticket]) -> None:
        """Replay a grant list against the model, one grant at a time."""
        active = self.active()
        for ticket in granted:
            workload = ticket.workload
            queue = self.queues[workload]
            assert queue, f"granted {ticket} but nothing of {workload!r} waits"
            head = queue[0]
            assert head.ticket is ticket, "within a workload, arrival order"
            assert has_room(self.config, active, workload), f"{workload!r} had no room"
            priority = self.config.workloads[workload].priority
            for other, other_queue in self.queues.items():
                if other == workload or not other_queue or not has_room(self.config, active, other):
                    continue
                rival = other_queue[0]
                rival_priority = self.config.workloads[other].priority
                assert rival_priority <= priority, (
                    f"{workload!r} (priority {priority}) went before {other!r} "
                    f"(priority {rival_priority})"
                )
                if rival_priority == priority:
                    assert (rival.since, rival.arrival) > (head.since, head.arrival), (
                        f"a tie went to {workload!r}, but {other!r} had waited longer"
                    )
            queue.pop(0)
            self.admit(ticket)
            active[workload] += 1
        self.check_no_idle_room()

    def admit(self, ticket: Ticket) -> None:
        lease = ticket.lease
        assert lease is not None, "a granted ticket carries its lease"
        assert lease.workload == ticket.workload
        assert lease.lease_id not in self.issued, f"lease id {lease.lease_id} reused"
        assert lease.expires_at == self.now + self.ttl
        self.issued.add(lease.lease_id)
        self.held[lease.lease_id] = Held(workload=lease.workload, expires_at=lease.expires_at)

    def check_no_idle_room(self) -> None:
        active = self.active()
        for workload, queue in self.queues.items():
            assert not (queue and has_room(self.config, active, workload)), (
                f"{len(queue)} request(s) of {workload!r} wait beside room"
            )

    def pick(self, index: int, stale: int) -> str:
        """A held lease id; with ``stale == 0`` any id ever issued, or one never issued."""
        held = sorted(self.held)
        ids = held if held and stale else [*sorted(self.issued), "no-such-lease"]
        return ids[index % len(ids)]

    # -- operations ---------------------------------------------------------------------

    @rule(workload=st.sampled_from(NAMES), count=st.integers(1, 4))
    def submit_several(self, workload: str, count: int) -> None:
        """A burst of requests, so that queues grow and releases have waiters to serve."""
        workloads = list(self.config.workloads)
        for _ in range(count):
            self.submit(workloads[NAMES.index(workload) % len(workloads)])

    def submit(self, workload: str) -> None:
        if any(lease.expires_at <= self.now for lease in self.held.values()):
            self.sweep()
            sweeps = True
        else:
            sweeps = False
        before = {w.ticket for w in self.waiting()}
        ticket, swept = self.state.submit(workload, self.now)
        if ticket.refused is not None:
            assert isinstance(ticket.refused, ConcurrencyQueueFullError)
            newly = [t for t in before if t.lease is not None and t not in swept]
            assert not newly, f"{len(newly)} request(s) granted by a sweep were not reported"
            self.check_grants(swept)
            assert self.max_queued is not None
            assert sum(map(len, self.queues.values())) >= self.max_queued
            assert self.queues[workload] or not has_room(self.config, self.active(), workload)
            return
        assert sweeps or not swept
        self.check_grants(swept)
        self.tickets.append(ticket)
        self.arrivals += 1
        if ticket.lease is not None:
            assert not self.queues[workload], "a newcomer went before earlier waiters"
            assert has_room(self.config, self.active(), workload)
            self.admit(ticket)
        else:
            assert self.queues[workload] or not has_room(self.config, self.active(), workload)
            if self.max_queued is not None:
                assert sum(map(len, self.queues.values())) < self.max_queued
            self.queues[workload].append(
                Waiting(ticket=ticket, arrival=self.arrivals, since=self.now)
            )
        self.check_no_idle_room()

    @rule(index=st.integers(0, 1000), stale=st.integers(0, 3))
    def withdraw(self, index: int, stale: int) -> None:
        """Take back a waiting or granted request (one time in four, any request ever made:
        withdrawing twice, or after release, does nothing)."""
        live = [t for t in self.tickets if t.lease is None or t.lease.lease_id in self.held]
        tickets = live if live and stale else self.tickets
        if not tickets:
            return
        ticket = tickets[index % len(tickets)]
        waiting = [w for w in self.queues[ticket.workload] if w.ticket is ticket]
        if waiting:
            self.queues[ticket.workload].remove(waiting[0])
        elif ticket.lease is not None:
            self.held.pop(ticket.lease.lease_id, None)
        granted = self.state.withdraw(ticket, self.now)
        if waiting:
            assert granted == [], "withdrawing a waiter frees no capacity"
        self.check_grants(granted)

    @rule(index=st.integers(0, 1000), stale=st.integers(0, 3))
    def release(self, index: int, stale: int) -> None:
        """Release a held lease (one time in four, any lease id: double or stale release)."""
        lease_id = self.pick(index, stale)
        self.held.pop(lease_id, None)
        self.check_grants(self.state.release(lease_id, self.now))

    @rule(index=st.integers(0, 1000), stale=st.integers(0, 3))
    def renew(self, index: int, stale: int) -> None:
        lease_id = self.pick(index, stale)
        held = self.held.get(lease_id)
        record = self.state.renew(lease_id, self.now)
        if held is None or held.expires_at <= self.now:
            assert record is None, "a lease that is no longer held was renewed"
        else:
            assert record is not None, "a valid lease could not be renewed"
            assert record.lease_id == lease_id
            assert record.expires_at == self.now + self.ttl
            held.expires_at = record.expires_at

    @rule(step=STEPS, expire=st.booleans())
    def advance(self, step: float, expire: bool) -> None:
        """Let time pass; with ``expire`` the shell sweeps expired leases at once, without it
        the next ``submit`` (or a later sweep) finds them."""
        self.now += step
        if expire:
            self.sweep()
            self.check_grants(self.state.expire(self.now))

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def leases_agree_with_the_model(self) -> None:
        if not hasattr(self, "state"):
            return
        assert set(self.state.leases) == set(self.held)
        for lease_id, record in self.state.leases.items():
            assert record.workload == self.held[lease_id].workload
            assert record.expires_at == self.held[lease_id].expires_at
        earliest = min((lease.expires_at for lease in self.held.values()), default=None)
        assert self.state.next_expiry() == earliest

    @invariant()
    def counts_agree_with_leases_and_queues(self) -> None:
        if not hasattr(self, "state"):
            return
        assert self.state.active == self.active()
        assert self.state.queued == sum(map(len, self.queues.values()))
        for workload, queue in self.queues.items():
            assert list(self.state.queues[workload].values()) == [w.ticket for w in queue]
        for waiting in self.waiting():
            assert waiting.ticket.lease is None, "a waiter was granted without being reported"

    @invariant()
    def valid_leases_never_exceed_the_limits(self) -> None:
        if not hasattr(self, "state"):
            return
        held = self.active()
        valid = dict.fromkeys(self.config.workloads, 0)
        for lease in self.held.values():
            if lease.expires_at > self.now:
                valid[lease.workload] += 1
        for counts in (held, valid):
            assert sum(counts.values()) <= self.config.max_concurrent
            for workload, limit in self.config.workloads.items():
                assert counts[workload] <= limit.ceiling

    @invariant()
    def reservations_are_never_lent(self) -> None:
        if not hasattr(self, "state"):
            return
        active = self.active()
        shared = self.config.max_concurrent - sum(
            r.reserved for r in self.config.workloads.values()
        )
        lent = sum(max(0, active[w] - r.reserved) for w, r in self.config.workloads.items())
        assert lent <= shared
        # The state keeps this sum as a running count; it must never drift.
        assert self.state.shared_used == lent

    @invariant()
    def max_queued_is_respected(self) -> None:
        if not hasattr(self, "state") or self.max_queued is None:
            return
        assert self.state.queued <= self.max_queued


LimiterStateMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_limiter_state = LimiterStateMachine.TestCase


# -- a few hand-made runs of the same state ----------------------------------------------------


def seed_state(*, max_queued: int | None = None) -> LimiterState:
    rules = Rules(
        max_concurrent=8,
        workloads={
            "interactive": WorkloadRule(ceiling=8, reserved=2, priority=10),
            "background": WorkloadRule(ceiling=6, reserved=0, priority=0),
        },
    )
    return LimiterState(rules, max_queued=max_queued, lease_ttl=30.0)


def one_slot_state() -> LimiterState:
    """One workload, one slot, leases of 5 seconds."""
    return LimiterState(
        Rules(
            max_concurrent=1, workloads={"default": WorkloadRule(ceiling=1, reserved=0, priority=0)}
        ),
        max_queued=None,
        lease_ttl=5.0,
    )


def test_an_unrenewed_lease_expires_and_its_slot_goes_to_the_next_waiter() -> None:
    state = one_slot_state()
    first, _ = state.submit("default", 0.0)
    second, _ = state.submit("default", 1.0)
    assert first.lease is not None
    assert second.lease is None
    assert state.next_expiry() == 5.0
    assert state.expire(4.9) == []
    assert state.expire(5.0) == [second]
    assert second.lease is not None
    assert state.renew(first.lease.lease_id, 5.0) is None
    assert state.release(first.lease.lease_id, 5.0) == []
    assert second.lease.expires_at == 10.0


class _Holder:
    released = False


def test_a_granted_ticket_does_not_keep_its_holder_alive() -> None:
    # A ticket kept alive after its grant (in a list of grants that a traceback holds) kept
    # its holder alive too, so the lease of a holder that died was extended for ever.
    state = one_slot_state()
    first, _ = state.submit("default", 0.0)
    assert first.lease is not None
    holder = _Holder()
    ticket, _ = state.submit("default", 1.0, holder)
    assert state.release(first.lease.lease_id, 2.0) == [ticket]
    assert ticket.lease is not None
    alive = weakref.ref(holder)
    del holder
    assert alive() is None  # the ticket, still referenced here, let it go
    assert state.expire(7.0) == []
    assert not state.leases  # the dead holder's lease expired: the slot is back


def test_a_regranted_ticket_stays_tied_to_its_holder() -> None:
    # A lease that ran out before its waiter resumed is granted again to the same holder.
    state = one_slot_state()
    holder = _Holder()
    ticket, _ = state.submit("default", 0.0, holder)
    assert ticket.lease is not None
    assert ticket.lease.tether is not None
    assert state.regrant(ticket, 6.0) == [ticket]
    assert ticket.lease.tether is not None
    assert ticket.lease.tether() is holder


def test_a_renewed_lease_outlives_its_first_expiry() -> None:
    state = seed_state()
    ticket, _ = state.submit("background", 0.0)
    assert ticket.lease is not None
    lease_id = ticket.lease.lease_id
    assert state.renew(lease_id, 20.0) is not None
    assert state.expire(30.0) == []
    assert state.next_expiry() == 50.0
    assert lease_id in state.leases


def test_submit_sweeps_expired_leases_first() -> None:
    state = seed_state()
    holders = [state.submit("background", 0.0)[0] for _ in range(6)]
    waiter, _ = state.submit("background", 1.0)
    assert waiter.lease is None
    assert all(t.lease is not None for t in holders)
    newcomer, swept = state.submit("background", 30.0)
    # Every holder expired: the earlier waiter is granted (and reported), then the newcomer.
    assert swept == [waiter]
    assert newcomer.lease is not None
    assert state.active == {"interactive": 0, "background": 2}


def test_withdraw_is_idempotent_and_gives_a_granted_slot_back() -> None:
    state = seed_state()
    holders = [state.submit("background", 0.0)[0] for _ in range(6)]
    waiter, _ = state.submit("background", 0.0)
    assert state.withdraw(waiter, 1.0) == []
    assert state.withdraw(waiter, 1.0) == []
    assert state.queued == 0
    late, _ = state.submit("background", 1.0)
    assert state.withdraw(holders[0], 2.0) == [late]
    assert state.withdraw(holders[0], 2.0) == []
    assert state.active["background"] == 6


def test_queue_full_refuses_only_requests_that_would_wait() -> None:
    state = seed_state(max_queued=1)
    for _ in range(6):
        state.submit("background", 0.0)
    state.submit("background", 0.0)
    refused, _ = state.submit("background", 0.0)
    assert isinstance(refused.refused, ConcurrencyQueueFullError)
    assert refused.lease is None
    assert state.queued == 1
    # interactive has room: it is granted, not refused.
    ticket, _ = state.submit("interactive", 0.0)
    assert ticket.lease is not None


def test_lease_ids_differ_between_states() -> None:
    one, two = seed_state(), seed_state()
    a, _ = one.submit("background", 0.0)
    b, _ = two.submit("background", 0.0)
    assert a.lease is not None
    assert b.lease is not None
    assert a.lease.lease_id != b.lease.lease_id


def test_the_expiry_heap_does_not_grow_with_released_and_renewed_leases() -> None:
    # Each grant and renewal pushes an expiry; released and renewed leases leave stale ones.
    # The heap is rebuilt once they outnumber the live leases, so memory follows the leases
    # held, not the slots ever granted.
    state = seed_state()
    held = state.submit("background", 0.0)[0]
    assert held.lease is not None
    for step in range(10_000):
        now = step * 0.001
        ticket, _ = state.submit("interactive", now)
        assert ticket.lease is not None
        state.renew(held.lease.lease_id, now)
        state.release(ticket.lease.lease_id, now)
    assert len(state.leases) == 1
    assert len(state._expiries) <= 2 * len(state.leases) + 64
    assert state.next_expiry() == held.lease.expires_at


def test_a_grant_lost_to_a_stall_is_refused_when_its_workload_was_removed_meanwhile() -> None:
    # A waiter of "background" is granted while its loop stalls; set_limits() removes
    # "background" (kept only for that held slot) and the lease runs out before the waiter
    # resumes. Put back in its queue it could never be granted again: it is refused.
    state = seed_state()
    holders = [state.submit("interactive", 0.0)[0] for _ in range(8)]
    waiter, _ = state.submit("background", 0.0)
    assert waiter.lease is None
    assert holders[0].lease is not None
    assert state.release(holders[0].lease.lease_id, 1.0) == [waiter]
    only_interactive = Rules(
        max_concurrent=8,
        workloads={"interactive": WorkloadRule(ceiling=8, reserved=2, priority=10)},
    )
    state.reconfigure(only_interactive, None, 2.0)
    assert state.rules.workloads["background"].ceiling == 0  # kept for the held slot

    newcomer, _ = state.submit("interactive", 40.0)  # sweeps the waiter's expired lease
    assert waiter.lease is not None
    assert newcomer.lease is not None
    assert state.regrant(waiter, 40.0) == []
    assert waiter.lease is None
    assert isinstance(waiter.refused, ConcurrencyConfigError)
    assert "removed by set_limits()" in str(waiter.refused)
    assert state.queued == 0
