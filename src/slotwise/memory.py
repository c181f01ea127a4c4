"""MemoryLimiter: one process's capacity, shared by every task of its event loop."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TypeVar, final, overload

import anyio

from ._base import BuiltinLimiter
from ._config import (
    DEFAULT_LEASE_TTL,
    Settings,
    Workload,
    build_settings,
    resolve_workload,
    wait_timeout,
)
from ._core.state import LimiterState, Ticket
from ._protocol import AcquireRequest, Lease, SupportsLease
from ._runtime.loop import checkpoint, new_waker, park, wake
from ._runtime.loop import now as current_time
from ._stats import LimiterStats

__all__ = ("MemoryLimiter",)

W = TypeVar("W", bound=str)


@final
class MemoryLimiter(BuiltinLimiter[W]):
    """A limiter whose slots live in this process.

    It can be built at module level, outside any event loop, and used from asyncio and trio.

    Args:
        name: Appears in events and errors.
        max_concurrent: Requests in flight at once, across every run.
        max_queued: Requests that may wait; the next one fails at once with
            ``ConcurrencyQueueFullError``. None: unbounded.
        lease_ttl: Seconds a slot stays valid without renewal; renewed automatically while
            held. A holder that stops renewing loses its slot to the next waiter.
        workloads: Named workloads sharing the capacity; default: one named ``"default"``.
        default_workload: The workload of requests that name none; default: ``"default"`` if
            it exists, or the only workload.

    Raises:
        ConcurrencyConfigError: a setting is invalid; the message names it.

    Example:
        >>> claude = MemoryLimiter(
        ...     name="claude",
        ...     max_concurrent=8,
        ...     workloads={
        ...         "interactive": Workload(reserved=2, priority=10, max_wait=60.0),
        ...         "background": Workload(max_concurrent=6, max_wait=300.0),
        ...     },
        ... )
        >>> claude
        <slotwise.MemoryLimiter 'claude' 0/8 active, 0 queued (interactive 0/8, background 0/6)>

    Typed workload names: annotate ``MemoryLimiter[Literal["interactive", "background"]]``
    (or key ``workloads`` by a ``StrEnum``) and ``slot(workload="typo")`` is a type error.
    """

    __slots__ = ("_state", "_watch_until", "_watcher")

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
    ) -> None: ...

    def __init__(
        self,
        *,
        name: str = "default",
        max_concurrent: int,
        max_queued: int | None = None,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        workloads: Mapping[W, Workload] | None = None,
        default_workload: str | None = None,
    ) -> None:
        self._settings: Settings = build_settings(
            name=name,
            max_concurrent=max_concurrent,
            max_queued=max_queued,
            lease_ttl=lease_ttl,
            workloads=workloads,
            default_workload=default_workload,
        )
        self._state = LimiterState(
            self._settings.rules,
            max_queued=self._settings.max_queued,
            lease_ttl=self._settings.lease_ttl,
        )
        # One waiter at a time watches the clock for leases that expire unrenewed, so a
        # dead holder's slot is handed on without a background task or a herd of timers.
        self._watcher: Ticket | None = None
        self._watch_until = math.inf  # when the sleeping watcher's alarm rings

    # -- the user's surface ---------------------------------------------------------------

    async def stats(self) -> LimiterStats:
        """Active and queued requests, in total and per workload."""
        await checkpoint()
        state = self._state
        self._wake(state.expire(current_time()))
        return self._stats(state.active, {name: len(q) for name, q in state.queues.items()})

    # -- the Limiter protocol -------------------------------------------------------------

    async def acquire(self, request: AcquireRequest) -> Lease:
        """Wait for a slot (see :class:`slotwise.Limiter`); safe to cancel at any point.

        Most code takes slots with :meth:`slot` instead, which runs the whole lifecycle.

        Args:
            request: The workload, the request's identity and its run's deadline.

        Returns:
            The lease; give it back with :meth:`release`.

        Raises:
            ConcurrencyConfigError: the workload is unknown, or missing with no default.
            ConcurrencyQueueFullError: ``max_queued`` requests are already waiting.
            ConcurrencyTimeoutError: no slot before ``max_wait`` or ``request.deadline``.
        """
        # One checkpoint, before anything is taken: a cancellation here leaves no trace, and
        # everything after it up to the grant or the enqueue is synchronous (atomic).
        await checkpoint()
        workload = resolve_workload(self._settings, request.workload)
        state = self._state
        now = current_time()
        ticket, swept = state.submit(workload, now)
        self._wake(swept)
        if ticket.lease is not None:
            self._granted(ticket)
            return self._lease(ticket)
        deadline = request.deadline if request.deadline is not None else math.inf
        max_wait = self._settings.workloads[workload].max_wait
        if max_wait is not None:
            deadline = min(deadline, now + max_wait)
        try:
            while ticket.lease is None and now < deadline:
                if self._watcher is None:
                    self._watcher = ticket
                wake_at = deadline
                if self._watcher is ticket:
                    wake_at = min(wake_at, state.next_expiry() or math.inf)
                    self._watch_until = wake_at
                ticket.waker = waker = new_waker()
                if wake_at == math.inf:
                    # Nothing to wake up for but a grant: no cancel scope, no timer.
                    await park(waker)
                else:
                    with anyio.CancelScope(deadline=wake_at):
                        await park(waker)
                if ticket.lease is None:
                    now = current_time()
                    self._wake(state.expire(now))
        except BaseException:
            # Cancelled while waiting, or as the slot was granted: give it back either way.
            self._leave(ticket)
            raise
        if ticket.lease is None:
            self._leave(ticket)
            raise wait_timeout(
                now - ticket.enqueued_at,
                max_wait,
                max_wait is not None
                and (request.deadline is None or ticket.enqueued_at + max_wait <= request.deadline),
            )
        self._leave_watch(ticket)
        return self._lease(ticket)

    async def renew(self, lease: SupportsLease) -> Lease | None:
        """Extend a lease by ``lease_ttl``; None when it is no longer held. Never waits."""
        return self.renew_nowait(lease)

    def renew_nowait(self, lease: SupportsLease) -> Lease | None:
        """:meth:`renew` without the ``await``; the slot lifecycle uses it when present."""
        record = self._state.renew(lease.lease_id, current_time())
        if record is None:
            return None
        return Lease(
            lease_id=record.lease_id, workload=record.workload, expires_at=record.expires_at
        )

    async def release(self, lease: SupportsLease) -> None:
        """Give a slot back to the next waiter. Idempotent; never waits."""
        self.release_nowait(lease)

    def release_nowait(self, lease: SupportsLease) -> None:
        """:meth:`release` without the ``await``; the slot lifecycle uses it when present."""
        self._wake(self._state.release(lease.lease_id, current_time()))

    # -- internals ------------------------------------------------------------------------

    @staticmethod
    def _lease(ticket: Ticket) -> Lease:
        record = ticket.lease
        assert record is not None
        return Lease(
            lease_id=record.lease_id, workload=record.workload, expires_at=record.expires_at
        )

    def _wake(self, granted: list[Ticket]) -> None:
        for ticket in granted:
            if ticket.waker is not None:
                wake(ticket.waker)
            self._granted(ticket)

    def _granted(self, ticket: Ticket) -> None:
        # A new lease may expire before the watcher's alarm (which is infinite when it fell
        # asleep with no lease at all): wake it so it re-arms for the earlier expiry.
        watcher = self._watcher
        if (
            watcher is not None
            and ticket.lease is not None
            and ticket.lease.expires_at < self._watch_until
            and watcher.waker is not None
        ):
            self._watch_until = ticket.lease.expires_at
            wake(watcher.waker)

    def _leave(self, ticket: Ticket) -> None:
        self._wake(self._state.withdraw(ticket, current_time()))
        self._leave_watch(ticket)

    def _leave_watch(self, ticket: Ticket) -> None:
        if self._watcher is not ticket:
            return
        self._watcher = None
        # Hand the clock to another waiter: wake it so it re-arms its timer as the watcher.
        for queue in self._state.queues.values():
            for other in queue.values():
                self._watcher = other
                if other.waker is not None:
                    wake(other.waker)
                return

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
