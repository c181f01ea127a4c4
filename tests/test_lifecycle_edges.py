"""The slot lifecycle at its edges: a renewal that hangs, a native asyncio cancellation during
release, a lease lost while the body is shielded, a limiter that ignores the run's deadline, a
slot abandoned inside an async generator, and the context the keeper runs in.

Every test runs on asyncio and trio, except the one about a native ``task.cancel()`` during
release: that cancellation exists on asyncio only (trio has no way to cancel a task from the
outside other than through its cancel scopes), so that test runs on asyncio alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import math
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import pytest
from anyio.abc import TaskStatus
from trio.testing import MockClock

import slotwise
from slotwise import (
    AcquireRequest,
    ConcurrencyEvent,
    ConcurrencyLeaseLostError,
    ConcurrencyTimeoutError,
    Lease,
    MemoryLimiter,
    ReleasedEvent,
    SupportsLease,
)

pytestmark = pytest.mark.anyio


def mock_clock_and_asyncio() -> pytest.MarkDecorator:
    """Run on trio with a virtual clock that jumps whenever every task sleeps, and on asyncio
    with the real clock (so the durations in these tests stay small)."""
    return pytest.mark.parametrize(
        "anyio_backend",
        [
            pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock"),
            pytest.param("asyncio", id="asyncio"),
        ],
    )


def on_mock_clock(anyio_backend: Any) -> bool:
    return isinstance(anyio_backend, tuple)


class Custom:
    """A custom limiter that grants every request at once and whose renewals succeed.

    Subclasses override one method to misbehave.
    """

    name = "custom"

    def __init__(self, *, lease_ttl: float = 30.0) -> None:
        self.lease_ttl = lease_ttl
        self.held: set[str] = set()
        self._ids = itertools.count(1)

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        await anyio.lowlevel.checkpoint()
        lease_id = f"lease-{next(self._ids)}"
        self.held.add(lease_id)
        return Lease(lease_id=lease_id, workload=request.workload, expires_at=math.inf)

    async def renew(self, lease: SupportsLease) -> SupportsLease | None:
        await anyio.lowlevel.checkpoint()
        return lease

    async def release(self, lease: SupportsLease) -> None:
        await anyio.lowlevel.checkpoint()
        self.held.discard(lease.lease_id)


class HangingRenewal(Custom):
    """Renewals never return (a stuck database connection)."""

    async def renew(self, lease: SupportsLease) -> SupportsLease | None:
        await anyio.sleep_forever()
        return lease


class Forgetful(Custom):
    """Every renewal answers that the lease is no longer held."""

    async def renew(self, lease: SupportsLease) -> SupportsLease | None:
        await anyio.lowlevel.checkpoint()
        return None


class NeverGrants(Custom):
    """Always full, and blind to ``request.deadline``: only a cancellation ends its wait."""

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


class SlowRelease(Custom):
    """Releasing takes a round trip: it waits until ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release_calls = 0
        self.releasing = anyio.Event()
        self.gate = anyio.Event()
        self.released = anyio.Event()

    async def release(self, lease: SupportsLease) -> None:
        self.release_calls += 1
        self.releasing.set()
        await self.gate.wait()
        self.held.discard(lease.lease_id)
        self.released.set()


@contextlib.contextmanager
def on_event(
    kind: str, limiter: object, callback: Callable[[ConcurrencyEvent], object]
) -> Iterator[None]:
    """Call ``callback`` with every event of ``kind`` that ``limiter`` emits in the block."""

    def listener(event: ConcurrencyEvent) -> None:
        if event.kind == kind:
            callback(event)

    unsubscribe = slotwise.subscribe(listener, limiter=limiter)
    try:
        yield
    finally:
        unsubscribe()


# -- renewals ---------------------------------------------------------------------------------


@mock_clock_and_asyncio()
async def test_a_hanging_renewal_does_not_delay_the_renewal_of_other_slots() -> None:
    # The hanging renewal starts at 0.8 s and hangs until its own lease would expire (2.4 s).
    # Meanwhile the memory slot, renewed every 0.2 s, is held for 1.8 s, three of its TTLs: a
    # keeper waiting for the hanging renewal would let it expire and hand it to the waiter.
    hanging = HangingRenewal(lease_ttl=2.4)
    memory = MemoryLimiter(name="memory", max_concurrent=1, lease_ttl=0.6)
    holders = peak = 0
    log: list[str] = []
    outcomes: dict[str, str] = {}
    finished = anyio.Event()

    async def hold_hanging(*, task_status: TaskStatus[None]) -> None:
        with contextlib.suppress(ConcurrencyLeaseLostError):
            async with slotwise.slot(limiter=hanging):
                task_status.started()
                await finished.wait()

    async def hold_memory(name: str, seconds: float, *, task_status: TaskStatus[None]) -> None:
        nonlocal holders, peak
        task_status.started()
        try:
            async with slotwise.slot(limiter=memory):
                holders += 1
                peak = max(peak, holders)
                log.append(f"{name} in")
                try:
                    await anyio.sleep(seconds)
                finally:
                    holders -= 1
                    log.append(f"{name} out")
        except ConcurrencyLeaseLostError:
            outcomes[name] = "lost"
        else:
            outcomes[name] = "completed"

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(hold_hanging)
            async with anyio.create_task_group() as users:
                await users.start(hold_memory, "first", 1.8)
                await anyio.sleep(0.05)  # the first holder is inside its slot
                await users.start(hold_memory, "waiter", 0.0)
            finished.set()

    assert outcomes == {"first": "completed", "waiter": "completed"}
    assert peak == 1
    assert log == ["first in", "first out", "waiter in", "waiter out"]
    assert (await memory.stats()).active == 0


# -- release ----------------------------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # task.cancel() is asyncio's own
async def test_a_native_asyncio_cancel_during_release_still_releases_once() -> None:
    limiter = SlowRelease()
    events: list[ConcurrencyEvent] = []
    unsubscribe = slotwise.subscribe(events.append, limiter=limiter)

    async def user() -> None:
        async with slotwise.slot(limiter=limiter):
            await anyio.lowlevel.checkpoint()

    task = asyncio.create_task(user())
    with anyio.fail_after(5):
        await limiter.releasing.wait()  # the body is done; the release awaits its round trip
    task.cancel()  # an asyncio.TaskGroup cancelling a sibling, an asyncio.timeout, ...
    await asyncio.wait([task])
    assert task.cancelled()  # the caller's cancellation is not swallowed

    limiter.gate.set()  # the round trip completes
    with anyio.move_on_after(5):
        await limiter.released.wait()
    assert limiter.held == set()
    assert limiter.release_calls == 1
    await asyncio.sleep(0)  # the release task's done callback reports it
    unsubscribe()
    assert [e.kind for e in events] == ["wait-started", "acquired", "released"]


# -- lease lost -------------------------------------------------------------------------------


@mock_clock_and_asyncio()
async def test_a_lease_lost_while_the_body_is_shielded_raises_on_exit() -> None:
    limiter = Forgetful(lease_ttl=0.3)
    lost = anyio.Event()
    held: list[slotwise.Slot] = []
    finished = False

    async def body() -> None:
        nonlocal finished
        async with slotwise.slot(limiter=limiter) as slot:
            held.append(slot)
            # A write the body must not interrupt: the keeper's cancellation cannot reach it,
            # and nothing in the body checks for it afterwards.
            with anyio.CancelScope(shield=True), anyio.fail_after(10):
                await lost.wait()
            finished = True

    released: list[ReleasedEvent] = []
    with (
        on_event("lease-lost", limiter, lambda event: lost.set()),
        on_event("released", limiter, released.append),  # type: ignore[arg-type]  # only ReleasedEvent
        pytest.raises(ConcurrencyLeaseLostError) as caught,
    ):
        await body()
    assert finished
    [slot] = held
    assert slot.lost
    assert slot.released
    assert caught.value.lease_id == slot.lease_id
    assert limiter.held == set()
    assert [e.outcome for e in released] == ["cancelled"]


# -- the run's budget -------------------------------------------------------------------------


@mock_clock_and_asyncio()
async def test_the_run_budget_ends_the_wait_of_a_limiter_that_ignores_deadlines(
    anyio_backend: Any,
) -> None:
    limiter = NeverGrants()
    budget = 0.2
    errors: list[ConcurrencyTimeoutError] = []
    ended_at: list[float] = []
    timed_out: list[ConcurrencyEvent] = []

    async def request() -> None:
        try:
            async with slotwise.slot():
                pytest.fail("the limiter never grants")
        except ConcurrencyTimeoutError as exc:
            ended_at.append(anyio.current_time())
            errors.append(exc)

    with on_event("timed-out", limiter, timed_out.append):
        # A worker pool opened outside the run: the request has the run as its current run,
        # but the run's own cancel scope does not cover it. Only the budget can end its wait.
        with anyio.move_on_after(budget * 25) as guard:
            async with (
                anyio.create_task_group() as pool,
                slotwise.run(limiter=limiter, timeout=budget) as run,
            ):
                deadline = run.deadline
                pool.start_soon(request)

    assert deadline is not None
    assert not guard.cancelled_caught  # the outer scope never had to step in
    assert len(errors) == 1
    assert errors[0].run_id == run.run_id
    assert len(timed_out) == 1
    if on_mock_clock(anyio_backend):
        assert ended_at == [deadline]
    else:
        assert ended_at[0] >= deadline


@mock_clock_and_asyncio()
async def test_an_outer_cancellation_of_a_budgeted_wait_stays_a_cancellation() -> None:
    limiter = NeverGrants()
    outcomes: list[str] = []
    kinds: list[str] = []

    async def request() -> None:
        try:
            async with slotwise.slot():
                pytest.fail("the limiter never grants")
        except ConcurrencyTimeoutError:
            outcomes.append("timeout")
        except anyio.get_cancelled_exc_class():
            outcomes.append("cancelled")
            raise

    unsubscribe = slotwise.subscribe(lambda event: kinds.append(event.kind), limiter=limiter)
    try:
        with anyio.move_on_after(0.1) as guard:
            async with (
                anyio.create_task_group() as pool,
                slotwise.run(limiter=limiter, timeout=5.0),
            ):
                pool.start_soon(request)
    finally:
        unsubscribe()

    assert guard.cancelled_caught
    assert outcomes == ["cancelled"]
    assert kinds == ["wait-started", "wait-cancelled"]


# -- a slot held across a yield ---------------------------------------------------------------


async def test_closing_a_generator_inside_another_slot_releases_the_generators_slot() -> None:
    """A generator holds a slot across its `yield`, entered in one task; another task, inside
    a slot of its own taken the same way, closes the generator: the generator's slot is the
    one released, and the closing task keeps its own."""
    limiter = MemoryLimiter(name="memory", max_concurrent=4)

    async def stream() -> AsyncIterator[int]:
        async with limiter.slot():
            yield 1

    generator = stream()

    async def start() -> None:
        await generator.__anext__()

    async with anyio.create_task_group() as tg:
        tg.start_soon(start)
    assert (await limiter.stats()).active == 1

    async with limiter.slot() as mine:
        await generator.aclose()
        assert not mine.released
        assert (await limiter.stats()).active == 1
    assert (await limiter.stats()).active == 0


async def test_a_slot_in_an_abandoned_async_generator_is_released_when_it_is_finalized(
    anyio_backend: Any,
) -> None:
    limiter = MemoryLimiter(name="memory", max_concurrent=1, lease_ttl=30.0)

    async def stream() -> AsyncIterator[int]:
        async with limiter.slot():
            for chunk in range(10):
                await anyio.lowlevel.checkpoint()
                yield chunk

    async def consume() -> None:
        async for chunk in stream():
            if chunk == 2:
                break  # no aclose(): the event loop finalizes the generator, in another task

    # Exiting the slot's cancel scope from the finalizing task is an error the event loop
    # reports (asyncio: to its exception handler; trio: to its log). Collect the asyncio reports
    # so that the test sees them instead of the test runner; they must be that error only.
    # trio also warns, as the generator is collected, that it was abandoned.
    reports: list[dict[str, Any]] = []
    on_trio = anyio_backend == "trio"
    loop = None if on_trio else asyncio.get_running_loop()
    previous = None if loop is None else loop.get_exception_handler()
    if loop is not None:
        loop.set_exception_handler(lambda _, context: reports.append(context))
    abandoned = (
        pytest.warns(ResourceWarning, match="garbage collected")
        if on_trio
        else contextlib.nullcontext()
    )
    try:
        with abandoned:
            await consume()
            gc.collect()
        for _ in range(100):
            gc.collect()
            await anyio.lowlevel.checkpoint()
            if (await limiter.stats()).active == 0:
                break
        assert (await limiter.stats()).active == 0
        gc.collect()  # report the finalizing task's error now, while it is collected here
        await anyio.lowlevel.checkpoint()
    finally:
        if loop is not None:
            loop.set_exception_handler(previous)
    for context in reports:
        assert isinstance(context.get("exception"), RuntimeError), context
        assert "cancel scope" in str(context["exception"])

    # The consumer's next slot of the same limiter is neither refused as nested nor kept
    # waiting by a slot nobody holds.
    with anyio.fail_after(5):
        async with limiter.slot() as slot:
            assert not slot.released
    assert (await limiter.stats()).active == 0


# -- the keeper's context ---------------------------------------------------------------------


@mock_clock_and_asyncio()
async def test_the_keeper_does_not_run_in_the_context_of_the_request_that_started_it() -> None:
    limiter = Forgetful(lease_ttl=0.3)
    seen: list[tuple[str | None, object]] = []

    def record(event: ConcurrencyEvent) -> None:
        seen.append((event.run_id, slotwise.current_run()))

    async def request(run_id: str) -> None:
        async with slotwise.run(limiter=limiter, run_id=run_id), slotwise.slot():
            await anyio.sleep_forever()

    with on_event("lease-lost", limiter, record):
        # The first slot starts the keeper; the second is renewed by the same keeper.
        for run_id in ("first", "second"):
            with pytest.raises(ConcurrencyLeaseLostError), anyio.fail_after(10):
                await request(run_id)

    assert seen == [("first", None), ("second", None)]
