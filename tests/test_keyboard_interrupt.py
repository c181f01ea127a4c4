"""A Ctrl-C that lands as the limiter takes its lock leaves the lock free.

The limiter's hot paths take their lock with ``acquire()`` and then enter ``try`` (cheaper
than ``with``). A ``KeyboardInterrupt`` raised between the two (the SIGINT handler runs as
``acquire()`` returns) would leave the lock held, and every later request of the process
would hang. On trio those functions are marked as protected, so trio delivers such a Ctrl-C
at the next checkpoint, as in its own primitives; ``asyncio.run()`` turns a first Ctrl-C into
the main task's cancellation.

Each test runs its event loop itself, not through the anyio plugin: trio delivers a deferred
Ctrl-C to the run's main task, which must be the test's own.
"""

from __future__ import annotations

import _thread
import asyncio
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import trio

import slotwise
from slotwise import (
    AcquireRequest,
    Adaptive,
    ConcurrencyEvent,
    ConcurrencyLeaseLostError,
    MemoryLimiter,
    SupportsLease,
)


class _InterruptingLock:
    """The limiter's lock, with a Ctrl-C right after its n-th acquisition from when it is
    armed: as a signal that arrives while ``acquire()`` blocks, its handler runs in the
    caller's frame once the lock is held, before the caller's next instruction."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self.countdown = 0  # 0: not armed
        self.interrupted: list[str] = []  # the functions whose acquire() was interrupted

    def acquire(self, *args: Any) -> bool:
        taken: bool = self._lock.acquire(*args)
        if self.countdown:
            self.countdown -= 1
            if not self.countdown:
                self.interrupted.append(sys._getframe(1).f_code.co_name)
                _thread.interrupt_main()  # its handler runs at the next instruction
        return taken

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def free(self) -> bool:
        if not self._lock.acquire(blocking=False):
            return False
        self._lock.release()
        return True


Path = Callable[[MemoryLimiter[str], _InterruptingLock], Awaitable[None]]


async def _take_at_once(limiter: MemoryLimiter[str], lock: _InterruptingLock) -> None:
    lock.countdown = 1  # _take_nowait()
    async with limiter.slot():
        pass


async def _release(limiter: MemoryLimiter[str], lock: _InterruptingLock) -> None:
    async with limiter.slot():
        lock.countdown = 1  # release_nowait()


async def _wait(limiter: MemoryLimiter[str], lock: _InterruptingLock, countdown: int) -> None:
    # The limit is held by another thread: this request waits, then gives up.
    lock.countdown = countdown
    with anyio.move_on_after(0.05):
        async with limiter.slot():
            pass


async def _queue(limiter: MemoryLimiter[str], lock: _InterruptingLock) -> None:
    await _wait(limiter, lock, 2)  # _take_nowait(), which finds no room, then _submit()


async def _withdraw(limiter: MemoryLimiter[str], lock: _InterruptingLock) -> None:
    await _wait(limiter, lock, 3)  # then _leave(), when the wait is cancelled


PATHS: dict[str, tuple[Path, str, bool]] = {
    # path: (what it does, the function interrupted, whether another thread holds the limit)
    "take at once": (_take_at_once, "_take_nowait", False),
    "release": (_release, "release_nowait", False),
    "queue": (_queue, "_submit", True),
    "withdraw": (_withdraw, "_leave", True),
}


def _hold_in_a_thread(limiter: MemoryLimiter[str]) -> Callable[[], None]:
    """Hold the limiter's one slot in another thread; returns what lets it go."""
    held, done = threading.Event(), threading.Event()

    def holder() -> None:
        with limiter.sync_slot():
            held.set()
            done.wait(10)

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    assert held.wait(10)

    def let_go() -> None:
        done.set()
        thread.join(10)

    return let_go


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_ctrl_c_as_the_lock_is_taken_leaves_it_free(backend: str, path: str) -> None:
    limiter = MemoryLimiter(max_concurrent=1)
    body, function, contended = PATHS[path]
    let_go = _hold_in_a_thread(limiter) if contended else (lambda: None)
    lock = _InterruptingLock(limiter._lock)
    limiter._lock = lock  # type: ignore[assignment]

    async def main() -> None:
        await body(limiter, lock)
        await anyio.sleep(5)  # the Ctrl-C ends this (on trio: its first checkpoint)

    def run() -> None:
        if backend == "trio":
            trio.run(main)
        else:
            asyncio.run(main())

    try:
        with pytest.raises(KeyboardInterrupt):
            run()
    finally:
        let_go()
    assert lock.interrupted == [function]
    assert lock.free(), "the Ctrl-C left the limiter's lock held"
    stats = anyio.run(limiter.stats)
    assert (stats.active, stats.queued) == (0, 0)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_ctrl_c_in_a_subscriber_called_by_a_release_interrupts_it_at_once(backend: str) -> None:
    # A release that climbs an adaptive limit (slow start: 1 -> 2) tells the subscribers
    # from inside the function that holds the lock; trio must not defer a Ctrl-C that lands
    # in the subscriber's own code until it returns.
    limiter = MemoryLimiter(max_concurrent=4, adaptive=Adaptive(min_concurrent=1, slow_start=True))
    steps: list[int] = []

    def subscriber(event: ConcurrencyEvent) -> None:
        if event.kind != "limit-changed":
            return
        _thread.interrupt_main()  # its handler runs at the next instruction
        for step in range(1000):
            steps.append(step)

    limiter.subscribe(subscriber)

    async def main() -> None:
        async with limiter.slot():
            pass
        await anyio.sleep(5)

    def run() -> None:
        if backend == "trio":
            trio.run(main)
        else:
            asyncio.run(main())

    with pytest.raises(KeyboardInterrupt):
        run()
    if backend == "trio":
        assert len(steps) < 1000, "the Ctrl-C waited for the subscriber to return"
    else:  # asyncio.run() makes a first Ctrl-C the main task's cancellation
        assert len(steps) == 1000
    stats = anyio.run(limiter.stats)
    assert (stats.active, stats.queued) == (0, 0)


class _LosingLimiter:
    """A custom limiter whose leases cannot be renewed: trio's lease keeper, a system task,
    tells the subscribers that the slot's lease is lost."""

    name = "losing"
    lease_ttl = 0.3

    def __init__(self) -> None:
        self._inner = MemoryLimiter(name="losing", max_concurrent=1)

    async def acquire(self, request: AcquireRequest) -> SupportsLease:
        return await self._inner.acquire(request)

    async def renew(self, lease: SupportsLease) -> SupportsLease | None:
        return None

    def renew_nowait(self, lease: SupportsLease) -> SupportsLease | None:
        return None

    async def release(self, lease: SupportsLease) -> None:
        await self._inner.release(lease)


def test_a_ctrl_c_in_a_subscriber_that_trios_lease_keeper_calls_reaches_the_run() -> None:
    # A trio system task must not raise (trio would fail with TrioInternalError): there a
    # Ctrl-C waits for the subscriber to return, then reaches the run as KeyboardInterrupt.
    limiter = _LosingLimiter()
    heard: list[str] = []

    def subscriber(event: ConcurrencyEvent) -> None:
        if event.kind == "lease-lost":
            _thread.interrupt_main()
            heard.extend("lost" for _ in range(1000))

    slotwise.subscribe(subscriber, limiter=limiter)

    async def main() -> None:
        with pytest.raises(ConcurrencyLeaseLostError):
            async with slotwise.slot(limiter=limiter):
                await trio.sleep(10)
        await trio.sleep(10)

    with pytest.raises(KeyboardInterrupt):
        trio.run(main)
    assert len(heard) == 1000
