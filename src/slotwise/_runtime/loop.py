"""The running event loop (asyncio or trio), asked once per slot and then directly.

``anyio`` looks the backend up on every call; a slot needs the clock, a checkpoint, a way to
park and a way to be woken, so `current()` finds the running loop once and returns an
object that answers all of these without further lookups. The answers are exactly anyio's:
``loop.time()`` on asyncio, ``trio.current_time()`` on trio (a ``MockClock`` included).

Wakers are the only part that crosses threads: a limiter shared by several event loops and
threads grants a slot in whichever thread releases one, and the waiter must be woken on its own
loop (``call_soon_threadsafe``, a trio token) or thread, never by touching another loop's
objects directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import sys
import threading
import time
import types
import weakref
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

import anyio

__all__ = (
    "AsyncioLoop",
    "Loop",
    "ThreadWaker",
    "TrioLoop",
    "Waker",
    "current",
    "ki_protected",
    "ki_unprotected",
    "later",
    "loop_identity",
    "own_cancellation",
    "now",
    "require",
    "spawn",
    "trio_running",
)

_get_running_loop = asyncio._get_running_loop  # None outside a running loop; no exception
_ident = threading.get_ident
_ref = weakref.ref


class Waker:
    """A one-shot wake-up call for one waiting task or thread, set from any thread."""

    __slots__ = ("parked", "thread")

    thread: int  # the thread the waiter runs in
    # The record that counts it among its thread's waiters, kept by the limiter it waits
    # on (None: not counted).
    parked: Any

    def wake(self) -> None:
        """Wake the waiter (harmless if it was woken already or has gone)."""
        raise NotImplementedError

    def alive(self) -> bool:
        """Whether waking it can still reach its waiter (False: its event loop is closed)."""
        return True


class Loop:
    """The running event loop, as the slot lifecycle and the limiters use it."""

    __slots__ = ("cancelled", "clock", "identity", "keeper", "thread", "turn", "virtual")

    clock: Callable[[], float]  # now(), as a plain callable: the hot path calls it directly
    turn: Callable[[], Awaitable[None]]  # checkpoint() without a coroutine of ours around it

    keeper: Any  # the lease keeper of this loop (slotwise._runtime.keeper), once started
    # The loop's clock object when it does not follow real time (trio's MockClock, which
    # has current_time()), else None.
    virtual: Any
    identity: object  # the loop (asyncio) or the run's token (trio)
    thread: int
    cancelled: type[BaseException]  # the backend's cancellation exception

    def now(self) -> float:
        """The loop's clock, as ``anyio.current_time()`` reads it."""
        return self.clock()

    def checkpoint(self) -> Awaitable[None]:
        """Yield to the loop once, raising if the task is cancelled."""
        raise NotImplementedError

    def checkpoint_if_cancelled(self) -> Awaitable[None]:
        """Raise if the task is cancelled; yield only then."""
        raise NotImplementedError

    def waker(self) -> Waker:
        """A new waker for the current task."""
        raise NotImplementedError

    def park(self, waker: Any, until: float) -> Awaitable[None]:
        """Wait until ``waker`` is woken or the loop's clock reaches ``until`` (``inf``:
        no timer). Returns normally either way; a cancellation of the task raises. Without a
        timer, the waker's own awaitable: no coroutine frame per waiting request."""
        raise NotImplementedError

    def cancel_scope(self) -> Any:
        """A new cancel scope (``cancel()``, ``cancelled_caught``, the context protocol)."""
        return anyio.CancelScope()

    def spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Start ``fn()`` now as a task nobody awaits (a system task on trio), in a fresh
        context rather than the caller's."""
        raise NotImplementedError

    def run_soon(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` soon in this loop's thread; callable from any thread. Does nothing
        once the loop has ended."""
        raise NotImplementedError


# -- asyncio ----------------------------------------------------------------------------------


@types.coroutine
def _sleep0() -> Generator[None, None, None]:
    # asyncio.sleep(0) without its two frames: a bare yield is how asyncio's own sleep(0)
    # gives the loop one turn (the task reschedules itself; a cancellation raises here).
    yield


def _set_future(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _FutureWaker(Waker):
    __slots__ = ("future",)

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: int) -> None:
        self.thread = thread
        self.parked = None
        self.future: asyncio.Future[None] = loop.create_future()

    def wake(self) -> None:
        future = self.future
        try:
            if _ident() != self.thread:
                future.get_loop().call_soon_threadsafe(_set_future, future)
            elif not future.done():
                future.set_result(None)
        except RuntimeError:  # the loop is closed: its waiter with it
            pass

    def alive(self) -> bool:
        return not self.future.get_loop().is_closed()


# Tasks that nothing awaits, kept here so that they are not garbage collected while they run.
_background: set[asyncio.Task[None]] = set()


def _start_asyncio(loop: asyncio.AbstractEventLoop, fn: Callable[[], Awaitable[None]]) -> None:
    task: asyncio.Task[None] = loop.create_task(fn(), context=contextvars.Context())  # type: ignore[arg-type]
    _background.add(task)
    task.add_done_callback(_background.discard)


def _anyio_task_states() -> dict[Any, Any] | None:
    """anyio's cancel scope state of each asyncio task: the dict inside its
    WeakKeyDictionary, keyed by weak references to the tasks (read without the mapping's
    own Python-level get()), or None if anyio's internals moved: the cancellation check
    then calls anyio's public function."""
    try:
        from anyio._backends._asyncio import _task_states
    except Exception:
        return None
    if not isinstance(_task_states, weakref.WeakKeyDictionary):
        return None
    data = vars(_task_states).get("data")
    return data if type(data) is dict else None


_task_states = _anyio_task_states()


def _current_task_lookup() -> Callable[[asyncio.AbstractEventLoop], asyncio.Task[Any] | None]:
    """The running task of a loop: asyncio's own table of them, read directly where it is a
    dict (asyncio.current_task() in Python 3.11 is a Python function that looks the loop up
    again), else asyncio.current_task()."""
    tasks = getattr(asyncio.tasks, "_current_tasks", None)
    current_task = asyncio.current_task
    if type(tasks) is dict and isinstance(current_task, types.FunctionType):
        # Only while current_task() is that Python function, reading that table: in later
        # versions it is asyncio's C function (as fast), and the table may be left unused.
        return tasks.get
    return current_task


_current_task = _current_task_lookup()


class AsyncioLoop(Loop):
    __slots__ = ("loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.identity = loop
        self.keeper = None
        self.virtual = None
        # The standard loops' time() is time.monotonic() behind a Python call; skip the call.
        standard = getattr(type(loop), "time", None) is asyncio.BaseEventLoop.time
        self.clock = time.monotonic if standard else loop.time
        self.turn = _sleep0
        self.thread = _ident()
        self.cancelled = asyncio.CancelledError

    def checkpoint(self) -> Awaitable[None]:
        return _sleep0()

    async def checkpoint_if_cancelled(self) -> None:
        # anyio's checkpoint_if_cancelled() (its cancel scopes), and a native task.cancel(),
        # with one look-up of the task.
        task = _current_task(self.loop)
        if task is None:
            return
        if task.cancelling():  # a native task.cancel()
            await asyncio.sleep(0)
            return
        if _task_states is None:
            await anyio.lowlevel.checkpoint_if_cancelled()
            return
        state = _task_states.get(_ref(task))
        scope = None if state is None else state.cancel_scope
        while scope is not None:
            if scope.cancel_called:
                await asyncio.sleep(0)
                return
            if scope.shield:
                return
            scope = scope._parent_scope

    def waker(self) -> _FutureWaker:
        return _FutureWaker(self.loop, self.thread)

    def park(self, waker: _FutureWaker, until: float) -> Awaitable[None]:
        return waker.future if until == math.inf else self._park_until(waker, until)

    async def _park_until(self, waker: _FutureWaker, until: float) -> None:
        timer = self.loop.call_at(until, _set_future, waker.future)
        try:
            await waker.future
        finally:
            timer.cancel()

    def spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        _start_asyncio(self.loop, fn)

    def run_soon(self, fn: Callable[[], object]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed
            self.loop.call_soon_threadsafe(fn)


# -- trio -------------------------------------------------------------------------------------


_trio_lowlevel: Any = None  # trio.lowlevel, once a TrioLoop exists (trio is optional)
_ki_marks: list[tuple[Callable[..., Any], bool]] = []  # see ki_protected()

_F = TypeVar("_F", bound=Callable[..., Any])


def ki_protected(fn: _F) -> _F:
    """Mark ``fn``, which takes a lock with ``acquire()`` before its ``try``, as code where
    trio must not raise ``KeyboardInterrupt``: a Ctrl-C that lands there (its signal handler
    runs as ``acquire()`` returns) would leave the lock held, and every later request would
    hang. trio then delivers it at the task's next checkpoint, as in its own primitives.

    Free per call: trio keeps the mark by code object (trio 0.28 and later; on older ones,
    whose mark is a wrapper's frame local, the mark is not set). trio reads the mark of the
    innermost marked frame, so code of the user's that ``fn`` calls must be `ki_unprotected`.
    """
    return _ki_mark(fn, True)


def ki_unprotected(fn: _F) -> _F:
    """Mark ``fn``, which runs the user's code (event subscribers), as code where trio raises
    ``KeyboardInterrupt`` at once even when a `ki_protected` function calls it: a Ctrl-C must
    not wait for a subscriber to return (or for ever, if it blocks). Never for code that a
    trio system task runs: one must not raise (trio fails with `TrioInternalError`)."""
    return _ki_mark(fn, False)


def _ki_mark(fn: _F, protected: bool) -> _F:
    _ki_marks.append((fn, protected))
    if _trio_lowlevel is not None:
        _set_ki_mark(_trio_lowlevel, fn, protected)
    return fn


def _set_ki_mark(lowlevel: Any, fn: Callable[..., Any], protected: bool) -> None:
    (lowlevel.enable_ki_protection if protected else lowlevel.disable_ki_protection)(fn)


class _TrioWaker(Waker):
    """trio.Event without its ParkingLot: one task, set once."""

    __slots__ = ("_set", "_task", "token")

    def __init__(self, token: Any, thread: int) -> None:
        self._set = False
        self._task: Any = None
        self.token = token
        self.thread = thread
        self.parked = None

    def wake(self) -> None:
        if _ident() == self.thread:
            self._wake_here()
            return
        with contextlib.suppress(RuntimeError):  # trio.RunFinishedError: the run has ended
            self.token.run_sync_soon(self._wake_here)

    def _wake_here(self) -> None:
        if self._set:
            return
        self._set = True
        if self._task is not None:
            task, self._task = self._task, None
            _trio_lowlevel.reschedule(task)

    def _abort(self, _: Any) -> Any:
        self._task = None
        return _trio_lowlevel.Abort.SUCCEEDED

    def wait(self) -> Awaitable[None]:
        """Called by the task that waits: trio's own wait (no coroutine frame of ours),
        or a checkpoint when woken already."""
        if self._set:
            return _trio_lowlevel.checkpoint()  # type: ignore[no-any-return]
        self._task = _trio_lowlevel.current_task()
        return _trio_lowlevel.wait_task_rescheduled(self._abort)  # type: ignore[no-any-return]


class TrioLoop(Loop):
    __slots__ = ("_trio",)

    def __init__(self, token: Any) -> None:
        global _trio_lowlevel
        trio = self._trio = sys.modules["trio"]
        if _trio_lowlevel is None:
            for fn, protected in _ki_marks:
                _set_ki_mark(trio.lowlevel, fn, protected)
            _trio_lowlevel = trio.lowlevel
        self.identity = token
        self.keeper = None
        self.thread = _ident()
        self.cancelled = trio.Cancelled
        clock = trio.lowlevel.current_clock()
        testing = sys.modules.get("trio.testing")
        self.virtual = (
            clock if testing is not None and isinstance(clock, testing.MockClock) else None
        )
        self.clock = clock.current_time  # what trio.current_time() reads, without its checks
        self.turn = trio.lowlevel.checkpoint

    def checkpoint(self) -> Awaitable[None]:
        return _trio_lowlevel.checkpoint()  # type: ignore[no-any-return]

    def checkpoint_if_cancelled(self) -> Awaitable[None]:
        return _trio_lowlevel.checkpoint_if_cancelled()  # type: ignore[no-any-return]

    def waker(self) -> _TrioWaker:
        return _TrioWaker(self.identity, self.thread)

    def park(self, waker: _TrioWaker, until: float) -> Awaitable[None]:
        return waker.wait() if until == math.inf else self._park_until(waker, until)

    async def _park_until(self, waker: _TrioWaker, until: float) -> None:
        with self._trio.CancelScope(deadline=until):
            await waker.wait()

    def cancel_scope(self) -> Any:
        # trio's own: anyio's wraps it at half again the cost.
        return self._trio.CancelScope()

    def spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        self._trio.lowlevel.spawn_system_task(fn)

    def run_soon(self, fn: Callable[[], object]) -> None:
        with contextlib.suppress(RuntimeError):  # trio.RunFinishedError: the run has ended
            self.identity.run_sync_soon(fn)  # type: ignore[attr-defined]


# -- plain threads ----------------------------------------------------------------------------


class ThreadWaker(Waker):
    """Wakes a thread that waits with no event loop."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()
        self.thread = _ident()
        self.parked = None

    def wake(self) -> None:
        self._event.set()

    def wait(self, timeout: float | None) -> bool:
        """Block until woken (True) or ``timeout`` seconds pass (False)."""
        return self._event.wait(timeout)


# -- the running loop -------------------------------------------------------------------------


class _Cache(threading.local):
    # The running loop (asyncio's; trio's runner) and its `Loop`, read as one pair: each
    # attribute read of a thread-local costs a look-up of the thread's own dict. One pair
    # each: in trio's guest mode both run in this thread, each keeping its own `Loop`.
    entry: tuple[object, Loop | None] = (None, None)
    trio: tuple[object, Loop | None] = (None, None)


_cache = _Cache()


_trio_context: Any = None  # trio's per-thread run context, once trio is imported
_NO_STATE: dict[str, Any] = {}  # its state before trio is imported (read, never written)


def current() -> Loop | None:
    """The running loop of this thread, or None when no event loop runs here."""
    global _trio_context
    cache = _cache
    # trio first: in trio's guest mode on an asyncio host both answer, and trio's is ours
    # while one of its tasks runs, the host's between them. One attribute read of trio's run
    # context, where its public functions (in_trio_run, current_trio_token) add calls and
    # their interrupt protection.
    context = _trio_context
    if context is None and "trio._core._run" in sys.modules:
        run = sys.modules["trio._core._run"]
        context = _trio_context = getattr(run, "GLOBAL_RUN_CONTEXT", None)
        if context is None and _imported(run):  # trio's internals moved: its public API
            lowlevel = getattr(sys.modules.get("trio"), "lowlevel", None)
            if lowlevel is not None and lowlevel.in_trio_run():
                return TrioLoop(lowlevel.current_trio_token())
    # Its per-thread dict, as trio clears it, not getattr(): in a thread that runs no trio
    # (every asyncio loop once trio is imported), getattr() raises and catches an
    # AttributeError, ten times the cost of the lookup.
    state: dict[str, Any] = _NO_STATE if context is None else context.__dict__
    runner = state.get("runner")
    # trio sets its context's `task` while it runs one: without it, code in this thread is
    # a guest run's host, if a host loop runs (else trio's own, between its tasks).
    if runner is not None and ("task" in state or _get_running_loop() is None):
        key, loop = cache.trio
        if key is not runner:
            loop = TrioLoop(sys.modules["trio"].lowlevel.current_trio_token())
            cache.trio = (runner, loop)
        return loop
    running = _get_running_loop()
    if running is None:
        return None
    key, loop = cache.entry
    if key is not running:
        loop = AsyncioLoop(running)
        cache.entry = (running, loop)
    return loop


def _imported(module: Any) -> bool:
    """Whether ``module``'s import has completed. A module is in sys.modules from the moment
    its import starts: while another thread imports trio, trio's run context may not exist
    yet, and this thread, which cannot be running trio, must not look for it."""
    return not getattr(getattr(module, "__spec__", None), "_initializing", False)


def now() -> float:
    """The running loop's clock, as ``anyio.current_time()`` reads it."""
    return require().now()


def loop_identity() -> object:
    """An object that identifies the running event loop for as long as it runs."""
    return require().identity


def trio_running() -> bool:
    """Whether the calling code runs under trio."""
    return isinstance(current(), TrioLoop)


def require() -> Loop:
    """The running loop; RuntimeError when this thread runs none."""
    loop = current()
    if loop is None:
        raise RuntimeError(
            "this needs a running asyncio or trio event loop; in code without one, use "
            "limiter.sync_slot() or slotwise.sync_slot()"
        )
    return loop


Start = Callable[[Callable[[], Awaitable[None]]], None]


def spawn(fn: Callable[[], Awaitable[None]]) -> None:
    """Start ``fn()`` now as a task of the running loop that nobody awaits."""
    require().spawn(fn)


def later() -> Start:
    """A function that starts ``fn()`` as such a task of the running loop, callable later
    from any thread (the garbage collector runs finalizers wherever it is triggered)."""
    loop = require()
    if isinstance(loop, TrioLoop):
        trio = sys.modules["trio"]
        token = loop.identity
        return lambda fn: token.run_sync_soon(trio.lowlevel.spawn_system_task, fn)  # type: ignore[attr-defined]
    assert isinstance(loop, AsyncioLoop)
    asyncio_loop = loop.loop

    def start(fn: Callable[[], Awaitable[None]]) -> None:
        asyncio_loop.call_soon_threadsafe(_start_asyncio, asyncio_loop, fn)

    return start


def own_cancellation(exc: BaseException, loop: Loop) -> bool:
    """Whether ``exc`` is the cancellation of the running task itself (the keeper stopping,
    the loop shutting down, a tool batch cancelled), rather than one raised by awaiting
    something that another task cancelled (a driver's future, an HTTP client's own request
    task)."""
    if isinstance(loop, TrioLoop):
        return isinstance(exc, loop.cancelled)
    if not isinstance(exc, asyncio.CancelledError):
        return False
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
