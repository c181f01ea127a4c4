"""One MemoryLimiter for every thread and event loop of a process.

asyncio loops in several threads, trio runs and plain threads (``sync_slot``) share one limiter
of 5 with workloads: the maximum active never exceeds a limit, no waiter hangs (every thread is
joined under a timeout), priority holds across threads, a lease taken in one loop and never
renewed expires for waiters of the others, and random schedules cancel and time out on every
side. These tests start their own loops in threads, so they are plain (sync) tests.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import trio

import slotwise
from slotwise import (
    AcquireRequest,
    ConcurrencyConfigError,
    ConcurrencyEvent,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
    MemoryLimiter,
    Workload,
)

WORKLOADS = {
    "interactive": Workload(reserved=1, priority=10),
    "background": Workload(max_concurrent=3),
}
CEILINGS = {"interactive": 5, "background": 3}


class Meter:
    """Counts bodies inside their slot, in total and per workload, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.inside = {"interactive": 0, "background": 0}
        self.peak = {"interactive": 0, "background": 0, "total": 0}
        self.entries = 0

    def enter(self, workload: str) -> None:
        with self._lock:
            self.inside[workload] += 1
            self.entries += 1
            self.peak[workload] = max(self.peak[workload], self.inside[workload])
            self.peak["total"] = max(self.peak["total"], sum(self.inside.values()))

    def leave(self, workload: str) -> None:
        with self._lock:
            self.inside[workload] -= 1


def run_threads(targets: list[Callable[[], None]], timeout: float = 60.0) -> None:
    """Run each target in a thread; fail if any raises or any is still running at timeout."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [thread for thread in threads if thread.is_alive()]
    assert not hung, f"{len(hung)} threads still waiting after {timeout}s"
    if errors:
        raise errors[0]


def test_threads_loops_and_trio_runs_share_one_limiter() -> None:
    limiter = MemoryLimiter(name="shared", max_concurrent=5, workloads=WORKLOADS)
    meter = Meter()
    rounds = 30

    async def body(workload: str, rng: random.Random) -> None:
        async with limiter.slot(workload=workload):
            meter.enter(workload)
            try:
                await anyio.sleep(rng.random() * 0.002)
            finally:
                meter.leave(workload)

    async def loop_worker(seed: int) -> None:
        rng = random.Random(seed)
        async with anyio.create_task_group() as tg:
            for index in range(4):
                workload = "interactive" if (seed + index) % 3 == 0 else "background"

                async def many(workload: str = workload) -> None:
                    for _ in range(rounds):
                        await body(workload, rng)

                tg.start_soon(many)

    def sync_worker(seed: int) -> None:
        rng = random.Random(seed)
        workload = "interactive" if seed % 4 == 0 else "background"
        for _ in range(rounds):
            with limiter.sync_slot(workload=workload):
                meter.enter(workload)
                try:
                    time.sleep(rng.random() * 0.002)
                finally:
                    meter.leave(workload)

    targets: list[Callable[[], None]] = []
    targets += [lambda s=s: asyncio.run(loop_worker(s)) for s in range(8)]  # type: ignore[misc]
    targets += [lambda s=s: trio.run(loop_worker, 100 + s) for s in range(2)]  # type: ignore[misc]
    targets += [lambda s=s: sync_worker(200 + s) for s in range(16)]  # type: ignore[misc]
    run_threads(targets)

    assert meter.entries == (8 + 2) * 4 * rounds + 16 * rounds
    assert meter.peak["total"] <= 5
    assert meter.peak["background"] <= CEILINGS["background"]
    assert meter.peak["total"] == 5  # the load did fill the limiter
    stats = limiter.stats_nowait()
    assert (stats.active, stats.queued) == (0, 0)


def test_priority_holds_across_threads_and_loops() -> None:
    limiter = MemoryLimiter(
        name="priority",
        max_concurrent=1,
        workloads={"interactive": Workload(priority=10), "background": Workload()},
    )
    order: list[str] = []
    holder = limiter.sync_slot(workload="background")
    held = holder.__enter__()
    queued = threading.Event()

    def background_thread(name: str) -> None:
        with limiter.sync_slot(workload="background"):
            order.append(name)

    async def interactive_loop() -> None:
        async with limiter.slot(workload="interactive"):
            order.append("interactive")

    def until_queued(count: int) -> None:
        deadline = time.monotonic() + 10
        while limiter.stats_nowait().queued < count:
            assert time.monotonic() < deadline
            time.sleep(0.001)

    threads = [threading.Thread(target=background_thread, args=(f"bg{i}",)) for i in range(3)]
    for index, thread in enumerate(threads):
        thread.start()
        until_queued(index + 1)
    interactive = threading.Thread(target=lambda: asyncio.run(interactive_loop()))
    interactive.start()
    until_queued(4)
    queued.set()
    holder.__exit__(None, None, None)
    assert held.released
    for thread in [*threads, interactive]:
        thread.join(10)
        assert not thread.is_alive()
    # The later, higher-priority request goes first; background keeps its arrival order.
    assert order == ["interactive", "bg0", "bg1", "bg2"]


def test_a_lease_from_one_loop_expires_for_waiters_of_every_other() -> None:
    # A lease taken through the protocol and never renewed (its holder died) in an asyncio
    # loop; waiters in a trio run and in a plain thread get the slot once lease_ttl passes,
    # and not before: the limiter keeps one clock for all of them.
    limiter = MemoryLimiter(name="expiry", max_concurrent=1, lease_ttl=0.3)
    taken_at: list[float] = []

    async def take_and_forget() -> None:
        await limiter.acquire(AcquireRequest(workload="default", request_id="dead"))
        taken_at.append(time.monotonic())

    asyncio.run(take_and_forget())
    got: dict[str, float] = {}

    async def trio_waiter() -> None:
        async with limiter.slot():
            got["trio"] = time.monotonic()
            await trio.sleep(0.05)

    def thread_waiter() -> None:
        with limiter.sync_slot(timeout=10):
            got["thread"] = time.monotonic()
            time.sleep(0.05)

    run_threads([lambda: trio.run(trio_waiter), thread_waiter], timeout=30)
    first = min(got.values())
    assert first - taken_at[0] >= 0.3 - 0.01
    assert first - taken_at[0] < 5
    assert abs(got["trio"] - got["thread"]) >= 0.04  # one after the other


def test_random_schedules_with_cancellations_and_timeouts_on_every_side() -> None:
    limiter = MemoryLimiter(
        name="chaos",
        max_concurrent=5,
        max_queued=40,
        workloads={
            "interactive": Workload(reserved=1, priority=10, max_wait=0.05),
            "background": Workload(max_concurrent=3),
        },
    )
    meter = Meter()
    outcomes: dict[str, int] = {"ok": 0, "timeout": 0, "cancelled": 0, "full": 0}
    outcome_lock = threading.Lock()

    def count(kind: str) -> None:
        with outcome_lock:
            outcomes[kind] += 1

    async def attempt(rng: random.Random) -> None:
        workload = rng.choice(["interactive", "background"])
        with anyio.move_on_after(rng.choice([0.0005, 0.003, 1.0])) as scope:
            try:
                async with limiter.slot(workload=workload):
                    meter.enter(workload)
                    try:
                        await anyio.sleep(rng.random() * 0.003)
                    finally:
                        meter.leave(workload)
            except ConcurrencyTimeoutError:
                count("timeout")
                return
            except ConcurrencyQueueFullError:
                count("full")
                return
        count("cancelled" if scope.cancelled_caught else "ok")

    async def loop_worker(seed: int) -> None:
        rng = random.Random(seed)
        async with anyio.create_task_group() as tg:
            for _ in range(5):

                async def many() -> None:
                    for _ in range(25):
                        await attempt(rng)

                tg.start_soon(many)

    async def native_cancels(seed: int) -> None:
        # asyncio's own cancellation, at random moments of the wait and the hold.
        rng = random.Random(seed)
        for _ in range(60):
            task = asyncio.ensure_future(attempt(rng))
            await asyncio.sleep(rng.random() * 0.004)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                count("cancelled")

    def sync_worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(40):
            workload = rng.choice(["interactive", "background"])
            try:
                with limiter.sync_slot(workload=workload, timeout=rng.choice([0.0, 0.002, 1])):
                    meter.enter(workload)
                    try:
                        time.sleep(rng.random() * 0.002)
                    finally:
                        meter.leave(workload)
            except ConcurrencyTimeoutError:
                count("timeout")
            except ConcurrencyQueueFullError:
                count("full")
            else:
                count("ok")

    targets: list[Callable[[], None]] = []
    targets += [lambda s=s: asyncio.run(loop_worker(s)) for s in range(4)]  # type: ignore[misc]
    targets += [lambda s=s: asyncio.run(native_cancels(50 + s)) for s in range(2)]  # type: ignore[misc]
    targets += [lambda s=s: trio.run(loop_worker, 100 + s) for s in range(2)]  # type: ignore[misc]
    targets += [lambda s=s: sync_worker(200 + s) for s in range(8)]  # type: ignore[misc]
    run_threads(targets)

    assert meter.peak["total"] <= 5
    assert meter.peak["background"] <= 3
    assert outcomes["ok"] > 0
    assert outcomes["timeout"] > 0
    assert outcomes["cancelled"] > 0
    stats = limiter.stats_nowait()
    assert (stats.active, stats.queued) == (0, 0)
    # Every slot went back: the whole capacity can be taken again at once.
    with (
        limiter.sync_slot(workload="interactive", timeout=1),
        limiter.sync_slot(workload="background", timeout=1, allow_nested=True),
        limiter.sync_slot(workload="background", timeout=1, allow_nested=True),
        limiter.sync_slot(workload="background", timeout=1, allow_nested=True),
        limiter.sync_slot(workload="interactive", timeout=1, allow_nested=True),
    ):
        assert limiter.stats_nowait().active == 5


# -- sync_slot --------------------------------------------------------------------------------


def test_sync_slot_reports_events_errors_and_stats() -> None:
    limiter = MemoryLimiter(
        name="sync", max_concurrent=1, max_queued=0, workloads={"default": Workload()}
    )
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)
    try:
        with limiter.sync_slot() as slot:
            assert limiter.stats_nowait().active == 1
            assert slot.lease_id is not None
            with pytest.raises(ConcurrencyConfigError, match="already holds a slot"):
                limiter.sync_slot().__enter__()
            with pytest.raises(ConcurrencyQueueFullError):
                limiter.sync_slot(allow_nested=True).__enter__()
        assert slot.released
        with pytest.raises(ConcurrencyConfigError, match="unknown workload 'typo'"):
            limiter.sync_slot(workload="typo").__enter__()
        with pytest.raises(ValueError, match="boom"), limiter.sync_slot():
            raise ValueError("boom")
    finally:
        unsubscribe()
    kinds = [e.kind for e in events]
    assert kinds == [
        "wait-started",
        "acquired",
        "config-error",
        "wait-started",
        "queue-full",
        "released",
        "config-error",
        "wait-started",
        "acquired",
        "released",
    ]
    released = [e for e in events if e.kind == "released"]
    assert [e.outcome for e in released] == ["completed", "failed"]


def test_sync_slot_times_out_and_says_so() -> None:
    limiter = MemoryLimiter(name="sync", max_concurrent=1)
    with limiter.sync_slot():
        started = time.monotonic()
        with pytest.raises(ConcurrencyTimeoutError) as caught:
            limiter.sync_slot(timeout=0.1, allow_nested=True).__enter__()
        waited = time.monotonic() - started
    assert 0.09 <= waited < 5
    assert caught.value.limiter == "sync"
    assert "deadline passed" in str(caught.value)
    assert "the run's budget ended" not in str(caught.value)  # there is no run
    assert limiter.stats_nowait().queued == 0


def test_a_sync_slot_held_past_its_lease_ttl_keeps_its_slot() -> None:
    # Nothing renews a sync slot's lease: the slot itself keeps it valid while it is held,
    # however long past lease_ttl, so no other thread is granted the limiter's only slot.
    limiter = MemoryLimiter(name="held", max_concurrent=1, lease_ttl=0.1)
    outcome: list[str] = []

    def other_thread() -> None:
        try:
            with limiter.sync_slot(timeout=0.3):
                outcome.append("granted while the slot was held")
        except ConcurrencyTimeoutError:
            outcome.append("timed out")

    with limiter.sync_slot() as slot:
        time.sleep(0.3)  # three times lease_ttl, with no renewal
        run_threads([other_thread], timeout=30)
        assert limiter.stats_nowait().active == 1
        assert not slot.released
    assert outcome == ["timed out"]
    assert slot.released
    assert limiter.stats_nowait().active == 0


def test_ctrl_c_interrupts_a_sync_wait_and_withdraws_its_request() -> None:
    # What else ends a wait in a thread: an exception raised in it, here Ctrl-C (SIGINT) in
    # the main thread while it is blocked waiting. The request leaves the queue, the wait is
    # reported as cancelled, and the next request is served as if it had never waited.
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    limiter = MemoryLimiter(name="ctrl-c", max_concurrent=1)
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)
    held, done = threading.Event(), threading.Event()

    def holder() -> None:
        with limiter.sync_slot():
            held.set()
            done.wait(30)

    def press_ctrl_c() -> None:
        deadline = time.monotonic() + 10
        while limiter.stats_nowait().queued < 1:
            if time.monotonic() > deadline:
                return  # never queued: the main thread's wait times out and fails the test
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGINT)  # delivered to the main thread, as Ctrl-C is

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(10)
        presser = threading.Thread(target=press_ctrl_c)
        presser.start()
        with pytest.raises(KeyboardInterrupt), limiter.sync_slot(timeout=30):
            pytest.fail("the body must not run")
        presser.join(10)
        assert limiter.stats_nowait().queued == 0
    finally:
        signal.signal(signal.SIGINT, previous)
        done.set()
        thread.join(10)
        unsubscribe()
    assert [e.kind for e in events if e.kind.startswith("wait-")] == [
        "wait-started",
        "wait-started",
        "wait-cancelled",
    ]
    with limiter.sync_slot(timeout=1):
        assert limiter.stats_nowait().active == 1


def test_sync_slot_without_a_limiter_limits_nothing() -> None:
    with slotwise.sync_slot() as slot:
        assert slot.limiter is None
        assert slot.released


def test_sync_slot_refuses_a_limiter_that_cannot_block_clearly() -> None:
    class AsyncOnly:
        name = "async-only"

        async def acquire(self, request: AcquireRequest) -> Any:
            raise AssertionError("never called")

        async def renew(self, lease: Any) -> Any:
            return lease

        async def release(self, lease: Any) -> None:
            return None

    with pytest.raises(ConcurrencyConfigError, match="cannot be used from code without an event"):
        slotwise.sync_slot(limiter=AsyncOnly()).__enter__()


# -- runs and threads -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_thread_started_from_a_run_keeps_its_lineage_and_budget(backend: str) -> None:
    limiter = MemoryLimiter(name="budget", max_concurrent=1)
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)

    def in_thread() -> float:
        with pytest.raises(ConcurrencyTimeoutError), slotwise.sync_slot():
            pytest.fail("the slot is held for longer than the run's budget")
        return time.monotonic()

    async def hold(held: anyio.Event) -> None:
        async with limiter.slot():
            held.set()
            await anyio.sleep(30)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            held = anyio.Event()
            tg.start_soon(hold, held)
            await held.wait()
            # Timed from the run's start, not the thread's: a thread that starts late (a
            # loaded machine) finds less of the budget left, or none.
            began = time.monotonic()
            async with slotwise.run(limiter=limiter, timeout=0.3) as run:
                timed_out_at = await anyio.to_thread.run_sync(in_thread)
            assert 0.2 <= timed_out_at - began < 5
            [timed_out] = [e for e in events if e.kind == "timed-out"]
            assert timed_out.run_id == run.run_id
            tg.cancel_scope.cancel()

    try:
        anyio.run(main, backend=backend)
    finally:
        unsubscribe()


def test_cancelling_a_run_reaches_a_child_run_on_another_event_loop() -> None:
    limiter = MemoryLimiter(name="tree", max_concurrent=2)
    child_started = threading.Event()
    results: list[str] = []

    async def child() -> None:
        try:
            await child_run()
        except BaseException as exc:
            results.append(repr(exc))
            raise

    async def child_run() -> None:
        try:
            async with slotwise.run() as run, slotwise.slot():
                assert run.parent_run_id is not None
                child_started.set()
                await anyio.sleep(30)
            results.append("not cancelled")
        except slotwise.RunCancelledError as exc:
            results.append("cancelled" if exc.run_id == run.run_id else repr(exc))

    async def main() -> None:
        async with slotwise.run(limiter=limiter) as parent:
            # A thread that runs its own event loop in a copy of the run's context.
            context = contextvars.copy_context()
            thread = threading.Thread(target=context.run, args=(asyncio.run, child()))
            thread.start()
            await anyio.to_thread.run_sync(child_started.wait, 10)
            parent.cancel()  # the last statement: this block ends as a finished one does
        await anyio.to_thread.run_sync(thread.join, 10)
        assert not thread.is_alive()

    asyncio.run(main())
    assert results == ["cancelled"]
    assert limiter.stats_nowait().active == 0


def test_a_sync_generator_holding_a_slot_closed_in_another_thread_releases_it() -> None:
    """A generator that holds a `sync_slot()` across a `yield`, advanced in a pool's worker
    thread and closed (or collected) in another thread: the slot goes back at once, and the
    worker, whose context still lists it, can take a slot again."""
    from concurrent.futures import ThreadPoolExecutor

    limiter = MemoryLimiter(name="gen", max_concurrent=1)

    def chunks() -> Any:
        with limiter.sync_slot():
            yield 1
            yield 2

    def start() -> Any:
        generator = chunks()
        next(generator)
        return generator

    def again() -> int:
        with limiter.sync_slot(timeout=5) as slot:
            return 1 if slot.lease is not None else 0

    with ThreadPoolExecutor(1) as worker:
        generator = worker.submit(start).result()
        assert limiter.stats_nowait().active == 1
        closer = threading.Thread(target=generator.close)
        closer.start()
        closer.join(10)
        assert limiter.stats_nowait().active == 0
        assert worker.submit(again).result(timeout=10) == 1
    assert limiter.stats_nowait().active == 0


def test_a_threads_last_waiter_leaves_its_watch_without_a_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each thread's waiters are counted: when a thread's only waiter is granted, its clock
    watch ends without looking through the requests other threads have queued (which would
    cost every grant the length of their queue, under the limiter's lock)."""
    from slotwise import memory

    searches = 0
    newest = memory._Watchers._newest

    def counted(self: Any, thread: int) -> Any:
        nonlocal searches
        searches += 1
        return newest(self, thread)

    monkeypatch.setattr(memory._Watchers, "_newest", counted)
    limiter = MemoryLimiter(
        max_concurrent=2,
        workloads={
            "interactive": Workload(max_concurrent=1, priority=10),
            "background": Workload(max_concurrent=1),
        },
    )
    parked = threading.Event()
    stop = threading.Event()
    served = 0

    def background() -> None:
        async def main() -> None:
            nonlocal served
            holder = await slotwise.acquire(limiter=limiter, workload="background")

            async def wait() -> None:
                nonlocal served
                async with limiter.slot("background", allow_nested=True):
                    served += 1

            tasks = [asyncio.create_task(wait()) for _ in range(200)]
            for _ in range(1000):
                if limiter.stats_nowait().queued == 200:
                    break
                await asyncio.sleep(0.01)
            parked.set()
            await asyncio.to_thread(stop.wait, 10)
            await holder.release()
            await asyncio.gather(*tasks)

        asyncio.run(main())

    loop_thread = threading.Thread(target=background)
    loop_thread.start()
    assert parked.wait(10)

    def ping_pong() -> None:
        for _ in range(50):
            with limiter.sync_slot("interactive", timeout=10):
                time.sleep(0)

    players = [threading.Thread(target=ping_pong) for _ in range(2)]
    for player in players:
        player.start()
    for player in players:
        player.join(10)
    stop.set()
    loop_thread.join(10)

    assert not loop_thread.is_alive()
    assert served == 200
    assert limiter.stats_nowait().active == 0
    assert searches < 10, f"{searches} searches for a successor"


def test_a_waiter_of_a_dropped_state_that_parks_again_is_counted_by_the_new_watchers() -> None:
    """A limiter drops the state of a finished virtual-clock run with new clock watchers. A
    waiter still parked in that state that wakes and parks again is counted, and watches, in
    the new watchers' table of its thread, not in the dropped one: its alarm always has a
    watcher to wake, and it leaves nothing behind."""
    from slotwise import memory
    from slotwise._core.state import Ticket
    from slotwise._runtime.loop import ThreadWaker

    state = MemoryLimiter(max_concurrent=1)._state
    ticket = Ticket(seq=1, workload="default", enqueued_at=0.0)
    dropped = memory._Watchers(state.queues)
    dropped.park(ticket, ThreadWaker(), state, 0.0)
    watchers = memory._Watchers(state.queues)
    watchers.park(ticket, ThreadWaker(), state, 0.0)  # woken, it parks again

    assert watchers.earlier(-1.0) == [ticket.waker]  # the watcher of its thread
    assert not watchers.leave(ticket)
    assert not watchers.alarms
    assert not watchers._threads
