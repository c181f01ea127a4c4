"""PostgresLimiter: one capacity shared by every process that uses the same limiter name."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Mapping
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
    Settings,
    Workload,
    build_settings,
    resolve_workload,
    seconds,
    wait_timeout,
)
from .._core.rules import allocate
from .._errors import (
    ConcurrencyConfigError,
    ConcurrencyLimiterError,
    ConcurrencyQueueFullError,
)
from .._protocol import AcquireRequest, Lease, SupportsLease, W
from .._runtime.lifecycle import SlotContext
from .._stats import LimiterStats
from ._schema import channel_name, schema_ddl

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


@attrs.frozen(kw_only=True)
class _Cycle:
    """What one allocation transaction found and did."""

    granted: dict[str, Lease]  # this process's entries that hold a lease now
    present: frozenset[str]  # this process's asked-about entries still queued
    queued: int  # live entries, ours included
    full: bool  # the request enqueued by this cycle was refused: max_queued


@final
class _Waiter:
    __slots__ = ("entry_id", "error", "event", "lease", "queued")

    def __init__(self, entry_id: str) -> None:
        self.entry_id = entry_id
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
        "_beat_at",
        "_channel",
        "_kick",
        "_listen",
        "_listener",
        "_owner",
        "_owns_pool",
        "_poller",
        "_pool",
        "_q",
        "_queue_entry_ttl",
        "_settings_json",
        "_start_lock",
        "_started",
        "_waiters",
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
                if self.ensure_schema:
                    await self._run(self._create_schema)
                await self._run(self._register)
            except BaseException:
                if self._owns_pool:  # a limiter that failed to start holds no connections
                    with anyio.CancelScope(shield=True):
                        await self._pool.close()
                raise
            self._started = True

    async def aclose(self) -> None:
        """Stop the poller and the listener, and close the pool if the limiter made it."""
        for task in (self._poller, self._listener):
            if task is not None:
                task.cancel()
        for task in (self._poller, self._listener):
            if task is not None:
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(task, return_exceptions=True)
        self._poller = self._listener = None
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
        """Active and queued requests across every process, in total and per workload."""
        await self.start()
        rows = await self._run(self._stats_rows)
        active: dict[str, int] = {}
        queued: dict[str, int] = {}
        for kind, workload, count in rows:
            (active if kind == "active" else queued)[workload] = count
        return self._stats(active, queued)

    # -- the Limiter protocol -------------------------------------------------------------

    async def acquire(self, request: AcquireRequest[W]) -> Lease:
        """Wait for a slot (see `slotwise.Limiter`); safe to cancel at any point.

        Raises:
            ConcurrencyTimeoutError: no slot before the deadline or ``max_wait``.
            ConcurrencyQueueFullError: ``max_queued`` requests were already waiting.
            ConcurrencyConfigError: unknown workload, limits changed, or not asyncio.
            psycopg.Error: the database failed (the runtime reports it as
                ``ConcurrencyLimiterError``).
        """
        await checkpoint_if_cancelled()
        workload = resolve_workload(self._settings, request.workload)
        await self.start()
        started = anyio.current_time()
        wait = math.inf if request.deadline is None else request.deadline - started
        max_wait = self._settings.workloads[workload].max_wait
        if max_wait is not None:
            wait = min(wait, max_wait)
        wait = max(wait, 0.0)
        waiter = _Waiter(str(uuid.uuid4()))
        self._waiters[waiter.entry_id] = waiter
        queued = True  # the entry may exist in the database: clean up on the way out
        try:
            with anyio.CancelScope(shield=True):
                cycle = await self._run(
                    partial(
                        self._cycle,
                        enqueue=(waiter.entry_id, workload, request.request_id, wait),
                        asked=[waiter.entry_id],
                    ),
                    retry=False,
                )
            waiter.queued = True
            self._deliver(cycle.granted)
            if waiter.lease is not None:
                await checkpoint_if_cancelled()
                return waiter.lease
            if cycle.full:
                queued = False
                raise ConcurrencyQueueFullError(
                    f"{cycle.queued} requests are already waiting "
                    f"(max_queued={self._settings.max_queued})"
                )
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
            cycle = await self._run(partial(self._cycle, release=lease.lease_id))
            self._deliver(cycle.granted)

    # -- the poller: one per limiter per process ------------------------------------------

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_loop())
        if self._listen and (self._listener is None or self._listener.done()):
            self._listener = asyncio.get_running_loop().create_task(self._listen_loop())

    async def _poll_loop(self) -> None:
        # Full allocation cycles every poll_interval (they also sweep dead processes'
        # leases and entries, and refresh this process's entries); in between, a
        # notification that another process granted us a slot triggers a lock-free read.
        interval = min(self.poll_interval, self._queue_entry_ttl / 3)
        next_cycle = anyio.current_time() + interval
        self._kick = anyio.Event()
        while self._waiters:
            with anyio.move_on_after(max(next_cycle - anyio.current_time(), 0)):
                await self._kick.wait()
            # A notification that arrives from now on is seen by the next round.
            self._kick = anyio.Event()
            asked = list(self._waiters)
            try:
                if anyio.current_time() >= next_cycle:
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
        cycle = await self._run(partial(self._cycle, asked=asked, heartbeat=beat))
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
                    entry_id: Lease(lease_id=lease_id, workload=workload, expires_at=expires)
                    for owner, entry_id, lease_id, workload, expires in grants
                    if owner == self._owner
                }
            )
            return
        owners = message.get("k") if isinstance(message, dict) else None
        if (owners == "*" or self._owner in (owners or ())) and self._kick is not None:
            self._kick.set()

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

    async def _create_schema(self, conn: Conn) -> None:
        # Many workers may start at once on a new database: the advisory lock (released at
        # commit, so it works through PgBouncer) lets one create the tables at a time.
        cur = await conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL", [f"{_quote(self.schema)}.leases"], prepare=False
        )
        row = await cur.fetchone()
        if row is not None and row[0]:
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
        if row[0]:
            return
        if self.on_conflict == "replace":
            await conn.execute(q.replace_limits, [self._settings_json, self.name], prepare=False)
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
        enqueue: tuple[str, str, str, float] | None = None,
        release: str | None = None,
        asked: list[str] | None = None,
        heartbeat: bool = False,
    ) -> _Cycle:
        """One allocation: lock, sweep, load, ``allocate``, grant; inside the caller's
        transaction.

        The order matters. The lock comes first, then expired leases are deleted in their
        own statement (a concurrent renewal either committed before it, and the lease
        survives, or finds the row gone), and only then is the snapshot loaded, in a new
        statement that sees everything committed before the lock was granted.
        """
        q = self._q
        name = self.name
        # In pipeline mode (see _run) everything up to the load's fetch is one round trip.
        locked = await conn.execute(q.lock_limiter, [self._settings_json, name], prepare=False)
        await conn.execute(
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
        if enqueue is not None:
            entry_id, workload, request_id, wait = enqueue
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
                },
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
        self._check_lock(await locked.fetchone())
        loaded = await cur.fetchone()
        assert loaded is not None
        active_rows, queued, head_rows, mine_rows, present_rows, now = loaded
        rules = self._settings.rules
        active = {w: n for w, n in (active_rows or {}).items() if w in rules.workloads}
        queues: dict[str, list[_Entry]] = {}
        for entry_id, workload, micros, seq, owner in head_rows or []:
            if workload in rules.workloads:
                queues.setdefault(workload, []).append(
                    _Entry(entry_id=entry_id, workload=workload, key=(micros, seq), owner=owner)
                )
        grants = allocate(rules, active, queues, order=lambda e: e.key)
        granted = {
            entry_id: Lease(lease_id=lease_id, workload=workload, expires_at=float(expires))
            for entry_id, lease_id, workload, expires in mine_rows or []
        }
        full = False
        if enqueue is not None and enqueue[0] not in {e.entry_id for e in grants}:
            # Not granted now: it waits, unless the queue is full or it may not wait.
            waiting_before = queued - 1
            maximum = self._settings.max_queued
            if (maximum is not None and waiting_before >= maximum) or enqueue[3] <= 0:
                full = maximum is not None and waiting_before >= maximum
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
                    )
            queued -= len(grants)
        return _Cycle(
            granted=granted,
            present=frozenset(str(e) for e in present_rows or []),
            queued=queued,
            full=full,
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
            str(entry_id): Lease(lease_id=str(lease_id), workload=workload, expires_at=expires)
            for entry_id, lease_id, workload, expires in await cur.fetchall()
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

    async def _stats_rows(self, conn: Conn) -> list[tuple[str, str, int]]:
        cur = await conn.execute(self._q.stats, {"name": self.name}, prepare=False)
        return await cur.fetchall()

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
    default workload and poll interval are each process's own)."""
    return {
        "max_concurrent": settings.max_concurrent,
        "max_queued": settings.max_queued,
        "workloads": {
            name: {
                "max_concurrent": rule.ceiling,
                "reserved": rule.reserved,
                "priority": rule.priority,
                "max_wait": settings.workloads[name].max_wait,
            }
            for name, rule in settings.rules.workloads.items()
        },
    }


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
        "drop_entry",
        "enqueue",
        "fetch_mine",
        "grant",
        "insert_limiter",
        "load",
        "lock_limiter",
        "renew",
        "replace_limits",
        "stats",
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
        self.replace_limits = q(
            "UPDATE {s}.limiters SET settings = %s::jsonb, updated_at = clock_timestamp() "
            "WHERE name = %s"
        )
        # Expired leases (and the one being released) go; so do other processes' entries
        # that are stale or past their deadline. This process's own entries are refreshed.
        self.sweep = q(
            """
            WITH gone AS (
                DELETE FROM {s}.leases
                WHERE limiter = %(name)s
                  AND (expires_at <= clock_timestamp() OR lease_id = %(release)s::uuid)
                RETURNING 1
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
                   (SELECT count(*) FROM beat)
            """
        )
        self.enqueue = q(
            """
            INSERT INTO {s}.queue (entry_id, limiter, workload, owner, request_id,
                                   enqueued_at, deadline, stale_at, lease_ttl)
            VALUES (%(entry_id)s, %(name)s, %(workload)s, %(owner)s, %(request_id)s,
                    clock_timestamp(),
                    clock_timestamp() + make_interval(secs => %(wait)s),
                    clock_timestamp() + make_interval(secs => %(entry_ttl)s),
                    %(lease_ttl)s)
            """
        )
        # The snapshot the allocation needs: active leases per workload, the number of live
        # entries, the first max_concurrent live entries of each workload (no more can be
        # granted at once), and the leases already granted to the entries asked about.
        self.load = q(
            """
            WITH live AS (
                SELECT entry_id, workload, enqueued_at, seq, owner FROM {s}.queue
                WHERE limiter = %(name)s AND stale_at > clock_timestamp()
                  AND (deadline IS NULL OR deadline > clock_timestamp()
                       OR entry_id = %(fresh)s::uuid)
            )
            SELECT
                (SELECT json_object_agg(workload, n) FROM (
                    SELECT workload, count(*) AS n FROM {s}.leases
                    WHERE limiter = %(name)s GROUP BY workload) a),
                (SELECT count(*) FROM live),
                (SELECT json_agg(json_build_array(entry_id, workload, micros, seq, owner)
                                 ORDER BY micros, seq)
                 FROM (SELECT entry_id, workload, seq, owner,
                              (extract(epoch FROM enqueued_at) * 1000000)::bigint AS micros,
                              row_number() OVER (PARTITION BY workload
                                                 ORDER BY enqueued_at, seq) AS rank
                       FROM live) h
                 WHERE rank <= %(heads)s),
                (SELECT json_agg(json_build_array(entry_id, lease_id, workload,
                                                  extract(epoch FROM expires_at)))
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
                SELECT * FROM unnest(%(entries)s::uuid[], %(leases)s::uuid[])
                    AS g(entry_id, lease_id)
            ), d AS (
                DELETE FROM {s}.queue q USING g
                WHERE q.entry_id = g.entry_id AND q.limiter = %(name)s
                RETURNING q.entry_id, g.lease_id, q.workload, q.owner, q.request_id,
                          q.lease_ttl
            ), i AS (
                INSERT INTO {s}.leases (lease_id, limiter, workload, owner, entry_id,
                                        request_id, granted_at, expires_at)
                SELECT lease_id, %(name)s, workload, owner, entry_id, request_id,
                       clock_timestamp(), clock_timestamp() + make_interval(secs => lease_ttl)
                FROM d
                RETURNING entry_id, lease_id, workload, owner, expires_at
            ), n AS (
                -- The grants of other processes, for their listeners; a payload must stay
                -- under 8000 bytes, so a long one shrinks to "poll now" for those owners.
                SELECT json_build_object('g', json_agg(json_build_array(
                           owner, entry_id, lease_id, workload,
                           extract(epoch FROM expires_at)::float8)))::text AS grants,
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
            "extract(epoch FROM expires_at)::float8 FROM {s}.leases "
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
