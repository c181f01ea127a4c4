"""Runs: lineage, inherited time budgets and cancellation that flows down to child runs."""

from __future__ import annotations

import math
import time
import uuid
import weakref
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any, final, overload

import anyio

from .._errors import ConcurrencyConfigError, RunCancelledError
from .._protocol import Limiter, TypedLimiter, W
from .loop import Loop, current, require

__all__ = ("Run", "RunContext", "current_run", "run")

_current: ContextVar[Run | None] = ContextVar("slotwise_run", default=None)


def current_run() -> Run | None:
    """The innermost run of the calling task (tasks a run starts inherit it), or None."""
    return _current.get()


@final
class Run:
    """A unit of work whose slots share a limiter, a workload, a budget and a lineage.

    Create one with ``async with slotwise.run(...) as run``. The run is the current run of
    its block and of every task started from inside it; a run's cancellation and deadline
    reach the tasks of task groups opened inside it, and every child run wherever it runs.
    A task started in a task group opened *outside* the run should open its own child run
    (``async with slotwise.run():``) to receive them.

    Attributes:
        run_id: This run's id.
        root_run_id: The id of the outermost run of the tree (``run_id`` for a root run).
        parent_run_id: The enclosing run's id, None for a root run.
        limiter: The limiter ``slotwise.slot()`` uses when it names none, or None.
        workload: The workload ``slotwise.slot()`` uses when it names none, or None for the
            limiter's default.
        deadline: When the run's budget ends, on ``anyio.current_time()``'s clock of the
            event loop that started the run; None when neither it nor any ancestor has a
            timeout. (Slots taken in another loop or a thread convert it to their clock.)
    """

    __slots__ = (
        "__weakref__",
        "_cancelled",
        "_children",
        "_expires",
        "_loop",
        "_parent",
        "_scope",
        "deadline",
        "limiter",
        "parent_run_id",
        "root_run_id",
        "run_id",
        "workload",
    )

    def __init__(
        self,
        *,
        run_id: str,
        parent: Run | None,
        limiter: Any,
        workload: str | None,
        deadline: float | None,
        loop: Loop,
    ) -> None:
        self.run_id: str = run_id
        self.parent_run_id: str | None = parent.run_id if parent else None
        self.root_run_id: str = parent.root_run_id if parent else run_id
        self.limiter = limiter
        self.workload = workload
        self.deadline = deadline
        self._loop = loop
        # The deadline on time.monotonic(), which every thread and loop agrees on.
        self._expires = None if deadline is None else time.monotonic() + deadline - loop.now()
        self._cancelled = False
        self._children: weakref.WeakSet[Run] = weakref.WeakSet()
        self._parent = parent  # for what a run tree shares: slotwise.tools counts its calls
        self._scope = anyio.CancelScope(deadline=math.inf if deadline is None else deadline)

    def deadline_on(self, loop: Loop | None) -> float | None:
        """The deadline on ``loop``'s clock (``time.monotonic()`` for None: a thread)."""
        if loop is self._loop or self.deadline is None:
            return self.deadline
        assert self._expires is not None
        if loop is None:
            return self._expires
        return self._expires - time.monotonic() + loop.now()

    def cancel(self) -> None:
        """Cancel this run and every child run, wherever it runs.

        A waiting request leaves its queue (a `wait-cancelled` event); a running body is
        cancelled at its next `await` and its slot released (a `released` event with
        outcome `"cancelled"`). The run's `async with` block then raises
        `slotwise.RunCancelledError`: the code after the block runs only when the body ran
        to its end (a body that ends before its next `await` ends as a finished one does).
        A child run started later is cancelled as it starts. Calling it again does nothing
        more.
        """
        self._cancelled = True
        here = current()
        if here is None or here.identity is not self._loop.identity:
            self._loop.run_soon(self._scope.cancel)  # the scope belongs to another loop
        else:
            self._scope.cancel()
        for child in list(self._children):
            child.cancel()

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel()`` was called on this run or an ancestor."""
        return self._cancelled

    def __repr__(self) -> str:
        limiter = getattr(self.limiter, "name", None)
        return (
            f"<slotwise.Run {self.run_id} root={self.root_run_id} "
            f"parent={self.parent_run_id} limiter={limiter!r} workload={self.workload!r}>"
        )


def _check_limiter(limiter: Any) -> None:
    missing = [
        method
        for method in ("acquire", "renew", "release")
        if not callable(getattr(limiter, method, None))
    ]
    if missing:
        raise ConcurrencyConfigError(
            f"limiter must be a limiter (an object with async acquire, renew and release), "
            f"got {limiter!r}, which has no {', '.join(missing)}"
        )


def _resolve(limiter: Any, workload: str | None) -> str | None:
    validate = getattr(limiter, "validate_workload", None)
    if validate is None:
        return None if workload is None else str(workload)
    try:
        return str(validate(workload))
    except ConcurrencyConfigError:
        if workload is None:
            return None  # several workloads, no default: each slot must name one
        raise


def _refuse(
    exc: ConcurrencyConfigError, limiter: Any, workload: str | None, run_id: str, parent: Run | None
) -> None:
    """Give the error of a run that cannot start its limiter and lineage. No event: events
    belong to slot requests, and this run asked for none."""
    exc._fill(
        limiter=str(getattr(limiter, "name", type(limiter).__name__)),
        workload=None if workload is None else str(workload),
        run_id=run_id,
        root_run_id=parent.root_run_id if parent is not None else run_id,
        parent_run_id=parent.run_id if parent is not None else None,
    )


@final
class RunContext:
    """`async with` form of `slotwise.run()`: yields the `Run`, ends it on exit.

    Its exit raises `RunCancelledError` when the run was cancelled while its body ran, and
    `TimeoutError` when the run's budget ended it; it never ends a stopped body quietly.
    """

    __slots__ = ("_limiter", "_run", "_run_id", "_timeout", "_token", "_workload")

    def __init__(
        self, limiter: Any, workload: str | None, timeout: float | None, run_id: str | None
    ) -> None:
        if timeout is not None and (
            not isinstance(timeout, int | float)
            or isinstance(timeout, bool)
            or math.isnan(timeout)
            or timeout < 0
        ):
            raise ConcurrencyConfigError(
                f"timeout must be None or a non-negative number of seconds, got {timeout!r}"
            )
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise ConcurrencyConfigError(f"run_id must be a non-empty string, got {run_id!r}")
        if limiter is not None:
            _check_limiter(limiter)
        self._limiter = limiter
        self._workload = workload
        self._timeout = None if timeout is None or math.isinf(timeout) else float(timeout)
        self._run_id = run_id
        self._run: Run | None = None
        self._token: Token[Run | None] | None = None

    async def __aenter__(self) -> Run:
        if self._run is not None:
            raise RuntimeError("a slotwise.run() context can be entered only once")
        loop = require()
        await loop.checkpoint()
        parent = _current.get()
        run_id = self._run_id or uuid.uuid4().hex
        limiter = self._limiter
        if limiter is None and parent is not None:
            limiter = parent.limiter
        workload = self._workload
        if workload is None and parent is not None and limiter is parent.limiter:
            workload = parent.workload
        if limiter is not None:
            try:
                workload = _resolve(limiter, workload)
            except ConcurrencyConfigError as exc:
                _refuse(exc, limiter, workload, run_id, parent)
                raise
        elif workload is not None:
            workload = str(workload)
        # The budget only shrinks down the tree: waiting for a slot spends it, nothing renews it.
        deadline = parent.deadline_on(loop) if parent is not None else None
        if self._timeout is not None:
            own = loop.now() + self._timeout
            deadline = own if deadline is None else min(deadline, own)
        run = Run(
            run_id=run_id,
            parent=parent,
            limiter=limiter,
            workload=workload,
            deadline=deadline,
            loop=loop,
        )
        if parent is not None:
            parent._children.add(run)
            if parent._cancelled:
                run.cancel()
        run._scope.__enter__()
        self._run = run
        self._token = _current.set(run)
        return run

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        run = self._run
        assert run is not None
        assert self._token is not None
        _current.reset(self._token)
        self._token = None
        swallowed = run._scope.__exit__(exc_type, exc, tb)
        if exc is None or not swallowed:
            return  # the body ended, or its exception (an outer cancellation) goes on
        # Our own scope stopped the body. The block never ends quietly: the code after it
        # would take a stopped body for a finished one (and a function that returns from
        # inside the run would return None).
        deadline = run.deadline
        if not run._cancelled and deadline is not None and anyio.current_time() >= deadline:
            raise TimeoutError(f"run {run.run_id} ran out of its time budget") from exc
        raise RunCancelledError(
            f"run {run.run_id} was cancelled",
            run_id=run.run_id,
            root_run_id=run.root_run_id,
            parent_run_id=run.parent_run_id,
        ) from None


@overload
def run(
    *,
    limiter: Limiter[str] | None = None,
    workload: str | None = None,
    timeout: float | None = None,
    run_id: str | None = None,
) -> RunContext: ...


@overload
def run(
    *,
    limiter: TypedLimiter[W],
    workload: W | None = None,
    timeout: float | None = None,
    run_id: str | None = None,
) -> RunContext: ...


def run(
    *,
    limiter: Limiter[Any] | None = None,
    workload: str | None = None,
    timeout: float | None = None,
    run_id: str | None = None,
) -> RunContext:
    """Start a run: ``async with slotwise.run(...) as run``.

    A run started inside another (in the same task, or in a task started from inside it) is
    its child: it inherits the parent's limiter, its workload unless it names one, its
    cancellation and its remaining budget.

    Args:
        limiter: The limiter for ``slotwise.slot()`` calls inside the run; default: the
            parent's. A child naming a different limiter uses that limiter's own default
            workload unless it names one.
        workload: The workload for those slots; default: the parent's (same limiter only).
        timeout: Seconds of budget from now; a child can only shorten its parent's. Waiting
            for a slot counts against it.
        run_id: The run's id; default: a random one.

    Raises:
        ConcurrencyConfigError: an unknown workload (when the run starts), an invalid
            timeout or run_id, or a limiter that is not a limiter. It carries the run's
            lineage.
        TimeoutError: on exit, when the budget ended while the body ran (the body was
            cancelled and its slot released).
        RunCancelledError: on exit, when the run was cancelled (`Run.cancel()`, on it or
            an ancestor) while the body ran.

    Example:
        ```python
        async with slotwise.run(limiter=claude, workload="background", timeout=120):
            async with slotwise.slot():  # claude's, for the background workload
                ...
        ```
    """
    return RunContext(limiter, workload, timeout, run_id)
