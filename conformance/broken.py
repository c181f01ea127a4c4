"""Deliberately broken limiters, each with one flaw a real backend could have.

The conformance suite must reject every one of them with the case aimed at its flaw. Two
families:

- :class:`SimpleLimiter`, a small correct single-workload limiter (first come, first served;
  a release hands the slot straight to the next waiter), and subclasses that each break one
  piece of it: the races and cancellation bugs live in the waiting code.
- :class:`Wrapped`, which delegates to :class:`slotwise.MemoryLimiter`, and factories that
  build a MemoryLimiter with a setting quietly dropped or changed: the allocation-rule bugs.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import anyio
from anyio.lowlevel import checkpoint

from slotwise import (
    AcquireRequest,
    ConcurrencyConfigError,
    Lease,
    LimiterStats,
    MemoryLimiter,
    SupportsLease,
    Workload,
    WorkloadStats,
)

Factory = Callable[..., Any]


class _Waiter:
    def __init__(self) -> None:
        self.event = anyio.Event()
        self.lease: Lease | None = None


class SimpleLimiter:
    """A correct limiter of one workload: the control for its broken subclasses."""

    def __init__(
        self,
        *,
        name: str = "default",
        max_concurrent: int,
        lease_ttl: float = 30.0,
        **ignored: Any,
    ) -> None:
        self.name = name
        self.max_concurrent = max_concurrent
        self.lease_ttl = lease_ttl
        self._leases: dict[str, float] = {}  # lease id -> expiry
        self._queue: list[_Waiter] = []

    async def acquire(self, request: AcquireRequest) -> Lease:
        await checkpoint()
        self._expire()
        if not self._queue and len(self._leases) < self.max_concurrent:
            return await self._take()
        waiter = _Waiter()
        self._queue.append(waiter)
        try:
            await self._wait(waiter)
        except BaseException:
            self._leave(waiter)
            raise
        assert waiter.lease is not None
        return waiter.lease

    async def renew(self, lease: SupportsLease) -> Lease | None:
        self._expire()
        if lease.lease_id not in self._leases:
            return None
        return self._set_expiry(lease.lease_id)

    async def release(self, lease: SupportsLease) -> None:
        self._drop(lease.lease_id)

    async def stats(self) -> LimiterStats:
        self._expire()
        active, queued = len(self._leases), len(self._queue)
        return LimiterStats(
            active=active,
            queued=queued,
            workloads={"default": WorkloadStats(active=active, queued=queued)},
        )

    # -- the pieces the broken subclasses replace -------------------------------------------

    async def _take(self) -> Lease:
        return self._new_lease()

    async def _wait(self, waiter: _Waiter) -> None:
        while waiter.lease is None:
            with anyio.CancelScope(deadline=self._next_expiry()):
                await waiter.event.wait()
            self._expire()

    def _leave(self, waiter: _Waiter) -> None:
        if waiter in self._queue:
            self._queue.remove(waiter)
        if waiter.lease is not None:  # granted as it was cancelled: give it back
            self._drop(waiter.lease.lease_id)

    def _hand_on(self) -> None:
        while self._queue and len(self._leases) < self.max_concurrent:
            waiter = self._queue.pop(0)
            waiter.lease = self._new_lease()
            waiter.event.set()

    # -- shared -----------------------------------------------------------------------------

    def _new_lease(self) -> Lease:
        return self._set_expiry(uuid.uuid4().hex)

    def _set_expiry(self, lease_id: str) -> Lease:
        expires_at = anyio.current_time() + self.lease_ttl
        self._leases[lease_id] = expires_at
        return Lease(lease_id=lease_id, workload="default", expires_at=expires_at)

    def _drop(self, lease_id: str) -> None:
        if self._leases.pop(lease_id, None) is not None:
            self._hand_on()

    def _expire(self) -> None:
        now = anyio.current_time()
        for lease_id, expires_at in list(self._leases.items()):
            if expires_at <= now:
                del self._leases[lease_id]
        self._hand_on()

    def _next_expiry(self) -> float:
        return min(self._leases.values(), default=math.inf)


class OverGrants(SimpleLimiter):
    """Checks for room, then awaits (a round trip, say) before taking the slot."""

    async def _take(self) -> Lease:
        await checkpoint()
        return self._new_lease()


class LeaksOnCancel(SimpleLimiter):
    """A waiter cancelled after the slot was handed to it keeps the slot forever."""

    def _leave(self, waiter: _Waiter) -> None:
        if waiter in self._queue:
            self._queue.remove(waiter)


class LosesWakeups(SimpleLimiter):
    """A release wakes the next waiter, which takes the slot when it runs; a woken waiter
    that is cancelled first wakes nobody (the asyncio.Semaphore bug of CPython gh-90155)."""

    def _hand_on(self) -> None:
        if self._queue and len(self._leases) < self.max_concurrent:
            self._queue.pop(0).event.set()

    async def _wait(self, waiter: _Waiter) -> None:
        while True:
            with anyio.CancelScope(deadline=self._next_expiry()):
                await waiter.event.wait()
            if not waiter.event.is_set():
                self._expire()
            elif len(self._leases) < self.max_concurrent:
                waiter.lease = self._new_lease()
                return
            else:  # someone else took the slot first: wait again, at the front
                waiter.event = anyio.Event()
                self._queue.insert(0, waiter)


class ClaimsAfterWakeup(SimpleLimiter):
    """A release wakes the next waiter without counting the slot as taken; the waiter
    claims it when it runs, while a newcomer may already have taken it (anyio#1170)."""

    def _hand_on(self) -> None:
        if self._queue and len(self._leases) < self.max_concurrent:
            self._queue.pop(0).event.set()

    async def _wait(self, waiter: _Waiter) -> None:
        while True:
            with anyio.CancelScope(deadline=self._next_expiry()):
                await waiter.event.wait()
            if waiter.event.is_set():
                waiter.lease = self._new_lease()
                return
            self._expire()


class RenewalDoesNotExtend(SimpleLimiter):
    """Renewing reports success but leaves the expiry where it was."""

    async def renew(self, lease: SupportsLease) -> Lease | None:
        self._expire()
        if lease.lease_id not in self._leases:
            return None
        return Lease(
            lease_id=lease.lease_id, workload="default", expires_at=self._leases[lease.lease_id]
        )


class ServesNewestFirst(SimpleLimiter):
    """Hands a freed slot to the request that arrived last."""

    def _hand_on(self) -> None:
        while self._queue and len(self._leases) < self.max_concurrent:
            waiter = self._queue.pop()
            waiter.lease = self._new_lease()
            waiter.event.set()


class ReleaseNotIdempotent(SimpleLimiter):
    """Releasing a lease twice raises."""

    async def release(self, lease: SupportsLease) -> None:
        del self._leases[lease.lease_id]
        self._hand_on()


class RenewsAnyLease(SimpleLimiter):
    """Renewing writes a fresh expiry without checking that the lease is still held."""

    async def renew(self, lease: SupportsLease) -> Lease | None:
        return self._set_expiry(lease.lease_id)


# -- MemoryLimiter with one thing wrong ---------------------------------------------------


class Wrapped:
    """Delegates everything to a MemoryLimiter; the subclasses change one member."""

    def __init__(self, **limits: Any) -> None:
        self.inner: MemoryLimiter[str] = MemoryLimiter(**limits)
        self.name = self.inner.name
        self.lease_ttl = self.inner.lease_ttl

    def validate_workload(self, workload: str | None) -> str:
        return self.inner.validate_workload(workload)

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        return await self.inner.acquire(request)

    async def renew(self, lease: SupportsLease) -> SupportsLease | None:
        return await self.inner.renew(lease)

    async def release(self, lease: SupportsLease) -> None:
        await self.inner.release(lease)

    async def stats(self) -> LimiterStats:
        return await self.inner.stats()


class ReusesLeaseIds(Wrapped):
    """Names each lease after the slot it occupies, so a freed slot's id comes back."""

    def __init__(self, **limits: Any) -> None:
        super().__init__(**limits)
        self._slots: dict[str, Lease] = {}  # "slot-N" -> the inner lease

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        inner = await self.inner.acquire(request)
        number = next(n for n in range(len(self._slots) + 1) if f"slot-{n}" not in self._slots)
        self._slots[f"slot-{number}"] = inner
        return Lease(lease_id=f"slot-{number}", workload=inner.workload, expires_at=0.0)

    async def renew(self, lease: SupportsLease) -> SupportsLease | None:
        inner = self._slots.get(lease.lease_id)
        if inner is None or await self.inner.renew(inner) is None:
            return None
        return lease

    async def release(self, lease: SupportsLease) -> None:
        inner = self._slots.pop(lease.lease_id, None)
        if inner is not None:
            await self.inner.release(inner)


class IgnoresDeadline(Wrapped):
    """Drops the request's deadline and waits as long as max_wait allows."""

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        return await self.inner.acquire(
            AcquireRequest(workload=request.workload, request_id=request.request_id)
        )


class NeverCountsQueued(Wrapped):
    """Reports active slots but never the waiting requests."""

    async def stats(self) -> LimiterStats:
        stats = await self.inner.stats()
        return LimiterStats(
            active=stats.active,
            queued=0,
            workloads={
                name: WorkloadStats(active=workload.active, queued=0)
                for name, workload in stats.workloads.items()
            },
        )


def _with_workloads(change: Callable[[int, Workload], Workload]) -> Factory:
    def create(**limits: Any) -> MemoryLimiter[str]:
        workloads = limits.get("workloads")
        if isinstance(workloads, Mapping):
            limits["workloads"] = {
                name: change(index, workload)
                for index, (name, workload) in enumerate(workloads.items())
            }
        return MemoryLimiter(**limits)

    return create


def never_expires(**limits: Any) -> MemoryLimiter[str]:
    """Leases live for years whatever lease_ttl says."""
    return MemoryLimiter(**{**limits, "lease_ttl": 1e9})


def unbounded_queue(**limits: Any) -> MemoryLimiter[str]:
    """Ignores max_queued."""
    return MemoryLimiter(**{**limits, "max_queued": None})


def accepts_invalid_limits(**limits: Any) -> MemoryLimiter[str]:
    """Falls back to one slot when the settings are invalid, instead of raising."""
    try:
        return MemoryLimiter(**limits)
    except ConcurrencyConfigError:
        return MemoryLimiter(max_concurrent=1)


ignores_priority = _with_workloads(
    lambda index, workload: Workload(
        max_concurrent=workload.max_concurrent,
        reserved=workload.reserved,
        max_wait=workload.max_wait,
    )
)
ignores_priority.__doc__ = "Serves every workload at priority 0."

lends_reservations = _with_workloads(
    lambda index, workload: Workload(
        max_concurrent=workload.max_concurrent,
        priority=workload.priority,
        max_wait=workload.max_wait,
    )
)
lends_reservations.__doc__ = "Treats reserved slots as shared ones, free for any workload."

serves_workloads_in_order = _with_workloads(
    lambda index, workload: Workload(
        max_concurrent=workload.max_concurrent,
        reserved=workload.reserved,
        priority=workload.priority * 1000 - index,
        max_wait=workload.max_wait,
    )
)
serves_workloads_in_order.__doc__ = (
    "Breaks priority ties by workload order, not by how long a request has waited."
)

ignores_max_wait = _with_workloads(
    lambda index, workload: Workload(
        max_concurrent=workload.max_concurrent,
        reserved=workload.reserved,
        priority=workload.priority,
    )
)
ignores_max_wait.__doc__ = "Lets every request wait without a limit."
