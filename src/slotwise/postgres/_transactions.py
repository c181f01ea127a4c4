"""What a PostgresLimiter runs in the database: its transactions (each in a task of its own,
every step bounded by ``db_timeout``), the schema checks, the limiter's registration, the
allocation round, and the reads and writes of renewals, grants and stats.

`Transactions` is the first layer of PostgresLimiter: `_coordinator.Coordinator` (the poller
and the listener of each process) builds on it, and `_limiter.PostgresLimiter` (the public
face) on that. The statements are in `_sql`, the tables in `_schema`."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio
import psycopg
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from .._base import BuiltinLimiter
from .._config import Settings
from .._core.rules import occupied, slots_tried
from .._core.state import (
    allocate_paced,
    carry_over,
    cost_error,
    paced_wake,
    pause,
    readapt,
    retire,
)
from .._errors import ConcurrencyConfigError, ConcurrencyLimiterError
from .._protocol import Lease, W
from ._round import (
    Charge,
    Cycle,
    Entry,
    Learned,
    Limit,
    Pushback,
    Waiter,
    cost_of,
    enqueued_at,
    entry_cost,
    entry_key,
)
from ._schema import NEWEST_COLUMN, NEWEST_TABLE, schema_ddl
from ._sql import Queries, quote
from ._stored import Pace, adaptive_params, limits_json

__all__ = ("MAX_SECONDS", "Conn", "Transactions", "resolve")

T = TypeVar("T")
Conn = psycopg.AsyncConnection[TupleRow]

_logger = logging.getLogger("slotwise")

# The longest duration the database's timestamps take in stride (clock_timestamp() plus more
# than about 290,000 years overflows): about 31 years. TTLs are checked against it; a longer
# wait waits with no deadline in the database (this process still ends it on time).
MAX_SECONDS = 1e9


class Transactions(BuiltinLimiter[W]):
    """PostgresLimiter's transactions and its allocation round, one per process's round.

    The state they use is declared here and set by ``PostgresLimiter.__init__``.
    """

    __slots__ = (
        "_channel",
        "_offset",
        "_owner",
        "_pool",
        "_prepare",
        "_q",
        "_queue_entry_ttl",
        "_settings_json",
        "_tasks",
        "_version",
        "db_timeout",
        "on_conflict",
        "poll_interval",
        "schema",
        "synchronous_commit",
    )

    _channel: str
    _offset: float | None
    _owner: str
    _pool: AsyncConnectionPool[Any]
    _prepare: bool
    _q: Queries
    _queue_entry_ttl: float
    _settings_json: str
    _tasks: set[asyncio.Task[Any]]
    _version: int
    db_timeout: float
    on_conflict: Literal["error", "replace"]
    poll_interval: float
    schema: str
    synchronous_commit: bool

    if TYPE_CHECKING:
        # The coordinator's (see _coordinator): the limits in force, and taking them.

        def _adopt(self, settings: Settings, version: int) -> None: ...

        def _settings_from(self, limits: Mapping[str, Any] | None) -> Settings: ...

    # -- transactions ---------------------------------------------------------------------

    async def _run(
        self,
        body: Callable[[Conn], Awaitable[T]],
        *,
        retry: bool = True,
        read: bool = False,
        ddl: bool = False,
    ) -> T:
        """Run ``body`` in one transaction on a pooled connection, in a task of its own.

        The caller waits for it, and may be cancelled meanwhile: the transaction goes on to
        its end (a query interrupted midway would leave its connection in an unknown state,
        and psycopg would warn), so nothing it began is left half done. Every step is bounded
        by ``db_timeout`` (see _transaction); the caller waits three times that at most.
        ``read``: the body is one statement that only reads, run without a transaction when
        the connection is in autocommit mode (one round trip instead of two). ``ddl``: the
        body changes the schema (see _transaction).
        """
        task = asyncio.get_running_loop().create_task(self._transaction(body, retry, read, ddl))
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        bound = 3 * self.db_timeout
        with anyio.move_on_after(bound):
            return await asyncio.shield(task)
        raise TimeoutError(f"the database did not answer within {bound:g}s (3 x db_timeout)")

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: its caller may have stopped waiting for it

    async def _transaction(
        self,
        body: Callable[[Conn], Awaitable[T]],
        retry: bool,
        read: bool = False,
        ddl: bool = False,
    ) -> T:
        """One transaction: a connection within ``db_timeout``, then the body under a
        ``lock_timeout`` and a ``statement_timeout`` of ``db_timeout``.

        A connection that turns out broken before anything was committed (the pool handed
        out a connection the server has since closed) is retried on another; after a server
        restart every pooled connection may be broken, so up to the pool's size plus one
        attempts are made. ``retry`` also allows a retry after commit was attempted
        (idempotent bodies). Any other failure (a timeout included) is raised at once.

        With prepared statements, a ``ddl`` transaction prepares nothing and is followed by
        a statement that prepares nothing: psycopg forgets a connection's prepared
        statements after an ALTER or a DROP and deallocates them on the server after its
        next statement, which a prepared one must not be (the next round would find it
        gone). A failed transaction's rollback deallocates them all, and psycopg forgets
        them too. A statement the server lost (see _stale) failed, so nothing was committed:
        the transaction is run again, unprepared.
        """
        attempts = self._pool.max_size + 1
        bound = f"{max(1, round(self.db_timeout * 1000))}ms"
        for attempt in range(1, attempts + 1):
            committing = False
            conn: Conn | None = None
            prepared = self._prepare
            try:
                async with self._pool.connection(timeout=self.db_timeout) as conn:
                    if read and conn.autocommit:
                        return await body(conn)
                    async with conn.pipeline(), conn.transaction():
                        await conn.execute(
                            self._q.timeouts, [bound, bound], prepare=prepared and not ddl
                        )
                        if not self.synchronous_commit:
                            await conn.execute("SET LOCAL synchronous_commit = off", prepare=False)
                        result = await body(conn)
                        committing = True
                    if ddl and prepared:
                        # The deallocation psycopg owes the server, sent now, while it believes
                        # nothing prepared.
                        await conn.execute("SELECT 1", prepare=False)
                return result
            except PoolTimeout as exc:
                raise await self._unreachable(exc) from None
            except psycopg.Error as exc:
                if prepared and self._stale(exc):
                    continue  # again, unprepared: a statement failed, so nothing was committed
                broken = conn is not None and conn.broken
                if (
                    not isinstance(exc, psycopg.OperationalError)
                    or attempt == attempts
                    or (committing and not retry)
                    or not broken
                ):
                    raise
        raise AssertionError("unreachable")

    def _stale(self, exc: psycopg.Error) -> bool:
        """Whether ``exc`` says that the server lost this limiter's prepared statements (or
        has others of the same names): something between this process and the server
        (PgBouncer in transaction mode, with ``listen=True``) does not keep them, or
        something else on these connections deallocated them. This limiter then prepares
        nothing from now on."""
        if not isinstance(
            exc, psycopg.errors.InvalidSqlStatementName | psycopg.errors.DuplicatePreparedStatement
        ):
            return False
        if self._prepare:
            self._prepare = False
            _logger.warning(
                "slotwise: limiter %r prepares no statements from now on: the server did not "
                "keep them (%s). Through PgBouncer in transaction mode, give listen=False or "
                "the server's own conninfo; else something on these connections deallocated "
                "them",
                self.name,
                exc,
            )
        return True

    async def _unreachable(self, exc: PoolTimeout) -> PoolTimeout:
        """No connection came within ``db_timeout``: say why (a connection of our own tells
        whether the database refuses, or the pool's connections are all held)."""
        cause: BaseException
        try:
            conninfo = await resolve(self._pool.conninfo)
            kwargs = dict(await resolve(self._pool.kwargs) or {})
            with anyio.fail_after(self.db_timeout):
                probe = await psycopg.AsyncConnection.connect(conninfo, **kwargs)
            await probe.close()
        except (psycopg.Error, OSError, TimeoutError) as error:
            cause = error
            what = f"no connection to the database within db_timeout={self.db_timeout:g}s: {error}"
        else:
            cause = exc
            what = (
                f"no free connection in the pool within db_timeout={self.db_timeout:g}s "
                f"(max_size={self._pool.max_size}): its connections are all in use"
            )
        timeout = PoolTimeout(what)
        timeout.__cause__ = cause
        return timeout

    async def _schema_state(self, conn: Conn) -> tuple[bool, bool]:
        """Whether the tables exist, and whether they have this version's columns."""
        table, column = NEWEST_COLUMN
        tables = f"{quote(self.schema)}.{table}"
        cur = await conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL AND EXISTS ("
            "SELECT 1 FROM pg_attribute "
            "WHERE attrelid = to_regclass(%s) AND attname = %s AND NOT attisdropped)",
            [tables, f"{quote(self.schema)}.{NEWEST_TABLE}", tables, column],
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
                f"(they lack {'.'.join(NEWEST_COLUMN)} or the {NEWEST_TABLE} table): apply "
                f"schema_sql({self.schema!r}) "
                "again (it only adds what is missing), or pass ensure_schema=True"
            )

    async def _create_schema(self, conn: Conn) -> None:
        # Many workers may start at once on a new database: the advisory lock (released at
        # commit, so it works through PgBouncer) lets one create the tables at a time. An
        # existing installation gets the columns of later versions the same way. The state
        # is read again under the lock: a worker that waited for it while another created
        # the tables must not run the DDL again, whose ALTER TABLE takes an exclusive lock
        # on tables the others already use (a deadlock with their allocations).
        if (await self._schema_state(conn))[1]:
            return
        await conn.execute(
            "SELECT pg_advisory_xact_lock(hashtext('slotwise schema'), hashtext(%s))",
            [self.schema],
            prepare=False,
        )
        if (await self._schema_state(conn))[1]:
            return
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

    # -- the allocation round -------------------------------------------------------------

    async def _cycle(
        self,
        conn: Conn,
        *,
        enqueue: Sequence[Waiter] = (),
        withdraw: Sequence[str] = (),
        release: Sequence[str] = (),
        failed: Collection[str] = (),
        asked: list[str] | None = None,
        heartbeat: bool = False,
        alive: bool = False,
        pending: Sequence[Learned] = (),
        change: Callable[[Settings], Settings] | None = None,
    ) -> Cycle:
        """One allocation: lock, sweep, load, ``allocate``, grant; inside the caller's
        transaction.

        The order matters. The lock comes first, then expired leases are deleted in their
        own statement (a concurrent renewal either committed before it, and the lease
        survives, or finds the row gone), and only then is the snapshot loaded, in a new
        statement that sees everything committed before the lock was granted.

        ``enqueue`` joins the queue in that order; ``withdraw`` leaves it, giving back any
        slot granted to those entries; ``release`` ends leases, of which ``failed`` are no
        successes; ``alive`` says that this process still waits for
        its entries (the poller says so at every cycle).

        The rates and pushback state (buckets, pause, adaptive limit, the limits in force)
        is read under the lock too and changed by the rules MemoryLimiter applies in memory
        (slotwise._core.state), at the database's ``now``: what ``pending`` brings from
        the provider, a ``change`` of the limits, the release's success, and the grants'
        costs. It is written back only when it changed.
        """
        q = self._q
        name = self.name
        began = anyio.current_time()  # before the database reads its clock (see _offset)
        # In pipeline mode (see _run) everything up to the load's fetch is one round trip.
        # The row as locked is its latest version: the rates and pushback state come with it.
        locked = await conn.execute(
            q.lock_state,
            {"settings": self._settings_json, "name": name, "version": self._version},
            prepare=self._prepare,
        )
        refused_leases = [p.lease_id for p in pending if isinstance(p, Pushback) and p.lease_id]
        marked = None
        if refused_leases:  # before the sweep, which deletes a lease being released
            marked = await conn.execute(
                q.mark_throttled, {"name": name, "leases": refused_leases}, prepare=self._prepare
            )
        swept = await conn.execute(
            q.sweep,
            {
                "name": name,
                "owner": self._owner,
                "release": list(release),
                "withdraw": list(withdraw),
                "beat": heartbeat,
                "asked": asked or [],
                "entry_ttl": self._queue_entry_ttl,
            },
            prepare=self._prepare,
        )
        if alive or enqueue:
            await conn.execute(q.alive, [self._owner, self._alive_for()], prepare=self._prepare)
        enqueued = counted = None
        bounded: list[str] = []
        if enqueue:
            enqueued = await conn.execute(
                q.enqueue,
                {
                    "entries": [w.entry_id for w in enqueue],
                    "workloads": [w.workload for w in enqueue],
                    "request_ids": [w.request_id for w in enqueue],
                    "waits": [None if w.wait > MAX_SECONDS else w.wait for w in enqueue],
                    "since": [w.since for w in enqueue],
                    "tokens": [w.tokens for w in enqueue],
                    "name": name,
                    "owner": self._owner,
                    "entry_ttl": self._queue_entry_ttl,
                    "lease_ttl": self._settings.lease_ttl,
                },
                prepare=self._prepare,
            )
            bounded = sorted(
                {
                    w.workload
                    for w in enqueue
                    if w.workload in self._settings.workloads
                    and self._settings.workloads[w.workload].max_queued is not None
                }
            )
            if bounded:
                counted = await conn.execute(
                    q.count_workloads,
                    {
                        "name": name,
                        "workloads": bounded,
                        "fresh": [w.entry_id for w in enqueue],
                    },
                    prepare=self._prepare,
                )
        cur = await conn.execute(
            q.load,
            {
                "name": name,
                "owner": self._owner,
                "heads": self._settings.max_concurrent,
                "asked": asked or [],
                # A request enqueued now may take a free slot even with no time to wait.
                "fresh": [w.entry_id for w in enqueue],
            },
            prepare=self._prepare,
        )
        locked_row = await locked.fetchone()
        if locked_row is not None and not locked_row[0] and (release or withdraw):
            # Another process stored other limits: allocating with ours would break theirs,
            # but the lease released and the entries withdrawn above go all the same.
            try:
                self._check_lock(locked_row)
            except ConcurrencyConfigError as exc:
                return Cycle(granted={}, present=frozenset(), queued=0, error=exc)
        self._check_lock(locked_row)
        assert locked_row is not None
        state_row = locked_row[2:]
        since = (
            {str(entry_id): at for entry_id, at in await enqueued.fetchall()} if enqueued else {}
        )
        epochs: dict[str, int] = {} if marked is None else dict(await marked.fetchall())
        swept_row = await swept.fetchone()
        assert swept_row is not None
        waiting_in = dict.fromkeys(bounded, 0)
        if counted is not None:
            waiting_in.update(await counted.fetchall())
        loaded = await cur.fetchone()
        assert loaded is not None
        active_rows, queued, head_rows, mine_rows, present_rows, now = loaded
        self._offset = now - began

        buckets, paused, backoffs, adaptive, version, limits, _ = state_row
        settings = self._settings
        adopted = version != self._version
        if adopted:
            settings = self._settings_from(limits)
        pace = Pace.load(settings, buckets, paused, backoffs, adaptive)
        changes: list[tuple[int, int, str]] = []
        if change is not None:
            old_limit = pace.limit(settings)
            settings = change(settings)
            version += 1
            adopted = True
            pace.bank = carry_over(pace.bank, settings.rules, now)
            pace.aimd, _ = readapt(pace.aimd, settings.rules, adaptive_params(settings))
            pace.dirty = True
            await conn.execute(
                q.store_limits,
                {"name": name, "limits": json.dumps(limits_json(settings)), "version": version},
                prepare=self._prepare,
            )
            if pace.limit(settings) != old_limit:
                changes.append((old_limit, pace.limit(settings), "set_limits"))
        for item in pending:
            pace.dirty = True
            if isinstance(item, Pushback):
                pace.paused_until, pace.backoffs = pause(
                    pace.paused_until, pace.backoffs, item.retry_after, now, item.jitter
                )
                epoch = epochs.get(item.lease_id or "")
                if epoch is not None and pace.aimd is not None:
                    old_limit = pace.aimd.limit
                    new_limit = pace.aimd.pushback(epoch)
                    if new_limit is not None:
                        changes.append((old_limit, new_limit, "pushback"))
            elif isinstance(item, Charge):
                pace.bank.refill(now)
                pace.bank.give(item.workload, "tokens", item.units)
            elif isinstance(item, Limit):
                pace.bank.learn(item.kind, item.limit, now)
            else:
                pace.bank.observe(item.kind, item.remaining, now)
        # [epoch, throttled, lease_id, workload, tried] of each lease released here, in the
        # order given.
        released = swept_row[-1] or ()
        # The slots occupied as these were released (what is held now, themselves, and the
        # reservations not in use), for an adaptive limit.
        held = dict(active_rows or {})
        for _, _, _, workload, _ in released:
            held[workload] = held.get(workload, 0) + 1
        busy = occupied(settings.rules, held)
        for epoch, throttled, lease_id, _, tried in released:
            if throttled or lease_id in failed:
                continue
            # A success: the backoff starts again from a second; an adaptive limit climbs.
            if pace.backoffs:
                pace.backoffs = 0
                pace.dirty = True
            if pace.aimd is not None:
                before = (pace.aimd.limit, pace.aimd.credit, pace.aimd.proven)
                new_limit = pace.aimd.success(int(epoch), busy, int(tried))
                after = (pace.aimd.limit, pace.aimd.credit, pace.aimd.proven)
                pace.dirty = pace.dirty or after != before
                if new_limit is not None:
                    changes.append((before[0], new_limit, "recovered"))

        active = dict(active_rows or {})
        # Leases of a workload these limits do not have (another process had other limits,
        # then on_conflict="replace", or set_limits() dropped it) count until released or
        # expired, as a workload that can take nothing more.
        rules = retire(pace.rules(settings), active)
        queues: dict[str, list[Entry]] = {}
        for entry_id, workload, micros, seq, owner, tokens, waited in head_rows or []:
            # An entry of a workload that is gone, or too large for a bucket made smaller,
            # takes and claims nothing: its process fails it when it adopts these limits.
            if workload in settings.workloads and (
                not tokens or cost_error(pace.bank, workload, cost_of(tokens)) is None
            ):
                queues.setdefault(workload, []).append(
                    Entry(
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
            entry_key,
            now=now,
            bank=pace.bank,
            paused_until=pace.paused_until,
            cost=entry_cost,
            enqueued_at=enqueued_at,
            waited=lambda entry, keys: waits.setdefault(entry.entry_id, set()).update(keys),
        )
        if grants and pace.bank:
            pace.dirty = True
        chosen = {e.entry_id for e in grants}
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
            and e.entry_id not in chosen
            and waited_for[e.entry_id] != e.waited_for
        }
        if blocked:
            await conn.execute(q.mark_waited, [json.dumps(blocked)], prepare=self._prepare)
        granted = {
            entry_id: Lease(
                lease_id=lease_id,
                workload=workload,
                expires_at=float(expires),
                waited_for=tuple(waited or ()),
            )
            for entry_id, lease_id, workload, expires, waited in mine_rows or []
        }
        refused: dict[str, str] = {}
        if enqueue:
            # Those not granted now wait, unless a queue is full or they may not wait.
            waiting = [w for w in enqueue if w.entry_id not in chosen]
            others = queued - len(grants) - len(waiting)  # waiting before this batch
            # Per bounded workload: its entries waiting before this batch, less those
            # granted now.
            fresh = {w.entry_id for w in enqueue}
            for entry in grants:
                if entry.entry_id not in fresh and entry.workload in waiting_in:
                    waiting_in[entry.workload] -= 1
            maximum = settings.max_queued
            for waiter in waiting:
                rule = settings.workloads.get(waiter.workload)
                bound = None if rule is None else rule.max_queued
                here = waiting_in.get(waiter.workload, 0)
                if waiter.wait <= 0:
                    refused[waiter.entry_id] = "no-wait"
                elif maximum is not None and others >= maximum:
                    refused[waiter.entry_id] = (
                        f"{others} requests are already waiting (max_queued={maximum})"
                    )
                elif bound is not None and here >= bound:
                    refused[waiter.entry_id] = (
                        f"{here} requests of workload {waiter.workload!r} are already "
                        f"waiting (its max_queued={bound})"
                    )
                else:
                    others += 1
                    if waiter.workload in waiting_in:
                        waiting_in[waiter.workload] = here + 1
            if refused:
                await conn.execute(q.drop_entries, [list(refused)], prepare=self._prepare)
                queued -= len(refused)
        if grants:
            # Not fetched: the grant, its notification and the commit go in one round trip.
            # The other processes learn from the notification (sent at commit) to look.
            lease_ids = [str(uuid.uuid4()) for _ in grants]
            # With an adaptive limit, the slots occupied once each was granted, in turn.
            tried = [0] * len(grants)
            if pace.aimd is not None:
                counts = dict(active)
                for i, entry in enumerate(grants):
                    counts[entry.workload] = counts.get(entry.workload, 0) + 1
                    tried[i] = slots_tried(rules, counts)
            await conn.execute(
                q.grant,
                {
                    "name": name,
                    "entries": [e.entry_id for e in grants],
                    "leases": lease_ids,
                    "waited": [json.dumps(waited_for.get(e.entry_id, ())) for e in grants],
                    "tried": tried,
                    "epoch": 0 if pace.aimd is None else pace.aimd.epoch,
                    "owner": self._owner,
                    "channel": self._channel,
                },
                prepare=self._prepare,
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
            await conn.execute(q.save_state, {"name": name, **pace.params()}, prepare=self._prepare)
        wake = paced_wake(refill_at, pace.paused_until, now)
        return Cycle(
            granted=granted,
            present=frozenset(str(e) for e in present_rows or []),
            queued=queued,
            refused=refused,
            since=since,
            settings=(settings, version) if adopted else None,
            changes=tuple(changes),
            wake=None if wake == math.inf else max(0.0, wake - now),
            paused_until=pace.paused_until,
            backoffs=pace.backoffs,
        )

    def _alive_for(self) -> float:
        """Seconds this process's entries stay grantable after its poller last said it
        waits: five poll rounds, and at least a second (a short stall of its event loop only
        defers its grants; its entries keep their places)."""
        return max(1.0, 5 * min(self.poll_interval, self._queue_entry_ttl / 3))

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

    # -- grants, renewals and stats -------------------------------------------------------

    async def _fetch(self, conn: Conn, *, asked: list[str]) -> dict[str, Lease]:
        began = anyio.current_time()
        cur = await conn.execute(self._q.fetch_mine, [asked], prepare=self._prepare)
        granted = {}
        for entry_id, lease_id, workload, expires, now, waited in await cur.fetchall():
            self._offset = now - began
            granted[str(entry_id)] = Lease(
                lease_id=str(lease_id),
                workload=workload,
                expires_at=expires,
                waited_for=tuple(waited or ()),
            )
        return granted

    async def _renew(self, conn: Conn, *, lease_id: str) -> tuple[str, float] | None:
        cur = await conn.execute(
            self._q.renew,
            {"lease_id": lease_id, "name": self.name, "ttl": self._settings.lease_ttl},
            prepare=self._prepare,
        )
        row = await cur.fetchone()
        return None if row is None else (row[0], float(row[1]))

    async def _stats_rows(self, conn: Conn) -> tuple[list[tuple[str, str, int]], tuple[Any, ...]]:
        cur = await conn.execute(self._q.stats, {"name": self.name}, prepare=self._prepare)
        state = await conn.execute(
            self._q.state, {"name": self.name, "version": self._version}, prepare=self._prepare
        )
        rows = await cur.fetchall()
        row = await state.fetchone()
        if row is None:
            raise ConcurrencyLimiterError(
                f"limiter {self.name!r} is missing from {self.schema!r}.limiters"
            )
        return rows, row


async def resolve(value: Any) -> Any:
    """A pool's conninfo or kwargs: a value, or a (possibly async) callable returning one."""
    if callable(value):
        value = value()
        if inspect.isawaitable(value):
            value = await value
    return value
