"""Cheap access to the running event loop (clock, identity, checkpoints, cancel scopes and
one-shot wakers) for the hot path, on asyncio and trio.

``anyio.current_time()`` looks the backend up on every call; a slot reads the clock several
times, so these helpers ask the running loop directly. They return exactly what anyio would:
``loop.time()`` on asyncio, ``trio.current_time()`` on trio (MockClock included).
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

__all__ = (
    "cancel_scope",
    "checkpoint",
    "later",
    "loop_identity",
    "new_waker",
    "now",
    "park",
    "spawn",
    "trio_running",
    "wake",
)


def trio_running() -> bool:
    """Whether the calling code runs under trio (else asyncio)."""
    trio = sys.modules.get("trio")
    return trio is not None and bool(trio.lowlevel.in_trio_run())


def now() -> float:
    """The running loop's clock, as ``anyio.current_time()`` reads it."""
    if trio_running():
        return float(sys.modules["trio"].current_time())
    return asyncio.get_running_loop().time()


def loop_identity() -> object:
    """An object that identifies the running event loop for as long as it runs."""
    if trio_running():
        return sys.modules["trio"].lowlevel.current_trio_token()
    return asyncio.get_running_loop()


def cancel_scope() -> Any:
    """A new cancel scope: trio's own on trio (anyio's wraps it at half again the cost),
    anyio's on asyncio. Both have ``cancel()``, ``cancelled_caught`` and the context protocol."""
    if trio_running():
        return sys.modules["trio"].CancelScope()
    return anyio.CancelScope()


async def checkpoint() -> None:
    """Yield to the loop once, raising if the task is cancelled: ``anyio.lowlevel.checkpoint``."""
    if trio_running():
        await sys.modules["trio"].lowlevel.checkpoint()
    else:
        await asyncio.sleep(0)


# A waiter's wake-up call: a bare future on asyncio (an asyncio.Event would add a deque and a
# future per waiter, an anyio.Event one more object); on trio, the waiting task itself.
Waker = Any


def new_waker() -> Waker:
    """A one-shot wake-up call for the current task, set from any task of the same loop."""
    if trio_running():
        return _TrioWaker()
    return asyncio.get_running_loop().create_future()


def wake(waker: Waker) -> None:
    """Set ``waker``; harmless if it was set or its waiter is gone."""
    if isinstance(waker, asyncio.Future):
        if not waker.done():
            waker.set_result(None)
    else:
        waker.set()


async def park(waker: Waker) -> None:
    """Wait until ``waker`` is set."""
    if isinstance(waker, asyncio.Future):
        await waker
    else:
        await waker.wait()


class _TrioWaker:
    """trio.Event without its ParkingLot: one task, set once."""

    __slots__ = ("_set", "_task")

    def __init__(self) -> None:
        self._set = False
        self._task: Any = None

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        if self._task is not None:
            task, self._task = self._task, None
            sys.modules["trio"].lowlevel.reschedule(task)

    def _abort(self, _: Any) -> Any:
        self._task = None
        return sys.modules["trio"].lowlevel.Abort.SUCCEEDED

    async def wait(self) -> None:
        lowlevel = sys.modules["trio"].lowlevel
        if self._set:
            await lowlevel.checkpoint()
            return
        self._task = lowlevel.current_task()
        await lowlevel.wait_task_rescheduled(self._abort)


Start = Callable[[Callable[[], Awaitable[None]]], None]

# Tasks that nothing awaits, kept here so that they are not garbage collected while they run.
_background: set[asyncio.Task[None]] = set()


def spawn(fn: Callable[[], Awaitable[None]]) -> None:
    """Start ``fn()`` now as a task of the running loop that nobody awaits (a system task on
    trio), in a fresh context rather than the caller's."""
    if trio_running():
        sys.modules["trio"].lowlevel.spawn_system_task(fn)
    else:
        _start_asyncio(asyncio.get_running_loop(), fn)


def later() -> Start:
    """A function that starts ``fn()`` as such a task of the running loop, callable later
    from any thread (the garbage collector runs finalizers wherever it is triggered)."""
    if trio_running():
        trio = sys.modules["trio"]
        token = trio.lowlevel.current_trio_token()
        return lambda fn: token.run_sync_soon(trio.lowlevel.spawn_system_task, fn)
    loop = asyncio.get_running_loop()

    def start(fn: Callable[[], Awaitable[None]]) -> None:
        loop.call_soon_threadsafe(_start_asyncio, loop, fn)

    return start


def _start_asyncio(loop: asyncio.AbstractEventLoop, fn: Callable[[], Awaitable[None]]) -> None:
    task: asyncio.Task[None] = loop.create_task(fn(), context=contextvars.Context())  # type: ignore[arg-type]
    _background.add(task)
    task.add_done_callback(_background.discard)
