"""One clock for a limiter shared by loops whose clocks differ.

A `MemoryLimiter` keeps its state on `time.monotonic()`; each waiter's deadline (the
request's deadline, its run's budget) is converted from its own loop's clock to that one, and
each waiter's alarm (its `max_wait` or deadline, a lease that expires unrenewed) back to its
loop's clock. Each loop and thread watches the clock for itself: in these tests the waiter is
the only one waiting, on a loop whose clock is far ahead of `time.monotonic()` or far behind
it, while a plain thread or another event loop holds the slot and watches nothing. A
conversion that is wrong then shows: a wait that ends far too early, one that does not end
when it must, or a waiter that never wakes up for an expired lease, or one that spins on an
alarm already past. Bounds are generous: a wait must not end before its moment, and must end
before a deadline many times later; no test times how fast anything is.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVarTuple

import anyio
import pytest
import trio
from test_threads import run_threads

import slotwise
from slotwise import AcquireRequest, ConcurrencyTimeoutError, MemoryLimiter, Workload

SHIFT = 1_000_000.0  # seconds between the waiter's clock and time.monotonic()
WAIT = 0.3  # the waiter's deadline, budget or max_wait; the holder's lease_ttl
LATE = 10.0  # a wait still going this long after its moment has missed it
# A waiter parked until its moment wakes up a handful of times; one whose alarm is already
# past (a conversion off by SHIFT) wakes up without end, thousands of times over WAIT.
WAKEUPS = 100

Ts = TypeVarTuple("Ts")


class ShiftedClock(trio.abc.Clock):
    """trio's clock in real time, `offset` seconds from `time.monotonic()`: no MockClock, so
    the limiter keeps real time and only the conversions bridge the two."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def start_clock(self) -> None:
        pass

    def current_time(self) -> float:
        return time.monotonic() + self.offset

    def deadline_to_sleep_time(self, deadline: float) -> float:
        return deadline - self.current_time()


class Steps(trio.abc.Instrument):
    """How many times a trio run's tasks were scheduled."""

    def __init__(self) -> None:
        self.count = 0

    def before_task_step(self, task: Any) -> None:
        self.count += 1


class ShiftedLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose `time()` is `offset` seconds from `time.monotonic()`, counting
    the timers set on it."""

    def __init__(self, offset: float) -> None:
        super().__init__()
        self.offset = offset
        self.timers = 0

    def time(self) -> float:
        return time.monotonic() + self.offset

    def call_at(
        self,
        when: float,
        callback: Callable[[*Ts], object],
        *args: *Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        self.timers += 1
        return super().call_at(when, callback, *args, context=context)


WAITERS = [
    pytest.param(("trio", SHIFT), id="trio-ahead"),
    pytest.param(("trio", -SHIFT), id="trio-behind"),
    pytest.param(("asyncio", SHIFT), id="asyncio-ahead"),
    pytest.param(("asyncio", -SHIFT), id="asyncio-behind"),
]


def run_shifted(waiter: tuple[str, float], main: Callable[[], Awaitable[None]]) -> int:
    """Run `main()` on a new loop of the waiter's kind whose clock is shifted by its offset;
    returns how many times that loop woke a task (trio) or set a timer (asyncio)."""
    kind, offset = waiter
    if kind == "trio":
        steps = Steps()
        trio.run(main, clock=ShiftedClock(offset), instruments=[steps])
        return steps.count
    loop = ShiftedLoop(offset)
    with asyncio.Runner(loop_factory=lambda: loop) as runner:
        assert abs(runner.get_loop().time() - time.monotonic() - offset) < 1
        runner.run(main())  # type: ignore[arg-type]
    return loop.timers


def hold(
    limiter: MemoryLimiter[str], holder: str, held: threading.Event, done: threading.Event
) -> None:
    """Hold the limiter's only slot until `done`, from a plain thread or an asyncio loop,
    without waiting on the limiter (so without watching its clock)."""
    if holder == "thread":
        with limiter.sync_slot(workload="default"):
            held.set()
            done.wait(60)
        return

    async def on_a_loop() -> None:
        async with limiter.slot(workload="default"):
            held.set()
            await asyncio.to_thread(done.wait, 60)

    asyncio.run(on_a_loop())


@pytest.mark.parametrize("waiter", WAITERS)
@pytest.mark.parametrize(
    ("ends_by", "holder"),
    [
        ("deadline", "thread"),
        ("deadline", "loop"),
        ("budget", "loop"),
        ("max_wait", "thread"),
    ],
)
def test_a_wait_on_a_shifted_clock_ends_at_its_moment(
    waiter: tuple[str, float], ends_by: str, holder: str
) -> None:
    # The slot is held by a plain thread or another asyncio loop for longer than the waiter
    # may wait; the waiter, the only one waiting, times out after WAIT: not before (its
    # deadline read on the wrong clock ends it at once) and not LATE (it never ends, or only
    # when the slot comes back), having woken up a handful of times, not without end.
    max_wait = WAIT if ends_by == "max_wait" else None
    limiter = MemoryLimiter(
        name="shifted", max_concurrent=1, workloads={"default": Workload(max_wait=max_wait)}
    )
    held, done = threading.Event(), threading.Event()
    outcome: list[str] = []
    waited: list[float] = []

    async def wait() -> None:
        assert held.is_set()
        started = time.monotonic()
        with anyio.move_on_after(LATE) as late:
            try:
                if ends_by == "deadline":
                    request = AcquireRequest(
                        workload="default", request_id="w", deadline=anyio.current_time() + WAIT
                    )
                    await limiter.acquire(request)
                    outcome.append("granted")
                elif ends_by == "budget":
                    async with slotwise.run(limiter=limiter, timeout=WAIT), slotwise.slot():
                        outcome.append("granted")
                else:
                    async with limiter.slot():
                        outcome.append("granted")
            except ConcurrencyTimeoutError:
                outcome.append("timed out")
        if late.cancelled_caught:
            outcome.append("still waiting")
        waited.append(time.monotonic() - started)

    wakeups: list[int] = []

    def waiter_thread() -> None:
        try:
            assert held.wait(10)
            wakeups.append(run_shifted(waiter, wait))
        finally:
            done.set()

    run_threads([lambda: hold(limiter, holder, held, done), waiter_thread])
    assert outcome == ["timed out"]
    assert WAIT - 0.02 <= waited[0] < LATE
    assert wakeups[0] < WAKEUPS
    stats = limiter.stats_nowait()
    assert (stats.active, stats.queued) == (0, 0)


@pytest.mark.parametrize("waiter", WAITERS)
def test_a_lease_from_a_stalled_loop_expires_for_the_only_waiter_on_a_shifted_clock(
    waiter: tuple[str, float],
) -> None:
    # An asyncio loop takes the only slot through the protocol and stalls (blocked in a sync
    # call: its lease is never renewed, and it watches nothing). The only waiter is on a loop
    # whose clock is far from time.monotonic(): it alone watches the clock, so it must wake
    # up when the lease expires, and is granted then: not before lease_ttl, and well before
    # LATE.
    limiter = MemoryLimiter(name="stalled", max_concurrent=1, lease_ttl=WAIT)
    taken, done = threading.Event(), threading.Event()
    taken_at: list[float] = []
    granted_at: list[float] = []

    async def take_and_stall() -> None:
        lease = await limiter.acquire(AcquireRequest(workload="default", request_id="stalled"))
        taken_at.append(time.monotonic())
        taken.set()
        done.wait(60)  # the loop is stalled: no renewal, no release
        await limiter.release(lease)  # lost meanwhile: a release that does nothing

    async def wait() -> None:
        with anyio.move_on_after(LATE):
            async with limiter.slot():
                granted_at.append(time.monotonic())

    wakeups: list[int] = []

    def waiter_thread() -> None:
        try:
            assert taken.wait(10)
            wakeups.append(run_shifted(waiter, wait))
        finally:
            done.set()

    run_threads([lambda: asyncio.run(take_and_stall()), waiter_thread])
    assert granted_at, f"no grant within {LATE}s of a lease that expires after {WAIT}s"
    assert WAIT - 0.02 <= granted_at[0] - taken_at[0] < LATE
    assert wakeups[0] < WAKEUPS
    stats = limiter.stats_nowait()
    assert (stats.active, stats.queued) == (0, 0)


@pytest.mark.parametrize("waiter", WAITERS)
def test_the_shifted_clocks_are_shifted(waiter: tuple[str, float]) -> None:
    # The premise of the tests above: each waiter's loop reads a clock SHIFT seconds away from
    # time.monotonic(), in real time (no MockClock: the limiter keeps time.monotonic()).
    readings: list[float] = []

    async def read() -> None:
        before = anyio.current_time()
        await anyio.sleep(0.01)
        readings.append(anyio.current_time() - before)
        readings.append(anyio.current_time() - time.monotonic())

    run_shifted(waiter, read)
    elapsed, offset = readings
    assert 0.01 <= elapsed < LATE
    assert math.isclose(offset, waiter[1], abs_tol=1.0)
