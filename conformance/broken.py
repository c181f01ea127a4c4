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
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import attrs
from anyio.lowlevel import checkpoint

from slotwise import (
    AcquireRequest,
    ConcurrencyConfigError,
    ConcurrencyTimeoutError,
    Lease,
    LimiterStats,
    MemoryLimiter,
    Rate,
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
        self.lease_ttl = lease_ttl  # read by the runtime: it renews every third of it
        self._lifetime = lease_ttl
        self._leases: dict[str, float] = {}  # lease id -> expiry
        self._queue: list[_Waiter] = []

    async def acquire(self, request: AcquireRequest) -> Lease:
        # Take a slot or join the queue at once, then yield: requests that arrive together
        # keep the order of their calls, whatever order their tasks resume in.
        self._expire()
        if not self._queue and self._room():
            lease = await self._take()
            try:
                await checkpoint()
            except BaseException:
                self._drop(lease.lease_id)
                raise
            return lease
        waiter = _Waiter()
        self._join(waiter)
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

    def _join(self, waiter: _Waiter) -> None:
        self._queue.append(waiter)

    async def _wait(self, waiter: _Waiter) -> None:
        while True:
            with anyio.CancelScope(deadline=self._next_expiry()):
                await waiter.event.wait()
            self._expire()
            if waiter.lease is None:
                continue
            if waiter.lease.lease_id in self._leases:
                return
            # Handed a slot whose lease ran out before this task resumed (the event loop
            # stalled): it was never held. Wait again, first in line.
            waiter.lease = None
            waiter.event = anyio.Event()
            self._queue.insert(0, waiter)
            self._hand_on()

    def _leave(self, waiter: _Waiter) -> None:
        if waiter in self._queue:
            self._queue.remove(waiter)
        if waiter.lease is not None:  # granted as it was cancelled: give it back
            self._drop(waiter.lease.lease_id)

    def _hand_on(self) -> None:
        while self._queue and self._room():
            waiter = self._queue.pop(0)
            waiter.lease = self._new_lease()
            waiter.event.set()

    def _room(self) -> bool:
        return len(self._leases) < self.max_concurrent

    def _end(self, lease_id: str) -> None:
        """A lease ran out."""
        del self._leases[lease_id]

    # -- shared -----------------------------------------------------------------------------

    def _new_lease(self) -> Lease:
        return self._set_expiry(uuid.uuid4().hex)

    def _set_expiry(self, lease_id: str) -> Lease:
        expires_at = anyio.current_time() + self._lifetime
        self._leases[lease_id] = expires_at
        return Lease(lease_id=lease_id, workload="default", expires_at=expires_at)

    def _drop(self, lease_id: str) -> None:
        if self._leases.pop(lease_id, None) is not None:
            self._hand_on()

    def _expire(self) -> None:
        now = anyio.current_time()
        for lease_id, expires_at in list(self._leases.items()):
            if expires_at <= now:
                self._end(lease_id)
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
        if self._queue and self._room():
            self._queue.pop(0).event.set()

    async def _wait(self, waiter: _Waiter) -> None:
        while True:
            with anyio.CancelScope(deadline=self._next_expiry()):
                await waiter.event.wait()
            if not waiter.event.is_set():
                self._expire()
            elif self._room():
                waiter.lease = self._new_lease()
                return
            else:  # someone else took the slot first: wait again, at the front
                waiter.event = anyio.Event()
                self._queue.insert(0, waiter)


class ClaimsAfterWakeup(SimpleLimiter):
    """A release wakes the next waiter without counting the slot as taken; the waiter
    claims it when it runs, while a newcomer may already have taken it (anyio#1170)."""

    def _hand_on(self) -> None:
        if self._queue and self._room():
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
        while self._queue and self._room():
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


class QueuesBatchesBackwards(SimpleLimiter):
    """Sends the requests that arrive in the same tick to its queue in one round trip, pushed
    to the front one by one: requests that arrive together are served newest first."""

    def __init__(self, **limits: Any) -> None:
        super().__init__(**limits)
        self._batch: list[_Waiter] = []

    def _join(self, waiter: _Waiter) -> None:
        self._batch.append(waiter)

    async def _wait(self, waiter: _Waiter) -> None:
        await checkpoint()  # the round trip: whoever runs first sends the whole batch
        if self._batch:
            self._queue.extend(reversed(self._batch))
            self._batch.clear()
            self._hand_on()
        await super()._wait(waiter)

    def _leave(self, waiter: _Waiter) -> None:
        if waiter in self._batch:
            self._batch.remove(waiter)
        super()._leave(waiter)


class HandsOutExpiredLeases(SimpleLimiter):
    """Returns the lease a release handed to a waiter without checking that it is still
    held when the waiter resumes, however late that is."""

    async def _wait(self, waiter: _Waiter) -> None:
        while waiter.lease is None:
            with anyio.CancelScope(deadline=self._next_expiry()):
                await waiter.event.wait()
            self._expire()


class RevivesExpiredLeases(SimpleLimiter):
    """Renews any lease still in its table: an expired one stays there until a request
    needs its slot, and a renewal in the meantime brings it back."""

    async def renew(self, lease: SupportsLease) -> Lease | None:
        if lease.lease_id not in self._leases:
            return None
        return self._set_expiry(lease.lease_id)


class RenewsForThirtySeconds(SimpleLimiter):
    """Renewing extends a lease by a fixed 30 s, whatever lease_ttl says."""

    async def renew(self, lease: SupportsLease) -> Lease | None:
        self._expire()
        if lease.lease_id not in self._leases:
            return None
        expires_at = self._leases[lease.lease_id] = anyio.current_time() + 30.0
        return Lease(lease_id=lease.lease_id, workload="default", expires_at=expires_at)


class RenewsFromOldExpiry(SimpleLimiter):
    """Renewing adds lease_ttl to the lease's expiry rather than to the time of the renewal
    (``SET expires_at = expires_at + ttl``): a lease renewed often outlives its holder by
    many lease_ttl."""

    async def renew(self, lease: SupportsLease) -> Lease | None:
        self._expire()
        if lease.lease_id not in self._leases:
            return None
        expires_at = self._leases[lease.lease_id] = self._leases[lease.lease_id] + self._lifetime
        return Lease(lease_id=lease.lease_id, workload="default", expires_at=expires_at)


class ExpiresAtHalfTtl(SimpleLimiter):
    """Lets a lease (and each renewal) run for half of lease_ttl."""

    def __init__(self, **limits: Any) -> None:
        super().__init__(**limits)
        self._lifetime = self.lease_ttl / 2


class FreesExpiredSlots(SimpleLimiter):
    """Counts held slots beside its lease table; a release takes one off the count for any
    lease it issued and saw no release of, even one that expired and was counted free then
    (a counter decremented without checking that the lease was still there)."""

    def __init__(self, **limits: Any) -> None:
        super().__init__(**limits)
        self._held = 0
        self._unreleased: set[str] = set()

    def _room(self) -> bool:
        return self._held < self.max_concurrent

    def _new_lease(self) -> Lease:
        lease = super()._new_lease()
        self._held += 1
        self._unreleased.add(lease.lease_id)
        return lease

    def _end(self, lease_id: str) -> None:
        super()._end(lease_id)
        self._held -= 1

    def _drop(self, lease_id: str) -> None:
        if lease_id in self._unreleased:
            self._unreleased.discard(lease_id)
            self._leases.pop(lease_id, None)
            self._held -= 1
            self._hand_on()


class RenewLosesLeaseOnCancel(SimpleLimiter):
    """Renewing deletes the lease and writes it back with its new expiry after a round trip:
    a renewal cancelled in between loses the lease."""

    async def renew(self, lease: SupportsLease) -> Lease | None:
        self._expire()
        if self._leases.pop(lease.lease_id, None) is None:
            return None
        await checkpoint()  # the round trip to the store
        return self._set_expiry(lease.lease_id)


class CycleTimeLeaseIds(SimpleLimiter):
    """Names each lease after the time of the allocation that granted it, as SQL's `now()`
    (the time its transaction began) would: the leases one allocation grants share an id."""

    def __init__(self, **limits: Any) -> None:
        super().__init__(**limits)
        self._cycle = 0.0

    def _expire(self) -> None:
        self._cycle = anyio.current_time()
        super()._expire()

    def _drop(self, lease_id: str) -> None:
        self._cycle = anyio.current_time()
        super()._drop(lease_id)

    def _new_lease(self) -> Lease:
        return self._set_expiry(f"lease-{self._cycle!r}")


class HidesLeaseTtl(SimpleLimiter):
    """Keeps its lease lifetime to itself (no lease_ttl attribute), so the runtime renews
    its leases at its 30 s default pace."""

    def __init__(self, **limits: Any) -> None:
        super().__init__(**limits)
        del self.lease_ttl


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

    def charge_tokens(self, lease: SupportsLease, tokens: int) -> None:
        self.inner.charge_tokens(lease, tokens)

    def throttle(
        self, lease: SupportsLease | None, retry_after: float | None = None
    ) -> tuple[float, tuple[int, int] | None]:
        return self.inner.throttle(lease, retry_after)

    async def set_limits(self, **limits: Any) -> None:
        await self.inner.set_limits(**limits)


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


class AcceptsUnknownWorkloads(Wrapped):
    """Serves a request for a workload it does not have as one for the default workload."""

    def validate_workload(self, workload: str | None) -> str:
        return self.inner.validate_workload(workload if workload in self.inner.workloads else None)

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        workload = self.validate_workload(request.workload)
        return await self.inner.acquire(attrs.evolve(request, workload=workload))


class MaxWaitFromQueueHead(Wrapped):
    """Times every waiter's max_wait from the arrival of the request at the head of the
    queue (one "queue started at" timestamp), not from the waiter's own arrival."""

    def __init__(self, **limits: Any) -> None:
        super().__init__(**limits)  # checks the settings as given
        workloads = self.inner.workloads
        self.max_waits = {name: workload.max_wait for name, workload in workloads.items()}
        untimed = {
            name: attrs.evolve(workload, max_wait=None) for name, workload in workloads.items()
        }
        self.inner = MemoryLimiter(**{**limits, "workloads": untimed})
        self._arrivals: dict[str, float] = {}  # request id -> arrival, while it waits

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        self._arrivals[request.request_id] = anyio.current_time()
        deadline = math.inf if request.deadline is None else request.deadline
        max_wait = self.max_waits.get(request.workload)
        if max_wait is not None:
            deadline = min(deadline, min(self._arrivals.values()) + max_wait)
        try:
            return await self.inner.acquire(attrs.evolve(request, deadline=deadline))
        finally:
            del self._arrivals[request.request_id]


class LendsIdleReservations(Wrapped):
    """Lends the reserved slots to other workloads once no reserved workload has used a slot
    for lease_ttl, as if a reservation were a lease that its workload must keep renewing."""

    def __init__(self, **limits: Any) -> None:
        super().__init__(**limits)
        workloads = self.inner.workloads
        self._reserving = {name for name, workload in workloads.items() if workload.reserved}
        self._lendable = sum(workload.reserved for workload in workloads.values())
        self._lent: set[str] = set()
        self._reserved_held: set[str] = set()
        self._used_at = anyio.current_time()  # when a reserved workload last held a slot

    def _idle(self) -> bool:
        now = anyio.current_time()
        return not self._reserved_held and now - self._used_at >= self.lease_ttl

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        if request.workload in self._reserving:
            lease = await self.inner.acquire(request)
            self._reserved_held.add(lease.lease_id)
            self._used_at = anyio.current_time()
            return lease
        try:  # a free slot now, or the reserved one if it is idle
            return await self.inner.acquire(attrs.evolve(request, deadline=-math.inf))
        except ConcurrencyTimeoutError:
            if not (self._idle() and len(self._lent) < self._lendable):
                return await self.inner.acquire(request)
        lease_id = f"lent-{uuid.uuid4().hex}"
        self._lent.add(lease_id)
        return Lease(lease_id=lease_id, workload=request.workload, expires_at=math.inf)

    async def renew(self, lease: SupportsLease) -> SupportsLease | None:
        if lease.lease_id in self._lent:
            return lease
        return await self.inner.renew(lease)

    async def release(self, lease: SupportsLease) -> None:
        self._lent.discard(lease.lease_id)
        if lease.lease_id in self._reserved_held:
            self._reserved_held.discard(lease.lease_id)
            self._used_at = anyio.current_time()
        await self.inner.release(lease)


class BlockableStorage(Wrapped):
    """A MemoryLimiter behind a store with a lock, held for a round trip by each acquire,
    and by ``blocked()`` (a stalled process holding it, say) for as long as it is entered."""

    def __init__(self, **limits: Any) -> None:
        super().__init__(**limits)
        self.storage = anyio.Lock()

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        await self._round_trip(request.deadline)
        return await self.inner.acquire(request)

    async def _round_trip(self, deadline: float | None) -> None:
        with anyio.move_on_at(math.inf if deadline is None else deadline):
            async with self.storage:
                await checkpoint()
            return
        raise ConcurrencyTimeoutError("the storage did not answer before the deadline")

    @asynccontextmanager
    async def blocked(self) -> AsyncIterator[None]:
        async with self.storage:
            yield


class BlocksPastDeadline(BlockableStorage):
    """Waits for its store's lock shielded, with no timeout: neither the request's deadline
    nor a cancellation ends that wait."""

    async def _round_trip(self, deadline: float | None) -> None:
        with anyio.CancelScope(shield=True):
            async with self.storage:
                await checkpoint()


def block_storage(limiter: Any) -> AbstractAsyncContextManager[None]:
    """``conformance_cases(block_storage=...)`` for a :class:`BlockableStorage`."""
    blocked: AbstractAsyncContextManager[None] = limiter.blocked()
    return blocked


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


class IgnoresTokenEstimates(Wrapped):
    """Grants a request without taking its estimated tokens: only corrections are charged."""

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        return await self.inner.acquire(attrs.evolve(request, tokens=0))


class ChargesHeldLeasesOnly(Wrapped):
    """Ignores a token correction for a lease it no longer holds, as if the usage of a
    request that has ended no longer mattered (it arrives at the end of a stream)."""

    def charge_tokens(self, lease: SupportsLease, tokens: int) -> None:
        if self.inner.renew_nowait(lease) is not None:
            self.inner.charge_tokens(lease, tokens)


class IgnoresPause(Wrapped):
    """Reports a pause when a request is refused, and keeps granting."""

    def throttle(
        self, lease: SupportsLease | None, retry_after: float | None = None
    ) -> tuple[float, tuple[int, int] | None]:
        return time.time() + (1.0 if retry_after is None else retry_after), None


class HandsOnDuringPause(Wrapped):
    """Keeps a request that finds a free slot during a pause waiting until it ends (or its
    deadline or max_wait), but lets a slot released during the pause go straight to the
    request queued for it: the hand-off skips the check for a pause."""

    def __init__(self, **limits: Any) -> None:
        super().__init__(**limits)
        self._until = -math.inf

    def throttle(
        self, lease: SupportsLease | None, retry_after: float | None = None
    ) -> tuple[float, tuple[int, int] | None]:
        pause = 1.0 if retry_after is None else retry_after
        self._until = max(self._until, anyio.current_time() + pause)
        return time.time() + pause, None

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        now = anyio.current_time()
        stats = self.inner.stats_nowait()
        if now < self._until and not stats.queued and stats.active < self.inner.max_concurrent:
            end = math.inf if request.deadline is None else request.deadline
            max_wait = self.inner.workloads[request.workload].max_wait
            if max_wait is not None:
                end = min(end, now + max_wait)
            await anyio.sleep(max(0.0, min(end, self._until) - now))
            if anyio.current_time() < self._until:
                raise ConcurrencyTimeoutError("no slot before the deadline")
        return await self.inner.acquire(request)


class SleepsThroughPause(Wrapped):
    """Sends every request that arrives during a pause to sleep until it ends, before it
    queues: its deadline and max_wait do not run meanwhile."""

    def __init__(self, **limits: Any) -> None:
        super().__init__(**limits)
        self._until = -math.inf

    def throttle(
        self, lease: SupportsLease | None, retry_after: float | None = None
    ) -> tuple[float, tuple[int, int] | None]:
        pause = 1.0 if retry_after is None else retry_after
        self._until = max(self._until, anyio.current_time() + pause)
        return time.time() + pause, None

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        # The pause may be extended while it sleeps.
        while anyio.current_time() < self._until:  # noqa: ASYNC110
            await anyio.sleep(self._until - anyio.current_time())
        return await self.inner.acquire(request)


class RevokesOnShrink(Wrapped):
    """Makes a smaller max_concurrent hold at once by ending the newest leases beyond it."""

    def __init__(self, **limits: Any) -> None:
        super().__init__(**limits)
        self._held: dict[str, SupportsLease] = {}  # in the order they were granted

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        lease = await self.inner.acquire(request)
        self._held[lease.lease_id] = lease
        return lease

    async def release(self, lease: SupportsLease) -> None:
        self._held.pop(lease.lease_id, None)
        await self.inner.release(lease)

    async def set_limits(self, **limits: Any) -> None:
        await self.inner.set_limits(**limits)
        while len(self._held) > self.inner.max_concurrent:
            await self.release(self._held[next(reversed(self._held))])


class AppliesSettingsInTurn(Wrapped):
    """Applies a new max_concurrent before it checks the other new settings: an invalid one
    raises, but the new limit has taken effect."""

    async def set_limits(self, **limits: Any) -> None:
        if "max_concurrent" in limits:
            await self.inner.set_limits(max_concurrent=limits.pop("max_concurrent"))
        await self.inner.set_limits(**limits)


class _Bucket:
    """A token bucket on the event loop's clock, full at the start."""

    def __init__(self, capacity: int, per: float) -> None:
        self.capacity = capacity
        self.per_second = capacity / per
        self.level = float(capacity)
        self.updated = anyio.current_time()

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.per_second)
        self.updated = now

    def wait(self, units: int) -> float:
        return max(0.0, (units - self.level) / self.per_second)


class _OverfillingBucket(_Bucket):
    def refill(self, now: float) -> None:
        self.level += (now - self.updated) * self.per_second
        self.updated = now


class ChecksRatesFirst(Wrapped):
    """Takes a request's rates from token buckets of its own before the request queues for
    a slot, each workload's requests one at a time in arrival order: a rate limiter in front
    of a semaphore, as peers are combined (its stats count the requests waiting for either).
    Across workloads, whichever waiter's tokens are there first takes them, whatever its
    priority."""

    def __init__(self, **limits: Any) -> None:
        super().__init__(**limits)  # checks the settings as given
        workloads = self.inner.workloads
        rates: list[tuple[str | None, Rate | None]] = [(None, limits.get("rate"))]
        rates += [(name, workload.rate) for name, workload in workloads.items()]
        self._buckets: dict[tuple[str | None, str], _Bucket] = {}
        for scope, rate in rates:
            for kind in ("requests", "tokens"):
                capacity = None if rate is None else getattr(rate, kind)
                if rate is not None and capacity is not None:
                    self._buckets[scope, kind] = self._bucket(capacity, rate.per)
        unrated = {name: attrs.evolve(workload, rate=None) for name, workload in workloads.items()}
        self.inner = MemoryLimiter(**{**limits, "rate": None, "workloads": unrated})
        self._turns = {name: anyio.Lock() for name in workloads}
        self._refunded = anyio.Event()
        self._gated = dict.fromkeys(workloads, 0)  # requests waiting for their rates

    _bucket = _Bucket

    def _needs(self, workload: str, cost: dict[str, int]) -> list[tuple[_Bucket, int]]:
        return [
            (bucket, cost[kind])
            for (scope, kind), bucket in self._buckets.items()
            if scope in (None, workload) and cost[kind]
        ]

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        workload = self.inner.validate_workload(request.workload)
        needs = self._needs(workload, {"requests": 1, "tokens": request.tokens})
        if any(units > bucket.capacity for bucket, units in needs):
            raise ConcurrencyConfigError(f"a request of {request.tokens} tokens never fits")
        self._gated[workload] += 1
        try:
            async with self._turns[workload]:
                while True:
                    for bucket, _ in needs:
                        bucket.refill(anyio.current_time())
                    wait = max((bucket.wait(units) for bucket, units in needs), default=0.0)
                    if wait <= 1e-9:  # what rounding leaves
                        break
                    with anyio.move_on_after(wait):
                        await self._refunded.wait()
                for bucket, units in needs:
                    bucket.level -= units
        finally:
            self._gated[workload] -= 1
        return await self.inner.acquire(request)

    async def stats(self) -> LimiterStats:
        stats = await self.inner.stats()
        return attrs.evolve(
            stats,
            queued=stats.queued + sum(self._gated.values()),
            workloads={
                name: attrs.evolve(counts, queued=counts.queued + self._gated.get(name, 0))
                for name, counts in stats.workloads.items()
            },
        )

    def charge_tokens(self, lease: SupportsLease, tokens: int) -> None:
        for bucket, units in self._needs(lease.workload, {"requests": 0, "tokens": tokens}):
            bucket.refill(anyio.current_time())
            bucket.level = min(bucket.capacity, bucket.level - units)
        if tokens < 0:
            self._refunded.set()
            self._refunded = anyio.Event()


class OverfillsBuckets(ChecksRatesFirst):
    """Refills its buckets past their capacity while nobody uses them."""

    _bucket = _OverfillingBucket


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

ignores_workload_max_queued = _with_workloads(
    lambda index, workload: attrs.evolve(workload, max_queued=None)
)
ignores_workload_max_queued.__doc__ = "Bounds only the limiter's queue, not each workload's."

ignores_workload_rates = _with_workloads(lambda index, workload: attrs.evolve(workload, rate=None))
ignores_workload_rates.__doc__ = "Applies the limiter's rate and none of its workloads'."
