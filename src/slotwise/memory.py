"""MemoryLimiter: one process's capacity, shared by every task, event loop and thread in it."""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, final, overload

from ._base import BuiltinLimiter
from ._config import (
    Adaptive,
    Rate,
    Settings,
    Workload,
    build_settings,
    resolve_workload,
    retry_after_seconds,
    wait_timeout,
)
from ._core.state import Holder, LeaseRecord, LimiterState, Tether, Ticket, holds
from ._errors import ConcurrencyConfigError
from ._protocol import AcquireRequest, Lease, SupportsLease, W
from ._runtime import collector
from ._runtime.lifecycle import SlotContext, SyncSlotContext, sync_slot, tethering
from ._runtime.loop import Loop, ThreadWaker, Waker, ki_protected, ki_unprotected, require
from ._stats import BucketStats, LimiterStats

__all__ = ("MemoryLimiter",)

_logger = logging.getLogger("slotwise")

_ident = threading.get_ident


@final
class Unchanged:
    """The default of a `set_limits()` keyword: that setting stays as it is (None is a
    value: no limit)."""

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED = Unchanged()


@final
@tethering
class MemoryLimiter(BuiltinLimiter[W]):
    """A limiter whose slots live in this process.

    One limiter serves every task of every event loop (asyncio and trio) and every thread of
    the process at once, with one queue: it can be built at module level, outside any event
    loop, and shared by `asyncio.run()` in several threads and by sync code
    (`sync_slot()`). Each waiter is woken on its own loop or thread.

    Args:
        name: Appears in events and errors.
        max_concurrent: Requests in flight at once, across every run.
        max_queued: Requests that may wait; the next one fails at once with
            `ConcurrencyQueueFullError`. None: unbounded.
        lease_ttl: Seconds a slot stays valid without renewal. A slot held through
            `slot()` or `slotwise.acquire()` stays valid as long as its `Slot` is neither
            released nor garbage collected; a slot whose holder is gone comes back within
            `lease_ttl`.
        workloads: Named workloads sharing the capacity; default: one named `"default"`.
        default_workload: The workload of requests that name none; default: `"default"` if
            it exists, or the only workload.
        rate: The provider account's request and token rates (`Rate`), checked with the
            slots in one decision; None: no rate limit.
        adaptive: An effective limit that backs off on the provider's pushback and climbs
            back on success (`Adaptive`); None: the limit is `max_concurrent`.

    Raises:
        ConcurrencyConfigError: a setting is invalid; the message names it.

    Example:
        ```python
        claude = MemoryLimiter(
            name="claude",
            max_concurrent=8,
            workloads={
                "interactive": Workload(reserved=2, priority=10, max_wait=60.0),
                "background": Workload(max_concurrent=6, max_wait=300.0),
            },
        )
        ```

        Its repr: `<slotwise.MemoryLimiter 'claude' 0/8 active, 0 queued (interactive 0/8,
        background 0/6)>`.

    Typed workload names: annotate `MemoryLimiter[Literal["interactive", "background"]]`
    (or key `workloads` by a `StrEnum`) and `slot(workload="typo")` is a type error.

    Clock: leases and deadlines are kept on `time.monotonic()`, which every thread and loop
    agrees on; each waiter's deadline is converted from its own loop's clock. Under trio's
    `MockClock` (tests), the limiter follows that virtual clock instead, and may then be used
    by that trio run only while it holds or awaits slots.
    """

    __slots__ = ("_clock", "_domain", "_lock", "_owners", "_state", "_watchers")

    @overload
    def __init__(
        self: MemoryLimiter[str],
        *,
        name: str = ...,
        max_concurrent: int,
        max_queued: int | None = ...,
        lease_ttl: float = ...,
        workloads: None = ...,
        default_workload: str | None = ...,
        rate: Rate | None = ...,
        adaptive: Adaptive | None = ...,
    ) -> None: ...

    @overload
    def __init__(
        self,
        *,
        name: str = ...,
        max_concurrent: int,
        max_queued: int | None = ...,
        lease_ttl: float = ...,
        workloads: Mapping[W, Workload],
        default_workload: W | None = ...,
        rate: Rate | None = ...,
        adaptive: Adaptive | None = ...,
    ) -> None: ...

    def __init__(
        self,
        *,
        name: str = "default",
        max_concurrent: int,
        max_queued: int | None = None,
        lease_ttl: float = 30.0,
        workloads: Mapping[W, Workload] | None = None,
        default_workload: str | None = None,
        rate: Rate | None = None,
        adaptive: Adaptive | None = None,
    ) -> None:
        self._settings: Settings = build_settings(
            name=name,
            max_concurrent=max_concurrent,
            max_queued=max_queued,
            lease_ttl=lease_ttl,
            workloads=workloads,
            default_workload=default_workload,
            rate=rate,
            adaptive=adaptive,
        )
        self._state = LimiterState(
            self._settings.rules,
            max_queued=self._settings.max_queued,
            lease_ttl=self._settings.lease_ttl,
            adaptive=_aimd(self._settings),
            slow_start=_slow_start(self._settings),
        )
        # Every read and write of the state, from any thread, holds this lock; it is never
        # held across an await, and waiters are woken after it is released.
        self._lock = threading.Lock()
        collector.start()  # for the requests that the garbage collector ends
        # The state's clock: time.monotonic, or a trio MockClock while a test drives it.
        self._domain: Any = None
        # The trio runs (their tokens) that have used the virtual clock, while it is one.
        self._owners: list[Any] = []
        self._clock: Callable[[], float] = time.monotonic
        # One waiter per thread watches the clock for leases that expire unrenewed, so a dead
        # holder's slot is handed on without a background task or a herd of timers.
        self._watchers = _Watchers(self._state.queues)

    # -- the user's surface ---------------------------------------------------------------

    def slot(
        self, workload: W | None = None, *, tokens: int | None = None, allow_nested: bool = False
    ) -> SlotContext[W]:
        """`async with limiter.slot(workload=...)`: `slotwise.slot()` with this limiter."""
        return SlotContext(workload, self, allow_nested, tokens)

    def sync_slot(
        self,
        workload: W | None = None,
        *,
        timeout: float | None = None,
        tokens: int | None = None,
        allow_nested: bool = False,
    ) -> SyncSlotContext[W]:
        """`with limiter.sync_slot(workload=...)`: `slotwise.sync_slot()` with this limiter,
        for code with no event loop (a thread, a sync SDK client)."""
        return sync_slot(
            workload, limiter=self, timeout=timeout, tokens=tokens, allow_nested=allow_nested
        )

    async def stats(self) -> LimiterStats:
        """Active and queued requests, in total and per workload."""
        await require().checkpoint()
        return self.stats_nowait()

    def stats_nowait(self) -> LimiterStats:
        """`stats()` without the `await`, for logs and dashboards in sync code."""
        with self._lock:
            state = self._state
            now = self._clock()
            wakers = self._settle(state.tick(now))
            active = dict(state.active)
            queued = {name: len(q) for name, q in state.queues.items()}
            state.bank.refill(now)
            buckets = {
                key: BucketStats(level=b.level, capacity=int(b.capacity), per=b.rule.per)
                for key, b in state.bank.buckets.items()
            }
            effective = state.rules.max_concurrent
            paused = None if state.paused_until <= now else self._epoch(state.paused_until, now)
        _wake(wakers)
        return self._stats(
            active, queued, effective=effective, paused_until=paused, buckets=buckets
        )

    async def set_limits(
        self,
        *,
        max_concurrent: int | None = None,
        max_queued: int | Unchanged | None = UNCHANGED,
        workloads: Mapping[W, Workload] | None = None,
        default_workload: str | Unchanged | None = UNCHANGED,
        rate: Rate | Unchanged | None = UNCHANGED,
        adaptive: Adaptive | Unchanged | None = UNCHANGED,
    ) -> None:
        """Change the limits at once, validated as the constructor validates them; what is
        not given stays as it is.

        Held slots are never revoked: with a smaller limit, new grants wait until fewer are
        active. Requests waiting for a workload that is gone fail with
        `ConcurrencyConfigError` (slots held in it count until they are released), and so
        do waiting requests whose token estimate a smaller bucket can never hold (the error
        names the bucket, as for a request too large at once). Emits `limit-changed` when
        the limit in force changes.

        Args:
            max_concurrent: The new limit; None: unchanged.
            max_queued: The new queue bound (None: unbounded); `UNCHANGED` (the default):
                unchanged.
            workloads: The new workloads, replacing all of them; None: unchanged.
            default_workload: As in the constructor; `UNCHANGED`: unchanged.
            rate: As in the constructor (None: no rate limit); `UNCHANGED`: unchanged.
            adaptive: As in the constructor (None: not adaptive); `UNCHANGED`: unchanged.

        Raises:
            ConcurrencyConfigError: a setting is invalid; nothing changed.

        Example:
            ```python
            await claude.set_limits(max_concurrent=16, rate=Rate(requests=100))
            ```
        """
        await require().checkpoint()
        settings = self._settings
        new = build_settings(
            name=settings.name,
            max_concurrent=settings.max_concurrent if max_concurrent is None else max_concurrent,
            max_queued=settings.max_queued if isinstance(max_queued, Unchanged) else max_queued,
            lease_ttl=settings.lease_ttl,
            workloads=settings.workloads if workloads is None else workloads,
            default_workload=settings.default_workload
            if isinstance(default_workload, Unchanged)
            else default_workload,
            rate=settings.rate if isinstance(rate, Unchanged) else rate,
            adaptive=settings.adaptive if isinstance(adaptive, Unchanged) else adaptive,
        )
        with self._lock:
            old_limit = self._state.rules.max_concurrent
            self._settings = new
            granted, refused = self._state.reconfigure(
                new.rules, new.max_queued, self._clock(), _aimd(new)
            )
            new_limit = self._state.rules.max_concurrent
            wakers = self._settle(granted)
            for ticket in refused:
                wakers += [t.waker for t in self._watchers.leave(ticket) if t.waker is not None]
                if ticket.waker is not None:
                    wakers.append(ticket.waker)
        _wake(wakers)
        if old_limit != new_limit:
            self._limit_changed(old_limit, new_limit, "set_limits")

    def throttle(
        self, lease: SupportsLease | None, retry_after: float | None = None
    ) -> tuple[float, tuple[int, int] | None]:
        """The provider refused a request (429, 529, 503): pause new grants until
        `retry_after` seconds from now (a doubling, jittered backoff from one second when
        None), and lower an adaptive limit. Held slots are untouched; waiting requests keep
        their places, and their `max_wait` and budgets keep running.

        Most code calls `Slot.throttled()` (or lets `slotwise.httpx` do it), which reports
        the `paused` and `limit-changed` events with the request's lineage.

        Returns:
            When the pause ends (seconds since the epoch), and the limit in force before
            and after, when an adaptive limit changed.

        Raises:
            ValueError: `retry_after` is negative, not finite or not a number.
        """
        retry_after = retry_after_seconds(retry_after)
        with self._lock:
            now = self._clock()
            throttle = self._state.throttle(
                None if lease is None else lease.lease_id,
                retry_after,
                now,
                random.uniform(0.75, 1.25),
            )
            until = self._epoch(throttle.paused_until, now)
            # Waiters whose alarm would ring during the pause re-arm for its end.
            wakers = self._watchers.earlier(throttle.paused_until)
        _wake(wakers)
        return until, throttle.limit

    def not_succeeded(self, lease: SupportsLease) -> None:
        """The request held by `lease` was cancelled or failed: its release is no success,
        so an adaptive limit does not climb on it and a backoff does not start again from
        a second. The slot lifecycle calls it before releasing a slot whose body did not
        complete."""
        if collector.thread is not None and collector.thread == _ident():
            collector.later(self.not_succeeded, lease)  # run by the collector
            return
        with self._lock:
            self._state.not_succeeded(lease.lease_id)

    def observe_remaining(self, lease: SupportsLease, kind: str, remaining: int) -> None:
        """The provider says `remaining` requests or tokens (`kind`) are left of its
        limit: the limiter's bucket of that kind holds no more than that (it is lowered,
        never raised), so the next grants wait for the provider's own refill.
        `Slot.provider_remaining()` calls it (`slotwise.httpx` reads the rate-limit
        headers)."""
        with self._lock:
            self._state.bank.observe(kind, remaining, self._clock())

    def observe_limit(self, lease: SupportsLease, kind: str, limit: int) -> None:
        """The provider says its limit of `kind` (requests or tokens) is `limit` a minute
        (the `x-ratelimit-limit-*` headers): the limiter's bucket of that kind holds and
        refills no more than that, nor than its configured rate, until the provider says
        otherwise or an hour passes without it saying (`slotwise._core.rates.Bank.learn`).
        `Slot.provider_limits()` calls it (`slotwise.httpx` reads the headers)."""
        with self._lock:
            self._state.bank.learn(kind, limit, self._clock())

    def charge_tokens(self, lease: SupportsLease, tokens: int) -> None:
        """Charge `tokens` more to the token buckets of `lease`'s workload and of the limiter
        (a refund when negative): `Slot.used_tokens()` corrects an estimate with it."""
        with self._lock:
            granted = self._state.charge(lease.workload, "tokens", tokens, self._clock())
            wakers = self._settle(granted)
        _wake(wakers)

    # -- the Limiter protocol -------------------------------------------------------------

    async def acquire(self, request: AcquireRequest[W]) -> Lease:
        """Wait for a slot (see `slotwise.Limiter`); safe to cancel at any point.

        Most code takes slots with `slot()` instead, which runs the whole lifecycle.

        Args:
            request: The workload, the request's identity and its run's deadline.

        Returns:
            The lease; give it back with `release()`.

        Raises:
            ConcurrencyConfigError: the workload is unknown, or missing with no default.
            ConcurrencyQueueFullError: `max_queued` requests are already waiting.
            ConcurrencyTimeoutError: no slot before `max_wait` or `request.deadline`.
        """
        workload = resolve_workload(self._settings, request.workload)
        record = await self._take(workload, require(), request.deadline, None, request.tokens)
        return _lease(record)

    async def renew(self, lease: SupportsLease) -> Lease | None:
        """Extend a lease by `lease_ttl`; None when it is no longer held. Never waits."""
        return self.renew_nowait(lease)

    def renew_nowait(self, lease: SupportsLease) -> Lease | None:
        """`renew()` without the `await`; the slot lifecycle uses it."""
        with self._lock:
            record = self._state.renew(lease.lease_id, self._clock())
            return None if record is None else _lease(record)

    async def release(self, lease: SupportsLease) -> None:
        """Give a slot back to the next waiter. Idempotent; never waits."""
        self.release_nowait(lease)

    @ki_protected
    def release_nowait(self, lease: SupportsLease) -> None:
        """`release()` without the `await`; the slot lifecycle uses it."""
        if collector.thread is not None and collector.thread == _ident():
            collector.later(self.release_nowait, lease)  # run by the collector
            return
        state = self._state
        lock = self._lock
        # Not `with self._lock`: on the path of every slot, `with` costs twice as much (it
        # binds __enter__ and __exit__ each time, and calls __exit__ with three arguments).
        # A Ctrl-C between acquire() and `try` would leave the lock held: see ki_protected.
        lock.acquire()
        try:
            limit = state.rules.max_concurrent
            granted = state.release(lease.lease_id, self._clock())
            climbed = state.aimd is not None and state.rules.max_concurrent != limit
            if not granted and not climbed and (not self._watchers.alarms or not state.timed):
                return  # nothing to wake: no grant, and no clock watch to move earlier
            wakers = self._settle(granted)
        finally:
            lock.release()
        _wake(wakers)
        if climbed:
            self._recovered(limit)

    @ki_unprotected
    def _recovered(self, limit: int) -> None:
        """Tell the subscribers that a release raised the limit by one, out of trio's
        `KeyboardInterrupt` protection of `release_nowait`: a Ctrl-C reaches them at once.
        (Only a request's own task releases with a success, never a trio system task, which
        must not raise.)"""
        self._limit_changed(limit, limit + 1, "recovered")

    # -- what the slot lifecycle uses (looked up on the class) ----------------------------

    @ki_protected
    def _take_nowait(
        self, workload: str, loop: Loop, tether: Tether, tokens: int = 0
    ) -> LeaseRecord | None:
        """A slot now, tethered to its holder, if the request would not have to wait (never
        with rate limits or a pause: those go through `_take`)."""
        lock = self._lock
        lock.acquire()  # not `with`: see release_nowait()
        try:
            if loop.virtual is not self._domain or (
                self._owners and loop.identity not in self._owners
            ):
                self._now(loop)  # follow (or refuse) another clock, or another run of it
            try:
                record = self._state.take_nowait(workload, self._clock(), tether)
            except KeyError:
                # set_limits() removed the workload since the request named it.
                resolve_workload(self._settings, workload)
                raise
            if record is None or not self._watchers.alarms:
                return record
            wakers = self._watchers.earlier(record.expires_at)
        finally:
            lock.release()
        _wake(wakers)
        return record

    async def _take(
        self,
        workload: str,
        loop: Loop,
        deadline: float | None,
        holder: Holder | None,
        tokens: int = 0,
    ) -> LeaseRecord:
        """Wait for a slot until the earlier of `deadline` (on `loop`'s clock) and the
        workload's `max_wait`, for `holder` (its lease is tethered to it; None: to nothing).
        The request takes a slot or its place in the queue before this yields (so arrival
        order is the order of calls), then yields once at least."""
        ticket, end, waker, until = self._submit(workload, loop, holder, tokens, deadline)
        try:
            parked = False
            if ticket.lease is not None:
                await loop.checkpoint()
            while True:
                if waker is None:
                    record, waker, until = self._step(ticket, loop, end, deadline)
                    if record is not None:
                        if parked:
                            # Granted while parked: a cancellation that came meanwhile wins.
                            await loop.checkpoint_if_cancelled()
                        return record
                if until != math.inf:
                    until = loop.now() + (until - self._clock())
                await loop.park(waker, until)
                record = ticket.lease
                if record is not None and not ticket.rate_waits and holds(record.tether):
                    # The hand-off: granted while parked, to a holder that lives, so valid;
                    # the grant passed the clock watch on already. A cancellation wins.
                    await loop.checkpoint_if_cancelled()
                    return record
                parked = True
                waker = None
        except BaseException:
            # Cancelled while waiting, or as the slot was granted: give it back either way.
            self._leave(ticket)
            raise

    @ki_protected
    def _submit(
        self,
        workload: str,
        loop: Loop | None,
        holder: Holder | None,
        tokens: int,
        deadline: float | None,
    ) -> tuple[Ticket, float, Waker | None, float]:
        """Add the request to the state: granted at once, or waiting. Returns it, when it
        stops waiting (its deadline or max_wait, on the state's clock) and, if it waits, the
        waker to park on and when to wake up (the first `_step`, under the same lock; None:
        look with `_step`). Raises its refusal (a full queue, a workload that is gone) after
        waking what the submit granted."""
        # A call of its own: what it wakes is not kept alive by the frame of every waiter.
        state = self._state
        waker: Waker | None = None
        lock = self._lock
        lock.acquire()  # not `with`: see release_nowait()
        try:
            now = self._now(loop)
            # Checked under the lock: set_limits() may have removed the workload since the
            # request named it (a workload kept only for its held slots takes nothing more).
            rule = self._settings.workloads.get(workload)
            if rule is None:
                resolve_workload(self._settings, workload)  # raises: unknown
            ticket, granted = state.submit(workload, now, holder, tokens)
            # When it stops waiting, on the state's clock: its deadline, its max_wait.
            end = math.inf
            if deadline is not None:
                end = deadline if loop is None else deadline - loop.now() + self._clock()
            if rule is not None and rule.max_wait is not None:
                end = min(end, now + rule.max_wait)
            until = end
            if ticket.lease is None and ticket.refused is None and now < end:
                waker = ThreadWaker() if loop is None else loop.waker()
                until = min(end, self._watchers.park(ticket, waker, state, now))
            wakers = self._settle(granted, ticket.lease)
        finally:
            lock.release()
        _wake(wakers)
        if ticket.refused is not None:
            raise ticket.refused
        return ticket, end, waker, until

    def _take_blocking(
        self, workload: str, timeout: float | None, holder: Holder | None, tokens: int = 0
    ) -> LeaseRecord:
        """`_take()` for a thread with no event loop: blocks until a slot, the timeout
        (seconds) or the workload's `max_wait`."""
        # A thread's state clock is time.monotonic() (a virtual one refuses threads).
        deadline = None if timeout is None else time.monotonic() + timeout
        ticket, end, waker, until = self._submit(workload, None, holder, tokens, deadline)
        try:
            while True:
                if waker is None:
                    record, waker, until = self._step(ticket, None, end, deadline)
                    if record is not None:
                        return record
                assert isinstance(waker, ThreadWaker)
                waker.wait(None if until == math.inf else max(0.0, until - self._clock()))
                waker = None
        except BaseException:
            self._leave(ticket)
            raise

    # -- internals ------------------------------------------------------------------------

    def _now(self, loop: Loop | None) -> float:
        """The state's clock; with the lock held. A limiter with no slot held or awaited
        follows the clock of whoever uses it next: real time, or a trio MockClock."""
        domain = None if loop is None else loop.virtual
        if domain is not self._domain:
            state = self._state
            if (state.leases or state.queued) and not self._abandoned():
                raise ConcurrencyConfigError(
                    f"limiter {self.name!r} is in use under the virtual clock of a trio run "
                    "(trio.testing.MockClock); another event loop or thread cannot share it "
                    "until that run's slots are released"
                    if self._domain is not None
                    else f"limiter {self.name!r} is in use in real time; a trio run with a "
                    "virtual clock (trio.testing.MockClock) cannot share it until its slots "
                    "are released"
                )
            self._domain = domain
            self._owners = [] if domain is None else [loop.identity]  # type: ignore[union-attr]
            self._clock = time.monotonic if domain is None else domain.current_time
            state.rebase(self._clock())
        elif domain is not None and loop.identity not in self._owners:  # type: ignore[union-attr]
            # The same virtual clock in another trio run (a test that reuses its MockClock,
            # one run after another or at once): what is left is abandoned only when every
            # run that used it has ended.
            self._owners = [token for token in self._owners if _running(token)]
            self._owners.append(loop.identity)  # type: ignore[union-attr]
        return self._clock()

    def _abandoned(self) -> bool:
        """Whether every slot held or awaited belongs to a trio run on a virtual clock that
        has ended (a test that left slots behind): then nothing can ever use them, and the
        state is dropped."""
        if self._domain is None or not self._owners or any(map(_running, self._owners)):
            return False
        self._state.clear()
        self._watchers = _Watchers(self._state.queues)
        return True

    def _max_wait(self, workload: str) -> float | None:
        """The workload's `max_wait`; None once set_limits() removed it (its waiters are
        refused then)."""
        settings = self._settings.workloads.get(workload)
        return None if settings is None else settings.max_wait

    def _step(
        self, ticket: Ticket, loop: Loop | None, end: float, deadline: float | None
    ) -> tuple[LeaseRecord | None, Waker | None, float]:
        """One look at a waiting request: its lease when it has a valid one; else a new
        waker to park on and when to wake up (state clock). Raises the timeout."""
        state = self._state
        timed_out = False
        with self._lock:
            now = self._clock()
            granted = state.tick(now) if ticket.lease is None else []
            record = ticket.lease
            if record is not None and record.expires_at <= now and not holds(record.tether):
                # Granted, but the lease ran out before this waiter resumed (its loop or
                # thread stalled) and someone may hold it now: never enter on it.
                granted += state.regrant(ticket, now)
                record = ticket.lease
            waker: Waker | None = None
            until = end
            if record is not None or ticket.refused is not None:
                granted += self._watchers.leave(ticket)
            elif now >= end:
                granted += state.withdraw(ticket, now)
                granted += self._watchers.leave(ticket)
                timed_out = True
            else:
                waker = ThreadWaker() if loop is None else loop.waker()
                until = min(until, self._watchers.park(ticket, waker, state, now))
            wakers = self._settle(granted)
        _wake(wakers)
        if ticket.refused is not None:
            raise ticket.refused
        if record is not None and ticket.rate_waits:
            record.waited_for = tuple(sorted(ticket.rate_waits))
        if timed_out:
            max_wait = self._max_wait(ticket.workload)
            by_max_wait = max_wait is not None and (
                deadline is None or ticket.enqueued_at + max_wait <= end
            )
            raise wait_timeout(now - ticket.enqueued_at, max_wait, by_max_wait)
        return record, waker, until

    @ki_protected
    def _leave(self, ticket: Ticket) -> None:
        if collector.thread is not None and collector.thread == _ident():
            collector.later(self._leave, ticket)  # closed by the collector
            return
        state = self._state
        lock = self._lock
        lock.acquire()  # not `with`: see release_nowait()
        try:
            # Most withdrawals only leave the queue: no clock read, nothing granted.
            granted = [] if state.leave_queue(ticket) else state.withdraw(ticket, self._clock())
            waker = ticket.waker
            home = None if waker is None else waker.parked
            if home is not None and home.watcher is not ticket:
                # _watchers.leave(), inlined for a waiter that does not watch the clock (all
                # but one of its thread's): it is only counted out.
                waker.parked = None
                home.waiting -= 1
            else:
                granted += self._watchers.leave(ticket)
            if not granted and (not self._watchers.alarms or not state.timed):
                return  # nothing to wake: no grant, and no clock watch to move earlier
            wakers = self._settle(granted)
        finally:
            lock.release()
        _wake(wakers)

    def _settle(self, granted: list[Ticket], taken: LeaseRecord | None = None) -> list[Waker]:
        """With the lock held: the wakers to call (after it is released) for the tickets
        `granted` and the lease `taken` at once by the caller."""
        watchers = self._watchers
        wakers = []
        soonest = math.inf if taken is None else taken.expires_at  # the earliest new expiry
        for ticket in granted:
            waker = ticket.waker
            if waker is not None:
                wakers.append(waker)
            lease = ticket.lease
            if lease is not None:
                if lease.expires_at < soonest:
                    soonest = lease.expires_at
                # A granted watcher may not resume soon (its loop may be stalled): hand its
                # watch to another waiter of its thread now.
                for successor in watchers.leave(ticket):
                    if successor.waker is not None:
                        wakers.append(successor.waker)
        state = self._state
        if state.timed:
            # A head may now wait for a bucket to refill: the clock watch must ring then.
            wake = state.next_wake(self._clock())
            if wake is not None:
                soonest = min(soonest, wake)
        if soonest != math.inf:
            for alarm in watchers.alarms.values():
                if soonest < alarm:  # a watcher to wake earlier: the usual grant has none
                    wakers += watchers.earlier(soonest)
                    break
        return wakers

    def _epoch(self, moment: float, now: float) -> float:
        """A time on the state's clock, in seconds since the epoch."""
        return time.time() + (moment - now)

    def __repr__(self) -> str:
        state = self._state
        rules = self._settings.rules
        parts = []
        for name, rule in rules.workloads.items():
            part = f"{name} {state.active[name]}/{rule.ceiling}"
            if state.queues[name]:
                part += f" +{len(state.queues[name])} queued"
            parts.append(part)
        return (
            f"<slotwise.MemoryLimiter {self.name!r} {len(state.leases)}/{rules.max_concurrent} "
            f"active, {state.queued} queued ({', '.join(parts)})>"
        )


def _aimd(settings: Settings) -> tuple[int, float] | None:
    adaptive = settings.adaptive
    return None if adaptive is None else (adaptive.min_concurrent, adaptive.backoff)


def _slow_start(settings: Settings) -> bool:
    return settings.adaptive is not None and settings.adaptive.slow_start


class _Thread:
    """The waiters of one thread on one limiter: how many are parked, and which of them
    watches the clock. The wakers of the ones counted point to it (``Waker.parked``)."""

    __slots__ = ("thread", "waiting", "watcher")

    def __init__(self, thread: int, watcher: Ticket) -> None:
        self.thread = thread
        self.waiting = 0
        self.watcher: Ticket | None = watcher


_NOBODY: tuple[Ticket, ...] = ()


class _Watchers:
    """Which waiter of each thread watches the clock for leases that expire unrenewed.

    Expiry needs no background task: a waiting request sets its timer to the earliest lease
    expiry as well as its own deadline. One waiter per thread does so (not every waiter: a
    herd of timers), and per thread, not per limiter, so that a stalled or paused event loop
    delays nobody on another one. A watcher that leaves hands its watch to the newest waiter
    of its thread (grants go in arrival order: it leaves last, so a hand-off does not pass the
    watch on at every grant), which it wakes so that it re-arms. No entry per waiter is kept:
    each thread's waiters are counted (a waker knows which count it is in), and the newest is
    found from the tails of the queues, only when its thread has one.
    """

    __slots__ = ("_queues", "_threads", "alarms")

    def __init__(self, queues: Mapping[str, OrderedDict[int, Ticket]]) -> None:
        self._queues = queues  # the state's queues, each in arrival order
        self._threads: dict[int, _Thread] = {}  # the threads with a waiter parked
        self.alarms: dict[int, float] = {}  # when each watcher wakes up, on the state's clock

    def park(self, ticket: Ticket, waker: Waker, state: LimiterState, now: float) -> float:
        """``ticket`` parks on ``waker``, a new one; returns when it must wake up for the
        clock (``inf``: never), which only its thread's watcher asks ``state``."""
        previous = ticket.waker
        home: _Thread | None = None if previous is None else previous.parked
        if home is not None and self._threads.get(home.thread) is home:
            previous.parked = None  # parked again: it was counted
        else:  # not counted yet, or only by the watchers of a state since dropped
            thread = waker.thread
            home = self._threads.get(thread)
            if home is None:
                home = _Thread(thread, ticket)
                self._threads[thread] = home
            home.waiting += 1
        waker.parked = home
        ticket.waker = waker
        watcher = home.watcher
        if watcher is not ticket:
            if watcher is not None and watcher.waker.alive():
                return math.inf
            # Its event loop was closed with it waiting: it can never wake up to watch.
            home.watcher = ticket
        wake = state.next_wake(now)
        alarm = self.alarms[home.thread] = math.inf if wake is None else wake
        return alarm

    def leave(self, ticket: Ticket) -> Sequence[Ticket]:
        """``ticket`` stops waiting (it is out of the queues already). Idempotent. Returns
        the waiter to wake to take over its watch."""
        waker = ticket.waker
        home: _Thread | None = None if waker is None else waker.parked
        if home is None:
            return _NOBODY
        waker.parked = None
        home.waiting -= 1
        if home.watcher is not ticket:
            return _NOBODY
        thread = home.thread
        if self._threads.get(thread) is not home:
            return _NOBODY  # a ticket of a state since dropped
        self.alarms.pop(thread, None)
        successor = self._newest(home) if home.waiting else None
        home.watcher = successor
        if successor is None:
            del self._threads[thread]
            return _NOBODY
        self.alarms[thread] = math.inf  # until it wakes up and re-arms
        return (successor,)

    def _newest(self, home: _Thread) -> Ticket | None:
        """The waiter counted in ``home`` that arrived last."""
        newest: Ticket | None = None
        for queue in self._queues.values():
            for ticket in reversed(queue.values()):
                waker = ticket.waker
                if waker is not None and waker.parked is home:
                    if newest is None or ticket.seq > newest.seq:
                        newest = ticket
                    break
        return newest

    def earlier(self, expires_at: float) -> list[Waker]:
        """A lease now expires at ``expires_at``: the watchers whose alarm is later."""
        wakers = []
        for thread, alarm in self.alarms.items():
            if expires_at < alarm:
                self.alarms[thread] = expires_at
                watcher = self._threads[thread].watcher
                if watcher is not None and watcher.waker is not None:
                    wakers.append(watcher.waker)
        return wakers


def _running(token: Any) -> bool:
    """Whether the trio run of ``token`` (its `TrioToken`) has not ended."""
    try:
        token.run_sync_soon(lambda: None)
    except RuntimeError:  # trio.RunFinishedError
        return False
    return True


def _lease(record: LeaseRecord) -> Lease:
    return Lease(
        lease_id=record.lease_id,
        workload=record.workload,
        expires_at=record.expires_at,
        waited_for=record.waited_for,
    )


def _wake(wakers: list[Waker]) -> None:
    for waker in wakers:
        try:
            waker.wake()
        except Exception:  # one waiter's loop gone must not keep the others asleep
            _logger.debug("slotwise: could not wake a waiter", exc_info=True)
