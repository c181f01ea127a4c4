"""Faults an adversarial review of the slot lifecycle found, one regression test each.

A slot entered through ``AsyncExitStack`` or a wrapper; the first renewal of a wrapped
limiter after a stalled hand-off; a renewal that ignores cancellation; a release that hangs
or raises a ``BaseException``; a subscriber that interrupts ``acquired``; a stalled loop that
watched the clock for everyone; a waiter left on a closed loop; a limiter left behind by a
finished trio run on a virtual clock; a keeper idle from a time where its linger rounds down;
trio's guest mode; ``sync_slot()`` inside a loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest
import trio
import trio.testing

import slotwise
from slotwise import (
    AcquireRequest,
    ConcurrencyConfigError,
    ConcurrencyEvent,
    ConcurrencyLeaseLostError,
    Lease,
    MemoryLimiter,
    SupportsLease,
    Workload,
)
from slotwise._runtime.loop import current

pytestmark = pytest.mark.anyio


class Custom:
    """A custom limiter of unlimited capacity; subclasses misbehave."""

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
        return lease if lease.lease_id in self.held else None

    async def release(self, lease: SupportsLease) -> None:
        await anyio.lowlevel.checkpoint()
        self.held.discard(lease.lease_id)


class Forwarding:
    """A wrapper with no fast paths of its own: the runtime renews its leases."""

    def __init__(self, inner: MemoryLimiter[Any]) -> None:
        self.inner = inner
        self.name = inner.name
        self.lease_ttl = inner.lease_ttl

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        return await self.inner.acquire(request)

    async def renew(self, lease: SupportsLease) -> SupportsLease | None:
        return await self.inner.renew(lease)

    async def release(self, lease: SupportsLease) -> None:
        await self.inner.release(lease)


@contextlib.contextmanager
def recording(limiter: object) -> Any:
    events: list[ConcurrencyEvent] = []
    unsubscribe = slotwise.subscribe(events.append, limiter=limiter)
    try:
        yield events
    finally:
        unsubscribe()


# -- entered through an exit stack or a wrapper -----------------------------------------------


class Wrapper:
    """Enters a slot in its own __aenter__ and exits it in its own __aexit__."""

    def __init__(self, limiter: MemoryLimiter[Any]) -> None:
        self._slot = limiter.slot()

    async def __aenter__(self) -> slotwise.Slot:
        return await self._slot.__aenter__()

    async def __aexit__(self, *exc: Any) -> None:
        await self._slot.__aexit__(*exc)


async def test_a_slot_entered_through_an_exit_stack_or_a_wrapper_is_released() -> None:
    limiter = MemoryLimiter(name="stack", max_concurrent=1)
    async with contextlib.AsyncExitStack() as stack:
        slot = await stack.enter_async_context(limiter.slot())
        assert not slot.released
    assert slot.released
    async with Wrapper(limiter) as wrapped:
        assert not wrapped.released
    assert wrapped.released
    shared = limiter.slot()
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(shared)
    # Nothing is left held: the task may take the slot again (no nested-slot refusal).
    async with limiter.slot():
        pass
    assert limiter.stats_nowait().active == 0


def test_a_sync_slot_entered_through_an_exit_stack_is_released() -> None:
    limiter = MemoryLimiter(name="stack", max_concurrent=1)
    with contextlib.ExitStack() as stack:
        slot = stack.enter_context(limiter.sync_slot())
    assert slot.released
    with limiter.sync_slot(timeout=1):
        assert limiter.stats_nowait().active == 1


# -- renewals of a limiter the runtime renews -------------------------------------------------


async def test_a_wrapped_limiter_renews_at_once_after_a_stalled_hand_off() -> None:
    # The waiter's loop stalls 0.25 s between the grant and its resumption, with a 0.3 s
    # lease: its first renewal must come as it resumes, not a third of a TTL later.
    inner = MemoryLimiter(name="wrapped", max_concurrent=1, lease_ttl=0.3)
    limiter = Forwarding(inner)
    inside = peak = 0

    async def use(seconds: float) -> None:
        nonlocal inside, peak
        async with slotwise.slot(limiter=limiter):
            inside += 1
            peak = max(peak, inside)
            await anyio.sleep(seconds)
            inside -= 1

    async def holder(queued: anyio.Event) -> None:
        async with slotwise.slot(limiter=limiter):
            await queued.wait()
        time.sleep(0.25)  # noqa: ASYNC251  (the stalled loop is the point)
        await use(0.0)

    with recording(limiter) as events, anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            queued = anyio.Event()
            tg.start_soon(holder, queued)
            await anyio.sleep(0.05)
            tg.start_soon(use, 0.5)
            await anyio.sleep(0.05)
            queued.set()
    assert peak == 1
    assert "lease-lost" not in [e.kind for e in events]


class RenewsInAThread(Custom):
    """A renewal that blocks in a thread: cancelling it waits for the thread."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(lease_ttl=0.6)
        self.gate = gate

    async def renew(self, lease: SupportsLease) -> SupportsLease | None:
        await anyio.to_thread.run_sync(self.gate.wait, 10)
        return lease


async def test_a_renewal_that_ignores_cancellation_still_loses_the_lease_in_time() -> None:
    gate = threading.Event()
    limiter = RenewsInAThread(gate)
    started = time.monotonic()
    try:
        with pytest.raises(ConcurrencyLeaseLostError), anyio.fail_after(10):
            async with slotwise.slot(limiter=limiter):
                await anyio.sleep(5)
        lost_after = time.monotonic() - started
    finally:
        gate.set()
    assert 0.55 <= lost_after < 2.0  # at the end of the lease, not when the renewal returns


# -- releases that hang or raise --------------------------------------------------------------


class ReleaseHangs(Custom):
    async def release(self, lease: SupportsLease) -> None:
        await anyio.sleep_forever()


async def test_a_release_that_hangs_is_bounded_by_the_lease() -> None:
    limiter = ReleaseHangs(lease_ttl=0.5)
    with recording(limiter) as events:
        started = time.monotonic()
        with anyio.move_on_after(0.2), anyio.fail_after(10):
            async with slotwise.slot(limiter=limiter):
                await anyio.sleep(5)
        took = time.monotonic() - started
    assert took < 2.0
    [failed] = [e for e in events if e.kind == "release-failed"]
    assert "TimeoutError" in failed.error


class _Boom(BaseException):
    pass


class ReleaseRaisesBaseException(Custom):
    async def release(self, lease: SupportsLease) -> None:
        await super().release(lease)
        raise _Boom("from release")


async def test_a_release_that_raises_a_base_exception_never_replaces_the_bodys() -> None:
    limiter = ReleaseRaisesBaseException()
    with recording(limiter) as events, pytest.raises(ValueError, match="from the body"):
        async with slotwise.slot(limiter=limiter):
            raise ValueError("from the body")
    assert [e.kind for e in events][-1] == "release-failed"
    assert limiter.held == set()


# -- a subscriber that interrupts ---------------------------------------------------------------


async def test_a_subscriber_interrupting_acquired_gives_the_slot_back() -> None:
    limiter = Custom()

    def interrupt(event: ConcurrencyEvent) -> None:
        if event.kind == "acquired":
            raise KeyboardInterrupt

    unsubscribe = slotwise.subscribe(interrupt, limiter=limiter)
    try:
        with pytest.raises(KeyboardInterrupt):
            async with slotwise.slot(limiter=limiter):
                pytest.fail("the slot never reaches its body")
    finally:
        unsubscribe()
    assert limiter.held == set()


# -- watching the clock, across threads -------------------------------------------------------


@pytest.mark.parametrize("stalled_backend", ["asyncio", "trio"])
def test_a_stalled_loop_does_not_delay_expiry_for_other_threads(stalled_backend: str) -> None:
    # A slot is abandoned (its Slot garbage collected); its lease comes back after 0.3 s. A
    # waiter of another thread must get it then, although the loop of the first waiter (which
    # watched the clock) is stalled for 2 s.
    limiter = MemoryLimiter(
        name="watch",
        max_concurrent=2,
        lease_ttl=0.3,
        workloads={"a": Workload(max_concurrent=1), "b": Workload()},
        default_workload="b",
    )
    ready = threading.Event()

    def stalled_loop() -> None:
        async def main() -> None:
            async def holder() -> None:
                async with limiter.slot("a"):
                    await anyio.sleep(3)

            async def waiter() -> None:
                async with limiter.slot("a"):
                    pass

            async with anyio.create_task_group() as tg:
                tg.start_soon(holder)
                await anyio.sleep(0.05)
                tg.start_soon(waiter)
                await anyio.sleep(0.05)
                ready.set()
                await anyio.sleep(0.1)
                time.sleep(2.0)  # noqa: ASYNC251  (the stall)

        anyio.run(main, backend=stalled_backend)

    async def main() -> float:
        thread = threading.Thread(target=stalled_loop)
        thread.start()
        await anyio.to_thread.run_sync(ready.wait, 10)
        abandoned = await slotwise.acquire(limiter=limiter, workload="b")
        del abandoned
        gc.collect()
        started = time.monotonic()
        async with limiter.slot("b"):
            waited = time.monotonic() - started
        await anyio.to_thread.run_sync(thread.join, 10)
        return waited

    waited = asyncio.run(main())
    assert waited < 1.5


def _full_with_a_waiter_on_a_closed_loop(limiter: MemoryLimiter[str]) -> list[slotwise.Slot]:
    """Fill ``limiter`` (2 slots) from this thread, and leave a waiter queued on an asyncio
    loop that is then closed. Returns the held slots: dropping them abandons them."""
    held = [
        slotwise._runtime.lifecycle.acquire_sync(limiter=limiter),
        slotwise._runtime.lifecycle.acquire_sync(limiter=limiter, allow_nested=True),
    ]

    async def wait_for_slot() -> None:
        async with limiter.slot(allow_nested=True):
            pass

    async def leave_a_waiter() -> None:
        asyncio.ensure_future(wait_for_slot())  # noqa: RUF006  (left behind on purpose)
        await asyncio.sleep(0.05)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(leave_a_waiter())
    loop.close()  # its waiter stays queued, on a closed loop
    return held


def test_a_waiter_left_on_a_closed_loop_keeps_no_one_else_asleep() -> None:
    limiter = MemoryLimiter(name="closed", max_concurrent=2, lease_ttl=0.2)
    held = _full_with_a_waiter_on_a_closed_loop(limiter)
    waited: list[float] = []

    def live() -> None:
        started = time.monotonic()
        with limiter.sync_slot(timeout=3, allow_nested=True):
            waited.append(time.monotonic() - started)

    thread = threading.Thread(target=live)
    thread.start()
    time.sleep(0.1)
    del held  # abandoned: their leases end within lease_ttl
    gc.collect()
    time.sleep(0.4)
    limiter.stats_nowait()  # sweeps, granting both waiters at once: must not raise
    thread.join(10)
    assert waited
    assert waited[0] < 2.5, waited  # asleep until its timeout would be 3 s


def test_a_waiter_left_on_a_closed_loop_does_not_keep_the_watch_of_its_thread() -> None:
    # The same, with the live waiter on a new event loop in the same thread: the closed
    # loop's waiter watched the clock for this thread, and can never wake up to do it.
    limiter = MemoryLimiter(name="closed", max_concurrent=2, lease_ttl=0.2)
    held = _full_with_a_waiter_on_a_closed_loop(limiter)
    del held  # abandoned: their leases end within lease_ttl

    async def live() -> float:
        started = time.monotonic()
        async with slotwise.run(limiter=limiter, timeout=3), limiter.slot(allow_nested=True):
            return time.monotonic() - started

    waited = asyncio.run(live())  # nothing else touches the limiter meanwhile
    assert waited < 2.5, waited  # asleep until its budget would be 3 s


# -- a virtual clock left behind --------------------------------------------------------------


def test_a_limiter_left_with_slots_by_a_finished_virtual_clock_run_serves_again() -> None:
    limiter = MemoryLimiter(name="mock", max_concurrent=1)

    async def take_and_leave() -> None:
        await limiter.acquire(AcquireRequest(workload="default", request_id="left"))

    trio.run(take_and_leave, clock=trio.testing.MockClock(autojump_threshold=0))

    async def use() -> None:
        with anyio.fail_after(5):
            async with limiter.slot():
                pass

    asyncio.run(use())  # real time: the finished run's slot is gone with it


@contextlib.contextmanager
def _collector_held_off() -> Iterator[None]:
    """Collect what is pending, then keep the collector off until the block ends: what the
    block leaves as garbage waits for the collection the test runs itself."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _collected_inside(lock: Any) -> None:
    """Run the garbage collector while this thread holds ``lock`` (a limiter's, or a
    subscriber's own), as it may run at any allocation inside it; fail if that does not
    return (an end of a request that waits for the lock would wait for ever: it is not
    reentrant)."""
    done = threading.Event()

    def collect() -> None:
        with lock:
            gc.collect()
        done.set()

    thread = threading.Thread(target=collect, daemon=True)
    thread.start()
    assert done.wait(10), "the collector's finalizers wait for the lock they interrupted"


def _eventually(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert check()


def test_a_waiter_closed_by_the_collector_inside_the_lock_gives_its_slot_back() -> None:
    """A request granted its slot on an asyncio loop that was closed is left as garbage; the
    collector closes its coroutine wherever it runs, here inside the limiter's lock in the
    same thread. Its withdrawal must not wait there for ever, and the slot must come back
    (not only when its lease expires). asyncio only: a trio run ends only when its tasks
    have."""
    limiter = MemoryLimiter(name="collected", max_concurrent=1, lease_ttl=60)
    held = slotwise._runtime.lifecycle.acquire_sync(limiter=limiter)

    async def wait_for_slot() -> None:
        me = asyncio.current_task()  # noqa: F841  (a cycle: the task, its coroutine, its frame)
        async with limiter.slot(allow_nested=True):
            pass

    async def leave_a_waiter() -> None:
        asyncio.ensure_future(wait_for_slot())  # noqa: RUF006  (left behind on purpose)
        await asyncio.sleep(0.05)

    with _collector_held_off():
        loop = asyncio.new_event_loop()
        loop.run_until_complete(leave_a_waiter())
        loop.close()  # the waiter is left as garbage, for the collector to close
        limiter.release_nowait(held.lease)  # granted to the waiter, whose loop is closed
        assert limiter.stats_nowait().active == 1
        _collected_inside(limiter._lock)
    _comes_back(limiter)


def _comes_back(limiter: MemoryLimiter[str]) -> None:
    _eventually(lambda: not limiter.stats_nowait().active)  # not after lease_ttl, 60 s


def test_a_slot_taken_at_once_and_closed_by_the_collector_inside_the_lock_comes_back() -> None:
    """As above, for a request that took its slot at once and had not resumed from the turn
    after it when its loop was closed. asyncio only, as above."""
    limiter = MemoryLimiter(name="collected", max_concurrent=1, lease_ttl=60)

    async def take() -> None:
        me = asyncio.current_task()  # noqa: F841  (a cycle: the task, its coroutine, its frame)
        async with limiter.slot():
            pass

    with _collector_held_off():
        loop = asyncio.new_event_loop()
        loop.create_task(take())  # noqa: RUF006  (left behind on purpose)
        loop.call_soon(loop.stop)
        loop.run_forever()  # one step: it took its slot, and waits for its turn
        loop.close()
        assert limiter.stats_nowait().active == 1
        _collected_inside(limiter._lock)
    _comes_back(limiter)


def _a_sync_slot_left_to_the_collector(limiter: MemoryLimiter[str]) -> None:
    """A generator that holds a `sync_slot()` of ``limiter``, left in a reference cycle."""

    def holding(box: list[object]) -> Iterator[None]:
        with limiter.sync_slot():
            yield

    box: list[object] = []
    generator = holding(box)
    box.append(generator)  # a cycle: the generator, its frame, the list
    next(generator)


def test_a_sync_slot_in_a_generator_closed_by_the_collector_inside_the_lock_comes_back() -> None:
    limiter = MemoryLimiter(name="collected", max_concurrent=1, lease_ttl=60)
    with _collector_held_off():
        _a_sync_slot_left_to_the_collector(limiter)
        assert limiter.stats_nowait().active == 1
        _collected_inside(limiter._lock)
    _comes_back(limiter)


@pytest.mark.parametrize("interrupted", ["the limiter's lock", "the subscriber's own lock"])
def test_a_subscriber_hears_of_a_slot_the_collector_ends_after_the_collection(
    interrupted: str,
) -> None:
    """The subscriber takes a lock of its own (as the OpenTelemetry bridge does, which
    allocates inside it) and the limiter's: the collector may have interrupted either when
    it ends a request, whose event must then wait for the collection to end."""
    limiter = MemoryLimiter(name="collected", max_concurrent=1, lease_ttl=60)
    own = threading.Lock()
    heard: list[tuple[str, int]] = []

    def subscriber(event: slotwise.ConcurrencyEvent) -> None:
        with own:
            heard.append((event.kind, limiter.stats_nowait().active))

    unsubscribe = slotwise.subscribe(subscriber, limiter)
    try:
        with _collector_held_off():
            _a_sync_slot_left_to_the_collector(limiter)
            heard.clear()
            _collected_inside(limiter._lock if interrupted == "the limiter's lock" else own)
        _comes_back(limiter)
        _eventually(lambda: ("released", 0) in heard)
    finally:
        unsubscribe()


def test_a_subscriber_that_raises_to_stop_does_not_keep_a_collected_event_from_the_others() -> None:
    """The worker delivers the events of requests that the collector ended: a subscriber's
    KeyboardInterrupt or SystemExit there stops nothing (it is logged), and every other
    subscriber still hears the event."""
    limiter = MemoryLimiter(name="collected", max_concurrent=1, lease_ttl=60)
    heard: list[str] = []

    def stopping(event: slotwise.ConcurrencyEvent) -> None:
        if event.kind == "released":
            raise KeyboardInterrupt

    unsubscribes = [
        slotwise.subscribe(stopping, limiter),
        slotwise.subscribe(lambda event: heard.append(event.kind), limiter),
    ]
    try:
        with _collector_held_off():
            _a_sync_slot_left_to_the_collector(limiter)
            gc.collect()
        _comes_back(limiter)
        _eventually(lambda: "released" in heard)
    finally:
        for unsubscribe in unsubscribes:
            unsubscribe()


async def test_a_limiter_in_use_on_a_virtual_clock_refuses_other_loops_clearly() -> None:
    limiter = MemoryLimiter(name="mock", max_concurrent=1)
    errors: list[BaseException] = []

    def from_a_thread() -> None:
        try:
            with limiter.sync_slot(timeout=1, allow_nested=True):
                pass
        except BaseException as exc:
            errors.append(exc)

    async def on_a_virtual_clock() -> None:
        async with limiter.slot():
            await trio.to_thread.run_sync(from_a_thread)

    trio_thread = threading.Thread(
        target=trio.run,
        args=(on_a_virtual_clock,),
        kwargs={"clock": trio.testing.MockClock(autojump_threshold=0)},
    )
    trio_thread.start()
    await anyio.to_thread.run_sync(trio_thread.join, 10)
    [error] = errors
    assert isinstance(error, ConcurrencyConfigError)
    assert "virtual clock" in str(error)


def test_a_virtual_clock_reused_by_a_later_run_belongs_to_that_run() -> None:
    """A test that reuses its MockClock for a second trio run: the limiter follows the second
    run, so another thread finds the one slot held there, and is refused, instead of taking
    the run for the finished first one and dropping the slot it holds."""
    limiter = MemoryLimiter(name="mock", max_concurrent=1)
    clock = trio.testing.MockClock(autojump_threshold=0)
    entered: list[str] = []
    errors: list[BaseException] = []

    async def first() -> None:
        async with limiter.slot():
            entered.append("first run")

    def from_a_thread() -> None:
        async def main() -> None:
            # Nested only in the context that trio's thread copies: another loop's slot.
            async with limiter.slot(allow_nested=True):
                entered.append("another thread, while the second run holds the slot")

        try:
            asyncio.run(main())
        except BaseException as exc:
            errors.append(exc)

    async def second() -> None:
        async with limiter.slot():
            entered.append("second run")
            await trio.to_thread.run_sync(from_a_thread)

    trio.run(first, clock=clock)
    trio.run(second, clock=clock)
    assert entered == ["first run", "second run"]
    [error] = errors
    assert isinstance(error, ConcurrencyConfigError)
    assert "virtual clock" in str(error)


def test_a_virtual_clock_shared_by_two_runs_at_once_belongs_to_both() -> None:
    """Two trio runs use one MockClock at once: the limiter's slots are abandoned only when
    both have ended. One run holds the one slot while the other, which used the limiter
    later, ends; another thread is refused all the same."""
    limiter = MemoryLimiter(name="mock", max_concurrent=1)
    clock = trio.testing.MockClock(autojump_threshold=0)
    entered: list[str] = []
    errors: list[BaseException] = []
    holding = threading.Event()
    leave = threading.Event()

    async def holder() -> None:
        async with limiter.slot():
            entered.append("the holder's run")
            holding.set()
            await trio.to_thread.run_sync(leave.wait)

    async def passer() -> None:
        with trio.move_on_after(1):
            async with limiter.slot():
                entered.append("the other run")  # not while the holder holds the one slot

    async def from_another_loop() -> None:
        async with limiter.slot():
            entered.append("another loop, while the holder's run holds the slot")

    holding_run = threading.Thread(target=trio.run, args=(holder,), kwargs={"clock": clock})
    holding_run.start()
    assert holding.wait(10)
    trio.run(passer, clock=clock)  # used the limiter after the holder's run, and ended
    try:
        asyncio.run(from_another_loop())
    except BaseException as exc:
        errors.append(exc)
    leave.set()
    holding_run.join(10)
    assert entered == ["the holder's run"]
    [error] = errors
    assert isinstance(error, ConcurrencyConfigError)
    assert "virtual clock" in str(error)


class _Spinning(trio.abc.Instrument):
    """Cancels ``scope`` once the run has stepped tasks 10,000 times at one virtual time: a
    task that never blocks (a wait of zero, again and again) keeps a virtual clock from
    moving, and the run would never end."""

    def __init__(self, clock: trio.testing.MockClock, scope: trio.CancelScope) -> None:
        self.clock, self.scope = clock, scope
        self.at, self.steps, self.spun = -1.0, 0, False

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        now = self.clock.current_time()
        self.steps = self.steps + 1 if now == self.at else 0
        self.at = now
        if self.steps > 10_000 and not self.spun:
            self.spun = True
            self.scope.cancel()


def test_the_keeper_ends_when_idle_at_a_time_where_the_linger_rounds_down() -> None:
    """The lease keeper lingers 5 s once idle, then ends. Idle from t = 28.072265335404968,
    the end of its linger rounds to 33.072265335404964, where ``now - idle_since`` is still
    below 5: it slept until then, found itself early, and slept 0 s again, forever, and
    on a virtual clock time stood still."""
    idle_since = 28.072265335404968
    assert (idle_since + 5.0) - idle_since < 5.0  # the rounding itself
    clock = trio.testing.MockClock(autojump_threshold=0)
    limiter = Custom()
    spinning: list[_Spinning] = []

    async def main() -> None:
        with trio.CancelScope() as scope:
            spinning.append(_Spinning(clock, scope))
            trio.lowlevel.add_instrument(spinning[0])
            clock.jump(idle_since)
            async with slotwise.slot(limiter=limiter):  # the keeper renews a custom limiter's
                pass
            await trio.sleep(60)  # past the linger: the keeper has ended

    trio.run(main, clock=clock)
    assert not spinning[0].spun, "the keeper never ended: it waited 0 s again and again"
    assert clock.current_time() == idle_since + 60


# -- trio's guest mode ------------------------------------------------------------------------


def test_trio_in_guest_mode_on_an_asyncio_host() -> None:
    limiter = MemoryLimiter(name="guest", max_concurrent=1)

    async def trio_main() -> str:
        async def hold() -> None:
            async with limiter.slot():
                await trio.sleep(0.1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold)
            await trio.sleep(0.01)
            with trio.fail_after(5):
                async with limiter.slot():
                    pass
        return "ok"

    async def host() -> Any:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        trio.lowlevel.start_guest_run(
            trio_main,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=done.set_result,
        )
        return (await done).unwrap()

    assert asyncio.run(host()) == "ok"


def test_the_hosts_tasks_take_slots_while_a_trio_guest_run_is_active() -> None:
    """Between trio's tasks, code of the same thread is the asyncio host's: its slots wait and
    yield on asyncio (they used to be taken as trio's and fail with "Task got bad yield"),
    beside the guest's own, each loop with its own `Loop`."""
    limiter = MemoryLimiter(name="guest", max_concurrent=1)
    entered: list[str] = []

    async def trio_main() -> None:
        with trio.fail_after(5):
            async with limiter.slot():
                entered.append("guest")
                await trio.sleep(0.05)

    async def host() -> Any:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        trio.lowlevel.start_guest_run(
            trio_main,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=done.set_result,
        )
        await asyncio.sleep(0.01)  # the guest holds the only slot: the host's waits for it
        async with asyncio.timeout(5), limiter.slot():
            entered.append("host")
            assert type(current()).__name__ == "AsyncioLoop"
        return (await done).unwrap()

    asyncio.run(host())
    assert entered == ["guest", "host"]
    assert limiter.stats_nowait().active == 0


# -- sync_slot inside an event loop -----------------------------------------------------------


async def test_sync_slot_inside_an_event_loop_is_refused_clearly() -> None:
    limiter = MemoryLimiter(name="sync", max_concurrent=1)
    with pytest.raises(ConcurrencyConfigError, match="runs an event loop"):
        limiter.sync_slot().__enter__()
    assert limiter.stats_nowait().active == 0
