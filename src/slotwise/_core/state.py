"""The in-process state of a limiter: wait queues and lease table, with ``now`` passed in.

A backend keeps one :class:`LimiterState` and calls it synchronously, so every read and the
grant that follows happen with no ``await`` in between: that is what makes allocation atomic in
memory. Each method that can free capacity returns the tickets it granted; the caller wakes
their waiters.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import attrs

from .._errors import ConcurrencyQueueFullError
from .rules import Rules, allocate, has_room

__all__ = ("LeaseRecord", "LimiterState", "Ticket")


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

    __slots__ = ("expires_at", "lease_id", "tether", "workload")

    def __init__(
        self, lease_id: str, workload: str, expires_at: float, tether: Tether | None
    ) -> None:
        self.lease_id = lease_id
        self.workload = workload
        self.expires_at = expires_at
        self.tether = tether

    def __repr__(self) -> str:
        return f"LeaseRecord({self.lease_id!r}, {self.workload!r}, expires_at={self.expires_at})"


@attrs.define(eq=False)
class Ticket:
    """One request for a slot. ``lease`` is set when it is granted; ``waker`` is the shell's."""

    seq: int
    workload: str
    enqueued_at: float
    lease: LeaseRecord | None = None
    waker: Any = None
    tether: Tether | None = None


def _arrival(ticket: Ticket) -> int:
    # In one process arrival order is also waiting-time order: seq grows with time.
    return ticket.seq


class LimiterState:
    """Queues and leases of one limiter. Not thread-safe; never awaits."""

    def __init__(self, rules: Rules, *, max_queued: int | None, lease_ttl: float) -> None:
        self.rules = rules
        self.max_queued = max_queued
        self.lease_ttl = lease_ttl
        self.queues: dict[str, OrderedDict[int, Ticket]] = {
            name: OrderedDict() for name in rules.workloads
        }
        self.active: dict[str, int] = dict.fromkeys(rules.workloads, 0)
        self.leases: dict[str, LeaseRecord] = {}
        self.queued = 0
        self.shared_used = 0  # shared_in_use(rules, active), kept up to date
        # (expires_at, lease_id); stale entries (renewed or released leases) are skipped.
        self._expiries: list[tuple[float, str]] = []
        self._seq = itertools.count()
        # A per-state prefix keeps lease ids unique across limiters and restarts.
        self._prefix = secrets.token_hex(6)
        self._lease_seq = itertools.count(1)

    # -- requests -------------------------------------------------------------------------

    def submit(
        self, workload: str, now: float, tether: Tether | None = None
    ) -> tuple[Ticket, list[Ticket]]:
        """Add a request; return it (granted at once when ``ticket.lease`` is set) and any
        tickets granted because expired leases were swept first.

        Raises:
            ConcurrencyQueueFullError: it would have to wait and ``max_queued`` are waiting.
        """
        swept = self.expire(now) if self._expiries and self._expiries[0][0] <= now else []
        ticket = Ticket(seq=next(self._seq), workload=workload, enqueued_at=now, tether=tether)
        # Fast path of `allocate`: an empty queue means every earlier waiter belongs to a
        # workload without room, so this request goes first iff its own workload has room.
        if not self.queues[workload] and has_room(
            self.rules, self.active, workload, self.shared_used
        ):
            self._grant(ticket, now)
            return ticket, swept
        if self.max_queued is not None and self.queued >= self.max_queued:
            raise ConcurrencyQueueFullError(
                f"{self.queued} requests are already waiting (max_queued={self.max_queued})"
            )
        self.queues[workload][ticket.seq] = ticket
        self.queued += 1
        return ticket, swept

    def take_nowait(
        self, workload: str, now: float, tether: Tether | None
    ) -> tuple[LeaseRecord | None, list[Ticket]]:
        """Grant a slot now if the request would not have to wait, else take nothing; also
        return the tickets granted because expired leases were swept first."""
        swept = self.expire(now) if self._expiries and self._expiries[0][0] <= now else []
        if self.queues[workload] or not has_room(
            self.rules, self.active, workload, self.shared_used
        ):
            return None, swept
        return self._lease(workload, now, tether), swept

    def regrant(self, ticket: Ticket, now: float) -> list[Ticket]:
        """A granted ticket whose lease ran out before its waiter could use it (the waiter's
        thread or loop stalled): drop that lease and put the ticket back at the head of its
        queue, where it was when it was granted. Returns what allocation grants now, which
        may be the ticket itself again."""
        record = ticket.lease
        assert record is not None
        ticket.lease = None
        if self.leases.get(record.lease_id) is record:
            del self.leases[record.lease_id]
            self._drop(record)
        queue = self.queues[ticket.workload]
        queue[ticket.seq] = ticket
        queue.move_to_end(ticket.seq, last=False)
        self.queued += 1
        return self._allocate(now)

    def withdraw(self, ticket: Ticket, now: float) -> list[Ticket]:
        """Take a request back: out of the queue, or, if it was granted meanwhile, give the
        slot back. Idempotent. Returns the tickets granted with the freed capacity."""
        if ticket.lease is not None:
            return self.release(ticket.lease.lease_id, now)
        if self.queues[ticket.workload].pop(ticket.seq, None) is not None:
            self.queued -= 1
        return []

    # -- leases ---------------------------------------------------------------------------

    def release(self, lease_id: str, now: float) -> list[Ticket]:
        """End a lease (idempotent) and grant what it frees."""
        record = self.leases.pop(lease_id, None)
        if record is None:
            return []
        self._drop(record)
        self._compact()
        return self._allocate(now)

    def renew(self, lease_id: str, now: float) -> LeaseRecord | None:
        """Extend a valid lease by ``lease_ttl``; None when it is no longer held."""
        record = self.leases.get(lease_id)
        if record is None or (record.expires_at <= now and not holds(record.tether)):
            return None
        record.expires_at = now + self.lease_ttl
        heapq.heappush(self._expiries, (record.expires_at, lease_id))
        self._compact()
        return record

    def expire(self, now: float) -> list[Ticket]:
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
        return self._allocate(now) if expired else []

    def rebase(self, now: float) -> None:
        """The shell moved this idle state (no lease, no waiter) to another clock: forget
        every time kept on the old one."""
        assert not self.leases
        assert not self.queued
        self._expiries.clear()

    def clear(self) -> None:
        """Drop every lease and waiter: the shell knows none of them can ever be used."""
        self.leases.clear()
        for queue in self.queues.values():
            queue.clear()
        self.queued = 0
        self.active = dict.fromkeys(self.active, 0)
        self.shared_used = 0
        self._expiries.clear()

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
        ticket.lease = self._lease(ticket.workload, now, ticket.tether)

    def _lease(self, workload: str, now: float, tether: Tether | None) -> LeaseRecord:
        lease_id = f"{self._prefix}-{next(self._lease_seq)}"
        record = LeaseRecord(lease_id, workload, now + self.lease_ttl, tether)
        self.leases[lease_id] = record
        held = self.active[workload]
        if held >= self.rules.workloads[workload].reserved:
            self.shared_used += 1
        self.active[workload] = held + 1
        heapq.heappush(self._expiries, (record.expires_at, lease_id))
        return record

    def _compact(self) -> None:
        # Released and renewed leases leave stale entries in the expiry heap; rebuilding it
        # once they outnumber the live ones keeps it O(leases) at O(1) amortized cost.
        if len(self._expiries) <= 2 * len(self.leases) + 64:
            return
        self._expiries = [(r.expires_at, r.lease_id) for r in self.leases.values()]
        heapq.heapify(self._expiries)

    def _drop(self, record: LeaseRecord) -> None:
        held = self.active[record.workload] - 1
        self.active[record.workload] = held
        if held >= self.rules.workloads[record.workload].reserved:
            self.shared_used -= 1

    def _allocate(self, now: float) -> list[Ticket]:
        if not self.queued:
            return []
        granted = allocate(
            self.rules, self.active, {w: q.values() for w, q in self.queues.items()}, _arrival
        )
        for ticket in granted:
            del self.queues[ticket.workload][ticket.seq]
            self.queued -= 1
            self._grant(ticket, now)
        return granted
