"""The per-process coordinator of a PostgresLimiter. In each process one poller per limiter
runs the rounds that carry the requests, withdrawals and releases of every local task, and
hands their grants to the local waiters; a listener wakes it when another process granted
it a slot; what held slots learn from the provider is stored by the next round; and each
round's commit brings the limits in force and when time alone can grant something.

`Coordinator` builds on `_transactions.Transactions` (what runs in the database);
`_limiter.PostgresLimiter` (the public face) builds on it."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import anyio
import psycopg
from psycopg import sql

from .._config import Settings, build_settings
from .._core.rates import Bank
from .._core.state import cost_error
from .._errors import ConcurrencyConfigError, ConcurrencyLimiterError, ConcurrencyQueueFullError
from .._protocol import Lease, W
from ._round import Cycle, Learned, Pushback, Release, Waiter, cost_of, unsucceeded
from ._stored import settings_kwargs
from ._transactions import Conn, Transactions, resolve

__all__ = ("Coordinator",)

_logger = logging.getLogger("slotwise")

# TCP keepalive of the listening connection, unless its conninfo sets its own: a connection
# that died without a word (a half-open socket) is noticed within about a minute.
_KEEPALIVE = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}


class Coordinator(Transactions[W]):
    """PostgresLimiter's poller, listener and the bookkeeping of its rounds in this process.

    The state they use is declared here (and in `Transactions`) and set by
    ``PostgresLimiter.__init__``.
    """

    __slots__ = (
        "_abandoned",
        "_alive_at",
        "_applying",
        "_backoffs",
        "_base",
        "_beat_at",
        "_flush_kick",
        "_flusher",
        "_kick",
        "_learned",
        "_listen",
        "_listener",
        "_listening",
        "_paused_until",
        "_pending",
        "_poller",
        "_releases",
        "_rounds",
        "_sending",
        "_waiters",
        "_wake_at",
    )

    _abandoned: dict[str, float]
    _alive_at: float
    _applying: anyio.Event | None
    _backoffs: int
    _base: Settings
    _beat_at: float
    _flush_kick: anyio.Event | None
    _flusher: asyncio.Task[None] | None
    _kick: anyio.Event | None
    _learned: list[Learned]
    _listen: bool | str
    _listener: asyncio.Task[None] | None
    _listening: Conn | None
    _paused_until: float
    _pending: dict[str, Waiter]
    _poller: asyncio.Task[None] | None
    _releases: dict[str, Release]
    _rounds: anyio.Event | None
    _sending: dict[str, Release]
    _waiters: dict[str, Waiter]
    _wake_at: float

    # -- the poller: one per limiter per process ------------------------------------------

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_loop())
        if self._listen and (self._listener is None or self._listener.done()):
            self._listener = asyncio.get_running_loop().create_task(self._listen_loop())

    def _wake_poller(self) -> None:
        self._ensure_poller()
        if self._kick is not None:
            self._kick.set()

    async def _poll_loop(self) -> None:
        # The one task that talks to the database for this process's requests and releases
        # (they only wait for its answers, so their deadlines and cancellations hold
        # whatever the database does). A full allocation cycle runs when requests are to be
        # enqueued (in arrival order, as one batch), withdrawn or released (all that arrived
        # since the last round go in one transaction: a group commit of its tasks), every
        # poll_interval (it also sweeps dead processes' leases and entries, and says that
        # this process is alive), and when time alone can grant something (a bucket
        # refills, a pause ends: each cycle computes when); in between, a notification that
        # another process granted us a slot triggers a lock-free read.
        interval = min(self.poll_interval, self._queue_entry_ttl / 3)
        next_cycle = anyio.current_time()
        rest = 0.0
        self._kick = anyio.Event()
        self._rounds = anyio.Event()
        try:
            while self._waiters or self._abandoned or self._releases:
                if not self._pending and not self._abandoned and not self._releases:
                    due = min(next_cycle, self._wake_at)
                    with anyio.move_on_after(max(due - anyio.current_time(), 0)):
                        await self._kick.wait()
                # A notification that arrives from now on is seen by the next round.
                self._kick = anyio.Event()
                batch = list(self._pending.values())
                self._pending.clear()
                withdraw = self._withdrawals()
                # Releases that arrive from now on go in the next round.
                releases = self._sending = self._releases
                self._releases = {}
                # Entries enqueued by earlier rounds: committed before this round began.
                asked = list(self._waiters.keys() - {waiter.entry_id for waiter in batch})
                try:
                    due = min(next_cycle, self._wake_at)
                    if batch or withdraw or releases or anyio.current_time() >= due:
                        next_cycle = anyio.current_time() + interval
                        await self._poll_cycle(batch, withdraw, asked, releases)
                    else:
                        granted = await self._run(partial(self._fetch, asked=asked), read=True)
                        self._deliver(granted)
                except Exception as exc:
                    # Fail closed: every local waiter raises (the runtime reports a limiter
                    # error); the entries of this batch may exist: their requests withdraw them.
                    for entry_id in [*asked, *(waiter.entry_id for waiter in batch)]:
                        waiter = self._waiters.pop(entry_id, None)
                        if waiter is not None:
                            waiter.error = exc
                            waiter.event.set()
                    for done in releases.values():
                        done.error = exc
                    rest = interval if withdraw else 0.0  # to try them again, not in a loop
                except BaseException:
                    # Stopped by aclose(): whether this round committed is not known, so its
                    # releases go back for aclose() to send again.
                    self._releases.update(releases)
                    releases = {}
                    raise
                finally:
                    self._sending = {}
                    for done in releases.values():
                        done.event.set()
                if rest:
                    await anyio.sleep(rest)
                    rest = 0.0
                rounds, self._rounds = self._rounds, anyio.Event()
                rounds.set()
        finally:
            self._kick = None
            if self._rounds is not None:
                self._rounds.set()
                self._rounds = None

    def _withdrawals(self) -> list[str]:
        """The abandoned entries to withdraw now; those old enough to have gone stale, and
        whose slot has expired, are forgotten (the database dropped them by itself)."""
        horizon = anyio.current_time() - self._queue_entry_ttl - self.lease_ttl
        for entry_id, since in list(self._abandoned.items()):
            if since < horizon:
                del self._abandoned[entry_id]
        return list(self._abandoned)

    async def _poll_cycle(
        self,
        batch: list[Waiter],
        withdraw: list[str],
        asked: list[str],
        releases: dict[str, Release],
    ) -> None:
        began = anyio.current_time()
        beat = began - self._beat_at >= self._queue_entry_ttl / 3
        # Once per poll interval is enough (its entries stay grantable for five), not at
        # every round: a busy process runs many rounds per interval.
        alive = began - self._alive_at >= min(self.poll_interval, self._queue_entry_ttl / 3)
        cycle = await self._run_cycle(
            enqueue=batch,
            withdraw=withdraw,
            release=list(releases),
            failed=unsucceeded(releases),
            asked=asked,
            heartbeat=beat,
            alive=alive,
            retry=not batch,
        )
        if alive or batch:
            self._alive_at = began
        # Committed: the releases are done, even when the limits turn out to be replaced
        # (a lease is released whatever limits are stored now).
        for done in releases.values():
            done.event.set()
        releases.clear()
        if beat:
            self._beat_at = anyio.current_time()
        for entry_id in withdraw:
            self._abandoned.pop(entry_id, None)
        for waiter in batch:
            waiter.since = cycle.since.get(waiter.entry_id)
            refused = cycle.refused.get(waiter.entry_id)
            if refused is not None and self._waiters.pop(waiter.entry_id, None) is not None:
                waiter.refused = True
                if refused != "no-wait":
                    waiter.error = ConcurrencyQueueFullError(refused)
                waiter.event.set()
        if cycle.error is not None:
            raise cycle.error
        # Entries committed before this cycle began are in its snapshot: if one is neither
        # queued nor granted there, it was dropped.
        self._deliver(cycle.granted, cycle.present, asked)

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
                if waiter is None:
                    continue
                if anyio.current_time() >= waiter.until:
                    waiter.refused = True  # swept past its deadline: a timeout
                else:
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
                await resolve(self._pool.conninfo),
                await resolve(self._pool.kwargs),
            )
            kwargs = dict(kwargs or {})
        kwargs["autocommit"] = True
        # It waits in silence for hours: TCP keepalive notices a peer gone without a word.
        given = {**psycopg.conninfo.conninfo_to_dict(conninfo), **kwargs}
        kwargs.update({key: value for key, value in _KEEPALIVE.items() if key not in given})
        delay = self.poll_interval
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(conninfo, **kwargs)
                async with conn:
                    self._listening = conn
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
            finally:
                self._listening = None
            await anyio.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _notified(self, payload: str) -> None:
        """A notification: another process granted slots to these owners (``"*"``: to
        owners too many to list), sent at its commit. Any role may send one: it only makes
        the poller read this process's grants from the database now, never a grant itself."""
        try:
            message = json.loads(payload)
        except ValueError:
            return
        owners = message.get("k") if isinstance(message, dict) else None
        if owners != "*" and not (isinstance(owners, list) and self._owner in owners):
            return
        if self._kick is not None:
            self._kick.set()

    # -- what held slots learn from the provider -------------------------------------------

    def _push(self, item: Learned, urgent: bool) -> None:
        """Keep ``item`` for this process's next transaction, and make sure one comes: at
        once when ``urgent`` (a pause), else within ``poll_interval`` (the slot's release
        usually comes first and stores it)."""
        self._learned.append(item)
        if self._flusher is None or self._flusher.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop: the next allocation stores it
                return
            self._flusher = loop.create_task(self._flush())
        elif urgent and self._flush_kick is not None:
            self._flush_kick.set()

    async def _flush(self) -> None:
        while self._learned:
            if not any(isinstance(item, Pushback) for item in self._learned):
                self._flush_kick = anyio.Event()
                with anyio.move_on_after(self.poll_interval):
                    await self._flush_kick.wait()
                self._flush_kick = None
                if not self._learned:
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

    async def _run_cycle(self, *, retry: bool = True, **kwargs: Any) -> Cycle:
        """One allocation cycle (`_cycle`) in its own transaction, storing what this process
        learned from the provider since its last one; then what it found is applied here.

        The cycle that stores a pause must commit before any later cycle of this process
        takes the lock: a refused request's release, coming next, must not hand its slot
        to a waiter during the pause. So a cycle that starts while one stores waits for it.
        """
        while self._applying is not None:
            await self._applying.wait()
        pending, self._learned = self._learned, []
        if pending:
            self._applying = anyio.Event()
        try:
            cycle = await self._run(partial(self._cycle, pending=pending, **kwargs), retry=retry)
        except BaseException:
            self._learned[:0] = pending  # not stored: the next transaction tries again
            raise
        finally:
            if pending:
                applying, self._applying = self._applying, None
                if applying is not None:
                    applying.set()
        if cycle.error is None:  # else nothing was read: what this process knows stands
            self._settle(cycle)
        return cycle

    def _settle(self, cycle: Cycle) -> None:
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
        bank = Bank(settings.rules.buckets, 0.0)
        for entry_id, waiter in list(self._waiters.items()):
            error: ConcurrencyConfigError | None
            if waiter.workload not in settings.workloads:
                error = ConcurrencyConfigError(
                    f"workload {waiter.workload!r} was removed from limiter {self.name!r} by "
                    "set_limits() while this request waited"
                )
            elif waiter.tokens:
                # A bucket made smaller than its estimate: it fails as it would at once.
                error = cost_error(bank, waiter.workload, cost_of(waiter.tokens))
            else:
                error = None
            if error is not None:
                del self._waiters[entry_id]
                if self._pending.pop(entry_id, None) is not None:
                    waiter.refused = True  # never enqueued: nothing to withdraw
                waiter.error = error
                waiter.event.set()

    def _settings_from(self, limits: Mapping[str, Any] | None) -> Settings:
        """The settings of the limits stored by `set_limits()` (None: those given here),
        with this process's own lease_ttl and, if it still exists, default workload."""
        if limits is None:
            return self._base
        kwargs = settings_kwargs(limits)
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
