"""PostgresLimiter: one capacity shared by every process that uses the same limiter name.

This module holds its public face: the constructor and the settings, ``start()`` and
``aclose()``, ``slot()``, ``stats()``, ``set_limits()``, what held slots report
(``throttle()``, ``not_succeeded()``, ``observe_*()``, ``charge_tokens()``) and the Limiter
protocol (``acquire``, ``renew``, ``release``). It builds on `_coordinator.Coordinator` (the
poller and the listener of each process), which builds on `_transactions.Transactions` (what
runs in the database: the transactions and the allocation round); the statements are in
`_sql`, the tables in `_schema`."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import uuid
from collections.abc import Mapping
from datetime import datetime
from functools import partial
from types import TracebackType
from typing import Any, ClassVar, Literal, final, overload

import anyio
from anyio.lowlevel import checkpoint, checkpoint_if_cancelled
from psycopg_pool import AsyncConnectionPool

from .._config import (
    Adaptive,
    Rate,
    Settings,
    Workload,
    build_settings,
    resolve_workload,
    retry_after_seconds,
    seconds,
    wait_timeout,
)
from .._core.rates import Bank
from .._core.state import check_cost, pause
from .._errors import ConcurrencyConfigError, ConcurrencyLimiterError
from .._protocol import AcquireRequest, Lease, SupportsLease, W
from .._runtime.lifecycle import SlotContext
from .._stats import BucketStats, LimiterStats
from ..memory import UNCHANGED, Unchanged
from ._coordinator import Coordinator
from ._round import (
    Charge,
    Learned,
    Limit,
    Observed,
    Pushback,
    Release,
    Waiter,
    cost_of,
    unsucceeded,
)
from ._schema import channel_name
from ._sql import Queries
from ._stored import Pace, stored_limits
from ._transactions import MAX_SECONDS, Conn

__all__ = ("PostgresLimiter",)

# How long the limiter's own pool keeps trying to remake a lost connection (see _own_pool).
_RECONNECT = 2.0


@final
class PostgresLimiter(Coordinator[W]):
    """A limiter whose slots live in PostgreSQL, shared by every process using its name.

    Each allocation is one short transaction that holds the limiter's row lock and runs the
    same allocation rules as `slotwise.MemoryLimiter`; no connection is held while a
    request waits or while the body runs. Lease expiry and wait deadlines are on the
    database clock. In each process one poller per limiter does the database work of every
    local request: each of its rounds is one transaction that carries the releases, new
    requests and withdrawals of all the process's tasks since the last round, and grants
    every waiter, of any process, that the freed slots allow. `LISTEN`/`NOTIFY` wakes it
    when another process grants it a slot, so the database load grows with processes, not
    with waiters, and a busy process commits once per round, not once per request.

    asyncio only (psycopg's async API): under trio, `acquire` fails with
    `ConcurrencyConfigError`. A limiter belongs to the event loop that started it (its pool,
    poller and listener live there): another loop or thread gets `ConcurrencyConfigError`;
    give it a limiter object of its own with the same name, which shares the same slots. Once
    that loop has ended (`asyncio.run()` returned), the next one may use it.

    Every step that needs the database (a connection, the limiter's lock, a statement) is
    bounded by `db_timeout`: past it, the request fails closed. A waiting request keeps its
    deadline and its cancellation whatever the database does: the poller talks to the
    database, the request only waits for its answer.

    Args:
        conninfo: A libpq connection string (the limiter creates and closes its own pool),
            or a ``psycopg_pool.AsyncConnectionPool`` that stays the caller's.
        name: Every process that uses this name shares its slots.
        max_concurrent: Requests in flight at once, across every process.
        max_queued: Requests that may wait, across every process; None: unbounded.
        lease_ttl: Seconds a slot stays valid without renewal. A dead process's slots
            return after this long.
        workloads: Named workloads sharing the capacity; default: one named ``"default"``.
        default_workload: The workload of requests that name none.
        rate: The provider's requests and tokens per period (`slotwise.Rate`), one set of
            buckets for every process: their levels are stored with the limiter and refilled
            on the database clock.
        adaptive: An effective limit that follows the provider's pushback
            (`slotwise.Adaptive`), stored with the limiter: every process grants under it.
        poll_interval: Seconds between the allocation checks of a process that has waiting
            requests (notifications make most grants faster than this).
        queue_entry_ttl: Seconds after which a dead process's queue entries are dropped
            (they are no longer granted slots from about a second after it died).
        schema: The schema of the tables (quoted as an identifier).
        ensure_schema: Create the tables on first use; False when a migration applied
            `schema_sql()`.
        on_conflict: ``"error"``: limits that differ from those stored for this name raise
            ``ConcurrencyConfigError``; ``"replace"``: store these limits instead.
        listen: ``True``: a session connection (outside the pool) receives notifications;
            a string: the conninfo for that connection (say, the server itself when the pool
            goes through PgBouncer in transaction mode); ``False``: timed polling only.
            With ``True`` the pool's connections reach the server itself, and the
            statements of every allocation are prepared on them (planned once).
        synchronous_commit: ``True``: every allocation waits for its WAL flush, as
            PostgreSQL does by default. ``False`` (``SET LOCAL synchronous_commit = off``)
            makes allocations several times faster when the disk is slow, at a price: if
            the database server crashes, the grants, renewals and releases of its last
            moments (up to three ``wal_writer_delay``) are lost, so a slot granted just
            before the crash may be granted again until its holder's next renewal finds
            the lease gone and cancels its body.
        db_timeout: Seconds one database step may take: waiting for a pool connection, for
            the limiter's row lock, or for a statement. Past it the request fails closed
            with `ConcurrencyLimiterError` (a refused connection, a pool whose connections
            are all held, a process stalled while holding the lock).

    Raises:
        ConcurrencyConfigError: a setting is invalid; the message names it.

    Example:
        ```python
        claude = PostgresLimiter("postgresql://app@db/app", name="claude", max_concurrent=8)
        async with claude:  # or `await claude.aclose()` when done
            async with claude.slot():
                ...
        ```
    """

    # What code without an event loop (sync_slot(), a sync HTTP client) should do instead.
    _sync_advice: ClassVar[str] = (
        "A PostgresLimiter waits on the asyncio event loop that started it: take the slot in "
        "a coroutine with `async with limiter.slot()` (run by asyncio.run(), or from a worker "
        "thread of that loop by anyio.from_thread.run()); a thread that runs its own event "
        "loop needs its own PostgresLimiter with the same name, which shares the same slots"
    )

    # The state of the public face; the coordinator's and the transactions' is declared in
    # their classes (Coordinator, Transactions). __init__ sets it all.
    __slots__ = (
        "_closing",
        "_loop",
        "_owns_pool",
        "_pool_guard",
        "_start_lock",
        "_started",
        "_unsucceeded",
        "ensure_schema",
    )

    @overload
    def __init__(
        self: PostgresLimiter[str],
        conninfo: str | AsyncConnectionPool[Any],
        *,
        name: str = ...,
        max_concurrent: int,
        max_queued: int | None = ...,
        lease_ttl: float = ...,
        workloads: None = ...,
        default_workload: str | None = ...,
        rate: Rate | None = ...,
        adaptive: Adaptive | None = ...,
        poll_interval: float = ...,
        queue_entry_ttl: float = ...,
        schema: str = ...,
        ensure_schema: bool = ...,
        on_conflict: Literal["error", "replace"] = ...,
        listen: bool | str = ...,
        synchronous_commit: bool = ...,
        db_timeout: float = ...,
    ) -> None: ...

    @overload
    def __init__(
        self,
        conninfo: str | AsyncConnectionPool[Any],
        *,
        name: str = ...,
        max_concurrent: int,
        max_queued: int | None = ...,
        lease_ttl: float = ...,
        workloads: Mapping[W, Workload],
        default_workload: W | None = ...,
        rate: Rate | None = ...,
        adaptive: Adaptive | None = ...,
        poll_interval: float = ...,
        queue_entry_ttl: float = ...,
        schema: str = ...,
        ensure_schema: bool = ...,
        on_conflict: Literal["error", "replace"] = ...,
        listen: bool | str = ...,
        synchronous_commit: bool = ...,
        db_timeout: float = ...,
    ) -> None: ...

    def __init__(
        self,
        conninfo: str | AsyncConnectionPool[Any],
        *,
        name: str = "default",
        max_concurrent: int,
        max_queued: int | None = None,
        lease_ttl: float = 30.0,
        workloads: Mapping[W, Workload] | None = None,
        default_workload: str | None = None,
        rate: Rate | None = None,
        adaptive: Adaptive | None = None,
        poll_interval: float = 0.1,
        queue_entry_ttl: float = 15.0,
        schema: str = "slotwise",
        ensure_schema: bool = True,
        on_conflict: Literal["error", "replace"] = "error",
        listen: bool | str = True,
        synchronous_commit: bool = True,
        db_timeout: float = 5.0,
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
        seconds("poll_interval", poll_interval, finite=True)
        seconds("queue_entry_ttl", queue_entry_ttl, finite=True)
        seconds("db_timeout", db_timeout, finite=True)
        for setting, value in (("lease_ttl", lease_ttl), ("queue_entry_ttl", queue_entry_ttl)):
            if value > MAX_SECONDS:
                raise ConcurrencyConfigError(
                    f"{setting} must be at most {MAX_SECONDS:g} seconds (about 31 years; the "
                    f"database's timestamps overflow beyond), got {value!r}"
                )
        if not isinstance(schema, str) or not schema:
            raise ConcurrencyConfigError(f"schema must be a non-empty string, got {schema!r}")
        if on_conflict not in ("error", "replace"):
            raise ConcurrencyConfigError(
                f"on_conflict must be 'error' or 'replace', got {on_conflict!r}"
            )
        if isinstance(conninfo, str):
            self._pool: AsyncConnectionPool[Any] = _own_pool(conninfo)
            self._owns_pool = True
        elif isinstance(conninfo, AsyncConnectionPool):
            self._pool = conninfo
            self._owns_pool = False
        else:
            raise ConcurrencyConfigError(
                "the first argument must be a conninfo string or a "
                f"psycopg_pool.AsyncConnectionPool, got {conninfo!r}"
            )
        self.poll_interval = float(poll_interval)
        self._queue_entry_ttl = float(queue_entry_ttl)
        self.schema = schema
        self.ensure_schema = bool(ensure_schema)
        self.on_conflict = on_conflict
        self._listen = listen
        # The statements of every round are prepared (planned once per connection) when
        # the pool's connections reach the server itself, as ``listen=True`` says they do
        # (notifications do not pass PgBouncer in transaction mode, and neither do
        # prepared statements before PgBouncer 1.21).
        self._prepare = listen is True
        self.synchronous_commit = bool(synchronous_commit)
        self.db_timeout = float(db_timeout)
        self._settings_json = json.dumps(stored_limits(self._settings), sort_keys=True)
        self._channel = channel_name(schema)
        self._owner = str(uuid.uuid4())
        self._q = Queries(schema)
        self._started = False
        self._start_lock: asyncio.Lock | None = None
        self._closing: anyio.Event | None = None  # set when an aclose() under way ends
        self._waiters: dict[str, Waiter] = {}  # local requests waiting, by queue entry
        self._pending: dict[str, Waiter] = {}  # those not yet enqueued, in arrival order
        # Entries of requests that ended without their lease, with when: the poller drops
        # them, and gives back any slot granted to them.
        self._abandoned: dict[str, float] = {}
        # Releases for the poller's next round, and those its round under way sends, by
        # lease id (a second release of the same lease waits for the first).
        self._releases: dict[str, Release] = {}
        self._unsucceeded: set[str] = set()  # not_succeeded() leases not yet released
        self._sending: dict[str, Release] = {}
        self._tasks: set[asyncio.Task[Any]] = set()  # transactions running (see _run)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that started it
        self._pool_guard: asyncio.Task[None] | None = None  # see _close_at_loop_end
        self._poller: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._listening: Conn | None = None  # the listener's connection, while it has one
        self._kick: anyio.Event | None = None
        self._rounds: anyio.Event | None = None  # set after each round of the poller
        self._beat_at = -math.inf
        self._alive_at = -math.inf  # when the poller last said in the database that it waits
        # The database clock minus this loop's clock, as last measured (an upper bound, so
        # a lease's expiry converted with it is never later than the truth).
        self._offset: float | None = None
        # The limits given here; those in force may have been changed by set_limits(), in
        # this process or another: limits_version in the limiter's row says which.
        self._base = self._settings
        self._version = 0
        # Pushback, token corrections and the provider's remaining counts, learned by sync
        # calls of held slots and stored by this process's next transaction.
        self._learned: list[Learned] = []
        self._applying: anyio.Event | None = None  # set when that transaction ended
        self._flusher: asyncio.Task[None] | None = None
        self._flush_kick: anyio.Event | None = None
        # When time alone (a refill, the end of a pause) can grant something (anyio clock).
        self._wake_at = math.inf
        # The pause and backoff count last seen (database clock), for throttle()'s answer.
        self._paused_until = -math.inf
        self._backoffs = 0

    # -- settings -------------------------------------------------------------------------

    @property
    def queue_entry_ttl(self) -> float:
        """Seconds a queue entry lives once its process stops refreshing it."""
        return self._queue_entry_ttl

    @property
    def pool(self) -> AsyncConnectionPool[Any]:
        """The connection pool the limiter uses."""
        return self._pool

    async def __aenter__(self) -> PostgresLimiter[W]:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _check_loop(self) -> None:
        """Refuse a second event loop: the pool, the poller and the listener belong to the
        loop that started the limiter (a request on another would never be woken)."""
        _require_asyncio()
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop is loop:
            return
        if self._loop.is_closed():
            self._forget_loop()  # that loop has ended (asyncio.run() returned): start anew
            return
        raise ConcurrencyConfigError(
            f"PostgresLimiter {self.name!r} is in use on another event loop (the one that "
            "started it, where its connections, poller and listener live), so it cannot serve "
            "this one. Give each event loop or thread its own PostgresLimiter with the same "
            "name and limits (they share one capacity through the database), or run this code "
            "on the limiter's loop (asyncio.run_coroutine_threadsafe)"
        )

    def _forget_loop(self) -> None:
        """Drop what lived on an event loop that has ended (its tasks ended with it)."""
        self._started = False
        self._loop = self._start_lock = None
        self._poller = self._listener = self._flusher = self._pool_guard = None
        self._kick = self._rounds = self._flush_kick = self._applying = None
        self._listening = None
        self._wake_at = math.inf
        self._waiters.clear()
        self._pending.clear()
        self._abandoned.clear()
        self._releases.clear()
        self._unsucceeded.clear()
        self._sending.clear()
        self._tasks.clear()
        self._owner = str(uuid.uuid4())  # what the old loop left behind is a dead process's
        self._alive_at = -math.inf
        if self._owns_pool:
            self._pool = _own_pool(self._pool.conninfo)  # type: ignore[arg-type]

    async def start(self) -> None:
        """Open the pool, create the schema if asked, and check or store the limits.

        Done on first use anyway; call it (or ``async with limiter``) to fail early.

        Raises:
            ConcurrencyConfigError: the limits differ from those stored for this name, the
                event loop is not asyncio, or the limiter is in use on another event loop.
        """
        self._check_loop()
        while self._closing is not None:
            # aclose() under way: start again once it is done, with a pool of its own.
            await self._closing.wait()
        if self._started:
            await checkpoint()
            return
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
            self._loop = asyncio.get_running_loop()
        async with self._start_lock:
            if self._started:
                return
            if self._owns_pool:
                if self._pool.closed:  # closed by aclose() or a failed start: a new one
                    self._pool = _own_pool(self._pool.conninfo)  # type: ignore[arg-type]
                await self._pool.open()
            try:
                await self._run(
                    self._create_schema if self.ensure_schema else self._check_schema, ddl=True
                )
                await self._run(self._register)
            except BaseException:
                if self._owns_pool:  # a limiter that failed to start holds no connections
                    with anyio.CancelScope(shield=True):
                        await self._pool.close()
                raise
            self._started = True
            if self._owns_pool:
                guard = _close_at_loop_end(self._pool, 3 * self.db_timeout)
                self._pool_guard = asyncio.get_running_loop().create_task(guard)

    async def aclose(self) -> None:
        """Stop the poller and the listener, and close the pool if the limiter made it."""
        self._check_loop()
        if self._loop is None:  # never started, or its event loop ended: nothing runs
            return
        if self._closing is not None:
            await self._closing.wait()
            return
        closing = self._closing = anyio.Event()
        try:
            await self._close()
        finally:
            self._closing = None
            closing.set()

    async def _close(self) -> None:
        started, self._started = self._started, False  # requests ending now start nothing
        for task in (self._poller, self._listener, self._flusher):
            if task is not None:
                task.cancel()
        for task in (self._poller, self._listener, self._flusher):
            if task is not None:
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(task, return_exceptions=True)
        self._poller = self._listener = self._flusher = None
        self._flush_kick = None
        # The entries of the requests failed here, and of those that ended lately, go now
        # (not when they go stale), with any slot granted to them.
        withdraw = [*self._abandoned, *(e for e in self._waiters if e not in self._pending)]
        for waiter in self._waiters.values():
            waiter.error = ConcurrencyLimiterError("the limiter was closed")
            waiter.event.set()
        self._waiters.clear()
        self._pending.clear()
        self._abandoned.clear()
        # Releases the poller had not sent, or whose round it was stopped in (a release is
        # idempotent: sent again, it changes nothing if that round committed).
        releases, self._releases = self._releases, {}
        error: BaseException | None = ConcurrencyLimiterError("the limiter was closed")
        try:
            with anyio.CancelScope(shield=True), anyio.move_on_after(3 * self.db_timeout):
                while self._tasks:  # transactions under way end before the withdrawal
                    await asyncio.wait(set(self._tasks))
                if (withdraw or releases) and started:
                    try:  # else the entries go stale, and the leases expire
                        await self._run(
                            partial(
                                self._cycle,
                                withdraw=withdraw,
                                release=list(releases),
                                failed=unsucceeded(releases),
                            )
                        )
                        error = None
                    except Exception as exc:
                        error = exc
                while self._tasks:  # and before their pool closes
                    await asyncio.wait(set(self._tasks))
        finally:
            for done in releases.values():
                done.error = error
                done.event.set()
        if self._owns_pool:
            with anyio.CancelScope(shield=True):
                await self._pool.close()
        guard, self._pool_guard = self._pool_guard, None
        if guard is not None:
            guard.cancel()  # the pool it guards is closed: it ends at once
            with anyio.CancelScope(shield=True):
                await asyncio.gather(guard, return_exceptions=True)
        self._loop = self._start_lock = None
        # A new identity for the next start: anything of this one left behind is a dead
        # process's, passed over at once.
        self._owner = str(uuid.uuid4())
        self._alive_at = -math.inf

    def slot(
        self, workload: W | None = None, *, tokens: int | None = None, allow_nested: bool = False
    ) -> SlotContext[W]:
        """`async with limiter.slot(workload=...)`: `slotwise.slot()` with this limiter."""
        return SlotContext(workload, self, allow_nested, tokens)

    async def stats(self) -> LimiterStats:
        """Active and queued requests across every process, in total and per workload, and
        the rate buckets, the pause and the limit in force, which every process shares.

        Requests of this process that ended are out of the queue first (when the database
        answers within `db_timeout`): the figures include what this process did.
        """
        await self.start()
        with anyio.move_on_after(self.db_timeout):
            while self._abandoned and self._rounds is not None:
                await self._rounds.wait()
        if self._learned or self._applying is not None:
            # What this process learned from the provider counts already.
            cycle = await self._run_cycle()
            self._deliver(cycle.granted)
        rows, state = await self._run(self._stats_rows)
        active: dict[str, int] = {}
        queued: dict[str, int] = {}
        for kind, workload, count in rows:
            (active if kind == "active" else queued)[workload] = count
        buckets, paused, backoffs, adaptive, version, limits, now = state
        if version != self._version:
            self._adopt(self._settings_from(limits), version)
        settings = self._settings
        pace = Pace.load(settings, buckets, paused, backoffs, adaptive)
        pace.bank.refill(now)
        return self._stats(
            active,
            queued,
            effective=pace.limit(settings),
            paused_until=pace.paused_until if pace.paused_until > now else None,
            buckets={
                key: BucketStats(level=b.level, capacity=int(b.capacity), per=b.rule.per)
                for key, b in pace.bank.buckets.items()
            },
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
        """Change the limits of every process using this name, validated as the
        constructor validates them; what is not given stays as it is in force.

        The new limits are stored with the limiter in one transaction, which applies them
        to the requests waiting now; every other process grants under them from its next
        allocation. Held slots are never revoked: with a smaller limit, new grants wait
        until fewer are active. Requests waiting for a workload that is gone fail with
        `ConcurrencyConfigError`, in every process (slots held in it count until they are
        released), and so do waiting requests whose token estimate a smaller bucket can
        never hold (the error names the bucket). `default_workload` is this process's own.
        Emits `limit-changed` when the limit in force changes. A worker started later with
        the limits it was deployed with takes these (a worker deployed with other limits
        still fails, see `on_conflict`; `on_conflict="replace"` stores its limits over
        these).

        Raises:
            ConcurrencyConfigError: a setting is invalid; nothing changed.
        """
        await self.start()

        def change(current: Settings) -> Settings:
            return build_settings(
                name=current.name,
                max_concurrent=current.max_concurrent if max_concurrent is None else max_concurrent,
                max_queued=current.max_queued if isinstance(max_queued, Unchanged) else max_queued,
                lease_ttl=current.lease_ttl,
                workloads=current.workloads if workloads is None else workloads,
                default_workload=current.default_workload
                if isinstance(default_workload, Unchanged)
                else default_workload,
                rate=current.rate if isinstance(rate, Unchanged) else rate,
                adaptive=current.adaptive if isinstance(adaptive, Unchanged) else adaptive,
            )

        change(self._settings)  # invalid settings fail before anything is stored
        cycle = await self._run_cycle(change=change)
        self._deliver(cycle.granted)

    def throttle(
        self, lease: SupportsLease | None, retry_after: float | None = None
    ) -> tuple[float, tuple[int, int] | None]:
        """The provider refused a request (429, 529, 503): pause new grants of every
        process until `retry_after` seconds from now (a doubling, jittered backoff from
        one second when None, counted across processes), and lower an adaptive limit.
        Held slots are untouched; waiting requests keep their places, and their
        `max_wait` and budgets keep running.

        Most code calls `Slot.throttled()` (or lets `slotwise.httpx` do it). The pause is
        stored by this process's next transaction: at once in a task of its own, or by the
        release of the refused request's slot if that comes first, so the slot it frees is
        never granted during the pause. An adaptive limit's change is reported by that
        transaction's `limit-changed` event.

        Returns:
            When the pause ends as this process sees it (seconds since the epoch; the one
            stored is computed on the database clock), and None: the limit's change is not
            known until the pause is stored.

        Raises:
            ValueError: `retry_after` is negative, not finite or not a number.
        """
        retry_after = retry_after_seconds(retry_after)
        jitter = random.uniform(0.75, 1.25)
        lease_id = None if lease is None or not _is_uuid(lease.lease_id) else lease.lease_id
        self._push(Pushback(lease_id=lease_id, retry_after=retry_after, jitter=jitter), True)
        self._paused_until, self._backoffs = pause(
            self._paused_until, self._backoffs, retry_after, time.time(), jitter
        )
        return self._paused_until, None

    def not_succeeded(self, lease: SupportsLease) -> None:
        """The request held by `lease` was cancelled or failed: its release is no success,
        so an adaptive limit does not climb on it and a backoff does not start again from
        a second. The slot lifecycle calls it just before releasing a slot whose body did
        not complete."""
        if _is_uuid(lease.lease_id):
            self._unsucceeded.add(lease.lease_id)

    def observe_remaining(self, lease: SupportsLease, kind: str, remaining: int) -> None:
        """The provider says `remaining` requests or tokens (`kind`) are left of its
        limit: the limiter's bucket of that kind, shared by every process, holds no more
        than that (it is lowered, never raised). Stored by this process's next transaction,
        within `poll_interval`. `Slot.provider_remaining()` calls it."""
        if kind in self._settings.rules.buckets:
            self._push(Observed(kind=kind, remaining=remaining), False)

    def observe_limit(self, lease: SupportsLease, kind: str, limit: int) -> None:
        """The provider says its limit of `kind` (requests or tokens) is `limit` a minute:
        the limiter's bucket of that kind, shared by every process, holds and refills no more
        than that, nor than its configured rate, until the provider says otherwise or an hour
        passes without it saying (stored with the buckets, on the database clock). Stored by
        this process's next transaction, within `poll_interval`. `Slot.provider_limits()`
        calls it."""
        if kind in self._settings.rules.buckets:
            self._push(Limit(kind=kind, limit=limit), False)

    def charge_tokens(self, lease: SupportsLease, tokens: int) -> None:
        """Charge `tokens` more to the token buckets of `lease`'s workload and of the limiter
        (a refund when negative): `Slot.used_tokens()` corrects an estimate with it. Stored
        by this process's next transaction (the slot's release, or within
        `poll_interval`)."""
        if any(rule.kind == "tokens" for rule in self._settings.rules.buckets.values()):
            self._push(Charge(workload=lease.workload, units=tokens), False)

    # -- the Limiter protocol -------------------------------------------------------------

    async def acquire(self, request: AcquireRequest[W]) -> Lease:
        """Wait for a slot (see `slotwise.Limiter`); safe to cancel at any point.

        The request joins this process's queue at once (requests made together enter the
        database in the order of the calls); the poller enqueues it, and hands it its lease.
        Its deadline and a cancellation end the wait at once, whatever the database does; its
        queue entry, and a slot granted to it meanwhile, then go back in the poller's next
        cycle.

        Raises:
            ConcurrencyTimeoutError: no slot before the deadline or ``max_wait``.
            ConcurrencyQueueFullError: ``max_queued`` requests were already waiting (the
                limiter's, or its workload's).
            ConcurrencyConfigError: unknown workload, limits changed, not asyncio, the
                limiter is in use on another event loop, or a token estimate that one of its
                rate buckets can never hold.
            psycopg.Error: the database failed (the runtime reports it as
                ``ConcurrencyLimiterError``).
        """
        await checkpoint_if_cancelled()
        workload = resolve_workload(self._settings, request.workload)
        self._check_loop()
        tokens = request.tokens
        if tokens and self._settings.rules.buckets:
            check_cost(Bank(self._settings.rules.buckets, 0.0), workload, cost_of(tokens))
        started = anyio.current_time()
        end = math.inf if request.deadline is None else request.deadline
        max_wait = self._settings.workloads[workload].max_wait
        if max_wait is not None:
            end = min(end, started + max_wait)
        waiter = self._enter(workload, request.request_id, max(end - started, 0.0), tokens=tokens)
        try:
            await self.start()
            while True:
                self._wake_poller()
                if waiter.wait > 0:
                    with anyio.move_on_after(end - anyio.current_time()):
                        await waiter.event.wait()
                else:  # no time to wait: one allocation says whether a slot is free now
                    await waiter.event.wait()
                if waiter.error is not None:
                    raise waiter.error
                lease = waiter.lease
                if lease is None:
                    raise wait_timeout(
                        anyio.current_time() - started,
                        max_wait,
                        max_wait is not None
                        and (request.deadline is None or started + max_wait <= request.deadline),
                    )
                if self._offset is None or lease.expires_at - self._offset > anyio.current_time():
                    return lease
                # The lease ran out before this request resumed (its event loop stalled), and
                # its slot may have gone to another: never enter on it. The request waits
                # again, in the place it had in the queue.
                self._abandoned[waiter.entry_id] = anyio.current_time()
                waiter = self._enter(
                    workload,
                    request.request_id,
                    max(end - anyio.current_time(), 0.0),
                    since=waiter.since,
                    tokens=tokens,
                )
        except BaseException:
            self._abandon(waiter)
            raise

    def _enter(
        self,
        workload: str,
        request_id: str,
        wait: float,
        since: datetime | None = None,
        tokens: int = 0,
    ) -> Waiter:
        """Queue a request in this process, in call order (nothing awaits before this)."""
        waiter = Waiter(workload, request_id, wait, since, tokens)
        self._waiters[waiter.entry_id] = waiter
        self._pending[waiter.entry_id] = waiter
        return waiter

    def _abandon(self, waiter: Waiter) -> None:
        """A request ended without taking its lease: leave the queue, and give back a slot
        granted to it, in the poller's next cycle (woken now)."""
        self._waiters.pop(waiter.entry_id, None)
        if self._pending.pop(waiter.entry_id, None) is not None or waiter.refused:
            return  # it never reached the database, or its entry is already gone
        if not self._started:
            return  # closed: the entry goes stale, a slot granted to it expires
        self._abandoned[waiter.entry_id] = anyio.current_time()
        self._wake_poller()

    async def renew(self, lease: SupportsLease) -> Lease | None:
        """Extend a lease by ``lease_ttl`` on the database clock; None when it is gone."""
        await self.start()
        if not _is_uuid(lease.lease_id):
            return None
        row = await self._run(partial(self._renew, lease_id=lease.lease_id))
        if row is None:
            return None
        return Lease(lease_id=lease.lease_id, workload=row[0], expires_at=float(row[1]))

    async def release(self, lease: SupportsLease) -> None:
        """Give a slot back and grant what it frees to the waiters. Idempotent.

        Returns once the poller's round that carries it has committed (releases made
        together share one transaction). Works whatever limits are stored now: a lease
        taken under limits that another process replaced is released all the same.
        """
        if not self._started:
            await self.start()
        self._check_loop()
        if not _is_uuid(lease.lease_id):
            await checkpoint()
            return
        # The poller's next round sends it, with the other releases, requests and
        # withdrawals of this process (one transaction for them all), and hands what it
        # frees to the waiters of every process. aclose() sends it if the poller has not.
        lease_id = lease.lease_id
        done = self._releases.get(lease_id) or self._sending.get(lease_id)
        if done is None:
            succeeded = lease_id not in self._unsucceeded
            self._unsucceeded.discard(lease_id)
            done = self._releases[lease_id] = Release(succeeded=succeeded)
        self._wake_poller()
        while True:
            with anyio.move_on_after(self.poll_interval):
                await done.event.wait()
            if done.event.is_set():
                break
            # A poller that ended of anything but aclose() (which sends the releases left)
            # put this release back: a new one sends it.
            if self._started:
                self._ensure_poller()
        if done.error is not None:
            raise done.error

    def __repr__(self) -> str:
        rules = self._settings.rules
        parts = ", ".join(
            f"{name} ≤{rule.ceiling}" + (f" reserved {rule.reserved}" if rule.reserved else "")
            for name, rule in rules.workloads.items()
        )
        return (
            f"<slotwise.postgres.PostgresLimiter {self.name!r} schema={self.schema!r} "
            f"max_concurrent={rules.max_concurrent} ({parts}), "
            f"{len(self._waiters)} waiting here>"
        )


def _own_pool(conninfo: str) -> AsyncConnectionPool[Any]:
    # A connection that cannot be remade is given up after a few seconds (psycopg_pool's
    # default is 5 minutes of growing back-off): the next request then connects at once, so
    # the limiter serves again as soon as the database is back.
    return AsyncConnectionPool(
        conninfo,
        min_size=1,
        max_size=4,
        open=False,
        kwargs={"autocommit": True},
        reconnect_timeout=_RECONNECT,
    )


async def _close_at_loop_end(pool: AsyncConnectionPool[Any], patience: float) -> None:
    """Close the limiter's own pool if its event loop ends with the pool open.

    ``asyncio.run()`` returning without `aclose()` cancels every task left, the pool's
    workers among them; a psycopg_pool worker cancelled while it opens a connection (the
    pool growing) swallows the cancellation and waits for its next job forever, and
    ``asyncio.run()`` never returns. Cancelled with them, this task closes the pool, which
    stops every worker: once the other tasks have ended (the slots that the cancelled tasks
    held are released through the pool) or ``patience`` seconds have passed.
    """
    try:
        await asyncio.get_running_loop().create_future()  # as long as the loop runs
    except asyncio.CancelledError:
        if not pool.closed:  # else aclose() closed it, then cancelled this task
            # The tasks cancelled with this one, which asyncio.run() waits for (not those
            # that they started since), but psycopg_pool's and the other limiters' guards.
            me = asyncio.current_task()
            others = {
                task
                for task in asyncio.all_tasks()
                if task is not me and task.cancelling() and not _pool_keeping(task)
            }
            if others:
                await asyncio.wait(others, timeout=patience)
            if not pool.closed:
                await pool.close()
        raise


def _pool_keeping(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` keeps a pool rather than uses one: psycopg_pool's own (a worker, its
    scheduler), or the guard of another limiter's pool, which in turn waits for this one's
    users (each would wait out its patience for the other)."""
    coro = task.get_coro()
    if getattr(coro, "cr_code", None) is _close_at_loop_end.__code__:
        return True
    frame = getattr(coro, "cr_frame", None)
    return frame is not None and str(frame.f_globals.get("__name__", "")).startswith(
        "psycopg_pool."
    )


def _require_asyncio() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise ConcurrencyConfigError(
            "PostgresLimiter runs on asyncio only (psycopg's async API is asyncio-only); "
            "this code is not running in an asyncio event loop (trio?)"
        ) from None


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except (ValueError, TypeError, AttributeError):
        return False
    return True
