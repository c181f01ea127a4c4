"""The slot lifecycle, written once for every limiter, built-in or custom.

acquire (bounded by the run's budget; the limiter applies ``max_wait``) -> hold (the keeper
renews the lease; a lost lease cancels the body) -> release (exactly once, shielded, from
whichever task ends the slot). Every outcome is an event; every failure an error carrying the
request's lineage.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar, Token
from functools import partial
from types import TracebackType
from typing import Any, Generic, TypeVar, final

import anyio
from anyio.lowlevel import checkpoint_if_cancelled

from .._config import DEFAULT_WORKLOAD
from .._errors import (
    ConcurrencyConfigError,
    ConcurrencyError,
    ConcurrencyLeaseLostError,
    ConcurrencyLimiterError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
)
from .._events import (
    AcquiredEvent,
    ConfigErrorEvent,
    LeaseLostEvent,
    LimiterErrorEvent,
    Outcome,
    QueueFullEvent,
    ReleasedEvent,
    ReleaseFailedEvent,
    RenewalFailedEvent,
    TimedOutEvent,
    WaitCancelledEvent,
    WaitStartedEvent,
)
from .._protocol import AcquireRequest, SupportsLease
from . import dispatch, keeper
from .loop import cancel_scope, checkpoint, now, trio_running
from .runs import Run, current_run

__all__ = ("Slot", "acquire", "slot")

W = TypeVar("W", bound=str)

_logger = logging.getLogger("slotwise")
_prefix = secrets.token_hex(4)
_request_seq = itertools.count(1)
# Slots the current task (and the tasks it starts) holds, for the nested-slot deadlock guard.
_holding: ContextVar[tuple[Slot, ...]] = ContextVar("slotwise_holding", default=())


_releasing: set[asyncio.Future[Any]] = set()


async def _release_shielded(
    limiter: Any,
    lease: SupportsLease,
    done: Callable[[Exception | None], None] = lambda error: None,
) -> None:
    """``await limiter.release(lease)`` to the end, whatever cancels the caller, then call
    ``done`` with the exception the release raised (or None) exactly once.

    anyio's shield stops anyio's cancellations only: on asyncio a native cancellation
    (``task.cancel()``, ``asyncio.timeout``, ``asyncio.TaskGroup``) goes through it, so there the
    release runs in a task of its own that the caller's cancellation cannot interrupt, and
    ``done`` runs when that task ends, even if the caller has gone.
    """
    with anyio.CancelScope(shield=True):
        if trio_running():
            try:
                await limiter.release(lease)
            except Exception as exc:
                done(exc)
            else:
                done(None)
            return
        task = asyncio.ensure_future(limiter.release(lease))
        _releasing.add(task)
        task.add_done_callback(_releasing.discard)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                # The caller was cancelled: the release goes on, and reports when it ends.
                task.add_done_callback(lambda task: done(_outcome_of(task)))
                raise
        except Exception:
            pass  # reported below
        done(_outcome_of(task))


def _outcome_of(task: asyncio.Future[Any]) -> Exception | None:
    if task.cancelled():
        return RuntimeError("the release was cancelled")
    error = task.exception()
    return error if isinstance(error, Exception) or error is None else RuntimeError(repr(error))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _epoch(deadline: float | None) -> float | None:
    if deadline is None or math.isinf(deadline):
        return None
    return time.time() + (deadline - now())


@final
class Slot:
    """A held slot (or, outside any limit, a stand-in that limits nothing).

    ``async with limiter.slot()`` yields one; ``await slotwise.acquire()`` returns one that
    any task may end with :meth:`release`.

    Attributes:
        limiter: The limiter, or None when nothing is limited.
        limiter_name: The limiter's name as events report it ("" when nothing is limited).
        workload: The workload the slot counts against.
        request_id: The id of the request that got it.
        run_id: The run that took it, or None.
        root_run_id: The root of that run's tree.
        parent_run_id: That run's parent.
        lease: The limiter's lease, renewed in place; None when nothing is limited.
    """

    __slots__ = (
        "_acquired_at",
        "_keeper",
        "_lost",
        "_released",
        "_renewed_at",
        "_scope",
        "_ttl",
        "lease",
        "limiter",
        "limiter_name",
        "parent_run_id",
        "request_id",
        "root_run_id",
        "run_id",
        "workload",
    )

    def __init__(self, limiter: Any, run: Run | None) -> None:
        self.limiter = limiter
        if limiter is None:
            self.limiter_name = ""
            self.request_id: str | None = None
        else:
            self.limiter_name = str(getattr(limiter, "name", type(limiter).__name__))
            self.request_id = f"{_prefix}-{next(_request_seq)}"
        self.workload: str | None = None
        self.run_id = run.run_id if run is not None else None
        self.root_run_id = run.root_run_id if run is not None else None
        self.parent_run_id = run.parent_run_id if run is not None else None
        self.lease: SupportsLease | None = None
        self._acquired_at = 0.0
        self._renewed_at = 0.0
        self._released = True  # nothing is held until a lease is granted
        self._lost = False
        self._scope: Any = None  # the body's cancel scope, while in `async with`
        self._keeper: Any = None
        self._ttl = 0.0

    def _hold(self, lease: SupportsLease, at: float) -> None:
        self.lease = lease
        self._acquired_at = self._renewed_at = at
        self._released = False

    @property
    def lease_id(self) -> str | None:
        """The lease's id, or None when nothing is limited."""
        return self.lease.lease_id if self.lease is not None else None

    @property
    def lost(self) -> bool:
        """Whether the lease was lost while held."""
        return self._lost

    @property
    def released(self) -> bool:
        """Whether the slot has been given back (always True when nothing is limited)."""
        return self._released

    async def release(self, outcome: Outcome = "completed") -> None:
        """Give the slot back: once, shielded from cancellation, from any task. Idempotent.

        Args:
            outcome: Reported in the ``released`` event.
        """
        if self._released or self.lease is None:
            return
        self._released = True
        keeper.forget(self)
        lease = self.lease
        release_nowait = getattr(self.limiter, "release_nowait", None)
        if release_nowait is None:
            await _release_shielded(self.limiter, lease, partial(self._released_as, outcome))
            return
        try:
            release_nowait(lease)
        except Exception as exc:
            self._released_as(outcome, exc)
        else:
            self._released_as(outcome, None)

    def _released_as(self, outcome: Outcome, error: Exception | None) -> None:
        lease_id = self.lease_id or ""
        if error is not None:
            _logger.warning("slotwise: releasing lease %s failed: %s", lease_id, _describe(error))
            self._emit(ReleaseFailedEvent, lease_id=lease_id, error=_describe(error))
        elif dispatch.wants(self.limiter):  # saves a clock read on the hot path
            self._emit(
                ReleasedEvent,
                lease_id=lease_id,
                hold_time=now() - self._acquired_at,
                outcome=outcome,
            )

    # -- used by the keeper ---------------------------------------------------------------

    def _renewal_failed(self, exc: Exception) -> None:
        if self.lease is not None:
            self._emit(RenewalFailedEvent, lease_id=self.lease.lease_id, error=_describe(exc))

    def _lose(self) -> None:
        if self._released or self._lost or self.lease is None:
            return
        self._lost = True
        if dispatch.wants(self.limiter):
            self._emit(
                LeaseLostEvent,
                lease_id=self.lease.lease_id,
                hold_time=now() - self._acquired_at,
            )
        if self._scope is not None:
            self._scope.cancel()

    def _context(self) -> dict[str, str | None]:
        """What every event and error of this request carries."""
        return {
            "limiter": self.limiter_name,
            "workload": self.workload,
            "run_id": self.run_id,
            "root_run_id": self.root_run_id,
            "parent_run_id": self.parent_run_id,
            "request_id": self.request_id,
        }

    def _emit(self, cls: Any, **fields: Any) -> None:
        if dispatch.wants(self.limiter):
            dispatch.emit(self.limiter, cls(timestamp=time.time(), **self._context(), **fields))

    def _fill(self, exc: ConcurrencyError) -> ConcurrencyError:
        exc._fill(**self._context())
        return exc

    def __repr__(self) -> str:
        if self.limiter is None:
            return "<slotwise.Slot unlimited>"
        state = "lost" if self._lost else "released" if self._released else "held"
        return (
            f"<slotwise.Slot {self.limiter_name!r} workload={self.workload!r} "
            f"lease={self.lease_id} {state}>"
        )


class _BudgetEnded(Exception):
    """The request's own budget scope ended the wait."""


_ERROR_EVENTS: tuple[tuple[type[ConcurrencyError], Any], ...] = (
    (ConcurrencyTimeoutError, TimedOutEvent),
    (ConcurrencyQueueFullError, QueueFullEvent),
)


async def acquire(
    workload: str | None = None,
    *,
    limiter: Any = None,
    allow_nested: bool = False,
) -> Slot:
    """Wait for a slot and return it; the caller (any task) must ``await slot.release()``.

    Prefer ``async with slotwise.slot()``, which also cancels the body when the lease is
    lost. This form suits a slot that outlives the code that took it, such as a streamed
    HTTP response closed elsewhere. The lease is renewed until the slot is released.

    Args:
        workload: The workload; default: the current run's (same limiter), else the
            limiter's default.
        limiter: The limiter; default: the current run's. With neither, nothing is
            limited: an unlimited :class:`Slot` is returned at once and nothing is emitted.
        allow_nested: Take the slot even though this task already holds a slot of the same
            limiter (see the deadlock guard in the docs).

    Raises:
        ConcurrencyTimeoutError: no slot before ``max_wait`` or the run's budget ended.
        ConcurrencyQueueFullError: ``max_queued`` requests were already waiting.
        ConcurrencyLimiterError: the limiter failed; fails closed.
        ConcurrencyConfigError: unknown workload, none where one is required, or a nested
            slot without ``allow_nested``.
    """
    run = current_run()
    if limiter is None:
        limiter = run.limiter if run is not None else None
        if limiter is None:
            await checkpoint()
            return Slot(None, run)
    if workload is None and run is not None and run.limiter is limiter:
        workload = run.workload
    slot = Slot(limiter, run)
    try:
        slot.workload = _resolve(limiter, workload)
        if not allow_nested and any(
            held.limiter is limiter and not held.released for held in _holding.get()
        ):
            raise ConcurrencyConfigError(
                "this task already holds a slot of this limiter; taking another inside it "
                "can deadlock a small limiter (a tool started inside a slot that starts a "
                "child run waits for a slot its own parent holds). Release the slot before "
                "running tools, or pass allow_nested=True if you mean it"
            )
    except ConcurrencyConfigError as exc:
        if slot.workload is None and workload is not None:
            slot.workload = str(workload)
        slot._emit(ConfigErrorEvent, error=_describe(exc))
        raise slot._fill(exc) from None

    deadline = run.deadline if run is not None else None
    listening = dispatch.wants(limiter)
    start = now() if listening else 0.0
    if listening:
        max_wait = _max_wait(limiter, slot.workload)
        effective = deadline
        if max_wait is not None:
            effective = start + max_wait if effective is None else min(effective, start + max_wait)
        slot._emit(WaitStartedEvent, deadline=_epoch(effective))
    request = AcquireRequest(
        workload=slot.workload,
        request_id=slot.request_id or "",
        run_id=slot.run_id,
        root_run_id=slot.root_run_id,
        parent_run_id=slot.parent_run_id,
        deadline=deadline,
    )
    # The run's budget bounds the wait even for a limiter that ignores request.deadline; only
    # this scope firing (never an unrelated cancellation) turns into a timeout.
    budget = None if deadline is None else anyio.CancelScope(deadline=deadline)
    try:
        if budget is None:
            lease = await limiter.acquire(request)
        else:
            with budget:
                lease = await limiter.acquire(request)
            if budget.cancelled_caught:
                raise _BudgetEnded
        try:
            # Granted just as the request was cancelled: give it back before any body runs.
            await checkpoint_if_cancelled()
        except BaseException:
            await _release_shielded(limiter, lease)  # never raises what the release raised
            raise
    except (_BudgetEnded, anyio.get_cancelled_exc_class()) as exc:
        waited = now() - start if listening else 0.0
        if isinstance(exc, _BudgetEnded) or (
            budget is not None and budget.cancel_called and not (run is not None and run.cancelled)
        ):
            slot._emit(TimedOutEvent, wait_time=waited)
            raise slot._fill(
                ConcurrencyTimeoutError(
                    "the run's time budget ended while the request waited for a slot"
                )
            ) from None
        slot._emit(WaitCancelledEvent, wait_time=waited)
        raise
    except ConcurrencyConfigError as exc:
        slot._emit(ConfigErrorEvent, error=_describe(exc))
        raise slot._fill(exc) from None
    except Exception as exc:
        waited = now() - start if listening else 0.0
        for cls, event in _ERROR_EVENTS:
            if isinstance(exc, cls):
                slot._emit(event, wait_time=waited)
                raise slot._fill(exc) from None
        slot._emit(LimiterErrorEvent, wait_time=waited, error=_describe(exc))
        if isinstance(exc, ConcurrencyLimiterError):
            raise slot._fill(exc) from None
        raise slot._fill(
            ConcurrencyLimiterError(f"the limiter failed while acquiring a slot: {_describe(exc)}")
        ) from exc
    slot._hold(lease, now())
    keeper.track(slot)
    if listening:
        slot._emit(AcquiredEvent, lease_id=lease.lease_id, wait_time=slot._acquired_at - start)
    return slot


def _resolve(limiter: Any, workload: str | None) -> str:
    validate = getattr(limiter, "validate_workload", None)
    if validate is not None:
        return str(validate(workload))
    return DEFAULT_WORKLOAD if workload is None else str(workload)


def _max_wait(limiter: Any, workload: str) -> float | None:
    workloads = getattr(limiter, "workloads", None)
    if isinstance(workloads, Mapping):
        settings = workloads.get(workload)
        max_wait = getattr(settings, "max_wait", None)
        if isinstance(max_wait, int | float):
            return float(max_wait)
    return None


@final
class SlotContext(Generic[W]):
    """``async with`` form of :func:`acquire`: yields the :class:`Slot`, releases it on exit,
    and cancels the body if the lease is lost."""

    __slots__ = ("_allow_nested", "_limiter", "_slot", "_token", "_workload")

    def __init__(self, workload: W | None, limiter: Any, allow_nested: bool) -> None:
        self._workload = workload
        self._limiter = limiter
        self._allow_nested = allow_nested
        self._slot: Slot | None = None
        self._token: Token[tuple[Slot, ...]] | None = None

    async def __aenter__(self) -> Slot:
        slot = await acquire(self._workload, limiter=self._limiter, allow_nested=self._allow_nested)
        self._slot = slot
        if slot.lease is not None:
            self._token = _holding.set((*_holding.get(), slot))
            slot._scope = cancel_scope()
            slot._scope.__enter__()
        return slot

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        slot = self._slot
        if slot is None or slot._scope is None:
            return
        scope, slot._scope = slot._scope, None
        # Only the keeper cancels this scope, and only when the lease is lost: if the scope
        # swallowed a cancellation, the lease-lost error below takes its place.
        try:
            scope.__exit__(exc_type, exc, tb)
        except BaseException:
            # Exited from another task: an async generator that held the slot across a `yield`
            # and was finalized by the event loop. The slot must still go back.
            await slot.release("cancelled")
            raise
        finally:
            if self._token is not None:
                with contextlib.suppress(ValueError):  # reset from another context
                    _holding.reset(self._token)
        lost = slot._lost and (exc_type is None or scope.cancelled_caught)
        if lost or (exc_type is not None and isinstance(exc, anyio.get_cancelled_exc_class())):
            outcome: Outcome = "cancelled"
        elif exc_type is None:
            outcome = "completed"
        else:
            outcome = "failed"
        await slot.release(outcome)
        if lost:
            raise ConcurrencyLeaseLostError(
                "the slot's lease was lost while the body ran; the body was cancelled",
                lease_id=slot.lease_id,
                **slot._context(),
            ) from None


def slot(
    workload: W | None = None, *, limiter: Any = None, allow_nested: bool = False
) -> SlotContext[W]:
    """Hold one slot around one provider request: ``async with slotwise.slot(): ...``.

    Args:
        workload: The workload; default: the current run's (same limiter), else the
            limiter's default.
        limiter: Any limiter, built-in or custom; default: the current run's. With neither,
            nothing is limited and nothing is emitted (limits are opt-in).
        allow_nested: Allow taking a slot while this task already holds one of the same
            limiter (otherwise ``ConcurrencyConfigError``, as that can deadlock).

    Raises:
        ConcurrencyTimeoutError: on entry, no slot in time.
        ConcurrencyQueueFullError: on entry, the queue is full.
        ConcurrencyLimiterError: on entry, the limiter failed (the body never runs).
        ConcurrencyConfigError: on entry, a bad workload or a nested slot.
        ConcurrencyLeaseLostError: on exit, the lease was lost and the body cancelled.

    The body's own exception always reaches the caller unchanged.

    Do not hold a slot across a ``yield`` of an async generator: the body's cancel scope
    cannot follow the generator into its consumer. Take the slot with :func:`acquire` there
    and release it in the generator's ``finally`` (``slotwise.httpx`` does this for streamed
    responses). If such a generator is abandoned anyway, its slot is still released when the
    event loop finalizes it.
    """
    return SlotContext(workload, limiter, allow_nested)
