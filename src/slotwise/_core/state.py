"""The in-process state of a limiter: wait queues, lease table, rate buckets and pause, with
``now`` passed in.

A backend keeps one `LimiterState` and calls it synchronously, so every read and the grant
that follows happen with no ``await`` in between: that is what makes allocation atomic in
memory. Each method that can free capacity returns the tickets it granted; the caller wakes
their waiters. `next_wake` says when time alone (a lease running out, a bucket refilling, a
pause ending) can change what is granted, so a waiter can set one timer for the limiter.
"""

from __future__ import annotations

import heapq
import itertools
import math
import secrets
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol, TypeVar

import attrs

from .._errors import ConcurrencyConfigError, ConcurrencyQueueFullError
from .adaptive import Aimd, backoff_delay
from .rates import Bank, Cost
from .rules import Rules, WorkloadRule, allocate, has_room, occupied, slots_tried

__all__ = (
    "LeaseRecord",
    "LimiterState",
    "Ticket",
    "allocate_paced",
    "carry_over",
    "check_cost",
    "cost_error",
    "pause",
    "readapt",
    "retire",
)

E = TypeVar("E")


class Holder(Protocol):
    """What holds a tethered lease (the shell's slot)."""

    @property
    def released(self) -> bool: ...


# A weak reference to a lease's holder: a lease with a tether is extended, rather than
# expired, whenever its time is up while its holder is alive and has not released it.
Tether = Callable[[], Holder | None]


def holds(tether: Tether | None) -> bool:
    """Whether the holder behind ``tether`` still holds its lease."""
    if tether is None:
        return False
    holder = tether()
    return holder is not None and not holder.released


class LeaseRecord:
    """A granted lease; the shell hands it out as the lease itself."""

    __slots__ = (
        "epoch",
        "expires_at",
        "lease_id",
        "succeeded",
        "tether",
        "tried",
        "waited_for",
        "workload",
    )

    expires_at: float

    def __init__(
        self,
        lease_id: str,
        workload: str,
        expires_at: float,
        tether: Tether | None,
        epoch: int,
        tried: int = 0,
    ) -> None:
        self.lease_id = lease_id
        self.workload = workload
        self.expires_at = expires_at
        self.tether = tether
        self.epoch = epoch  # the adaptive limit's epoch when it was granted
        self.tried = tried  # with an adaptive limit: the slots occupied once it was granted
        # False once the provider refused its request, or its body was cancelled or failed:
        # its release then tells nothing of the provider's room (no climb, no backoff reset).
        self.succeeded = True
        self.waited_for: tuple[str, ...] = ()  # the rate buckets (and "pause") it waited for

    def __repr__(self) -> str:
        return f"LeaseRecord({self.lease_id!r}, {self.workload!r}, expires_at={self.expires_at})"


_NO_COST: Cost = {"requests": 1}
_NEVER = -math.inf  # paused_until when no pause was ever set


@attrs.frozen(kw_only=True)
class Throttle:
    """What a provider's refusal did: the pause and, with an adaptive limit, the change."""

    paused_until: float
    limit: tuple[int, int] | None  # (old, new) effective max_concurrent, when it changed


@attrs.define(eq=False, weakref_slot=False)
class Ticket:
    """One request for a slot. ``lease`` is set when it is granted; ``waker`` is the shell's.
    ``rate_waits`` collects the buckets (and ``"pause"``) the request had to wait for."""

    seq: int
    workload: str
    enqueued_at: float
    lease: LeaseRecord | None = None
    waker: Any = None
    # What will hold its lease (the shell's slot; None: nothing ties the lease to a holder).
    # Held strongly while it waits, as its waiter holds it anyway; when it is granted the
    # lease gets a weak reference to it, its tether, and the ticket lets it go: a ticket
    # kept alive elsewhere (a list of grants in a traceback) must not keep a dead holder's
    # lease alive.
    holder: Holder | None = None
    cost: Cost = _NO_COST
    rate_waits: set[str] | None = None
    # Why it will never be granted (the error its waiter raises): a full queue at submit,
    # or limits changed while it waited (its workload removed, a bucket made too small).
    refused: Exception | None = None


def _cost(ticket: Ticket) -> Cost:
    return ticket.cost


def _arrival(ticket: Ticket) -> int:
    # In one process arrival order is also waiting-time order: seq grows with time.
    return ticket.seq


class LimiterState:
    """Queues, leases, rate buckets and pause of one limiter. Not thread-safe; never awaits."""

    def __init__(
        self,
        rules: Rules,
        *,
        max_queued: int | None,
        lease_ttl: float,
        adaptive: tuple[int, float] | None = None,
        slow_start: bool = False,
    ) -> None:
        self.rules = rules
        self.max_queued = max_queued
        self.lease_ttl = lease_ttl
        self.queues: dict[str, OrderedDict[int, Ticket]] = {
            name: OrderedDict() for name in rules.workloads
        }
        self._views = {name: queue.values() for name, queue in self.queues.items()}
        self.active: dict[str, int] = dict.fromkeys(rules.workloads, 0)
        self.leases: dict[str, LeaseRecord] = {}
        self.queued = 0
        self.shared_used = 0  # shared_in_use(rules, active), kept up to date
        # (expires_at, lease_id); stale entries (renewed or released leases) are skipped.
        self._expiries: list[tuple[float, str]] = []
        self._compact_at = 64  # the heap's size that triggers its next rebuild (_compact)
        self._seq = itertools.count()
        # A per-state prefix keeps lease ids unique across limiters and restarts.
        self._prefix = secrets.token_hex(6)
        self._lease_seq = itertools.count(1)
        # Buckets start full: as if they had been refilling forever.
        self.bank = Bank(rules.buckets, -math.inf)
        self.paused_until = -math.inf  # no grant before this time
        self.timed = False  # bank.buckets or a pause (`_retime`)
        self._refill_at = math.inf  # when a head blocked by buckets can have them
        self._backoffs = 0  # pauses without a retry-after since the last success
        # The effective limit, when it follows pushback: rules.max_concurrent is its value.
        self.aimd: Aimd | None = None
        if adaptive is not None:
            floor, backoff = adaptive
            self.aimd = Aimd(
                floor=floor,
                ceiling=rules.max_concurrent,
                backoff=backoff,
                limit=floor if slow_start else rules.max_concurrent,
                slow_start=slow_start,
            )
            self._set_limit(self.aimd.limit)
        self._retime()

    def _retime(self) -> None:
        """Set `timed` after the buckets or the pause changed."""
        # Whether time alone can grant something (rate buckets, or a pause): a field, not a
        # property, as every request and release asks it.
        self.timed = bool(self.bank.buckets) or self.paused_until != _NEVER

    # -- requests -------------------------------------------------------------------------

    def submit(
        self,
        workload: str,
        now: float,
        holder: Holder | None = None,
        tokens: int = 0,
    ) -> tuple[Ticket, list[Ticket]]:
        """Add a request; return it (granted at once when ``ticket.lease`` is set) and the
        other tickets granted meanwhile (expired leases swept, buckets refilled, a pause
        ended), which the caller must wake whatever became of this request.

        A request that would have to wait while ``max_queued`` are waiting (the limiter's,
        or its workload's) is refused: ``ticket.refused`` is a `ConcurrencyQueueFullError`
        and it waits nowhere. The bound counts only requests that wait: one that the
        allocation grants at once is never refused.

        Raises:
            ConcurrencyConfigError: its cost can never fit one of its buckets (before
                anything is granted).
        """
        cost = _NO_COST if not tokens else {"requests": 1, "tokens": tokens}
        if self.bank.buckets:
            check_cost(self.bank, workload, cost)
        expiries = self._expiries
        # tick(), when time alone may have granted something (not a call per request).
        swept = self.tick(now) if self.timed or (expiries and expiries[0][0] <= now) else []
        ticket = Ticket(
            seq=next(self._seq), workload=workload, enqueued_at=now, holder=holder, cost=cost
        )
        # Fast path of `allocate`: an empty queue means every earlier waiter belongs to a
        # workload without room, so this request goes first iff its own workload has room
        # (with no buckets or pause to consult).
        if (
            not self.timed
            and not self.queues[workload]
            and has_room(self.rules, self.active, workload, self.shared_used)
        ):
            self._grant(ticket, now)
            return ticket, swept
        queue = self.queues[workload]
        queue[ticket.seq] = ticket
        self.queued += 1
        granted = swept
        if self.timed:
            # Buckets or a pause decide whether it goes now; the queue bound is checked
            # after that, so that it only refuses a request that would wait.
            granted += self._allocate(now)
            if ticket.lease is not None:
                granted.remove(ticket)
                return ticket, granted
        # _full(), only where a bound is set.
        full = (
            None
            if self.max_queued is None and self.rules.workloads[workload].max_queued is None
            else self._full(workload)
        )
        if full is not None:
            ticket.refused = ConcurrencyQueueFullError(full)
            granted += self.withdraw(ticket, now)
        return ticket, granted

    def _full(self, workload: str) -> str | None:
        """Why the queue is too full for the request just added to ``workload``'s queue, or
        None when it may wait."""
        others = self.queued - 1
        if self.max_queued is not None and others >= self.max_queued:
            return f"{others} requests are already waiting (max_queued={self.max_queued})"
        bound = self.rules.workloads[workload].max_queued
        ahead = len(self.queues[workload]) - 1
        if bound is not None and ahead >= bound:
            return (
                f"{ahead} requests of workload {workload!r} are already waiting "
                f"(its max_queued={bound})"
            )
        return None

    def take_nowait(self, workload: str, now: float, tether: Tether | None) -> LeaseRecord | None:
        """Grant a slot now if the request would not have to wait, else take nothing (the
        caller then submits it). Only the plain case: nobody of its workload queued ahead,
        no lease to sweep, no rate bucket and no pause to consult."""
        if self.timed or self.queues[workload]:
            return None
        expiries = self._expiries
        if expiries and expiries[0][0] <= now and (self.next_expiry() or math.inf) <= now:
            return None  # a lease may have expired: the caller's submit sweeps it first
        rules = self.rules
        rule = rules.workloads[workload]
        held = self.active[workload]
        if held >= rule.ceiling:
            return None
        if held >= rule.reserved:
            if self.shared_used >= rules.shared:
                return None
            self.shared_used += 1
        self.active[workload] = held + 1
        # _grant(), inlined, without a ticket: this is the path of every uncontended slot.
        lease_id = f"{self._prefix}-{next(self._lease_seq)}"
        # LeaseRecord(...), inlined: its __init__ is a frame, which costs as much as the stores.
        record = object.__new__(LeaseRecord)
        record.lease_id = lease_id
        record.workload = workload
        record.expires_at = now + self.lease_ttl
        record.tether = tether
        aimd = self.aimd
        record.epoch = 0 if aimd is None else aimd.epoch
        record.tried = 0 if aimd is None else slots_tried(rules, self.active)
        record.succeeded = True
        record.waited_for = ()
        self.leases[lease_id] = record
        heapq.heappush(expiries, (record.expires_at, lease_id))
        return record

    def regrant(self, ticket: Ticket, now: float) -> list[Ticket]:
        """A granted ticket whose lease ran out before its waiter could use it (the waiter's
        thread or loop stalled): drop that lease and put the ticket back at the head of its
        queue, where it was when it was granted, its cost given back to the buckets. Returns
        what allocation grants now, which may be the ticket itself again. If `reconfigure`
        removed its workload or made a bucket too small for its cost meanwhile, it is refused
        instead (``ticket.refused``), as such waiters were: it could never be granted again."""
        record = ticket.lease
        assert record is not None
        ticket.lease = None
        if record.tether is not None:
            ticket.holder = record.tether()  # its grant let it go; the next one ties to it
        if self.leases.get(record.lease_id) is record:
            del self.leases[record.lease_id]
            self._drop(record)
        if self.bank:
            # Its request never went on that grant: what the grant took from the buckets
            # comes back, so that the grant made again is the only charge.
            self.bank.refill(now)
            for kind, units in ticket.cost.items():
                self.bank.give(ticket.workload, kind, -units)
        rule = self.rules.workloads.get(ticket.workload)
        if rule is None or not rule.ceiling:  # gone, or kept only for its held slots
            ticket.refused = ConcurrencyConfigError(
                f"workload {ticket.workload!r} was removed by set_limits() while this "
                "request waited"
            )
        elif self.bank.buckets:
            ticket.refused = cost_error(self.bank, ticket.workload, ticket.cost)  # made smaller
        if ticket.refused is not None:
            return self._allocate(now)
        queue = self.queues[ticket.workload]
        queue[ticket.seq] = ticket
        queue.move_to_end(ticket.seq, last=False)
        self.queued += 1
        return self._allocate(now)

    def withdraw(self, ticket: Ticket, now: float) -> list[Ticket]:
        """Take a request back: out of the queue, or, if it was granted meanwhile, give the
        slot back. Idempotent. Returns the tickets granted with what it freed: its slot, or
        its claim on the limiter's buckets (a waiting head short of a bucket holds back
        every request after it in serving order that draws from that bucket)."""
        if ticket.lease is not None:
            # Granted, never used: its release is no success (no climb, no backoff reset).
            ticket.lease.succeeded = False
            return self.release(ticket.lease.lease_id, now)
        if self.leave_queue(ticket):
            return []
        return self._allocate(now)  # the requests it held back from a bucket may go now

    def leave_queue(self, ticket: Ticket) -> bool:
        """Take a waiting request out of its queue (idempotent). True when that is all its
        withdrawal does; False when `withdraw()` must follow, with the time: the request was
        granted meanwhile, or buckets may have held requests back behind it. (Most
        withdrawals need no clock read.)"""
        if ticket.lease is not None:
            return False
        queue = self.queues.get(ticket.workload)  # gone when reconfigure() refused it
        if queue is not None and queue.pop(ticket.seq, None) is not None:
            self.queued -= 1
        # Without buckets a waiter holds nothing back: nobody waits while their workload
        # has room.
        return not self.bank.buckets

    # -- leases ---------------------------------------------------------------------------

    def release(self, lease_id: str, now: float) -> list[Ticket]:
        """End a lease (idempotent) and grant what it frees. A lease whose request completed
        (neither refused by the provider nor cancelled nor failed: `not_succeeded()`) counts
        as a success for an adaptive limit."""
        record = self.leases.pop(lease_id, None)
        if record is None:
            return []
        # An adaptive limit counts a success only with half the limit occupied (this one too).
        busy = (
            occupied(self.rules, self.active) if self.aimd is not None and record.succeeded else 0
        )
        workload = record.workload  # _drop(), inlined: the path of every release
        held = self.active[workload] - 1
        self.active[workload] = held
        if held >= self.rules.workloads[workload].reserved:
            self.shared_used -= 1
        if len(self._expiries) > self._compact_at:
            self._compact()
        if record.succeeded:
            self._backoffs = 0
            if self.aimd is not None:
                new = self.aimd.success(record.epoch, busy, record.tried)
                if new is not None:
                    self._set_limit(new)
        return self._allocate(now) if self.queued else []

    def not_succeeded(self, lease_id: str) -> None:
        """The request of lease ``lease_id`` ended without success (cancelled, or failed):
        its release will not count as one. An adaptive limit only climbs on requests the
        provider answered; a cancelled or failed one says nothing of its room, so it is
        ignored (neither a success nor a pushback)."""
        record = self.leases.get(lease_id)
        if record is not None:
            record.succeeded = False

    def renew(self, lease_id: str, now: float) -> LeaseRecord | None:
        """Extend a valid lease by ``lease_ttl``; None when it is no longer held."""
        record = self.leases.get(lease_id)
        if record is None or (record.expires_at <= now and not holds(record.tether)):
            return None
        record.expires_at = now + self.lease_ttl
        heapq.heappush(self._expiries, (record.expires_at, lease_id))
        if len(self._expiries) > self._compact_at:
            self._compact()
        return record

    def tick(self, now: float) -> list[Ticket]:
        """What time alone grants by ``now``: expired leases swept, refilled buckets and a
        pause that has ended."""
        expiries = self._expiries
        due = bool(expiries) and expiries[0][0] <= now
        # self.paused(now), inlined: this runs at every request.
        paused_until = self.paused_until
        ended = _NEVER < paused_until <= now
        if self.timed and self.queued and (due or self._refill_at <= now or ended):
            self.expire(now, allocate=False)
            granted = self._allocate(now)
        else:
            granted = self.expire(now) if due else []
        if ended and not self._waiting_since(paused_until):
            self.unpause()
        return granted

    def _waiting_since(self, moment: float) -> bool:
        """Whether a request that arrived before ``moment`` still waits."""
        return any(
            next(iter(queue.values())).enqueued_at < moment
            for queue in self.queues.values()
            if queue
        )

    def expire(self, now: float, *, allocate: bool = True) -> list[Ticket]:
        """Drop every lease whose time is up and grant what that frees. A tethered lease
        whose holder still holds it is extended by ``lease_ttl`` instead."""
        expired = False
        kept: list[LeaseRecord] = []
        while self._expiries and self._expiries[0][0] <= now:
            expires_at, lease_id = heapq.heappop(self._expiries)
            record = self.leases.get(lease_id)
            if record is None or record.expires_at != expires_at:
                continue
            if holds(record.tether):
                kept.append(record)
                continue
            del self.leases[lease_id]
            self._drop(record)
            expired = True
        for record in kept:
            record.expires_at = now + self.lease_ttl
            heapq.heappush(self._expiries, (record.expires_at, record.lease_id))
        return self._allocate(now) if expired and allocate else []

    def paused(self, now: float) -> bool:
        """Whether a pause was in force and has ended by ``now`` (so waiters can go)."""
        return -math.inf < self.paused_until <= now

    def unpause(self) -> None:
        """Forget a pause that has ended (after the grants it held back were made)."""
        self.paused_until = -math.inf
        self._retime()

    def throttle(
        self, lease_id: str | None, retry_after: float | None, now: float, jitter: float
    ) -> Throttle:
        """The provider refused a request (the lease ``lease_id``, if still held): grant
        nothing before ``now + retry_after`` (or a doubling backoff when it gave none), and
        lower an adaptive limit. Held slots are untouched; waiters keep their places."""
        self.paused_until, self._backoffs = pause(
            self.paused_until, self._backoffs, retry_after, now, jitter
        )
        self._retime()
        record = self.leases.get(lease_id) if lease_id is not None else None
        change = None
        if record is not None:
            record.succeeded = False
            if self.aimd is not None:
                old = self.aimd.limit
                new = self.aimd.pushback(record.epoch)
                if new is not None:
                    self._set_limit(new)
                    change = (old, new)
        return Throttle(paused_until=self.paused_until, limit=change)

    def charge(self, workload: str, kind: str, units: int, now: float) -> list[Ticket]:
        """Charge ``units`` more of ``kind`` to the buckets of ``workload`` (a refund when
        negative: an estimate corrected after the fact); returns what a refund grants."""
        if not self.bank or not units:
            return []
        self.bank.refill(now)
        self.bank.give(workload, kind, units)
        return self._allocate(now) if units < 0 else []

    def reconfigure(
        self,
        rules: Rules,
        max_queued: int | None,
        now: float,
        adaptive: tuple[int, float] | None = None,
    ) -> tuple[list[Ticket], list[Ticket]]:
        """Apply new limits at once. Every held lease still counts until it is released or
        expires (a workload that is gone keeps its leases, as a workload that can take
        nothing more). Waiters that can never be granted under the new limits are refused
        (``ticket.refused`` says why): those of a workload that is gone, and those whose
        cost a bucket made smaller can never hold. Returns (granted, refused)."""
        refused: list[Ticket] = []
        for name in list(self.queues):
            if name not in rules.workloads:
                gone = list(self.queues.pop(name).values())
                for ticket in gone:
                    ticket.refused = ConcurrencyConfigError(
                        f"workload {name!r} was removed by set_limits() while this request waited"
                    )
                refused += gone
        rules = retire(rules, self.active)
        for name in rules.workloads:
            self.queues.setdefault(name, OrderedDict())
        self._views = {name: queue.values() for name, queue in self.queues.items()}
        self.queued -= len(refused)
        self.active = {name: self.active.get(name, 0) for name in rules.workloads}
        self.aimd, rules = readapt(self.aimd, rules, adaptive)
        self.rules = rules
        self.max_queued = max_queued
        self.shared_used = sum(
            max(0, held - rules.workloads[name].reserved) for name, held in self.active.items()
        )
        self.bank = carry_over(self.bank, rules, now)
        self._retime()
        refused += self._refuse_oversized()
        return self._allocate(now), refused

    def _refuse_oversized(self) -> list[Ticket]:
        """Take out of the queues the waiters whose cost a bucket can never hold (their
        buckets were made smaller), each with its error, as `check_cost` gives it."""
        if not any(bucket.rule.kind == "tokens" for bucket in self.bank.buckets.values()):
            return []  # a request costs one request, and every bucket holds one
        refused = []
        for queue in self.queues.values():
            for ticket in list(queue.values()):
                error = cost_error(self.bank, ticket.workload, ticket.cost)
                if error is not None:
                    ticket.refused = error
                    del queue[ticket.seq]
                    self.queued -= 1
                    refused.append(ticket)
        return refused

    def rebase(self, now: float) -> None:
        """The shell moved this idle state (no lease, no waiter) to another clock: forget
        every time kept on the old one."""
        assert not self.leases
        assert not self.queued
        self._expiries.clear()
        self.bank = Bank(self.rules.buckets, -math.inf)
        self.paused_until = -math.inf
        self._refill_at = math.inf
        self._retime()

    def clear(self) -> None:
        """Drop every lease and waiter: the shell knows none of them can ever be used."""
        self.bank = Bank(self.rules.buckets, -math.inf)
        self.paused_until = -math.inf
        self._refill_at = math.inf
        self._retime()
        self.leases.clear()
        for queue in self.queues.values():
            queue.clear()
        self.queued = 0
        self.active = dict.fromkeys(self.active, 0)
        self.shared_used = 0
        self._expiries.clear()

    def next_wake(self, now: float) -> float | None:
        """When time alone can next change what is granted: the earliest lease expiry, the
        refill a blocked head waits for, the end of a pause. None: never."""
        wake = min(
            self.next_expiry() or math.inf, paced_wake(self._refill_at, self.paused_until, now)
        )
        return None if wake == math.inf else wake

    def next_expiry(self) -> float | None:
        """When the earliest lease may expire (a lower bound: renewals move it later)."""
        while self._expiries:
            expires_at, lease_id = self._expiries[0]
            record = self.leases.get(lease_id)
            if record is not None and record.expires_at == expires_at:
                return expires_at
            heapq.heappop(self._expiries)
        return None

    # -- internals ------------------------------------------------------------------------

    def _grant(self, ticket: Ticket, now: float) -> None:
        """Give ``ticket`` a new lease of its workload, counted."""
        workload = ticket.workload
        held = self.active[workload]
        if held >= self.rules.workloads[workload].reserved:
            self.shared_used += 1
        self.active[workload] = held + 1
        lease_id = f"{self._prefix}-{next(self._lease_seq)}"
        holder = ticket.holder
        tether = None
        if holder is not None:
            tether = weakref.ref(holder)
            ticket.holder = None  # the lease's tether refers to it from now on
        aimd = self.aimd
        if aimd is None:
            record = LeaseRecord(lease_id, workload, now + self.lease_ttl, tether, 0)
        else:
            record = LeaseRecord(
                lease_id,
                workload,
                now + self.lease_ttl,
                tether,
                aimd.epoch,
                slots_tried(self.rules, self.active),
            )
        self.leases[lease_id] = record
        heapq.heappush(self._expiries, (record.expires_at, lease_id))
        ticket.lease = record

    def _set_limit(self, limit: int) -> None:
        self.rules = attrs.evolve(self.rules, max_concurrent=limit)
        # Held slots stay: shared_used may now exceed the smaller shared capacity, and no
        # workload has room beyond its reservation until enough of them are released.

    def _compact(self) -> None:
        # Released and renewed leases leave stale entries in the expiry heap; rebuilding it
        # once it holds twice the live leases (and 64) keeps it O(leases) at O(1) amortized
        # cost: the next rebuild waits until as many entries again have been pushed.
        self._expiries = [(r.expires_at, r.lease_id) for r in self.leases.values()]
        heapq.heapify(self._expiries)
        self._compact_at = 2 * len(self.leases) + 64

    def _drop(self, record: LeaseRecord) -> None:
        held = self.active[record.workload] - 1
        self.active[record.workload] = held
        if held >= self.rules.workloads[record.workload].reserved:
            self.shared_used -= 1

    def _allocate(self, now: float) -> list[Ticket]:
        if not self.queued:
            return []
        queues = self.queues
        # Only the workloads that wait: with one, allocate() takes its heads without choosing.
        views = self._views if len(queues) == 1 else {w: q.values() for w, q in queues.items() if q}
        if self.timed:
            granted, self._refill_at = allocate_paced(
                self.rules,
                self.active,
                views,
                _arrival,
                now=now,
                bank=self.bank,
                paused_until=self.paused_until,
                cost=_cost,
                enqueued_at=_enqueued_at,
                waited=_waited,
            )
        else:
            self._refill_at = math.inf
            granted = allocate(
                self.rules, self.active, views, _arrival, shared_used=self.shared_used
            )
        for ticket in granted:
            del queues[ticket.workload][ticket.seq]
            self._grant(ticket, now)
        self.queued -= len(granted)
        return granted


def _waited(ticket: Ticket, reasons: list[str]) -> None:
    if ticket.rate_waits is None:
        ticket.rate_waits = set(reasons)
    else:
        ticket.rate_waits.update(reasons)


def _enqueued_at(ticket: Ticket) -> float:
    return ticket.enqueued_at


# -- the time-dependent rules, shared with backends that keep their state elsewhere ---------


def check_cost(bank: Bank, workload: str, cost: Cost) -> None:
    """Raise `ConcurrencyConfigError` when a request of ``workload`` costing ``cost`` can
    never be granted: one of its buckets can never hold that much."""
    error = cost_error(bank, workload, cost)
    if error is not None:
        raise error


def cost_error(bank: Bank, workload: str, cost: Cost) -> ConcurrencyConfigError | None:
    """The error of a request of ``workload`` costing ``cost`` that one of its buckets can
    never hold, or None when every bucket can."""
    oversized = bank.oversized(workload, cost)
    if oversized is None:
        return None
    key, units, rule = oversized
    return ConcurrencyConfigError(
        f"a request of {units} {rule.kind} can never be granted: bucket {key!r} "
        f"holds at most {rule.capacity} {rule.kind} per {rule.per:g}s"
    )


def pause(
    paused_until: float, backoffs: int, retry_after: float | None, now: float, jitter: float
) -> tuple[float, int]:
    """A provider's refusal at ``now``: the new end of the pause, and the number of pauses
    without a retry-after since the last success (the next backoff's step).

    ``retry_after`` None means a doubling backoff (`backoff_delay`); a pause already in
    force that ends later stays. A refusal without a retry-after while a backoff's pause is
    in force does not double the backoff: nothing was granted during the pause, so its
    request went out before the pause began, with the burst that caused it (eight requests
    in flight refused together pause for a second, not for a minute)."""
    if retry_after is None:
        if paused_until > now and backoffs:
            retry_after = backoff_delay(backoffs - 1, jitter)  # the burst's own step
        else:
            retry_after = backoff_delay(backoffs, jitter)
            backoffs += 1
    return max(paused_until, now + max(0.0, retry_after)), backoffs


def retire(rules: Rules, active: Mapping[str, int]) -> Rules:
    """``rules`` plus, for each workload that is gone but still holds slots, a workload that
    can take nothing more: its held slots keep counting until released or expired."""
    retired = {
        name: WorkloadRule(ceiling=0, reserved=0, priority=0)
        for name, held in active.items()
        if held and name not in rules.workloads
    }
    if not retired:
        return rules
    return attrs.evolve(rules, workloads={**rules.workloads, **retired})


def readapt(
    aimd: Aimd | None, rules: Rules, adaptive: tuple[int, float] | None
) -> tuple[Aimd | None, Rules]:
    """The adaptive limit under new ``rules`` (``adaptive``: its floor and backoff, or None
    for none), and the rules with the limit in force as their ``max_concurrent``. What
    pushback taught is kept, within the new bounds."""
    if adaptive is None:
        return None, rules
    floor, backoff = adaptive
    limit = rules.max_concurrent
    if aimd is not None:
        limit = min(max(aimd.limit, floor), rules.max_concurrent)
    epoch = 0 if aimd is None else aimd.epoch
    aimd = Aimd(
        floor=floor,
        ceiling=rules.max_concurrent,
        backoff=backoff,
        limit=limit,
        epoch=epoch,
        slow_start=aimd is not None and aimd.slow_start,  # a slow start goes on
        proven=0 if aimd is None else aimd.proven,
    )
    return aimd, attrs.evolve(rules, max_concurrent=limit)


def carry_over(old: Bank, rules: Rules, now: float) -> Bank:
    """The buckets of ``rules``, full, except those already in ``old``: they keep what was
    spent by ``now`` (within their new capacity)."""
    bank = Bank(rules.buckets, -math.inf)
    for key, bucket in bank.buckets.items():
        previous = old.buckets.get(key)
        if previous is not None:
            previous.refill(now)
            bucket.learned, bucket.learned_until = previous.learned, previous.learned_until
            bucket.level = min(previous.level, bucket.capacity)
            bucket.updated = now
    return bank


def paced_wake(refill_at: float, paused_until: float, now: float) -> float:
    """When time alone can next grant something: the refill a blocked head waits for, or
    the end of a pause in force (``inf``: never)."""
    return min(refill_at, paused_until) if paused_until > now else refill_at


def allocate_paced(
    rules: Rules,
    active: Mapping[str, int],
    queues: Mapping[str, Collection[E]],
    order: Callable[[E], Any],
    *,
    now: float,
    bank: Bank,
    paused_until: float,
    cost: Callable[[E], Cost],
    enqueued_at: Callable[[E], float],
    waited: Callable[[E, list[str]], object],
) -> tuple[list[E], float]:
    """`allocate` with the rate buckets and the pause: nothing while paused; otherwise the
    buckets are refilled to ``now`` and the grants' costs taken from them.

    ``waited`` is told what held a request back: the bucket keys of a head that must wait
    for them, and ``"pause"`` for a request granted that arrived before the pause ended.
    Returns the grants and when a head blocked by buckets can have them (``inf``: none is).
    """
    if now < paused_until:
        return [], math.inf
    refill_at = math.inf
    if bank:
        bank.refill(now)

        def blocked(item: E, keys: list[str], wait: float) -> None:
            nonlocal refill_at
            waited(item, keys)
            # Strictly later than now, even when rounding makes `now + wait` equal it: a
            # waiter woken at `now` again would spin without the clock moving (a virtual
            # clock never moves while a task runs).
            refill_at = min(refill_at, max(now + wait, math.nextafter(now, math.inf)))

        granted = allocate(rules, active, queues, order, bank=bank, cost=cost, blocked=blocked)
    else:
        granted = allocate(rules, active, queues, order)
    for item in granted:
        if enqueued_at(item) < paused_until:
            waited(item, ["pause"])
    return granted, refill_at
