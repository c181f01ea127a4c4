"""The slot lifecycle under faults: every slot comes back, no task hangs, every report is true.

One test (or a few) per fault: a renewal that raises a ``BaseException``, a grant that expired
before its waiter resumed, a release cancelled by the event loop's shutdown, arrival order on
trio, a wrapper limiter whose own ``renew`` and ``release`` must run, a give-back that fails,
a body whose nursery is cancelled, a subscriber that joins while a request waits, and one
``slot()`` object entered by several tasks. Each runs on asyncio and trio unless the fault
exists on one of them only, which the test then says.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest
import trio
from trio.testing import MockClock

import slotwise
from slotwise import (
    AcquireRequest,
    ConcurrencyEvent,
    ConcurrencyLeaseLostError,
    ConcurrencyTimeoutError,
    Lease,
    MemoryLimiter,
    SupportsLease,
    Workload,
)

pytestmark = pytest.mark.anyio


def mock_clock_and_asyncio() -> pytest.MarkDecorator:
    """trio on a virtual clock that jumps whenever every task sleeps; asyncio in real time."""
    return pytest.mark.parametrize(
        "anyio_backend",
        [
            pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock"),
            pytest.param("asyncio", id="asyncio"),
        ],
    )


@contextlib.contextmanager
def recording(limiter: object) -> Iterator[list[ConcurrencyEvent]]:
    events: list[ConcurrencyEvent] = []
    unsubscribe = slotwise.subscribe(events.append, limiter=limiter)
    try:
        yield events
    finally:
        unsubscribe()


class Custom:
    """A custom limiter of unlimited capacity whose calls all succeed; subclasses misbehave."""

    name = "custom"

    def __init__(self, *, lease_ttl: float = 30.0) -> None:
        self.lease_ttl = lease_ttl
        self.held: set[str] = set()
        self.renewals = 0
        self._ids = itertools.count(1)

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        await anyio.lowlevel.checkpoint()
        lease_id = f"lease-{next(self._ids)}"
        self.held.add(lease_id)
        return Lease(lease_id=lease_id, workload=request.workload, expires_at=math.inf)

    async def renew(self, lease: SupportsLease) -> SupportsLease | None:
        await anyio.lowlevel.checkpoint()
        self.renewals += 1
        return lease if lease.lease_id in self.held else None

    async def release(self, lease: SupportsLease) -> None:
        await anyio.lowlevel.checkpoint()
        self.held.discard(lease.lease_id)


class _Boom(BaseException):
    """Not an Exception: what a driver's cancelled future or a broken custom limiter raises."""


# -- 1. a renewal that raises a BaseException -------------------------------------------------


class RenewalRaisesBaseException(Custom):
    name = "breaks"

    def __init__(self, exc: Callable[[], BaseException], *, lease_ttl: float) -> None:
        super().__init__(lease_ttl=lease_ttl)
        self._exc = exc

    async def renew(self, lease: SupportsLease) -> SupportsLease | None:
        await anyio.lowlevel.checkpoint()
        self.renewals += 1
        raise self._exc()


def _base_exceptions(anyio_backend: Any) -> list[Callable[[], BaseException]]:
    exceptions: list[Callable[[], BaseException]] = [_Boom]
    if anyio_backend == "asyncio":
        exceptions.append(asyncio.CancelledError)
    return exceptions


@mock_clock_and_asyncio()
async def test_a_renewal_that_raises_a_base_exception_is_a_failed_renewal(
    anyio_backend: Any,
) -> None:
    for make in _base_exceptions(anyio_backend):
        broken = RenewalRaisesBaseException(make, lease_ttl=0.6)
        healthy = Custom(lease_ttl=0.6)
        healthy.name = "healthy"
        with recording(broken) as events:
            async with anyio.create_task_group() as tg:

                async def hold(limiter: Custom) -> None:
                    async with slotwise.slot(limiter=limiter):
                        await anyio.sleep(3.0)

                tg.start_soon(hold, healthy)
                with pytest.raises(ConcurrencyLeaseLostError), anyio.fail_after(10):
                    async with slotwise.slot(limiter=broken):
                        await anyio.sleep(30)
        kinds = [e.kind for e in events]
        # Retried until the lease ran out, then lost: the body was cancelled.
        assert kinds[:2] == ["wait-started", "acquired"]
        assert "renewal-failed" in kinds
        assert kinds[-2:] == ["lease-lost", "released"]
        assert broken.renewals >= 2
        # The keeper survived: the healthy limiter's slot kept being renewed, every ttl/3.
        assert healthy.renewals >= 12
        assert healthy.held == set()


# -- 2. a grant that expired before its waiter resumed ----------------------------------------


async def test_a_grant_that_expired_before_its_waiter_resumed_never_enters_its_body() -> None:
    # Real time on both backends: the loop stalls in a blocking call.
    limiter = MemoryLimiter(name="stall", max_concurrent=1, lease_ttl=0.3)
    inside = peak = 0
    order: list[str] = []

    async def use(name: str) -> None:
        nonlocal inside, peak
        async with limiter.slot():
            inside += 1
            peak = max(peak, inside)
            order.append(name)
            await anyio.sleep(0.05)
            inside -= 1

    async def holder(waiter_queued: anyio.Event) -> None:
        async with limiter.slot():
            await waiter_queued.wait()
        # The exit handed the slot to the waiter; the loop now stalls past its lease...
        time.sleep(0.4)  # noqa: ASYNC251  (a stalled loop is the point)
        await use("latecomer")  # ...and this request finds the expired lease: a free slot

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            queued = anyio.Event()
            tg.start_soon(holder, queued)
            await anyio.sleep(0.05)
            tg.start_soon(use, "waiter")
            await anyio.sleep(0.05)
            queued.set()
    assert peak == 1
    assert sorted(order) == ["latecomer", "waiter"]
    assert (await limiter.stats()).active == 0


async def test_the_first_renewal_comes_in_time_after_a_stalled_hand_off() -> None:
    limiter = MemoryLimiter(name="stall", max_concurrent=1, lease_ttl=1.0)
    lost: list[ConcurrencyEvent] = []

    async def holder(waiter_queued: anyio.Event) -> None:
        async with limiter.slot():
            await waiter_queued.wait()
        # Past 2/3 of the ttl: the waiter's first renewal is due at once.
        time.sleep(0.75)  # noqa: ASYNC251  (a stalled loop is the point)

    async def waiter() -> None:
        async with limiter.slot():
            await anyio.sleep(0.6)  # past the lease's first ttl

    with recording(limiter) as events:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                queued = anyio.Event()
                tg.start_soon(holder, queued)
                await anyio.sleep(0.05)
                tg.start_soon(waiter)
                await anyio.sleep(0.05)
                queued.set()
        lost = [e for e in events if e.kind == "lease-lost"]
    assert lost == []
    assert (await limiter.stats()).active == 0


# -- 3. a release cancelled by the event loop's shutdown --------------------------------------


class SlowRelease(Custom):
    def __init__(self) -> None:
        super().__init__()
        self.releasing = asyncio.Event()

    async def release(self, lease: SupportsLease) -> None:
        self.releasing.set()
        await asyncio.sleep(3600)  # cancelled by the shutdown below


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # asyncio.run's shutdown is asyncio's
async def test_a_cancelled_release_never_swallows_the_callers_cancellation() -> None:
    limiter = SlowRelease()
    rounds = 0

    async def worker() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            async with slotwise.slot(limiter=limiter):
                await asyncio.sleep(0)

    task = asyncio.create_task(worker())
    await asyncio.wait_for(limiter.releasing.wait(), 5)
    # What asyncio.run() does at shutdown: cancel every remaining task, the release's too.
    [releasing] = [
        other
        for other in asyncio.all_tasks()
        if other is not task and "SlowRelease.release" in repr(other.get_coro())
    ]
    releasing.cancel()  # (in whichever order asyncio.all_tasks() lists them)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert rounds == 1


# -- 5. arrival order on trio -----------------------------------------------------------------


async def test_requests_are_served_in_the_order_they_reach_the_limiter() -> None:
    # Taking a slot or a place in the queue happens the moment slot() is entered, before the
    # task yields: otherwise arrival order would become the order in which tasks resume from
    # that yield, which trio randomises.
    limiter = MemoryLimiter(name="fifo", max_concurrent=1)
    arrived: list[int] = []
    served: list[int] = []

    async def loop(number: int) -> None:
        for _ in range(20):
            arrived.append(number)
            async with limiter.slot():
                served.append(number)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for number in (1, 2, 3):
                tg.start_soon(loop, number)
    assert served == arrived


# -- 7. a wrapper that forwards everything else -----------------------------------------------


class Logging:
    """Wraps a limiter, counting renew and release, and forwards every other attribute."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.renewed = 0
        self.released = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        return await self._inner.acquire(request)  # type: ignore[no-any-return]

    async def renew(self, lease: SupportsLease) -> SupportsLease | None:
        self.renewed += 1
        return await self._inner.renew(lease)  # type: ignore[no-any-return]

    async def release(self, lease: SupportsLease) -> None:
        self.released += 1
        await self._inner.release(lease)


@mock_clock_and_asyncio()
async def test_a_wrappers_own_renew_and_release_are_what_runs() -> None:
    wrapper = Logging(MemoryLimiter(name="wrapped", max_concurrent=1, lease_ttl=0.3))
    with anyio.fail_after(10):
        async with slotwise.slot(limiter=wrapper):
            await anyio.sleep(0.5)
    assert wrapper.renewed >= 2
    assert wrapper.released == 1


# -- 8. a give-back that fails ----------------------------------------------------------------


class GrantsAsCancelled(Custom):
    """Grants, but only after cancelling its caller (a grant that meets a cancellation), and
    fails to give that grant back."""

    def __init__(self) -> None:
        super().__init__()
        self.scope: anyio.CancelScope | None = None

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        lease = await super().acquire(request)
        assert self.scope is not None
        self.scope.cancel()
        return lease

    async def release(self, lease: SupportsLease) -> None:
        await anyio.lowlevel.checkpoint()
        raise RuntimeError("the database is gone")


async def test_a_failed_give_back_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    limiter = GrantsAsCancelled()
    with recording(limiter) as events, caplog.at_level(logging.WARNING, logger="slotwise"):
        with anyio.CancelScope() as scope:
            limiter.scope = scope
            async with slotwise.slot(limiter=limiter):
                pytest.fail("a cancelled request never enters its body")
    kinds = [e.kind for e in events]
    # The slot granted as the request was cancelled is given back, and that failed.
    assert kinds == ["wait-started", "release-failed", "wait-cancelled"]
    failed = events[1]
    assert failed.kind == "release-failed"
    assert "RuntimeError: the database is gone" in failed.error
    assert "the database is gone" in caplog.text


# -- 9. a body whose task group is cancelled --------------------------------------------------


async def test_a_cancelled_task_group_in_the_body_is_a_cancellation(
    anyio_backend_name: str,
) -> None:
    # On trio, a nursery of trio's own: cancelled from outside, it raises a group made only
    # of Cancelled (anyio's task group hands its cancellation on as a single one).
    limiter = MemoryLimiter(name="group", max_concurrent=2)
    with recording(limiter) as events:
        with anyio.move_on_after(0.05):
            async with limiter.slot():
                if anyio_backend_name == "trio":
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(trio.sleep_forever)
                        nursery.start_soon(trio.sleep_forever)
                        await trio.sleep_forever()
                else:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(anyio.sleep_forever)
                        tg.start_soon(anyio.sleep_forever)
                        await anyio.sleep_forever()
    [released] = [e for e in events if e.kind == "released"]
    assert released.outcome == "cancelled"


async def test_a_group_of_cancellations_is_a_cancellation() -> None:
    # What a trio nursery raises when its body and children are all cancelled (strict groups).
    limiter = MemoryLimiter(name="group", max_concurrent=2)
    cancelled = anyio.get_cancelled_exc_class()
    with recording(limiter) as events:
        with anyio.CancelScope() as scope:
            async with limiter.slot():
                scope.cancel()
                caught: list[BaseException] = []
                for _ in range(2):
                    try:
                        await anyio.lowlevel.checkpoint()
                    except cancelled as exc:
                        caught.append(exc)
                raise BaseExceptionGroup("nursery", caught)
    [released] = [e for e in events if e.kind == "released"]
    assert released.outcome == "cancelled"


async def test_a_group_with_a_real_failure_is_a_failure() -> None:
    limiter = MemoryLimiter(name="group", max_concurrent=2)
    with recording(limiter) as events, pytest.raises(BaseExceptionGroup):
        async with limiter.slot():
            raise BaseExceptionGroup("nursery", [ValueError("boom"), KeyError("k")])
    [released] = [e for e in events if e.kind == "released"]
    assert released.outcome == "failed"


# -- 10. a subscriber that joins while a request waits ----------------------------------------


@mock_clock_and_asyncio()
async def test_a_subscriber_that_joins_mid_wait_gets_true_events() -> None:
    limiter = MemoryLimiter(
        name="late", max_concurrent=1, workloads={"default": Workload(max_wait=0.4)}
    )
    events: list[ConcurrencyEvent] = []
    release = anyio.Event()

    async def holder() -> None:
        async with limiter.slot():
            await release.wait()

    async def times_out() -> None:
        with pytest.raises(ConcurrencyTimeoutError):
            async with limiter.slot():
                pytest.fail("no slot is free")

    async def waits() -> None:
        async with limiter.slot():
            pass

    unsubscribe: Callable[[], None] = lambda: None  # noqa: E731
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(holder)
                await anyio.sleep(0.05)
                tg.start_soon(times_out)
                await anyio.sleep(0.2)
                unsubscribe = limiter.subscribe(events.append)  # mid-wait
                await anyio.sleep(0.4)
                [timed_out] = [e for e in events if e.kind == "timed-out"]
                assert timed_out.wait_time >= 0.39  # its whole wait, not since subscribe()
                unsubscribe()
                events.clear()
                tg.start_soon(waits)
                await anyio.sleep(0.1)
                unsubscribe = limiter.subscribe(events.append)  # mid-wait again
                release.set()
    finally:
        unsubscribe()
    kinds = [e.kind for e in events]
    # The holder's release; then the waiter's grant, with its whole wait, and its release.
    assert kinds == ["released", "acquired", "released"]
    acquired = events[1]
    assert acquired.kind == "acquired"
    assert acquired.wait_time >= 0.09


# -- 11. one slot() object entered by several tasks -------------------------------------------


@mock_clock_and_asyncio()
async def test_one_slot_context_entered_by_several_tasks_gives_each_its_own_slot() -> None:
    limiter = MemoryLimiter(name="shared", max_concurrent=2)
    shared = limiter.slot()
    inside = peak = 0
    leases: list[str | None] = []

    async def use(seconds: float) -> None:
        nonlocal inside, peak
        async with shared as slot:
            inside += 1
            peak = max(peak, inside)
            leases.append(slot.lease_id)
            await anyio.sleep(seconds)
            inside -= 1
        assert slot.released

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for seconds in (0.3, 0.1, 0.2, 0.05, 0.15):
                tg.start_soon(use, seconds)
    assert peak == 2
    assert len(set(leases)) == 5
    assert (await limiter.stats()).active == 0


async def test_one_slot_context_entered_twice_in_one_task_releases_inner_then_outer() -> None:
    limiter = MemoryLimiter(name="nested", max_concurrent=2)
    shared = limiter.slot(allow_nested=True)
    async with shared as outer:
        async with shared as inner:
            assert inner.lease_id != outer.lease_id
        assert inner.released
        assert not outer.released
    assert outer.released
    assert (await limiter.stats()).active == 0
