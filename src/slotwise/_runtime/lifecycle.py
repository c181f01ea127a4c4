"""The slot lifecycle, written once for every limiter, built-in or custom.

acquire (the one place a wait ends: the limiter's own deadline, or the run's budget) -> hold
(the lease is kept alive; a lost lease cancels the body) -> release (exactly once, shielded,
from whichever task ends the slot). Every outcome is an event; every failure an error carrying
the request's lineage.

Two ways to keep a lease alive while it is held:

- A limiter class registered with `tethering` (``MemoryLimiter``) ties each lease to its
  `Slot` object: the lease stays valid while the slot is neither released nor
  garbage collected, so nothing renews it, it cannot be lost to a stalled loop, and its body
  needs no cancel scope.
- Any other limiter's lease is renewed by the keeper of the holder's event loop; if it is
  lost, the body's cancel scope is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import math
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from functools import partial
from types import TracebackType
from typing import Any, Generic, NoReturn, TypeVar, final, overload

import anyio

from .._config import DEFAULT_WORKLOAD, retry_after_seconds, token_count
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
    LimitChangedEvent,
    LimiterErrorEvent,
    Outcome,
    PausedEvent,
    QueueFullEvent,
    ReleasedEvent,
    ReleaseFailedEvent,
    RenewalFailedEvent,
    TimedOutEvent,
    WaitCancelledEvent,
    WaitStartedEvent,
)
from .._protocol import AcquireRequest, Limiter, SupportsLease, TypedLimiter, W
from . import dispatch, keeper
from .keeper import lease_ttl
from .loop import Loop, TrioLoop, current, require
from .runs import Run
from .runs import _current as _current_run

__all__ = (
    "Slot",
    "SyncSlotContext",
    "acquire",
    "acquire_sync",
    "is_cancellation",
    "outcome_of",
    "slot",
    "sync_slot",
)

_logger = logging.getLogger("slotwise")
_prefix = secrets.token_hex(4)
_request_seq = itertools.count(1)
_numbering = threading.Lock()  # a request's id is read from whichever thread reports it
# Slots the current task (and the tasks it starts) holds, for the nested-slot deadlock guard.
_holding: ContextVar[tuple[Slot, ...]] = ContextVar("slotwise_holding", default=())


def is_cancellation(exc: BaseException, cancelled: type[BaseException]) -> bool:
    """Whether ``exc`` only says that the code was cancelled: the backend's cancellation, an
    async generator closed early, or a group made of nothing else (a cancelled nursery)."""
    if isinstance(exc, cancelled | GeneratorExit):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(is_cancellation(inner, cancelled) for inner in exc.exceptions)
    return False


def outcome_of(exc: BaseException | None, cancelled: type[BaseException]) -> Outcome:
    """The ``released`` outcome of a body that ended with ``exc`` (None: it returned)."""
    if exc is None:
        return "completed"
    return "cancelled" if is_cancellation(exc, cancelled) else "failed"


def _name(limiter: Any) -> str:
    return str(getattr(limiter, "name", type(limiter).__name__))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _epoch(deadline: float | None, loop: Loop) -> float | None:
    if deadline is None or math.isinf(deadline):
        return None
    return time.time() + (deadline - loop.clock())


# -- release, shielded ------------------------------------------------------------------------

_releasing: set[asyncio.Future[Any]] = set()


def _fatal(exc: BaseException) -> bool:
    """Whether ``exc`` asks the program to stop (Ctrl-C, `sys.exit`): it always goes on."""
    return isinstance(exc, KeyboardInterrupt | SystemExit)


async def _release(
    limiter: Any,
    lease: SupportsLease,
    done: Callable[[BaseException | None], None],
    bound: float,
) -> None:
    """Give ``lease`` back to ``limiter``, whatever cancels the caller, then call ``done``
    exactly once with what the release raised (None when it succeeded).

    A limiter whose class offers ``release_nowait`` is released synchronously. Otherwise the
    release is awaited inside a shield, for at most ``bound`` seconds (the lease's remaining
    life: after that the limiter frees the slot by itself, and a release that hangs must not
    hang its caller). anyio's shield stops anyio's cancellations only, so on asyncio the
    release runs in a task of its own that a native cancellation of the caller
    (``task.cancel()``, ``asyncio.timeout``, the shutdown of ``asyncio.run()``) cannot
    interrupt: the caller's cancellation is re-raised at once and ``done`` runs when the
    release ends. Whatever the release raises is reported, never raised, except a request
    to stop the program.
    """
    nowait = getattr(type(limiter), "release_nowait", None)
    if nowait is not None:
        try:
            nowait(limiter, lease)
        except BaseException as exc:
            if _fatal(exc):
                raise
            done(exc)
        else:
            done(None)
        return
    timed_out = TimeoutError(f"the release did not return within {bound:.3g}s")
    with anyio.CancelScope(shield=True):
        loop = require()
        if isinstance(loop, TrioLoop):
            with anyio.move_on_after(bound) as limit:
                try:
                    await limiter.release(lease)
                except BaseException as exc:
                    if _fatal(exc) or isinstance(exc, loop.cancelled):
                        raise
                    done(exc)
                    return
            done(timed_out if limit.cancelled_caught else None)
            return
        task = asyncio.ensure_future(limiter.release(lease))
        _releasing.add(task)
        task.add_done_callback(_releasing.discard)
        with anyio.move_on_after(bound) as limit:
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                caller = asyncio.current_task()
                if limit.cancel_called or (
                    not task.done() or (caller is not None and caller.cancelling())
                ):
                    if not limit.cancel_called:
                        # The caller is cancelled: it goes at once; the release reports when
                        # it ends.
                        task.add_done_callback(lambda task: done(_error_of(task)))
                    raise
                # Else the release alone was cancelled, not its caller: a failed release.
            except BaseException as exc:
                if _fatal(exc):
                    raise  # otherwise what the release raised is reported below
        if not task.done():  # the bound ran out
            task.cancel()
            done(timed_out)
            return
        done(_error_of(task))


def _error_of(task: asyncio.Future[Any]) -> BaseException | None:
    if task.cancelled():
        return RuntimeError("the release was cancelled")
    return task.exception()


# -- the slot ---------------------------------------------------------------------------------


@final
class Slot:
    """A held slot (or, outside any limit, a stand-in that limits nothing).

    `async with limiter.slot()` yields one; `await slotwise.acquire()` returns one that any
    task may end with `release()`.

    Attributes:
        limiter: The limiter, or None when nothing is limited.
        limiter_name: The limiter's name as events report it ("" when nothing is limited).
        workload: The workload the slot counts against.
        request_id: The id of the request that got it.
        run_id: The run that took it, or None.
        root_run_id: The root of that run's tree.
        parent_run_id: That run's parent.
        lease: The limiter's lease, kept valid while the slot is held; None when nothing is
            limited.
    """

    __slots__ = (
        "__weakref__",
        "_acquired_at",
        "_context",
        "_frame",
        "_keeper",
        "_loop",
        "_lost",
        "_number",
        "_released",
        "_renewed_at",
        "_run",
        "_scope",
        "_token",
        "_tokens",
        "_ttl",
        "lease",
        "limiter",
        "workload",
    )

    # Set by the keeper, for slots whose lease it renews.
    _renewed_at: float
    _ttl: float

    def __init__(
        self,
        workload: str | None,
        limiter: Any,
        allow_nested: bool,
        loop: Loop | None,
        tokens: int | None = None,
    ) -> None:
        """The slot a request will fill: its limiter (``limiter``, else the current run's),
        workload, token estimate and lineage, checked. With no limiter it limits nothing."""
        if tokens is not None:
            token_count("tokens", tokens, optional=True)
        run = _current_run.get()
        if limiter is None and run is not None:
            limiter = run.limiter
        self.limiter = limiter
        self._run = run
        self._number = 0  # numbered when its id is first asked for (events, errors)
        self.workload: str | None = None
        self.lease: SupportsLease | None = None
        self._loop = loop  # the event loop that took it; None: a thread without one
        self._acquired_at = 0.0
        # Not released while it is being acquired: a lease tied to this slot is held.
        self._released = limiter is None
        self._lost = False
        self._scope: Any = None  # the body's cancel scope, when the lease can be lost
        # The `async with` (or `with`) object that entered it, until its exit ran.
        self._context: SlotContext[Any] | SyncSlotContext[Any] | None = None
        self._frame: Any = None  # the generator frame that entered it, until its exit ran
        self._token: Any = None  # its entry in the nested-slot guard (a ContextVar token)
        self._keeper: Any = None  # the keeper that renews the lease, if one must
        self._tokens = tokens or 0  # the tokens charged for it: the estimate, then what was used
        if limiter is None:
            return
        if workload is None and run is not None and run.limiter is limiter:
            workload = run.workload
        try:
            # The workload, resolved by the limiter when it can (a built-in one checks it).
            validate = getattr(limiter, "validate_workload", None)
            if validate is not None:
                resolved = validate(workload)
                self.workload = resolved if type(resolved) is str else str(resolved)
            else:
                self.workload = DEFAULT_WORKLOAD if workload is None else str(workload)
            held = _holding.get()
            if (
                held
                and not allow_nested
                and any(other.limiter is limiter and not other._released for other in held)
            ):
                raise ConcurrencyConfigError(
                    "this task already holds a slot of this limiter; taking another inside it "
                    "can deadlock a small limiter (a tool started inside a slot that starts a "
                    "child run waits for a slot its own parent holds). Release the slot before "
                    "running tools, or pass allow_nested=True if you mean it"
                )
        except ConcurrencyConfigError as exc:
            if self.workload is None and workload is not None:
                self.workload = str(workload)
            self._emit(ConfigErrorEvent, error=_describe(exc))
            raise self._fill(exc) from None

    @property
    def limiter_name(self) -> str:
        """The limiter's name as events report it ("" when nothing is limited)."""
        return "" if self.limiter is None else _name(self.limiter)

    @property
    def request_id(self) -> str | None:
        """The id of the request that got it (None when nothing is limited)."""
        if self.limiter is None:
            return None
        if not self._number:
            with _numbering:
                if not self._number:
                    self._number = next(_request_seq)
        return f"{_prefix}-{self._number}"

    @property
    def run_id(self) -> str | None:
        """The run that took it, or None."""
        return None if self._run is None else self._run.run_id

    @property
    def root_run_id(self) -> str | None:
        """The root of that run's tree."""
        return None if self._run is None else self._run.root_run_id

    @property
    def parent_run_id(self) -> str | None:
        """That run's parent."""
        return None if self._run is None else self._run.parent_run_id

    def _clock(self) -> float:
        loop = self._loop
        return time.monotonic() if loop is None else loop.clock()

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
            outcome: Reported in the `released` event.
        """
        if self._released or self.lease is None:
            self._released = True
            return
        nowait = getattr(type(self.limiter), "release_nowait", None)
        if nowait is not None:
            self._release_nowait(nowait, outcome)
            return
        self._released = True
        if outcome != "completed":
            self._not_succeeded()
        keeper = self._keeper
        bound = keeper.remaining(self) if keeper is not None else lease_ttl(self.limiter)
        if keeper is not None:
            keeper.forget(self)
        await _release(self.limiter, self.lease, partial(self._released_as, outcome), bound)

    def used_tokens(self, tokens: int) -> None:
        """Correct the slot's token estimate with what its request really used (the
        response's `usage`): the difference is charged to the token buckets, or refunded.
        Call it once the count is known, while held or after release. `slotwise.httpx` does
        it for the OpenAI and Anthropic SDKs.

        Args:
            tokens: The tokens the request used, input and output together.

        Raises:
            ValueError: `tokens` is not a non-negative integer, or is above 2**53; the
                estimate is then left as it was.
        """
        tokens = token_count("tokens", tokens, ValueError)
        delta = tokens - self._tokens
        charge = getattr(type(self.limiter), "charge_tokens", None)
        if delta and charge is not None and self.lease is not None:
            charge(self.limiter, self.lease, delta)
        self._tokens = tokens  # once charged: a call that fails leaves the estimate as it was

    def provider_remaining(self, *, requests: int | None = None, tokens: int | None = None) -> None:
        """Tell the limiter what the provider says is left of its rate limits (the
        `x-ratelimit-remaining-*` and `anthropic-ratelimit-*-remaining` headers): a rate
        bucket that holds more is lowered to it, so that slotwise does not send what the
        provider would refuse. `slotwise.httpx` calls it by itself.

        Args:
            requests: Requests left in the provider's current window, if it said.
            tokens: Tokens left, if it said.
        """
        observe = getattr(type(self.limiter), "observe_remaining", None)
        if observe is None or self.lease is None:
            return
        for kind, remaining in (("requests", requests), ("tokens", tokens)):
            if remaining is not None:
                if not isinstance(remaining, int) or isinstance(remaining, bool) or remaining < 0:
                    raise ValueError(f"{kind} must be a non-negative integer, got {remaining!r}")
                observe(self.limiter, self.lease, kind, remaining)

    def provider_limits(self, *, requests: int | None = None, tokens: int | None = None) -> None:
        """Tell the limiter the provider's own limits, a minute (the `x-ratelimit-limit-*`
        and `anthropic-ratelimit-*-limit` headers): a rate bucket configured higher holds and
        refills no more than that, until the provider states another limit (never above the
        configured one) or an hour passes without it stating one. `slotwise.httpx` calls it
        by itself.

        Args:
            requests: The provider's requests a minute, if it said.
            tokens: The provider's tokens a minute, if it said.

        Raises:
            ValueError: a limit is not a positive integer.
        """
        learn = getattr(type(self.limiter), "observe_limit", None)
        for kind, limit in (("requests", requests), ("tokens", tokens)):
            if limit is not None:
                if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                    raise ValueError(f"{kind} must be a positive integer, got {limit!r}")
                if learn is not None and self.lease is not None:
                    learn(self.limiter, self.lease, kind, limit)

    def throttled(self, retry_after: float | None = None, *, reason: str = "throttled") -> None:
        """Say that the provider refused this slot's request (a 429, 529 or 503): the limiter
        grants no new slot until `retry_after` seconds from now (a jittered backoff that
        doubles from one second when None), for every task, and for every process of a
        `PostgresLimiter`; an adaptive limit backs off. Held slots are untouched, waiting
        requests keep their places. `slotwise.httpx` calls it by itself.

        Args:
            retry_after: Seconds, from the provider's `retry-after` header; None when it
                gave none.
            reason: Reported in the `paused` event (`slotwise.httpx` gives the status).

        Raises:
            ValueError: `retry_after` is negative or not a finite number.
        """
        retry_after = retry_after_seconds(retry_after)
        throttle = getattr(type(self.limiter), "throttle", None)
        if throttle is None or self.lease is None:
            return
        until, change = throttle(self.limiter, self.lease, retry_after)
        self._emit(PausedEvent, until=until, reason=reason)
        if change is not None:
            self._emit(LimitChangedEvent, old=change[0], new=change[1], reason="pushback")

    def release_sync(self, outcome: Outcome = "completed") -> None:
        """`release()` for code with no event loop (a slot taken with `sync_slot()`).
        Idempotent.

        Raises:
            ConcurrencyConfigError: the limiter can only release by awaiting.
        """
        if self._released or self.lease is None:
            self._released = True
            return
        nowait = getattr(type(self.limiter), "release_nowait", None)
        if nowait is None:
            raise ConcurrencyConfigError(
                f"limiter {self.limiter_name!r} has no release_nowait(): release its slots "
                "with `await slot.release()`"
            )
        self._release_nowait(nowait, outcome)

    def _release_nowait(
        self, nowait: Callable[[Any, SupportsLease], object], outcome: Outcome
    ) -> None:
        self._released = True
        if self._keeper is not None:
            self._keeper.forget(self)
        if outcome != "completed":
            self._not_succeeded()
        try:
            nowait(self.limiter, self.lease)  # type: ignore[arg-type]
        except BaseException as exc:
            self._release_raised(exc)
            return
        if dispatch._subscriptions and dispatch.wants(self.limiter):
            self._released_as(outcome, None)

    def _release_raised(self, exc: BaseException) -> None:
        """A `release_nowait()` raised ``exc``: reported, as the slot is released all the
        same (the lease expires), unless the program is asked to stop."""
        if _fatal(exc):
            raise exc
        self._release_failed(exc)

    def _not_succeeded(self) -> None:
        """Tell a limiter that has `not_succeeded()` that this slot's request was cancelled
        or failed, so that its release is no success for an adaptive limit."""
        hook = getattr(type(self.limiter), "not_succeeded", None)
        if hook is None:
            return
        try:
            hook(self.limiter, self.lease)
        except BaseException as exc:  # the release goes on: it frees the slot all the same
            if _fatal(exc):
                raise
            _logger.warning("slotwise: not_succeeded() of %s failed: %s", self.lease_id, exc)

    def _released_as(self, outcome: Outcome, error: BaseException | None) -> None:
        lease_id = self.lease_id or ""
        if error is not None:
            self._release_failed(error)
        elif dispatch.wants(self.limiter):
            self._emit(
                ReleasedEvent,
                lease_id=lease_id,
                hold_time=self._clock() - self._acquired_at,
                outcome=outcome,
            )

    def _release_failed(self, error: BaseException | None) -> None:
        if error is None:
            return
        lease_id = self.lease_id or ""
        _logger.warning("slotwise: releasing lease %s failed: %s", lease_id, _describe(error))
        self._emit(ReleaseFailedEvent, lease_id=lease_id, error=_describe(error))

    # -- used by the keeper ---------------------------------------------------------------

    def _renewal_failed(self, exc: BaseException) -> None:
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
                hold_time=self._clock() - self._acquired_at,
            )
        if self._scope is not None:
            self._scope.cancel()

    def _context_fields(self) -> dict[str, str | None]:
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
        if dispatch._subscriptions and dispatch.wants(self.limiter):
            dispatch.emit(
                self.limiter, cls(timestamp=time.time(), **self._context_fields(), **fields)
            )

    def _fill(self, exc: ConcurrencyError) -> ConcurrencyError:
        exc._fill(**self._context_fields())
        return exc

    def __repr__(self) -> str:
        if self.limiter is None:
            return "<slotwise.Slot unlimited>"
        state = "lost" if self._lost else "released" if self._released else "held"
        return (
            f"<slotwise.Slot {self.limiter_name!r} workload={self.workload!r} "
            f"lease={self.lease_id} {state}>"
        )


# -- acquire ----------------------------------------------------------------------------------


class _BudgetEnded(Exception):
    """The request's budget scope ended the wait of a limiter that ignores deadlines."""


_ERROR_EVENTS: tuple[tuple[type[ConcurrencyError], Any], ...] = (
    (ConcurrencyTimeoutError, TimedOutEvent),
    (ConcurrencyQueueFullError, QueueFullEvent),
)


@overload
async def acquire(
    workload: str | None = None,
    *,
    limiter: Limiter[str] | None = None,
    tokens: int | None = None,
    allow_nested: bool = False,
) -> Slot: ...


@overload
async def acquire(
    workload: W | None = None,
    *,
    limiter: TypedLimiter[W],
    tokens: int | None = None,
    allow_nested: bool = False,
) -> Slot: ...


async def acquire(
    workload: str | None = None,
    *,
    limiter: Limiter[Any] | None = None,
    tokens: int | None = None,
    allow_nested: bool = False,
) -> Slot:
    """Wait for a slot and return it; the caller (any task) must `await slot.release()`.

    Prefer `async with slotwise.slot()`, which also cancels the body when the lease is lost.
    This form suits a slot that outlives the code that took it, such as a streamed HTTP
    response closed elsewhere. The lease is kept valid until the slot is released.

    Args:
        workload: The workload; default: the current run's (same limiter), else the
            limiter's default.
        limiter: The limiter; default: the current run's. With neither, nothing is
            limited: an unlimited `Slot` is returned at once and nothing is emitted.
        tokens: The request's estimated tokens, for a limiter with token rate limits
            (charged when the slot is granted; correct it with `Slot.used_tokens()`).
            None: the request costs no tokens (it waits only for requests and slots).
        allow_nested: Take the slot even though this task already holds a slot of the same
            limiter (see the deadlock guard in the docs).

    Raises:
        ConcurrencyTimeoutError: no slot before `max_wait` or the run's budget ended.
        ConcurrencyQueueFullError: `max_queued` requests were already waiting.
        ConcurrencyLimiterError: the limiter failed; fails closed.
        ConcurrencyConfigError: unknown workload, none where one is required, or a nested
            slot without `allow_nested`.
    """
    loop = require()
    slot = Slot(workload, limiter, allow_nested, loop, tokens)
    run = slot._run
    if slot.limiter is None:
        await loop.checkpoint()
    elif _take_at_once(slot, loop):
        try:
            await loop.turn()
        except BaseException as exc:
            _not_entered(slot, run, loop, exc)
        _hold(slot, run, loop, None)
    else:
        await _wait(slot, run, loop)
    return slot


# Limiter classes that tie each lease to its Slot (see the module's docstring). They offer
# `_take_nowait(workload, loop, tether, tokens)` (the tether: a weak reference to the slot),
# `_take(workload, loop, deadline, holder, tokens)`, `_take_blocking(workload, timeout,
# holder, tokens)` (the holder: the slot itself, referred to weakly once granted) and
# `release_nowait(lease)`.
# Declared, not guessed from method names that a custom limiter may use for its own ends.
_tethering: set[type] = set()

T = TypeVar("T", bound=type)


def tethering(cls: T) -> T:
    """Class decorator: declare a limiter class as one that ties leases to their slots."""
    _tethering.add(cls)
    return cls


def can_block(limiter: Any) -> bool:
    """Whether ``limiter`` can serve code with no event loop (`sync_slot()`)."""
    return type(limiter) in _tethering


def _take_at_once(slot: Slot, loop: Loop) -> bool:
    """For a tethering limiter: take a free slot now, before anything yields, so that
    arrival order is the order of calls. False: the request must wait (`_wait`). A refusal
    is reported and raised as `_wait` reports and raises it."""
    limiter = slot.limiter
    cls = type(limiter)
    if cls not in _tethering:
        return False
    try:
        lease = cls._take_nowait(limiter, slot.workload, loop, weakref.ref(slot), slot._tokens)
    except BaseException as exc:
        _refused_at_once(slot, loop, exc)
    if lease is None:
        return False
    slot.lease = lease
    return True


def _refused_at_once(slot: Slot, loop: Loop, exc: BaseException) -> NoReturn:
    """The take at once raised (a refusal, or the limiter failed): reported and raised as
    `_wait` reports and raises it."""
    if _fatal(exc):
        raise exc
    if dispatch._subscriptions and dispatch.wants(slot.limiter):
        run = slot._run
        _wait_started(slot, loop.clock(), run.deadline_on(loop) if run is not None else None)
    _failed(slot, exc, 0.0, False, loop.cancelled)


def _not_entered(slot: Slot, run: Run | None, loop: Loop, exc: BaseException) -> NoReturn:
    """A slot taken at once whose request was cancelled before it resumed: nothing was
    held; give it back and report the request as cancelled."""
    assert slot.lease is not None
    type(slot.limiter).release_nowait(slot.limiter, slot.lease)
    slot._released = True
    if dispatch._subscriptions and dispatch.wants(slot.limiter):
        _wait_started(slot, loop.clock(), run.deadline_on(loop) if run is not None else None)
    _failed(slot, exc, 0.0, False, loop.cancelled)


def _entered(slot: Slot, run: Run | None, loop: Loop, start: float | None) -> None:
    """The slot is held from now: when, and the events (``start`` is when the request
    began to wait, None for a slot taken at once)."""
    slot._acquired_at = now = loop.clock()
    if dispatch._subscriptions and dispatch.wants(slot.limiter):
        if start is None:
            start = now
            _wait_started(slot, now, run.deadline_on(loop) if run is not None else None)
        _acquired(slot, slot.lease, now - start)  # type: ignore[arg-type]


def _hold(slot: Slot, run: Run | None, loop: Loop, start: float | None) -> None:
    """`_entered`, for a tethered lease: one that a subscriber's KeyboardInterrupt leaves
    with nobody to hold it is given back at once."""
    try:
        _entered(slot, run, loop, start)
    except BaseException:
        slot.release_sync("cancelled")
        raise


def _wait_begins(slot: Slot, run: Run | None, loop: Loop) -> float:
    """A request that must wait: when it starts to (reported, with its run's deadline)."""
    start = loop.clock()
    if dispatch._subscriptions and dispatch.wants(slot.limiter):
        _wait_started(slot, start, run.deadline_on(loop) if run is not None else None)
    return start


def _tethered_wait(slot: Slot, loop: Loop) -> Awaitable[SupportsLease]:
    """The tethering limiter's wait for ``slot``'s lease, until its run's deadline: it takes
    a place in the queue before anything yields, and keeps the lease valid while the slot
    lives."""
    limiter = slot.limiter
    run = slot._run
    deadline = run.deadline_on(loop) if run is not None else None
    return type(limiter)._take(  # type: ignore[no-any-return]
        limiter, slot.workload, loop, deadline, slot, slot._tokens
    )


def _raised() -> BaseException:
    """The exception being handled."""
    exc = sys.exc_info()[1]
    assert exc is not None
    return exc


def _wait_failed(
    slot: Slot, run: Run | None, loop: Loop, start: float, exc: BaseException
) -> NoReturn:
    """A wait that began at ``start`` ended with ``exc``: report it, raise what the caller
    sees (the run's budget ending is a timeout)."""
    budget_ended = isinstance(exc, _BudgetEnded) or (
        run is not None and isinstance(exc, loop.cancelled) and _budget_ended(run, loop)
    )
    _failed(slot, exc, loop.clock() - start, budget_ended, loop.cancelled)


async def _wait(slot: Slot, run: Run | None, loop: Loop) -> None:
    """Wait for the slot's lease: the one place where a wait ends, and how (`SlotContext`
    inlines it for a tethering limiter)."""
    start = _wait_begins(slot, run, loop)
    tethered = type(slot.limiter) in _tethering
    try:
        if tethered:
            lease = await _tethered_wait(slot, loop)
        else:
            lease = await _acquire_renewable(
                slot, loop, run.deadline_on(loop) if run is not None else None
            )
    except BaseException as exc:
        _wait_failed(slot, run, loop, start, exc)
    slot.lease = lease
    if tethered:
        _hold(slot, run, loop, start)
        return
    slot._acquired_at = loop.clock()
    keeper.track(slot, loop, since=start)
    try:
        _entered(slot, run, loop, start)
    except BaseException:  # a subscriber's KeyboardInterrupt: nobody will hold the slot
        await slot.release("cancelled")
        raise


def acquire_sync(
    workload: str | None = None,
    *,
    limiter: Any = None,
    timeout: float | None = None,
    tokens: int | None = None,
    allow_nested: bool = False,
) -> Slot:
    """`acquire()` for code with no event loop: blocks the thread until a slot, `timeout`
    (seconds), the workload's `max_wait` or the current run's budget. Release the slot with
    `Slot.release_sync()` (or use `sync_slot()`).

    Raises:
        ConcurrencyConfigError: as `acquire()`, and for a limiter that has no blocking form
            (only `MemoryLimiter` has one) or an invalid `timeout`.
    """
    if timeout is not None and (
        not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout >= 0
    ):
        raise ConcurrencyConfigError(
            f"timeout must be None or a non-negative number of seconds, got {timeout!r}"
        )
    slot = Slot(workload, limiter, allow_nested, None, tokens)
    run = slot._run
    limiter = slot.limiter
    if limiter is None:
        return slot
    if current() is not None:
        exc = ConcurrencyConfigError(
            "sync_slot() blocks its thread, and this thread runs an event loop: a slot held "
            "on this loop could never be released while it waits. Use `async with "
            "slot()` here, or run the sync code in a thread (anyio.to_thread.run_sync)"
        )
        slot._emit(ConfigErrorEvent, error=_describe(exc))
        raise slot._fill(exc)
    take = type(limiter)._take_blocking if can_block(limiter) else None
    if take is None:
        # A limiter class may say what to do instead (a class attribute, `_sync_advice`).
        advice = getattr(type(limiter), "_sync_advice", None)
        exc = ConcurrencyConfigError(
            f"limiter {slot.limiter_name!r} ({type(limiter).__name__}) cannot be used from "
            "code without an event loop: sync_slot() needs a limiter that can wait by "
            "blocking a thread, such as MemoryLimiter" + (f". {advice}" if advice else "")
        )
        slot._emit(ConfigErrorEvent, error=_describe(exc))
        raise slot._fill(exc)
    start = time.monotonic()
    deadline = run.deadline_on(None) if run is not None else None
    if timeout is not None:
        deadline = start + timeout if deadline is None else min(deadline, start + timeout)
    _wait_started(slot, start, deadline)
    # A deadline already past means: a free slot now, or a timeout.
    remaining = None if deadline is None else max(0.0, deadline - start)
    try:
        lease = take(limiter, slot.workload, remaining, slot, slot._tokens)
    except BaseException as exc:
        _failed(slot, exc, time.monotonic() - start, False, KeyboardInterrupt)
    slot.lease = lease
    slot._acquired_at = now = time.monotonic()
    if dispatch._subscriptions and dispatch.wants(limiter):
        try:
            _acquired(slot, lease, now - start)
        except BaseException:  # a subscriber's KeyboardInterrupt: nobody will hold the slot
            slot.release_sync("cancelled")
            raise
    return slot


def _acquired(slot: Slot, lease: SupportsLease, waited: float) -> None:
    waited_for = getattr(lease, "waited_for", ())
    slot._emit(AcquiredEvent, lease_id=lease.lease_id, wait_time=waited, waited_for=waited_for)


def _wait_started(slot: Slot, start: float, deadline: float | None) -> float:
    """Report that the request waits, with when it stops waiting; return ``start``."""
    if dispatch._subscriptions and dispatch.wants(slot.limiter):
        assert slot.workload is not None
        max_wait = _max_wait(slot.limiter, slot.workload)
        if max_wait is not None:
            deadline = start + max_wait if deadline is None else min(deadline, start + max_wait)
        epoch = None if deadline is None or math.isinf(deadline) else time.time() + deadline - start
        slot._emit(WaitStartedEvent, deadline=epoch)
    return start


async def _acquire_renewable(slot: Slot, loop: Loop, deadline: float | None) -> SupportsLease:
    """The lease of a limiter without a tether: through the Limiter protocol, bounded by the
    run's budget even if the limiter ignores the deadline."""
    limiter = slot.limiter
    assert slot.workload is not None
    request = AcquireRequest(
        workload=slot.workload,
        request_id=slot.request_id or "",
        run_id=slot.run_id,
        root_run_id=slot.root_run_id,
        parent_run_id=slot.parent_run_id,
        deadline=deadline,
        tokens=slot._tokens,
    )
    if deadline is None:
        lease: SupportsLease = await limiter.acquire(request)
    else:
        with anyio.CancelScope(deadline=deadline) as budget:
            lease = await limiter.acquire(request)
        if budget.cancelled_caught:
            raise _BudgetEnded
    try:
        # Granted just as the request was cancelled: give it back before any body runs.
        await loop.checkpoint_if_cancelled()
    except BaseException:
        slot.lease = lease
        await _release(limiter, lease, slot._release_failed, lease_ttl(limiter))
        raise
    return lease


def _failed(
    slot: Slot,
    exc: BaseException,
    waited: float,
    budget_ended: bool,
    cancelled: type[BaseException],
) -> NoReturn:
    """Report a request that got no slot, and raise what its caller sees."""
    if budget_ended:
        slot._emit(TimedOutEvent, wait_time=waited)
        raise slot._fill(
            ConcurrencyTimeoutError(
                "the run's time budget ended while the request waited for a slot"
            )
        ) from None
    if isinstance(exc, cancelled) or not isinstance(exc, Exception):
        slot._emit(WaitCancelledEvent, wait_time=waited)
        raise exc
    if isinstance(exc, ConcurrencyConfigError):
        slot._emit(ConfigErrorEvent, error=_describe(exc))
        raise slot._fill(exc) from None
    for error_cls, event in _ERROR_EVENTS:
        if isinstance(exc, error_cls):
            slot._emit(event, wait_time=waited)
            raise slot._fill(exc) from None
    slot._emit(LimiterErrorEvent, wait_time=waited, error=_describe(exc))
    if isinstance(exc, ConcurrencyLimiterError):
        raise slot._fill(exc) from None
    raise slot._fill(
        ConcurrencyLimiterError(f"the limiter failed while acquiring a slot: {_describe(exc)}")
    ) from exc


def _budget_ended(run: Run | None, loop: Loop) -> bool:
    """Whether a cancellation that ended a wait is the run's budget running out."""
    if run is None or run.cancelled:
        return False
    deadline = run.deadline_on(loop)
    return deadline is not None and loop.clock() >= deadline


def _max_wait(limiter: Any, workload: str) -> float | None:
    workloads = getattr(limiter, "workloads", None)
    if isinstance(workloads, Mapping):
        settings = workloads.get(workload)
        max_wait = getattr(settings, "max_wait", None)
        if isinstance(max_wait, int | float):
            return float(max_wait)
    return None


# -- async with -------------------------------------------------------------------------------


_CO_ASYNC_GENERATOR = inspect.CO_ASYNC_GENERATOR
_CO_ANY_GENERATOR = inspect.CO_ASYNC_GENERATOR | inspect.CO_GENERATOR


def _enter(context: SyncSlotContext[Any], slot: Slot, frame: Any) -> None:
    """Record that ``context`` (a `SyncSlotContext`) entered ``slot`` in this thread's
    context (its exit finds it there)."""
    slot._context = context
    context._open += 1
    context._last = slot
    held = _holding.get()
    if held:
        held = _forget_ended(held)
    slot._token = _holding.set((*held, slot))
    if frame.f_code.co_flags & _CO_ANY_GENERATOR:
        _entered_by_generator(slot, frame)


def _forget_ended(held: tuple[Slot, ...]) -> tuple[Slot, ...]:
    """``held`` (this context's slots) without those whose exit ran elsewhere (a generator
    closed in another task or thread): this context forgets them too."""
    if any(other._context is None for other in held):
        held = tuple(other for other in held if other._context is not None)
        _holding.set(held)
    return held


def _entered_by_generator(slot: Slot, frame: Any) -> None:
    """A generator may be closed, or finalized by the collector, in another task, thread or
    context, where its slot is not: its exit then finds the slot by the generator's frame
    (one frame may hold several slots, innermost last)."""
    slot._frame = frame
    _in_generators[id(frame)] = (*_in_generators.get(id(frame), ()), slot)


def _exit(context: SlotContext[Any] | SyncSlotContext[Any], frame: Any) -> Slot | None:
    """The slot that ``context`` entered and that this exit ends: the innermost one that the
    generator whose frame this is entered with ``context``, if it did (wherever it is closed);
    else the innermost one this task entered with ``context`` (whatever frames
    `AsyncExitStack` or a wrapper run them in), other than a generator's; else, for an exit
    that an exit stack runs where nothing records its slot (the stack closed by another task,
    or by a generator's finalizer), the one slot of ``context`` whose exit has not run, if
    only one has not. None when none is found. A slot released by hand is still its
    context's until its exit runs."""
    found: Slot | None = None
    entered = _in_generators.get(id(frame))
    if entered is not None:
        for slot in reversed(entered):
            if slot._frame is frame and slot._context is context:
                found = slot
                break
    if (
        found is None
        and context._open == 1
        and frame.f_code in _STACK_EXITS  # not an exit called by hand, maybe once too often
    ):
        last = context._last
        if last._context is context:
            found = last  # the one entry whose exit has not run: this exit is its
    held = _holding.get()
    for index in range(len(held) - 1, -1, -1):
        slot = held[index]
        if slot is found or (found is None and slot._frame is None and slot._context is context):
            found = slot
            # Not reset(): its token's old value may hold slots ended since.
            _holding.set(held[:index] + held[index + 1 :])
            break
    if found is not None:
        _ended(context, found)
    return found


def _ended(context: SlotContext[Any] | SyncSlotContext[Any], slot: Slot) -> None:
    """``slot``, which ``context`` entered, has had its exit: it is that context's no more,
    nor its generator's."""
    context._open -= 1
    slot._context = None
    slot._token = None  # its old value: the slots held before it, ended since perhaps
    frame = slot._frame
    if frame is not None:
        slot._frame = None  # the generator's frame, with its locals, is not kept alive
        rest = tuple(other for other in _in_generators.get(id(frame), ()) if other is not slot)
        if rest:
            _in_generators[id(frame)] = rest
        else:
            _in_generators.pop(id(frame), None)


# The frames from which an exit stack runs the exits pushed on it.
_STACK_EXITS = frozenset(
    (contextlib.AsyncExitStack.__aexit__.__code__, contextlib.ExitStack.__exit__.__code__)
)

# Slots entered by a generator, by id(frame), innermost last (see _entered_by_generator).
_in_generators: dict[int, tuple[Slot, ...]] = {}


@final
class SlotContext(Generic[W]):
    """`async with` form of `acquire()`: yields the `Slot`, releases it on exit, and cancels
    the body if the lease is lost.

    One object may be entered by many tasks at once, and again inside itself: each entry
    takes a slot of its own, and each exit releases the slot that the same task entered
    last (as `AsyncExitStack` does).
    """

    __slots__ = ("_allow_nested", "_last", "_limiter", "_loop", "_open", "_tokens", "_workload")

    _last: Slot

    def __init__(
        self,
        workload: W | None,
        limiter: Any,
        allow_nested: bool,
        tokens: int | None = None,
        loop: Loop | None = None,
    ) -> None:
        self._workload = workload
        self._limiter = limiter
        self._allow_nested = allow_nested
        self._tokens = tokens
        # The event loop every entry runs on, when its maker knows it (a tool batch's slots
        # are all entered by the batch's own tasks); None: looked up at each entry.
        self._loop = loop
        # The entries whose exit has not run, and (set by the first) the last entry: an
        # exit that finds its slot nowhere else ends that one when it is the only one.
        self._open = 0

    async def __aenter__(self) -> Slot:
        # acquire(), inlined: one coroutine less on the path of every provider request.
        loop = self._loop or current() or require()
        slot = Slot(self._workload, self._limiter, self._allow_nested, loop, self._tokens)
        run = slot._run
        limiter = slot.limiter
        cls = type(limiter)
        if limiter is None:
            await loop.turn()  # nothing limited; still entered, for its exit to find
        elif cls not in _tethering:
            await _wait(slot, run, loop)  # which reports the entry itself
        else:
            start: float | None = None  # when the request began to wait; None: it did not
            try:  # _take_at_once(), inlined: the path of every uncontended slot
                slot.lease = cls._take_nowait(
                    limiter, slot.workload, loop, weakref.ref(slot), slot._tokens
                )
            except BaseException as exc:
                _refused_at_once(slot, loop, exc)
            if slot.lease is not None:
                try:
                    await loop.turn()
                except BaseException as exc:
                    _not_entered(slot, run, loop, exc)
            else:
                # _wait(), inlined for a limiter that ties leases to slots: a waiting request
                # keeps one coroutine frame less alive (and this frame few locals).
                start = _wait_begins(slot, run, loop) if dispatch._subscriptions else loop.clock()
                try:
                    slot.lease = await _tethered_wait(slot, loop)
                except loop.cancelled:
                    # As is when outside any run with no one to tell. Not `as exc`: binding
                    # the exception costs 4% of a cancelled wait.
                    if run is not None or dispatch._subscriptions:
                        _wait_failed(slot, run, loop, start, _raised())
                    raise
                except BaseException as exc:
                    _wait_failed(slot, run, loop, start, exc)
            if dispatch._subscriptions and dispatch.wants(limiter):
                _hold(slot, run, loop, start)  # the events; a subscriber's raise releases it
            else:
                slot._acquired_at = loop.clock()  # _entered(), without events
        # _enter(), inlined.
        slot._context = self
        self._open += 1
        self._last = slot
        held = _holding.get()
        if held:
            held = _forget_ended(held)
        slot._token = _holding.set(held + (slot,))  # noqa: RUF005 (the cheaper)
        frame = sys._getframe(1)
        if frame.f_code.co_flags & _CO_ASYNC_GENERATOR:
            _entered_by_generator(slot, frame)
        if slot._keeper is not None:  # a lease that can be lost: the body can be cancelled
            scope = slot._scope = loop.cancel_scope()
            scope.__enter__()
        return slot

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        held = _holding.get()
        slot = held[-1] if held else None
        if (
            slot is not None
            and slot._context is self
            and slot._frame is None
            and not _in_generators
        ):
            # The usual case, _exit() inlined: the innermost slot of this task, and no
            # generator's slot that this exit may be the end of (a context may be shared).
            slot._context = None  # its exit has run: _ended(), inlined (it has no frame)
            self._open -= 1
            token, slot._token = slot._token, None
            try:
                _holding.reset(token)
            except ValueError:  # set in another context: take it out by hand
                _holding.set(held[:-1])
        else:
            slot = _exit(self, sys._getframe(1))
            if slot is None:
                return  # not entered (or entered where nothing recorded it, see _exit)
        lost = False
        scope, slot._scope = slot._scope, None
        if scope is not None:
            try:
                # Only the keeper cancels this scope, and only when the lease is lost: if the
                # scope swallowed a cancellation, the lease-lost error below takes its place.
                scope.__exit__(exc_type, exc, tb)
            except BaseException:
                # Exited from another task: an async generator that held the slot across a
                # `yield` and was finalized by the event loop. The slot must still go back.
                await slot.release("cancelled")
                raise
            lost = slot._lost and (exc_type is None or scope.cancelled_caught)
        if lost:
            outcome: Outcome = "cancelled"
        elif exc is None:
            outcome = "completed"
        else:
            outcome = outcome_of(exc, require().cancelled)
        limiter = slot.limiter
        nowait = getattr(type(limiter), "release_nowait", None)
        if nowait is None or slot._released:
            await slot.release(outcome)
        elif slot._keeper is None and outcome == "completed" and not dispatch._subscriptions:
            # Slot._release_nowait(), inlined for the usual exit: nothing more to tell.
            slot._released = True
            try:
                nowait(limiter, slot.lease)
            except BaseException as exc:
                slot._release_raised(exc)
        else:
            slot._release_nowait(nowait, outcome)  # Slot.release(), without a coroutine
        if lost:
            raise ConcurrencyLeaseLostError(
                "the slot's lease was lost while the body ran; the body was cancelled",
                lease_id=slot.lease_id,
                **slot._context_fields(),
            ) from None


@overload
def slot(
    workload: str | None = None,
    *,
    limiter: Limiter[str] | None = None,
    tokens: int | None = None,
    allow_nested: bool = False,
) -> SlotContext[str]: ...


@overload
def slot(
    workload: W | None = None,
    *,
    limiter: TypedLimiter[W],
    tokens: int | None = None,
    allow_nested: bool = False,
) -> SlotContext[W]: ...


def slot(
    workload: str | None = None,
    *,
    limiter: Limiter[Any] | None = None,
    tokens: int | None = None,
    allow_nested: bool = False,
) -> SlotContext[Any]:
    """Hold one slot around one provider request: `async with slotwise.slot(): ...`.

    Args:
        workload: The workload; default: the current run's (same limiter), else the
            limiter's default.
        limiter: Any limiter, built-in or custom; default: the current run's. With neither,
            nothing is limited and nothing is emitted (limits are opt-in).
        tokens: The request's estimated tokens, for token rate limits (charged at the
            grant; correct it with `Slot.used_tokens()`). None: it costs no tokens.
        allow_nested: Allow taking a slot while this task already holds one of the same
            limiter (otherwise `ConcurrencyConfigError`, as that can deadlock).

    Raises:
        ConcurrencyTimeoutError: on entry, no slot in time.
        ConcurrencyQueueFullError: on entry, the queue is full.
        ConcurrencyLimiterError: on entry, the limiter failed (the body never runs).
        ConcurrencyConfigError: on entry, a bad workload or a nested slot.
        ConcurrencyLeaseLostError: on exit, the lease was lost and the body cancelled.

    The body's own exception always reaches the caller unchanged. The object may be kept and
    entered by many tasks at once, like a semaphore: each entry is a slot of its own.

    Do not hold a slot across a `yield` of an async generator: the body's cancel scope
    cannot follow the generator into its consumer. Take the slot with `acquire()` there and
    release it in the generator's `finally` (`slotwise.httpx` does this for streamed
    responses). If such a generator is abandoned anyway, its slot is still released when the
    event loop finalizes it.
    """
    return SlotContext(workload, limiter, allow_nested, tokens)


@final
class SyncSlotContext(Generic[W]):
    """`with` form of a slot for code with no event loop: yields the `Slot`, releases it on
    exit. Like `SlotContext`, one object may be entered by many threads at once."""

    __slots__ = ("_allow_nested", "_last", "_limiter", "_open", "_timeout", "_tokens", "_workload")

    _last: Slot

    def __init__(
        self,
        workload: W | None,
        limiter: Any,
        timeout: float | None,
        allow_nested: bool,
        tokens: int | None = None,
    ) -> None:
        self._workload = workload
        self._limiter = limiter
        self._timeout = timeout
        self._allow_nested = allow_nested
        self._tokens = tokens
        self._open = 0  # as SlotContext's

    def __enter__(self) -> Slot:
        slot = acquire_sync(
            self._workload,
            limiter=self._limiter,
            timeout=self._timeout,
            tokens=self._tokens,
            allow_nested=self._allow_nested,
        )
        _enter(self, slot, sys._getframe(1))
        return slot

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        slot = _exit(self, sys._getframe(1))
        if slot is not None:
            slot.release_sync(outcome_of(exc, KeyboardInterrupt))


@overload
def sync_slot(
    workload: str | None = None,
    *,
    limiter: Limiter[str] | None = None,
    timeout: float | None = None,
    tokens: int | None = None,
    allow_nested: bool = False,
) -> SyncSlotContext[str]: ...


@overload
def sync_slot(
    workload: W | None = None,
    *,
    limiter: TypedLimiter[W],
    timeout: float | None = None,
    tokens: int | None = None,
    allow_nested: bool = False,
) -> SyncSlotContext[W]: ...


def sync_slot(
    workload: str | None = None,
    *,
    limiter: Limiter[Any] | None = None,
    timeout: float | None = None,
    tokens: int | None = None,
    allow_nested: bool = False,
) -> SyncSlotContext[Any]:
    """Hold one slot in code with no event loop: `with slotwise.sync_slot(limiter=claude):`.

    The thread blocks until a slot is free, `timeout` seconds pass, the workload's
    `max_wait` ends or the current run's budget ends (a thread started from a run with
    `anyio.to_thread.run_sync` belongs to that run). Nothing else interrupts the wait but
    an exception raised in the thread (Ctrl-C in the main thread): a thread cannot be
    cancelled from outside. The lease stays valid while the slot is held (no renewal
    thread: the slot itself keeps it), so the body cannot lose it.

    Args:
        workload: The workload; default: the current run's (same limiter), else the
            limiter's default.
        limiter: The limiter (one that can block a thread: `MemoryLimiter`); default: the
            current run's. With neither, nothing is limited.
        timeout: The longest the thread waits for a slot, in seconds; None: no limit but
            the workload's `max_wait` and the run's budget.
        tokens: As in `slot()`.
        allow_nested: As in `slot()`.

    Raises:
        ConcurrencyTimeoutError: on entry, no slot in time.
        ConcurrencyQueueFullError: on entry, the queue is full.
        ConcurrencyConfigError: on entry, a bad workload, a nested slot, or a limiter that
            cannot block a thread.
    """
    return SyncSlotContext(workload, limiter, timeout, allow_nested, tokens)
