"""The slot lifecycle: acquire, renewal while held, release, and what every failure turns into.

The lifecycle is written once for every limiter, so most tests here run it over a custom
limiter (a thin wrapper around MemoryLimiter whose methods a test can break) as well as over
MemoryLimiter itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

import anyio
import pytest
from trio.testing import MockClock

import slotwise
from slotwise import (
    AcquireRequest,
    ConcurrencyError,
    ConcurrencyEvent,
    ConcurrencyLeaseLostError,
    ConcurrencyLimiterError,
    ConcurrencyTimeoutError,
    Lease,
    MemoryLimiter,
    SupportsLease,
    Workload,
)

pytestmark = pytest.mark.anyio

RenewStep = Literal["ok", "gone", "fail"]


def on_mock_clock() -> pytest.MarkDecorator:
    """Run the test on trio with a virtual clock that jumps whenever every task sleeps."""
    return pytest.mark.parametrize(
        "anyio_backend",
        [pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock")],
    )


class Flaky:
    """A custom limiter (no base class, no optional members) backed by a MemoryLimiter.

    ``renew_plan(n)`` decides what the n-th renewal does: "ok" renews, "gone" answers None
    (the lease is no longer held), "fail" raises a transient error.
    """

    def __init__(
        self,
        *,
        name: str = "flaky",
        max_concurrent: int = 1,
        lease_ttl: float = 9.0,
        renew_plan: Callable[[int], RenewStep] = lambda n: "ok",
    ) -> None:
        self.name = name
        self.lease_ttl = lease_ttl
        self.inner = MemoryLimiter(name=name, max_concurrent=max_concurrent, lease_ttl=lease_ttl)
        self.renew_plan = renew_plan
        self.acquire_error: Exception | None = None
        self.release_error: Exception | None = None
        self.renewals = 0
        self.releases = 0

    async def acquire(self, request: AcquireRequest) -> Lease:
        if self.acquire_error is not None:
            await anyio.lowlevel.checkpoint()
            raise self.acquire_error
        return await self.inner.acquire(request)

    async def renew(self, lease: SupportsLease) -> Lease | None:
        step = self.renew_plan(self.renewals)
        self.renewals += 1
        if step == "fail":
            raise OSError("connection reset")
        if step == "gone":
            await self.inner.release(lease)
            return None
        return await self.inner.renew(lease)

    async def release(self, lease: SupportsLease) -> None:
        self.releases += 1
        await self.inner.release(lease)
        if self.release_error is not None:
            raise self.release_error


LimiterKind = Literal["memory", "custom"]


def make_limiter(kind: LimiterKind, max_concurrent: int = 1) -> MemoryLimiter[str] | Flaky:
    if kind == "memory":
        return MemoryLimiter(name="memory", max_concurrent=max_concurrent)
    return Flaky(name="custom", max_concurrent=max_concurrent)


async def active(limiter: MemoryLimiter[str] | Flaky) -> int:
    inner = limiter.inner if isinstance(limiter, Flaky) else limiter
    return (await inner.stats()).active


@contextmanager
def recorded(limiter: object) -> Iterator[list[ConcurrencyEvent]]:
    events: list[ConcurrencyEvent] = []
    unsubscribe = slotwise.subscribe(events.append, limiter=limiter)
    try:
        yield events
    finally:
        unsubscribe()


def kinds(events: list[ConcurrencyEvent]) -> list[str]:
    return [event.kind for event in events]


both_limiters = pytest.mark.parametrize("kind", ["memory", "custom"])


class LongBody:
    """A slot whose body would run for 100 s; records its slot and whether it finished."""

    def __init__(self) -> None:
        self.slot: slotwise.Slot | None = None
        self.finished = False

    async def run(self, limiter: object) -> None:
        async with slotwise.slot(limiter=limiter) as slot:
            self.slot = slot
            await anyio.sleep(100.0)
            self.finished = True


# -- the body's own outcome -------------------------------------------------------------------


@both_limiters
async def test_the_body_exception_reaches_the_caller_unchanged(kind: LimiterKind) -> None:
    limiter = make_limiter(kind)
    error = ValueError("the provider said no")
    with recorded(limiter) as events, pytest.raises(ValueError, match="said no") as caught:
        async with slotwise.slot(limiter=limiter):
            raise error
    assert caught.value is error
    assert type(caught.value) is ValueError  # never wrapped in an ExceptionGroup
    assert kinds(events) == ["wait-started", "acquired", "released"]
    released = events[-1]
    assert released.kind == "released"
    assert released.outcome == "failed"
    assert await active(limiter) == 0
    if isinstance(limiter, Flaky):
        assert limiter.releases == 1


@both_limiters
async def test_a_cancelled_body_is_released_as_cancelled(kind: LimiterKind) -> None:
    limiter = make_limiter(kind)
    finished = False
    with recorded(limiter) as events:
        with anyio.CancelScope() as scope:
            async with slotwise.slot(limiter=limiter):
                scope.cancel()
                await anyio.sleep(3600)
                finished = True
        assert scope.cancelled_caught
    assert not finished
    released = events[-1]
    assert released.kind == "released"
    assert released.outcome == "cancelled"
    assert await active(limiter) == 0
    if isinstance(limiter, Flaky):
        assert limiter.releases == 1


@both_limiters
async def test_a_body_cancelled_from_another_task_is_released(kind: LimiterKind) -> None:
    limiter = make_limiter(kind)
    inside = anyio.Event()
    with recorded(limiter) as events:
        async with anyio.create_task_group() as tg:

            async def body() -> None:
                async with slotwise.slot(limiter=limiter):
                    inside.set()
                    await anyio.sleep(3600)

            tg.start_soon(body)
            await inside.wait()
            tg.cancel_scope.cancel()
    assert [e.outcome for e in events if e.kind == "released"] == ["cancelled"]
    assert await active(limiter) == 0


@both_limiters
async def test_a_request_cancelled_before_it_starts_takes_nothing(kind: LimiterKind) -> None:
    limiter = make_limiter(kind)
    ran = False
    with recorded(limiter) as events:
        with anyio.CancelScope() as scope:
            scope.cancel()
            async with slotwise.slot(limiter=limiter):
                ran = True
        with anyio.move_on_after(0):
            async with slotwise.slot(limiter=limiter):
                ran = True
    assert not ran
    assert "acquired" not in kinds(events)
    assert await active(limiter) == 0


@both_limiters
async def test_a_completed_body_is_released_once(kind: LimiterKind) -> None:
    limiter = make_limiter(kind)
    with recorded(limiter) as events:
        async with slotwise.slot(limiter=limiter) as slot:
            assert not slot.released
            assert slot.lease_id is not None
        assert slot.released
        await slot.release()  # idempotent: nothing more happens
    assert kinds(events) == ["wait-started", "acquired", "released"]
    assert events[-1].kind == "released"
    assert events[-1].outcome == "completed"
    if isinstance(limiter, Flaky):
        assert limiter.releases == 1
    assert await active(limiter) == 0


@both_limiters
async def test_a_slot_granted_as_its_request_is_cancelled_is_given_back(
    kind: LimiterKind,
) -> None:
    limiter = make_limiter(kind)
    inner = limiter.inner if isinstance(limiter, Flaky) else limiter
    held = await inner.acquire(AcquireRequest(workload="default", request_id="holder"))
    scope = anyio.CancelScope()
    ran = False

    async def waiter() -> None:
        nonlocal ran
        with scope:
            async with slotwise.slot(limiter=limiter):
                ran = True

    with recorded(limiter) as events, anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            await inner.release(held)  # grants the slot to the waiter, which has not resumed
            assert "1/1 active" in repr(inner)
            scope.cancel()
    assert not ran
    assert kinds(events) == ["wait-started", "wait-cancelled"]
    assert await active(limiter) == 0
    async with slotwise.slot(limiter=limiter) as again:
        assert again.lease is not None


@both_limiters
async def test_a_slot_released_inside_its_body_is_released_once(kind: LimiterKind) -> None:
    limiter = make_limiter(kind)
    with recorded(limiter) as events:
        async with slotwise.slot(limiter=limiter) as slot:
            await slot.release()
            assert slot.released
            assert await active(limiter) == 0
            other = await slotwise.acquire(limiter=limiter)
        # Leaving the block released nothing more: the other slot is still held.
        assert await active(limiter) == 1
        await other.release()
    released = [e for e in events if e.kind == "released"]
    assert [e.lease_id for e in released] == [slot.lease_id, other.lease_id]
    if isinstance(limiter, Flaky):
        assert limiter.releases == 2


# -- renewal and lost leases ------------------------------------------------------------------


@on_mock_clock()
async def test_automatic_renewal_keeps_a_slot_past_its_ttl() -> None:
    limiter = MemoryLimiter(max_concurrent=1, lease_ttl=10.0)
    order: list[str] = []

    lost: list[bool] = []
    inside = anyio.Event()

    async def holder() -> None:
        async with limiter.slot() as slot:
            inside.set()
            await anyio.sleep(50.0)  # five times the lease's ttl
            lost.append(slot.lost)
            order.append("holder")

    async def rival() -> None:
        async with limiter.slot():
            order.append("rival")

    with recorded(limiter) as events:
        async with anyio.create_task_group() as tg:
            tg.start_soon(holder)
            await inside.wait()
            tg.start_soon(rival)
            await anyio.sleep(45.0)
            assert (await limiter.stats()).workloads["default"].queued == 1
    assert lost == [False]
    assert order == ["holder", "rival"]
    assert "lease-lost" not in kinds(events)
    assert [e.outcome for e in events if e.kind == "released"] == ["completed", "completed"]


@on_mock_clock()
async def test_a_lease_the_limiter_no_longer_holds_cancels_the_body() -> None:
    limiter = Flaky(lease_ttl=9.0, renew_plan=lambda n: "gone")
    body = LongBody()
    with recorded(limiter) as events:
        async with slotwise.run(limiter=limiter) as parent, slotwise.run() as child:
            with pytest.raises(ConcurrencyLeaseLostError) as caught:
                await body.run(limiter=None)
    slot = body.slot
    assert slot is not None
    assert not body.finished
    error = caught.value
    assert error.lease_id == slot.lease_id
    assert error.limiter == "flaky"
    assert error.workload == "default"
    assert error.run_id == child.run_id
    assert error.parent_run_id == parent.run_id
    assert error.root_run_id == parent.run_id
    assert error.request_id == slot.request_id
    assert slot.lost
    lost = [e for e in events if e.kind == "lease-lost"]
    assert len(lost) == 1
    assert lost[0].lease_id == slot.lease_id
    assert lost[0].hold_time >= 3.0  # the first renewal, at a third of the ttl
    assert lost[0].run_id == child.run_id
    assert [e.outcome for e in events if e.kind == "released"] == ["cancelled"]
    assert await active(limiter) == 0


@on_mock_clock()
async def test_transient_renewal_failures_are_retried() -> None:
    limiter = Flaky(lease_ttl=9.0, renew_plan=lambda n: "fail" if n in (0, 1) else "ok")
    with recorded(limiter) as events:
        async with slotwise.slot(limiter=limiter) as slot:
            await anyio.sleep(45.0)  # five times the ttl
            assert not slot.lost
    failed = [e for e in events if e.kind == "renewal-failed"]
    assert len(failed) == 2
    assert all(e.lease_id == slot.lease_id and "connection reset" in e.error for e in failed)
    assert "lease-lost" not in kinds(events)
    assert events[-1].kind == "released"
    assert events[-1].outcome == "completed"


@on_mock_clock()
async def test_renewal_failing_until_expiry_loses_the_lease() -> None:
    limiter = Flaky(lease_ttl=9.0, renew_plan=lambda n: "fail")
    body = LongBody()
    start = anyio.current_time()
    with recorded(limiter) as events, pytest.raises(ConcurrencyLeaseLostError) as caught:
        await body.run(limiter=limiter)
    slot = body.slot
    assert slot is not None
    assert not body.finished
    assert anyio.current_time() - start >= 9.0  # not before the lease would expire
    assert caught.value.lease_id == slot.lease_id
    assert kinds(events)[:3] == ["wait-started", "acquired", "renewal-failed"]
    assert kinds(events)[-2:] == ["lease-lost", "released"]
    assert set(kinds(events)[2:-2]) == {"renewal-failed"}
    assert await active(limiter) == 0


# -- limiter failures -----------------------------------------------------------------------


async def test_a_failing_acquire_fails_closed() -> None:
    limiter = Flaky()
    cause = ConnectionError("database is down")
    limiter.acquire_error = cause
    ran = False
    with recorded(limiter) as events, pytest.raises(ConcurrencyLimiterError) as caught:
        async with slotwise.slot(limiter=limiter):
            ran = True
    assert not ran
    assert caught.value.__cause__ is cause
    assert caught.value.limiter == "flaky"
    assert caught.value.workload == "default"
    assert caught.value.request_id is not None
    assert kinds(events) == ["wait-started", "limiter-error"]
    failure = events[-1]
    assert failure.kind == "limiter-error"
    assert "database is down" in failure.error
    assert failure.request_id == caught.value.request_id
    assert failure.wait_time >= 0


async def test_a_failing_release_keeps_the_body_result() -> None:
    limiter = Flaky()
    limiter.release_error = ConnectionError("database is down")
    with recorded(limiter) as events:
        async with slotwise.slot(limiter=limiter) as slot:
            result = "answer"
    assert result == "answer"
    assert kinds(events) == ["wait-started", "acquired", "release-failed"]
    failure = events[-1]
    assert failure.kind == "release-failed"
    assert failure.lease_id == slot.lease_id
    assert "database is down" in failure.error


async def test_a_failing_release_keeps_the_body_exception(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limiter = Flaky()
    limiter.release_error = ConnectionError("database is down")
    error = KeyError("the body's own")
    with (
        caplog.at_level(logging.WARNING, logger="slotwise"),
        recorded(limiter) as events,
        pytest.raises(KeyError) as caught,
    ):
        async with slotwise.slot(limiter=limiter):
            raise error
    assert caught.value is error
    assert kinds(events)[-1] == "release-failed"
    assert any("database is down" in record.getMessage() for record in caplog.records)


# -- acquire and release by hand ------------------------------------------------------------


@both_limiters
async def test_a_slot_can_be_released_from_another_task(kind: LimiterKind) -> None:
    limiter = make_limiter(kind)
    slot = await slotwise.acquire(limiter=limiter)
    assert await active(limiter) == 1
    got_next = anyio.Event()

    async def next_in_line() -> None:
        async with slotwise.slot(limiter=limiter):
            got_next.set()

    with recorded(limiter) as events, anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(next_in_line)
            await anyio.wait_all_tasks_blocked()
            assert not got_next.is_set()
            async with anyio.create_task_group() as other:
                other.start_soon(slot.release)
        assert got_next.is_set()
        # Releasing again from yet another task frees nothing more.
        async with anyio.create_task_group() as other:
            other.start_soon(slot.release)
        await slot.release()
    assert slot.released
    released = [e for e in events if e.kind == "released" and e.lease_id == slot.lease_id]
    assert len(released) == 1
    assert await active(limiter) == 0


async def test_a_repeated_release_does_not_free_a_slot_someone_else_holds() -> None:
    limiter = MemoryLimiter(max_concurrent=1, workloads={"default": Workload(max_wait=0)})
    first = await slotwise.acquire(limiter=limiter)
    await first.release()
    second = await slotwise.acquire(limiter=limiter)
    await first.release()
    with pytest.raises(ConcurrencyTimeoutError):
        await slotwise.acquire(limiter=limiter)
    await second.release()


@on_mock_clock()
async def test_a_slot_taken_by_hand_is_renewed_until_released() -> None:
    limiter = MemoryLimiter(max_concurrent=1, lease_ttl=10.0)
    slot = await slotwise.acquire(limiter=limiter)
    await anyio.sleep(50.0)
    assert not slot.lost
    assert slot.lease is not None
    assert await limiter.renew(slot.lease) is not None
    await slot.release()
    assert (await limiter.stats()).active == 0


# -- no limiter -----------------------------------------------------------------------------


async def test_without_a_limiter_nothing_is_limited_or_emitted() -> None:
    events: list[ConcurrencyEvent] = []
    unsubscribe = slotwise.subscribe(events.append)
    inside = peak = 0
    all_in = anyio.Event()

    async def body() -> None:
        nonlocal inside, peak
        async with slotwise.slot() as slot:
            assert slot.limiter is None
            assert slot.lease is None
            inside += 1
            peak = max(peak, inside)
            if inside == 50:
                all_in.set()
            await all_in.wait()
            inside -= 1

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(50):
                    tg.start_soon(body)
        manual = await slotwise.acquire()
        await manual.release()
    finally:
        unsubscribe()
    assert peak == 50
    assert events == []


# -- errors ---------------------------------------------------------------------------------


async def test_errors_carry_the_limiter_the_workload_and_the_lineage() -> None:
    limiter = MemoryLimiter(
        name="claude",
        max_concurrent=1,
        workloads={"batch": Workload(max_wait=0)},
    )
    held = await slotwise.acquire(limiter=limiter)
    async with slotwise.run(limiter=limiter) as parent, slotwise.run() as child:
        with pytest.raises(ConcurrencyTimeoutError) as caught:
            async with slotwise.slot():
                pytest.fail("the body must not run")
    error = caught.value
    assert isinstance(error, TimeoutError)
    assert isinstance(error, ConcurrencyError)
    assert error.limiter == "claude"
    assert error.workload == "batch"
    assert error.request_id is not None
    assert error.run_id == child.run_id
    assert error.parent_run_id == parent.run_id
    assert error.root_run_id == parent.run_id
    assert "claude" in str(error)
    await held.release()


async def test_a_timeout_error_is_a_timeout_error() -> None:
    assert issubclass(ConcurrencyTimeoutError, TimeoutError)
    assert issubclass(ConcurrencyTimeoutError, ConcurrencyError)
    with pytest.raises(TimeoutError):
        raise ConcurrencyTimeoutError("no slot", limiter="x", workload="y", request_id="z")
