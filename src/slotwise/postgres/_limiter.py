"""PostgresLimiter: one capacity shared by every process that uses the same limiter name."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from types import TracebackType
from typing import Any, Literal, TypeVar, final, overload

import anyio
import attrs
import psycopg
from anyio.lowlevel import checkpoint, checkpoint_if_cancelled
from psycopg import sql
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool

from .._base import BuiltinLimiter
from .._config import (
    Adaptive,
    Rate,
    Settings,
    Workload,
    build_settings,
    resolve_workload,
    seconds,
    wait_timeout,
)
from .._core.adaptive import Aimd
from .._core.rates import Bank
from .._core.rules import Rules
from .._core.state import (
    allocate_paced,
    carry_over,
    check_cost,
    paced_wake,
    pause,
    readapt,
    retire,
)
from .._errors import (
    ConcurrencyConfigError,
    ConcurrencyLimiterError,
    ConcurrencyQueueFullError,
)
from .._protocol import AcquireRequest, Lease, SupportsLease, W
from .._runtime.lifecycle import SlotContext
from .._stats import BucketStats, LimiterStats
from ..memory import UNCHANGED, Unchanged
from ._schema import NEWEST_COLUMN, channel_name, schema_ddl

__all__ = ("PostgresLimiter",)

T = TypeVar("T")
Conn = psycopg.AsyncConnection[TupleRow]

_logger = logging.getLogger("slotwise")


@attrs.frozen(kw_only=True)
class _Entry:
    """A queued request as the allocation sees it."""

    entry_id: str
    workload: str
    key: tuple[int, int]  # (enqueued_at in microseconds, seq): who has waited longest
    owner: str  # the process (limiter object) that waits for it
    tokens: int = 0  # its token estimate
    waited_for: tuple[str, ...] = ()  # the buckets it has had to wait for so far


def _key(entry: _Entry) -> tuple[int, int]:
    return entry.key


def _cost(entry: _Entry) -> Mapping[str, int]:
    return {"requests": 1, "tokens": entry.tokens} if entry.tokens else {"requests": 1}


def _enqueued_at(entry: _Entry) -> float:
    return entry.key[0] / 1e6


@attrs.frozen(kw_only=True)
class _Cycle:
    """What one allocation transaction found and did."""

    granted: dict[str, Lease]  # this process's entries that hold a lease now
    present: frozenset[str]  # this process's asked-about entries still queued
    queued: int  # live entries, ours included
    full: str | None  # why the request enqueued by this cycle was refused (max_queued)
    settings: tuple[Settings, int] | None = None  # the limits in force, when they changed
    changes: tuple[tuple[int, int, str], ...] = ()  # (old, new, reason) of the limit in force
    wake: float | None = None  # seconds until time alone can grant something
    paused_until: float = -math.inf  # database clock, seconds since the epoch
    backoffs: int = 0


# What a process learns from the provider between two of its transactions (the sync calls
# of a held slot), stored by the next one.
@attrs.frozen(kw_only=True)
class _Pushback:
    lease_id: str | None
    retry_after: float | None
    jitter: float


@attrs.frozen(kw_only=True)
class _Charge:
    workload: str
    units: int


@attrs.frozen(kw_only=True)
class _Observed:
    kind: str
    remaining: int


_Pending = _Pushback | _Charge | _Observed


@attrs.define(kw_only=True, eq=False)
class _Pace:
    """The rates and pushback state stored with a limiter's row, loaded for one
    transaction: the values that MemoryLimiter keeps in memory, changed by the same rules
    (slotwise._core.state), on the database clock."""

    bank: Bank
    paused_until: float
    backoffs: int
    aimd: Aimd | None
    dirty: bool = False  # changed: to be stored

    @classmethod
    def load(
        cls,
        settings: Settings,
        buckets: Mapping[str, Any] | None,
        paused_until: float | None,
        backoffs: int | None,
        adaptive: Mapping[str, Any] | None,
    ) -> _Pace:
        # Buckets not stored yet are full, as if they had been refilling forever.
        bank = Bank(settings.rules.buckets, -math.inf)
        for key, (level, updated) in (buckets or {}).items():
            bucket = bank.buckets.get(key)
            if bucket is not None:
                bucket.level = min(float(level), float(bucket.rule.capacity))
                bucket.updated = float(updated)
        aimd = None
        if settings.adaptive is not None:
            floor, ceiling = settings.adaptive.min_concurrent, settings.max_concurrent
            stored = adaptive or {}
            aimd = Aimd(
                floor=floor,
                ceiling=ceiling,
                backoff=settings.adaptive.backoff,
                limit=min(max(int(stored.get("limit", ceiling)), floor), ceiling),
                epoch=int(stored.get("epoch", 0)),
                credit=float(stored.get("credit", 0.0)),
            )
        return cls(
            bank=bank,
            paused_until=-math.inf if paused_until is None else float(paused_until),
            backoffs=int(backoffs or 0),
            aimd=aimd,
        )

    def limit(self, settings: Settings) -> int:
        """The limit in force."""
        return settings.max_concurrent if self.aimd is None else self.aimd.limit

    def rules(self, settings: Settings) -> Rules:
        if self.aimd is None:
            return settings.rules
        return attrs.evolve(settings.rules, max_concurrent=self.aimd.limit)

    def params(self) -> dict[str, Any]:
        return {
            "buckets": json.dumps(
                {
                    key: [bucket.level, bucket.updated]
                    for key, bucket in self.bank.buckets.items()
                    if math.isfinite(bucket.updated)
                }
            ),
            "paused_until": None if self.paused_until == -math.inf else self.paused_until,
            "backoffs": self.backoffs,
            "adaptive": None
            if self.aimd is None
            else json.dumps(
                {"limit": self.aimd.limit, "epoch": self.aimd.epoch, "credit": self.aimd.credit}
            ),
        }


@final
class _Waiter:
    __slots__ = ("entry_id", "error", "event", "lease", "queued", "workload")

    def __init__(self, entry_id: str, workload: str) -> None:
        self.entry_id = entry_id
        self.workload = workload
        self.queued = False  # its queue entry is committed
        self.event = anyio.Event()
        self.lease: Lease | None = None
        self.error: BaseException | None = None


@final
class PostgresLimiter(BuiltinLimiter[W]):
    """A limiter whose slots live in PostgreSQL, shared by every process using its name.

    Each allocation is one short transaction that holds the limiter's row lock and runs the
    same allocation rules as `slotwise.MemoryLimiter`; no connection is held while a
    request waits or while the body runs. Lease expiry and wait deadlines are on the
    database clock. In each process one poller per limiter serves every local waiter, and
    `LISTEN`/`NOTIFY` wakes it when another process grants it a slot, so the database
    load grows with processes, not with waiters.

    asyncio only (psycopg's async API): under trio, `acquire` fails with
    `ConcurrencyConfigError`.

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
        queue_entry_ttl: Seconds after which a dead process's queue entries are dropped.
        schema: The schema of the tables (quoted as an identifier).
        ensure_schema: Create the tables on first use; False when a migration applied
            `schema_sql()`.
        on_conflict: ``"error"``: limits that differ from those stored for this name raise
            ``ConcurrencyConfigError``; ``"replace"``: store these limits instead.
        listen: ``True``: a session connection (outside the pool) receives notifications;
            a string: the conninfo for that connection (say, the server itself when the pool
            goes through PgBouncer in transaction mode); ``False``: timed polling only.
        synchronous_commit: ``True``: every allocation waits for its WAL flush, as
            PostgreSQL does by default. ``False`` (``SET LOCAL synchronous_commit = off``)
            makes allocations several times faster when the disk is slow, at a price: if
            the database server crashes, the grants, renewals and releases of its last
            moments (up to three ``wal_writer_delay``) are lost, so a slot granted just
            before the crash may be granted again until its holder's next renewal finds
            the lease gone and cancels its body.

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

    __slots__ = (
        "_applying",
        "_backoffs",
        "_base",
        "_beat_at",
        "_channel",
        "_flush_kick",
        "_flusher",
        "_kick",
        "_listen",
        "_listener",
        "_owner",
        "_owns_pool",
        "_paused_until",
        "_pending",
        "_poller",
        "_pool",
        "_q",
        "_queue_entry_ttl",
        "_settings_json",
        "_start_lock",
        "_started",
        "_version",
        "_waiters",
        "_wake_at",
        "ensure_schema",
        "on_conflict",
        "poll_interval",
        "schema",
        "synchronous_commit",
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
        self.synchronous_commit = bool(synchronous_commit)
        self._settings_json = json.dumps(_stored_limits(self._settings), sort_keys=True)
        self._channel = channel_name(schema)
        self._owner = str(uuid.uuid4())
        self._q = _Queries(schema)
        self._started = False
        self._start_lock: asyncio.Lock | None = None
        self._waiters: dict[str, _Waiter] = {}
        self._poller: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._kick: anyio.Event | None = None
        self._beat_at = -math.inf
        # The limits given here; those in force may have been changed by set_limits(), in
        # this process or another: limits_version in the limiter's row says which.
        self._base = self._settings
        self._version = 0
        # Pushback, token corrections and the provider's remaining counts, learned by sync
        # calls of held slots and stored by this process's next transaction.
        self._pending: list[_Pending] = []
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

    async def start(self) -> None:
        """Open the pool, create the schema if asked, and check or store the limits.

        Done on first use anyway; call it (or ``async with limiter``) to fail early.

        Raises:
            ConcurrencyConfigError: the limits differ from those stored for this name, or
                the event loop is not asyncio.
        """
        _require_asyncio()
        if self._started:
            await checkpoint()
            return
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            if self._owns_pool:
                if self._pool.closed:  # closed by aclose() or a failed start: a new one
                    self._pool = _own_pool(self._pool.conninfo)  # type: ignore[arg-type]
                await self._pool.open()
            try:
                await self._run(self._create_schema if self.ensure_schema else self._check_schema)
                await self._run(self._register)
            except BaseException:
                if self._owns_pool:  # a limiter that failed to start holds no connections
                    with anyio.CancelScope(shield=True):
                        await self._pool.close()
                raise
            self._started = True

    async def aclose(self) -> None:
        """Stop the poller and the listener, and close the pool if the limiter made it."""
        for task in (self._poller, self._listener, self._flusher):
            if task is not None:
                task.cancel()
        for task in (self._poller, self._listener, self._flusher):
            if task is not None:
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(task, return_exceptions=True)
        self._poller = self._listener = self._flusher = None
        for waiter in self._waiters.values():
            waiter.error = ConcurrencyLimiterError("the limiter was closed")
            waiter.event.set()
        self._waiters.clear()
        if self._owns_pool:
            await self._pool.close()
        self._started = False

    def slot(
        self, workload: W | None = None, *, tokens: int | None = None, allow_nested: bool = False
    ) -> SlotContext[W]:
        """`async with limiter.slot(workload=...)`: `slotwise.slot()` with this limiter."""
        return SlotContext(workload, self, allow_nested, tokens)

    async def stats(self) -> LimiterStats:
        """Active and queued requests across every process, in total and per workload, and
        the rate buckets, the pause and the limit in force, which every process shares."""
        await self.start()
        if self._pending or self._applying is not None:
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
        pace = _Pace.load(settings, buckets, paused, backoffs, adaptive)
        pace.bank.refill(now)
        return self._stats(
            active,
            queued,
            effective=pace.limit(settings),
            paused_until=pace.paused_until if pace.paused_until > now else None,
            buckets={
                key: BucketStats(level=b.level, capacity=b.rule.capacity, per=b.rule.per)
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
        `ConcurrencyConfigError`, in every process; slots held in it count until they are
        released. `default_workload` is this process's own. Emits `limit-changed` when the
        limit in force changes. A worker started later with the limits it was deployed
        with takes these (a worker deployed with other limits still fails, see
        `on_conflict`; `on_conflict="replace"` stores its limits over these).

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
        """
        jitter = random.uniform(0.75, 1.25)
        lease_id = None if lease is None or not _is_uuid(lease.lease_id) else lease.lease_id
        self._push(_Pushback(lease_id=lease_id, retry_after=retry_after, jitter=jitter), True)
        self._paused_until, self._backoffs = pause(
            self._paused_until, self._backoffs, retry_after, time.time(), jitter
        )
        return self._paused_until, None

    def observe_remaining(self, lease: SupportsLease, kind: str, remaining: int) -> None:
        """The provider says `remaining` requests or tokens (`kind`) are left of its
        limit: the limiter's bucket of that kind, shared by every process, holds no more
        than that (it is lowered, never raised). Stored by this process's next transaction,
        within `poll_interval`. `Slot.provider_remaining()` calls it."""
        if kind in self._settings.rules.buckets:
            self._push(_Observed(kind=kind, remaining=remaining), False)

    def charge_tokens(self, lease: SupportsLease, tokens: int) -> None:
        """Charge `tokens` more to the token buckets of `lease`'s workload and of the limiter
        (a refund when negative): `Slot.used_tokens()` corrects an estimate with it. Stored
        by this process's next transaction (the slot's release, or within
        `poll_interval`)."""
        if any(rule.kind == "tokens" for rule in self._settings.rules.buckets.values()):
            self._push(_Charge(workload=lease.workload, units=tokens), False)

    # -- the Limiter protocol -------------------------------------------------------------

    async def acquire(self, request: AcquireRequest[W]) -> Lease:
        """Wait for a slot (see `slotwise.Limiter`); safe to cancel at any point.

        Raises:
            ConcurrencyTimeoutError: no slot before the deadline or ``max_wait``.
            ConcurrencyQueueFullError: ``max_queued`` requests were already waiting (the
                limiter's, or its workload's).
            ConcurrencyConfigError: unknown workload, limits changed, not asyncio, or a
                token estimate that one of its rate buckets can never hold.
            psycopg.Error: the database failed (the runtime reports it as
                ``ConcurrencyLimiterError``).
        """
        await checkpoint_if_cancelled()
        workload = resolve_workload(self._settings, request.workload)
        await self.start()
        tokens = request.tokens
        if tokens and self._settings.rules.buckets:
            check_cost(
                Bank(self._settings.rules.buckets, 0.0),
                workload,
                {"requests": 1, "tokens": tokens},
            )
        started = anyio.current_time()
        wait = math.inf if request.deadline is None else request.deadline - started
        max_wait = self._settings.workloads[workload].max_wait
        if max_wait is not None:
            wait = min(wait, max_wait)
        wait = max(wait, 0.0)
        waiter = _Waiter(str(uuid.uuid4()), workload)
        self._waiters[waiter.entry_id] = waiter
        queued = True  # the entry may exist in the database: clean up on the way out
        try:
            with anyio.CancelScope(shield=True):
                cycle = await self._run_cycle(
                    enqueue=(waiter.entry_id, workload, request.request_id, wait, tokens),
                    asked=[waiter.entry_id],
                    retry=False,
                )
            waiter.queued = True
            self._deliver(cycle.granted)
            if waiter.lease is not None:
                await checkpoint_if_cancelled()
                return waiter.lease
            if cycle.full is not None:
                queued = False
                raise ConcurrencyQueueFullError(cycle.full)
            if wait > 0:
                self._ensure_poller()
                with anyio.move_on_after(wait):
                    await waiter.event.wait()
            if waiter.error is not None:
                raise waiter.error
            if waiter.lease is not None:
                return waiter.lease
            # The deadline passed: leave the queue, unless a slot was granted just before it.
            self._waiters.pop(waiter.entry_id, None)
            with anyio.CancelScope(shield=True):
                lease, _ = await self._run(partial(self._withdraw, entry_id=waiter.entry_id))
            queued = False
            if lease is not None:
                waiter.lease = lease
                await checkpoint_if_cancelled()
                return lease
            raise wait_timeout(
                anyio.current_time() - started,
                max_wait,
                max_wait is not None
                and (request.deadline is None or started + max_wait <= request.deadline),
            )
        except BaseException:
            # Cancelled or failed: leave the queue and give back a slot granted in the same
            # moment. A database that is down leaves the entry to go stale and the lease to
            # expire; either way nothing stays held.
            self._waiters.pop(waiter.entry_id, None)
            if queued or waiter.lease is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        if waiter.lease is not None:
                            await self.release(waiter.lease)
                        else:
                            _, granted = await self._run(
                                partial(self._withdraw, entry_id=waiter.entry_id, give_back=True)
                            )
                            self._deliver(granted)
                    except Exception:
                        _logger.warning(
                            "slotwise: could not withdraw queue entry %s of limiter %r",
                            waiter.entry_id,
                            self.name,
                            exc_info=True,
                        )
            raise
        finally:
            self._waiters.pop(waiter.entry_id, None)

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
        """Give a slot back and grant what it frees to the waiters. Idempotent."""
        await self.start()
        if _is_uuid(lease.lease_id):
            cycle = await self._run_cycle(release=lease.lease_id)
            self._deliver(cycle.granted)

    # -- the poller: one per limiter per process ------------------------------------------

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_loop())
        if self._listen and (self._listener is None or self._listener.done()):
            self._listener = asyncio.get_running_loop().create_task(self._listen_loop())

    async def _poll_loop(self) -> None:
        # Full allocation cycles every poll_interval (they also sweep dead processes'
        # leases and entries, and refresh this process's entries), and when time alone can
        # grant something (a bucket refills, a pause ends: each cycle computes when); in
        # between, a notification that another process granted us a slot triggers a
        # lock-free read.
        interval = min(self.poll_interval, self._queue_entry_ttl / 3)
        next_cycle = anyio.current_time() + interval
        self._kick = anyio.Event()
        while self._waiters:
            with anyio.move_on_after(max(min(next_cycle, self._wake_at) - anyio.current_time(), 0)):
                await self._kick.wait()
            # A notification that arrives from now on is seen by the next round.
            self._kick = anyio.Event()
            asked = list(self._waiters)
            try:
                if anyio.current_time() >= min(next_cycle, self._wake_at):
                    next_cycle = anyio.current_time() + interval
                    await self._poll_cycle(asked)
                else:
                    granted = await self._run(partial(self._fetch, asked=asked))
                    self._deliver(granted)
            except Exception as exc:
                # Fail closed: every local waiter raises (the runtime reports a limiter error).
                for entry_id in asked:
                    waiter = self._waiters.pop(entry_id, None)
                    if waiter is not None:
                        waiter.error = exc
                        waiter.event.set()
        self._kick = None

    async def _poll_cycle(self, asked: list[str]) -> None:
        beat = anyio.current_time() - self._beat_at >= self._queue_entry_ttl / 3
        # Entries committed before this cycle began are in its snapshot: if one is neither
        # queued nor granted there, it was dropped. (A newer one may simply not be visible.)
        committed = [entry_id for entry_id in asked if self._waiters[entry_id].queued]
        cycle = await self._run_cycle(asked=asked, heartbeat=beat)
        if beat:
            self._beat_at = anyio.current_time()
        self._deliver(cycle.granted, cycle.present, committed)

    def _deliver(
        self,
        granted: Mapping[str, Lease],
        present: frozenset[str] | None = None,
        asked: list[str] | None = None,
    ) -> None:
        """Hand leases to the local waiters they were granted to (after the commit)."""
        for entry_id, lease in granted.items():
            waiter = self._waiters.pop(entry_id, None)
            if waiter is not None:
                waiter.lease = lease
                waiter.event.set()
        if present is None or asked is None:
            return
        for entry_id in asked:
            if entry_id not in present and entry_id not in granted:
                waiter = self._waiters.pop(entry_id, None)
                if waiter is not None:
                    waiter.error = ConcurrencyLimiterError(
                        "the queue entry was dropped as stale (this process did not refresh "
                        f"it within queue_entry_ttl={self._queue_entry_ttl}s)"
                    )
                    waiter.event.set()

    async def _listen_loop(self) -> None:
        # One session connection outside the pool. If it drops, timed polling carries on
        # and the listener reconnects.
        kwargs: dict[str, Any] = {}
        if isinstance(self._listen, str):
            conninfo = self._listen
        else:
            conninfo, kwargs = (
                await _resolve(self._pool.conninfo),
                await _resolve(self._pool.kwargs),
            )
            kwargs = dict(kwargs or {})
        kwargs["autocommit"] = True
        delay = self.poll_interval
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(conninfo, **kwargs)
                async with conn:
                    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
                    delay = self.poll_interval
                    # Grants made before LISTEN took effect sent no notification here: a
                    # read now finds them; from now on notifications do.
                    if self._kick is not None:
                        self._kick.set()
                    async for note in conn.notifies():
                        self._notified(note.payload)
            except Exception:
                _logger.debug("slotwise: listener of %r failed", self.name, exc_info=True)
            await anyio.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _notified(self, payload: str) -> None:
        """A notification: grants made by another process (delivered at once: NOTIFY is
        sent at commit), or, for a long list, the owners that should poll now."""
        try:
            message = json.loads(payload)
        except ValueError:
            return
        grants = message.get("g") if isinstance(message, dict) else None
        if isinstance(grants, list):
            self._deliver(
                {
                    entry_id: Lease(
                        lease_id=lease_id,
                        workload=workload,
                        expires_at=expires,
                        waited_for=tuple(waited[0]) if waited and waited[0] else (),
                    )
                    for owner, entry_id, lease_id, workload, expires, *waited in grants
                    if owner == self._owner
                }
            )
            return
        owners = message.get("k") if isinstance(message, dict) else None
        if (owners == "*" or self._owner in (owners or ())) and self._kick is not None:
            self._kick.set()

    # -- what held slots learn from the provider -------------------------------------------

    def _push(self, item: _Pending, urgent: bool) -> None:
        """Keep ``item`` for this process's next transaction, and make sure one comes: at
        once when ``urgent`` (a pause), else within ``poll_interval`` (the slot's release
        usually comes first and stores it)."""
        self._pending.append(item)
        if self._flusher is None or self._flusher.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop: the next allocation stores it
                return
            self._flusher = loop.create_task(self._flush())
        elif urgent and self._flush_kick is not None:
            self._flush_kick.set()

    async def _flush(self) -> None:
        while self._pending:
            if not any(isinstance(item, _Pushback) for item in self._pending):
                self._flush_kick = anyio.Event()
                with anyio.move_on_after(self.poll_interval):
                    await self._flush_kick.wait()
                self._flush_kick = None
                if not self._pending:
                    return
            try:
                cycle = await self._run_cycle()
            except Exception:
                # Kept: the next allocation of this process stores them.
                _logger.warning(
                    "slotwise: could not store the provider's pushback for limiter %r",
                    self.name,
                    exc_info=True,
                )
                return
            self._deliver(cycle.granted)

    async def _run_cycle(self, *, retry: bool = True, **kwargs: Any) -> _Cycle:
        """One allocation cycle (`_cycle`) in its own transaction, storing what this process
        learned from the provider since its last one; then what it found is applied here.

        The cycle that stores a pause must commit before any later cycle of this process
        takes the lock: a refused request's release, coming next, must not hand its slot
        to a waiter during the pause. So a cycle that starts while one stores waits for it.
        """
        while self._applying is not None:
            await self._applying.wait()
        pending, self._pending = self._pending, []
        if pending:
            self._applying = anyio.Event()
        try:
            cycle = await self._run(partial(self._cycle, pending=pending, **kwargs), retry=retry)
        except BaseException:
            self._pending[:0] = pending  # not stored: the next transaction tries again
            raise
        finally:
            if pending:
                applying, self._applying = self._applying, None
                if applying is not None:
                    applying.set()
        self._settle(cycle)
        return cycle

    def _settle(self, cycle: _Cycle) -> None:
        """After a cycle's commit: take the limits in force, arm the poller for the next
        refill or the end of a pause, report changes of the limit."""
        if cycle.settings is not None:
            self._adopt(*cycle.settings)
        self._paused_until, self._backoffs = cycle.paused_until, cycle.backoffs
        wake_at = math.inf if cycle.wake is None else anyio.current_time() + cycle.wake
        earlier = wake_at < self._wake_at
        self._wake_at = wake_at
        if earlier and self._kick is not None:
            self._kick.set()
        for old, new, reason in cycle.changes:
            self._limit_changed(old, new, reason)

    def _adopt(self, settings: Settings, version: int) -> None:
        """Use the limits in force (set by `set_limits()` here or in another process); a
        local request waiting for a workload that is gone fails."""
        self._settings, self._version = settings, version
        for entry_id, waiter in list(self._waiters.items()):
            if waiter.workload not in settings.workloads:
                del self._waiters[entry_id]
                waiter.error = ConcurrencyConfigError(
                    f"workload {waiter.workload!r} was removed from limiter {self.name!r} by "
                    "set_limits() while this request waited"
                )
                waiter.event.set()

    def _settings_from(self, limits: Mapping[str, Any] | None) -> Settings:
        """The settings of the limits stored by `set_limits()` (None: those given here),
        with this process's own lease_ttl and, if it still exists, default workload."""
        if limits is None:
            return self._base
        kwargs = _settings_kwargs(limits)
        default = self._settings.default_workload or self._base.default_workload
        if default not in kwargs["workloads"]:
            default = None
        try:
            return build_settings(
                name=self.name,
                lease_ttl=self._settings.lease_ttl,
                default_workload=default,
                **kwargs,
            )
        except ConcurrencyConfigError as exc:
            raise ConcurrencyLimiterError(
                f"the limits stored for limiter {self.name!r} are invalid: {exc}"
            ) from exc

    # -- transactions ---------------------------------------------------------------------

    async def _run(self, body: Callable[[Conn], Awaitable[T]], *, retry: bool = True) -> T:
        """Run ``body`` in one transaction on a pooled connection.

        A connection that turns out broken before anything was committed (the pool handed
        out a connection the server has since closed) is retried on another; after a server
        restart every pooled connection may be broken, so up to the pool's size plus one
        attempts are made. ``retry`` also allows a retry after commit was attempted
        (idempotent bodies).
        """
        attempts = self._pool.max_size + 1
        for attempt in range(1, attempts + 1):
            committing = False
            try:
                async with self._pool.connection() as conn, conn.pipeline(), conn.transaction():
                    if not self.synchronous_commit:
                        await conn.execute("SET LOCAL synchronous_commit = off", prepare=False)
                    result = await body(conn)
                    committing = True
                return result
            except psycopg.OperationalError:
                if attempt == attempts or (committing and not retry):
                    raise
        raise AssertionError("unreachable")

    async def _schema_state(self, conn: Conn) -> tuple[bool, bool]:
        """Whether the tables exist, and whether they have this version's columns."""
        table, column = NEWEST_COLUMN
        cur = await conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL, EXISTS (SELECT 1 FROM pg_attribute "
            "WHERE attrelid = to_regclass(%s) AND attname = %s AND NOT attisdropped)",
            [f"{_quote(self.schema)}.{table}"] * 2 + [column],
            prepare=False,
        )
        row = await cur.fetchone()
        assert row is not None
        return bool(row[0]), bool(row[1])

    async def _check_schema(self, conn: Conn) -> None:
        exists, current = await self._schema_state(conn)
        if exists and not current:
            raise ConcurrencyConfigError(
                f"the tables in schema {self.schema!r} predate this version of slotwise "
                f"(they lack {'.'.join(NEWEST_COLUMN)}): apply schema_sql({self.schema!r}) "
                "again (it only adds what is missing), or pass ensure_schema=True"
            )

    async def _create_schema(self, conn: Conn) -> None:
        # Many workers may start at once on a new database: the advisory lock (released at
        # commit, so it works through PgBouncer) lets one create the tables at a time. An
        # existing installation gets the columns of later versions the same way.
        if (await self._schema_state(conn))[1]:
            return
        await conn.execute(
            "SELECT pg_advisory_xact_lock(hashtext('slotwise schema'), hashtext(%s))",
            [self.schema],
            prepare=False,
        )
        for statement in schema_ddl(self.schema):
            await conn.execute(statement, prepare=False)

    async def _register(self, conn: Conn) -> None:
        q = self._q
        await conn.execute(q.insert_limiter, [self.name, self._settings_json], prepare=False)
        cur = await conn.execute(q.lock_limiter, [self._settings_json, self.name], prepare=False)
        row = await cur.fetchone()
        assert row is not None
        if row[0] or self.on_conflict == "replace":
            if not row[0]:
                await conn.execute(
                    q.replace_limits, [self._settings_json, self.name], prepare=False
                )
            # The limits in force may have been changed by set_limits().
            cur = await conn.execute(
                q.state, {"name": self.name, "version": self._version}, prepare=False
            )
            state = await cur.fetchone()
            assert state is not None
            if state[4] != self._version:
                self._adopt(self._settings_from(state[5]), state[4])
            return
        raise ConcurrencyConfigError(
            f"limiter {self.name!r} in schema {self.schema!r} is stored with different "
            f"limits: stored {json.dumps(row[1], sort_keys=True)}, "
            f"this process {self._settings_json}. Use a new name, or deploy every worker "
            "with the same limits and on_conflict='replace'"
        )

    async def _cycle(
        self,
        conn: Conn,
        *,
        enqueue: tuple[str, str, str, float, int] | None = None,
        release: str | None = None,
        asked: list[str] | None = None,
        heartbeat: bool = False,
        pending: Sequence[_Pending] = (),
        change: Callable[[Settings], Settings] | None = None,
    ) -> _Cycle:
        """One allocation: lock, sweep, load, ``allocate``, grant; inside the caller's
        transaction.

        The order matters. The lock comes first, then expired leases are deleted in their
        own statement (a concurrent renewal either committed before it, and the lease
        survives, or finds the row gone), and only then is the snapshot loaded, in a new
        statement that sees everything committed before the lock was granted.

        The rates and pushback state (buckets, pause, adaptive limit, the limits in force)
        is read under the lock too and changed by the rules MemoryLimiter applies in memory
        (slotwise._core.state), at the database's ``now``: what ``pending`` brings from
        the provider, a ``change`` of the limits, the release's success, and the grants'
        costs. It is written back only when it changed.
        """
        q = self._q
        name = self.name
        # In pipeline mode (see _run) everything up to the load's fetch is one round trip.
        # The row as locked is its latest version: the rates and pushback state come with it.
        locked = await conn.execute(
            q.lock_state,
            {"settings": self._settings_json, "name": name, "version": self._version},
            prepare=False,
        )
        refused = [p.lease_id for p in pending if isinstance(p, _Pushback) and p.lease_id]
        marked = None
        if refused:  # before the sweep, which deletes a lease being released
            marked = await conn.execute(
                q.mark_throttled, {"name": name, "leases": refused}, prepare=False
            )
        swept = await conn.execute(
            q.sweep,
            {
                "name": name,
                "owner": self._owner,
                "release": release,
                "beat": heartbeat,
                "entry_ttl": self._queue_entry_ttl,
            },
            prepare=False,
        )
        counted = None
        if enqueue is not None:
            entry_id, workload, request_id, wait, tokens = enqueue
            await conn.execute(
                q.enqueue,
                {
                    "entry_id": entry_id,
                    "name": name,
                    "workload": workload,
                    "owner": self._owner,
                    "request_id": request_id,
                    "wait": None if math.isinf(wait) else wait,
                    "entry_ttl": self._queue_entry_ttl,
                    "lease_ttl": self._settings.lease_ttl,
                    "tokens": tokens,
                },
                prepare=False,
            )
            rule = self._settings.rules.workloads.get(workload)
            if rule is not None and rule.max_queued is not None:
                counted = await conn.execute(
                    q.count_workload,
                    {"name": name, "workload": workload, "fresh": entry_id},
                    prepare=False,
                )
        cur = await conn.execute(
            q.load,
            {
                "name": name,
                "heads": self._settings.max_concurrent,
                "asked": asked or [],
                # A request enqueued now may take a free slot even with no time to wait.
                "fresh": None if enqueue is None else enqueue[0],
            },
            prepare=False,
        )
        locked_row = await locked.fetchone()
        self._check_lock(locked_row)
        assert locked_row is not None
        state_row = locked_row[2:]
        epochs: dict[str, int] = {} if marked is None else dict(await marked.fetchall())
        swept_row = await swept.fetchone()
        assert swept_row is not None
        waiting_here = None if counted is None else await counted.fetchone()
        loaded = await cur.fetchone()
        assert loaded is not None
        active_rows, queued, head_rows, mine_rows, present_rows, now = loaded

        buckets, paused, backoffs, adaptive, version, limits, _ = state_row
        settings = self._settings
        adopted = version != self._version
        if adopted:
            settings = self._settings_from(limits)
        pace = _Pace.load(settings, buckets, paused, backoffs, adaptive)
        changes: list[tuple[int, int, str]] = []
        if change is not None:
            old_limit = pace.limit(settings)
            settings = change(settings)
            version += 1
            adopted = True
            pace.bank = carry_over(pace.bank, settings.rules, now)
            pace.aimd, _ = readapt(pace.aimd, settings.rules, _adaptive(settings))
            pace.dirty = True
            await conn.execute(
                q.store_limits,
                {"name": name, "limits": json.dumps(_limits(settings)), "version": version},
                prepare=False,
            )
            if pace.limit(settings) != old_limit:
                changes.append((old_limit, pace.limit(settings), "set_limits"))
        for item in pending:
            pace.dirty = True
            if isinstance(item, _Pushback):
                pace.paused_until, pace.backoffs = pause(
                    pace.paused_until, pace.backoffs, item.retry_after, now, item.jitter
                )
                epoch = epochs.get(item.lease_id or "")
                if epoch is not None and pace.aimd is not None:
                    old_limit = pace.aimd.limit
                    new_limit = pace.aimd.pushback(epoch)
                    if new_limit is not None:
                        changes.append((old_limit, new_limit, "pushback"))
            elif isinstance(item, _Charge):
                pace.bank.refill(now)
                pace.bank.give(item.workload, "tokens", item.units)
            else:
                pace.bank.observe(item.kind, item.remaining, now)
        released = swept_row[-1]  # [epoch, throttled] of the lease released here
        if released is not None and not released[1]:
            # A success: the backoff starts again from a second; an adaptive limit climbs.
            if pace.backoffs:
                pace.backoffs = 0
                pace.dirty = True
            if pace.aimd is not None:
                old_limit, credit = pace.aimd.limit, pace.aimd.credit
                new_limit = pace.aimd.success(int(released[0]))
                pace.dirty = pace.dirty or pace.aimd.credit != credit
                if new_limit is not None:
                    changes.append((old_limit, new_limit, "recovered"))

        active = dict(active_rows or {})
        rules = retire(pace.rules(settings), active)
        queues: dict[str, list[_Entry]] = {}
        for entry_id, workload, micros, seq, owner, tokens, waited in head_rows or []:
            if workload in settings.workloads:
                queues.setdefault(workload, []).append(
                    _Entry(
                        entry_id=entry_id,
                        workload=workload,
                        key=(micros, seq),
                        owner=owner,
                        tokens=tokens,
                        waited_for=tuple(waited or ()),
                    )
                )
        waits: dict[str, set[str]] = {}
        grants, refill_at = allocate_paced(
            rules,
            active,
            queues,
            _key,
            now=now,
            bank=pace.bank,
            paused_until=pace.paused_until,
            cost=_cost,
            enqueued_at=_enqueued_at,
            waited=lambda entry, keys: waits.setdefault(entry.entry_id, set()).update(keys),
        )
        if grants and pace.bank:
            pace.dirty = True
        granted_ids = {e.entry_id for e in grants}
        waited_for = {
            e.entry_id: tuple(sorted(set(e.waited_for) | waits.get(e.entry_id, set())))
            for entries in queues.values()
            for e in entries
            if e.entry_id in waits or e.waited_for
        }
        # A head that waits for buckets says so in its entry: whichever process grants it
        # later reports what it waited for.
        blocked = {
            e.entry_id: list(waited_for[e.entry_id])
            for entries in queues.values()
            for e in entries
            if e.entry_id in waits
            and e.entry_id not in granted_ids
            and waited_for[e.entry_id] != e.waited_for
        }
        if blocked:
            await conn.execute(q.mark_waited, [json.dumps(blocked)], prepare=False)
        granted = {
            entry_id: Lease(
                lease_id=lease_id,
                workload=workload,
                expires_at=float(expires),
                waited_for=tuple(waited or ()),
            )
            for entry_id, lease_id, workload, expires, waited in mine_rows or []
        }
        full = None
        if enqueue is not None and enqueue[0] not in granted_ids:
            # Not granted now: it waits, unless the queue is full or it may not wait.
            waiting_before = queued - 1
            maximum = settings.max_queued
            bound = (
                settings.workloads[enqueue[1]].max_queued
                if enqueue[1] in settings.workloads
                else None
            )
            if maximum is not None and waiting_before >= maximum:
                full = f"{waiting_before} requests are already waiting (max_queued={maximum})"
            elif bound is not None and waiting_here is not None and waiting_here[0] >= bound:
                full = (
                    f"{waiting_here[0]} requests of workload {enqueue[1]!r} are already "
                    f"waiting (its max_queued={bound})"
                )
            if full is not None or enqueue[3] <= 0:
                await conn.execute(q.drop_entry, [enqueue[0]], prepare=False)
                queued -= 1
        if grants:
            # Not fetched: the grant, its notification and the commit go in one round trip.
            # The other processes learn their grants from the notification (sent at commit).
            lease_ids = [str(uuid.uuid4()) for _ in grants]
            await conn.execute(
                q.grant,
                {
                    "name": name,
                    "entries": [e.entry_id for e in grants],
                    "leases": lease_ids,
                    "waited": [json.dumps(waited_for.get(e.entry_id, ())) for e in grants],
                    "epoch": 0 if pace.aimd is None else pace.aimd.epoch,
                    "owner": self._owner,
                    "channel": self._channel,
                },
                prepare=False,
            )
            for entry, lease_id in zip(grants, lease_ids, strict=True):
                if entry.owner == self._owner:
                    # It expires lease_ttl after the grant statement, a moment after `now`.
                    granted[entry.entry_id] = Lease(
                        lease_id=lease_id,
                        workload=entry.workload,
                        expires_at=now + self._settings.lease_ttl,
                        waited_for=waited_for.get(entry.entry_id, ()),
                    )
            queued -= len(grants)
        if pace.dirty:
            await conn.execute(q.save_state, {"name": name, **pace.params()}, prepare=False)
        wake = paced_wake(refill_at, pace.paused_until, now)
        return _Cycle(
            granted=granted,
            present=frozenset(str(e) for e in present_rows or []),
            queued=queued,
            full=full,
            settings=(settings, version) if adopted else None,
            changes=tuple(changes),
            wake=None if wake == math.inf else max(0.0, wake - now),
            paused_until=pace.paused_until,
            backoffs=pace.backoffs,
        )

    async def _lock(self, conn: Conn) -> None:
        """Take the limiter's row lock (again, harmlessly, if this transaction has it) and
        check that the stored limits are still this process's."""
        cur = await conn.execute(
            self._q.lock_limiter, [self._settings_json, self.name], prepare=False
        )
        self._check_lock(await cur.fetchone())

    def _check_lock(self, row: tuple[Any, ...] | None) -> None:
        if row is None:
            raise ConcurrencyLimiterError(
                f"limiter {self.name!r} is missing from {self.schema!r}.limiters"
            )
        if not row[0]:
            raise ConcurrencyConfigError(
                f"the limits of limiter {self.name!r} were changed by another process "
                f"(stored {json.dumps(row[1], sort_keys=True)})"
            )

    async def _fetch(self, conn: Conn, *, asked: list[str]) -> dict[str, Lease]:
        cur = await conn.execute(self._q.fetch_mine, [asked], prepare=False)
        return {
            str(entry_id): Lease(
                lease_id=str(lease_id),
                workload=workload,
                expires_at=expires,
                waited_for=tuple(waited),
            )
            for entry_id, lease_id, workload, expires, waited in await cur.fetchall()
        }

    async def _withdraw(
        self, conn: Conn, *, entry_id: str, give_back: bool = False
    ) -> tuple[Lease | None, Mapping[str, Lease]]:
        """Leave the queue. A slot granted to the entry meanwhile is returned, or with
        ``give_back`` released by a full allocation cycle, so it goes to the next waiter
        (whose grants are returned too, to deliver after the commit)."""
        if give_back:
            # Lock order: the limiter row before any queue row (as every allocation does).
            await self._lock(conn)
        await conn.execute(self._q.drop_entry, [entry_id], prepare=False)
        granted = await self._fetch(conn, asked=[entry_id])
        lease = granted.get(entry_id)
        if lease is None or not give_back:
            return lease, {}
        cycle = await self._cycle(conn, release=lease.lease_id)
        return None, cycle.granted

    async def _renew(self, conn: Conn, *, lease_id: str) -> tuple[str, float] | None:
        cur = await conn.execute(
            self._q.renew,
            {"lease_id": lease_id, "name": self.name, "ttl": self._settings.lease_ttl},
            prepare=False,
        )
        row = await cur.fetchone()
        return None if row is None else (row[0], float(row[1]))

    async def _stats_rows(self, conn: Conn) -> tuple[list[tuple[str, str, int]], tuple[Any, ...]]:
        cur = await conn.execute(self._q.stats, {"name": self.name}, prepare=False)
        state = await conn.execute(
            self._q.state, {"name": self.name, "version": self._version}, prepare=False
        )
        rows = await cur.fetchall()
        row = await state.fetchone()
        if row is None:
            raise ConcurrencyLimiterError(
                f"limiter {self.name!r} is missing from {self.schema!r}.limiters"
            )
        return rows, row

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
    return AsyncConnectionPool(
        conninfo, min_size=1, max_size=4, open=False, kwargs={"autocommit": True}
    )


def _require_asyncio() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise ConcurrencyConfigError(
            "PostgresLimiter runs on asyncio only (psycopg's async API is asyncio-only); "
            "this code is not running in an asyncio event loop (trio?)"
        ) from None


def _stored_limits(settings: Settings) -> dict[str, Any]:
    """The limits every process sharing a name must agree on (lease and entry TTLs, the
    default workload and poll interval are each process's own). Settings that came later
    (rates, pushback, per-workload queue bounds) appear only when set, so that limits
    stored by an earlier version still agree."""
    workloads: dict[str, Any] = {}
    for name, rule in settings.rules.workloads.items():
        workload = settings.workloads[name]
        stored = workloads[name] = {
            "max_concurrent": rule.ceiling,
            "reserved": rule.reserved,
            "priority": rule.priority,
            "max_wait": workload.max_wait,
        }
        if workload.max_queued is not None:
            stored["max_queued"] = workload.max_queued
        if workload.rate is not None:
            stored["rate"] = _rate_json(workload.rate)
    limits: dict[str, Any] = {
        "max_concurrent": settings.max_concurrent,
        "max_queued": settings.max_queued,
        "workloads": workloads,
    }
    if settings.rate is not None:
        limits["rate"] = _rate_json(settings.rate)
    if settings.adaptive is not None:
        limits["adaptive"] = _adaptive_json(settings.adaptive)
    return limits


def _limits(settings: Settings) -> dict[str, Any]:
    """The limits set by `set_limits()`, as stored for every process (each keeps its own
    lease_ttl and default workload): the settings as given, a workload's ceiling None when
    it follows the limiter's."""
    return {
        "max_concurrent": settings.max_concurrent,
        "max_queued": settings.max_queued,
        "workloads": {
            name: {
                "max_concurrent": w.max_concurrent,
                "reserved": w.reserved,
                "priority": w.priority,
                "max_wait": w.max_wait,
                "max_queued": w.max_queued,
                "rate": None if w.rate is None else _rate_json(w.rate),
            }
            for name, w in settings.workloads.items()
        },
        "rate": None if settings.rate is None else _rate_json(settings.rate),
        "adaptive": None if settings.adaptive is None else _adaptive_json(settings.adaptive),
    }


def _settings_kwargs(limits: Mapping[str, Any]) -> dict[str, Any]:
    """`build_settings` keywords from `_limits()`."""

    def rate(stored: Mapping[str, Any] | None) -> Rate | None:
        return None if stored is None else Rate(**stored)

    return {
        "max_concurrent": limits["max_concurrent"],
        "max_queued": limits["max_queued"],
        "workloads": {
            name: Workload(**{**w, "rate": rate(w.get("rate"))})
            for name, w in limits["workloads"].items()
        },
        "rate": rate(limits.get("rate")),
        "adaptive": None if limits.get("adaptive") is None else Adaptive(**limits["adaptive"]),
    }


def _rate_json(rate: Rate) -> dict[str, Any]:
    return {"requests": rate.requests, "tokens": rate.tokens, "per": float(rate.per)}


def _adaptive_json(adaptive: Adaptive) -> dict[str, Any]:
    return {"min_concurrent": adaptive.min_concurrent, "backoff": float(adaptive.backoff)}


def _adaptive(settings: Settings) -> tuple[int, float] | None:
    adaptive = settings.adaptive
    return None if adaptive is None else (adaptive.min_concurrent, adaptive.backoff)


async def _resolve(value: Any) -> Any:
    """A pool's conninfo or kwargs: a value, or a (possibly async) callable returning one."""
    if callable(value):
        value = value()
        if inspect.isawaitable(value):
            value = await value
    return value


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except (ValueError, TypeError, AttributeError):
        return False
    return True


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


@final
class _Queries:
    """The statements, with the schema quoted in; every value is a bound parameter."""

    __slots__ = (
        "count_workload",
        "drop_entry",
        "enqueue",
        "fetch_mine",
        "grant",
        "insert_limiter",
        "load",
        "lock_limiter",
        "lock_state",
        "mark_throttled",
        "mark_waited",
        "renew",
        "replace_limits",
        "save_state",
        "state",
        "stats",
        "store_limits",
        "sweep",
    )

    def __init__(self, schema: str) -> None:
        def q(text: str) -> sql.Composed:
            return sql.SQL(text).format(s=sql.Identifier(schema))

        self.insert_limiter = q(
            "INSERT INTO {s}.limiters (name, settings) VALUES (%s, %s::jsonb) "
            "ON CONFLICT (name) DO NOTHING"
        )
        self.lock_limiter = q(
            "SELECT settings = %s::jsonb, settings FROM {s}.limiters WHERE name = %s FOR UPDATE"
        )
        # New limits deployed: those set at run time by set_limits() go too.
        self.replace_limits = q(
            "UPDATE {s}.limiters SET settings = %s::jsonb, updated_at = clock_timestamp(), "
            "limits = NULL, limits_version = limits_version + 1 WHERE name = %s"
        )
        # The rates and pushback state, and the limits in force when they are not those
        # this process last saw; with the row lock and the check of lock_limiter.
        state = """
            buckets, extract(epoch FROM paused_until)::float8, backoffs, adaptive,
            limits_version, CASE WHEN limits_version <> %(version)s THEN limits END,
            extract(epoch FROM clock_timestamp())::float8
            FROM {s}.limiters WHERE name = %(name)s
        """
        self.state = q("SELECT " + state)
        self.lock_state = q(
            "SELECT settings = %(settings)s::jsonb, settings, " + state + " FOR UPDATE"
        )
        self.save_state = q(
            """
            UPDATE {s}.limiters
            SET buckets = %(buckets)s::jsonb,
                paused_until = to_timestamp(%(paused_until)s::float8),
                backoffs = %(backoffs)s, adaptive = %(adaptive)s::jsonb
            WHERE name = %(name)s
            """
        )
        self.store_limits = q(
            "UPDATE {s}.limiters SET limits = %(limits)s::jsonb, "
            "limits_version = %(version)s WHERE name = %(name)s"
        )
        self.mark_throttled = q(
            """
            UPDATE {s}.leases SET throttled = true
            WHERE lease_id = ANY(%(leases)s::uuid[]) AND limiter = %(name)s
            RETURNING lease_id::text, epoch
            """
        )
        self.mark_waited = q(
            """
            UPDATE {s}.queue q SET waited_for = ARRAY(SELECT jsonb_array_elements_text(b.value))
            FROM jsonb_each(%s::jsonb) AS b
            WHERE q.entry_id = b.key::uuid
            """
        )
        self.count_workload = q(
            """
            SELECT count(*) FROM {s}.queue
            WHERE limiter = %(name)s AND workload = %(workload)s
              AND entry_id <> %(fresh)s::uuid AND stale_at > clock_timestamp()
              AND (deadline IS NULL OR deadline > clock_timestamp())
            """
        )
        # Expired leases (and the one being released) go; so do other processes' entries
        # that are stale or past their deadline. This process's own entries are refreshed.
        self.sweep = q(
            """
            WITH gone AS (
                DELETE FROM {s}.leases
                WHERE limiter = %(name)s
                  AND (expires_at <= clock_timestamp() OR lease_id = %(release)s::uuid)
                RETURNING lease_id, epoch, throttled
            ), stale AS (
                DELETE FROM {s}.queue
                WHERE limiter = %(name)s AND owner <> %(owner)s::uuid
                  AND (stale_at <= clock_timestamp() OR deadline <= clock_timestamp())
                RETURNING 1
            ), beat AS (
                UPDATE {s}.queue
                SET stale_at = clock_timestamp() + make_interval(secs => %(entry_ttl)s)
                WHERE %(beat)s AND limiter = %(name)s AND owner = %(owner)s::uuid
                RETURNING 1
            )
            SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM stale),
                   (SELECT count(*) FROM beat),
                   (SELECT json_build_array(epoch, throttled) FROM gone
                    WHERE lease_id = %(release)s::uuid)
            """
        )
        self.enqueue = q(
            """
            INSERT INTO {s}.queue (entry_id, limiter, workload, owner, request_id,
                                   enqueued_at, deadline, stale_at, lease_ttl, tokens)
            VALUES (%(entry_id)s, %(name)s, %(workload)s, %(owner)s, %(request_id)s,
                    clock_timestamp(),
                    clock_timestamp() + make_interval(secs => %(wait)s),
                    clock_timestamp() + make_interval(secs => %(entry_ttl)s),
                    %(lease_ttl)s, %(tokens)s)
            """
        )
        # The snapshot the allocation needs: active leases per workload, the number of live
        # entries, the first max_concurrent live entries of each workload (no more can be
        # granted at once), and the leases already granted to the entries asked about.
        self.load = q(
            """
            WITH live AS (
                SELECT entry_id, workload, enqueued_at, seq, owner, tokens, waited_for
                FROM {s}.queue
                WHERE limiter = %(name)s AND stale_at > clock_timestamp()
                  AND (deadline IS NULL OR deadline > clock_timestamp()
                       OR entry_id = %(fresh)s::uuid)
            )
            SELECT
                (SELECT json_object_agg(workload, n) FROM (
                    SELECT workload, count(*) AS n FROM {s}.leases
                    WHERE limiter = %(name)s GROUP BY workload) a),
                (SELECT count(*) FROM live),
                (SELECT json_agg(json_build_array(entry_id, workload, micros, seq, owner,
                                                  tokens, waited_for)
                                 ORDER BY micros, seq)
                 FROM (SELECT entry_id, workload, seq, owner, tokens, waited_for,
                              (extract(epoch FROM enqueued_at) * 1000000)::bigint AS micros,
                              row_number() OVER (PARTITION BY workload
                                                 ORDER BY enqueued_at, seq) AS rank
                       FROM live) h
                 WHERE rank <= %(heads)s),
                (SELECT json_agg(json_build_array(entry_id, lease_id, workload,
                                                  extract(epoch FROM expires_at), waited_for))
                 FROM {s}.leases
                 WHERE entry_id = ANY(%(asked)s::uuid[]) AND expires_at > clock_timestamp()),
                (SELECT json_agg(entry_id) FROM {s}.queue
                 WHERE entry_id = ANY(%(asked)s::uuid[])),
                extract(epoch FROM clock_timestamp())::float8
            """
        )
        self.drop_entry = q("DELETE FROM {s}.queue WHERE entry_id = %s")
        self.grant = q(
            """
            WITH g AS (
                SELECT * FROM unnest(%(entries)s::uuid[], %(leases)s::uuid[],
                                     %(waited)s::text[])
                    AS g(entry_id, lease_id, waited)
            ), d AS (
                DELETE FROM {s}.queue q USING g
                WHERE q.entry_id = g.entry_id AND q.limiter = %(name)s
                RETURNING q.entry_id, g.lease_id, q.workload, q.owner, q.request_id,
                          q.lease_ttl, g.waited
            ), i AS (
                INSERT INTO {s}.leases (lease_id, limiter, workload, owner, entry_id,
                                        request_id, granted_at, expires_at, epoch, waited_for)
                SELECT lease_id, %(name)s, workload, owner, entry_id, request_id,
                       clock_timestamp(), clock_timestamp() + make_interval(secs => lease_ttl),
                       %(epoch)s, ARRAY(SELECT jsonb_array_elements_text(waited::jsonb))
                FROM d
                RETURNING entry_id, lease_id, workload, owner, expires_at, waited_for
            ), n AS (
                -- The grants of other processes, for their listeners; a payload must stay
                -- under 8000 bytes, so a long one shrinks to "poll now" for those owners.
                SELECT json_build_object('g', json_agg(json_build_array(
                           owner, entry_id, lease_id, workload,
                           extract(epoch FROM expires_at)::float8, waited_for)))::text AS grants,
                       json_build_object('k', json_agg(DISTINCT owner))::text AS owners
                FROM i WHERE owner <> %(owner)s::uuid
                HAVING count(*) > 0
            )
            SELECT pg_notify(%(channel)s, CASE WHEN length(grants) < 7900 THEN grants
                                               WHEN length(owners) < 7900 THEN owners
                                               ELSE '{{"k": "*"}}' END)
            FROM n
            """
        )
        self.fetch_mine = q(
            "SELECT entry_id::text, lease_id::text, workload, "
            "extract(epoch FROM expires_at)::float8, waited_for FROM {s}.leases "
            "WHERE entry_id = ANY(%s::uuid[]) AND expires_at > clock_timestamp()"
        )
        self.renew = q(
            """
            UPDATE {s}.leases
            SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s)
            WHERE lease_id = %(lease_id)s::uuid AND limiter = %(name)s
              AND expires_at > clock_timestamp()
            RETURNING workload, extract(epoch FROM expires_at)
            """
        )
        self.stats = q(
            """
            SELECT 'active', workload, count(*)::int FROM {s}.leases
            WHERE limiter = %(name)s AND expires_at > clock_timestamp() GROUP BY workload
            UNION ALL
            SELECT 'queued', workload, count(*)::int FROM {s}.queue
            WHERE limiter = %(name)s AND stale_at > clock_timestamp()
              AND (deadline IS NULL OR deadline > clock_timestamp())
            GROUP BY workload
            """
        )
