"""Lease renewal for every held slot of an event loop, scheduled by one task, not one per slot.

The keeper is a system task of the running event loop, started when the first slot is held.
Held slots are kept in insertion-ordered groups, one per lease TTL, so that the slot due
first is always at the front of its group, adding and removing a slot is O(1) (a retry due
before later slots is inserted in order), and a released slot leaves nothing behind. Each
renewal runs in a short task of its own, so one that hangs delays no other. Each lease is renewed every third of its TTL; a renewal
that raises is retried until the lease would have expired; a lease the limiter no longer holds
(or one that expires while its renewals fail) is lost, which cancels the slot's body.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import anyio

from .._config import DEFAULT_LEASE_TTL
from .loop import loop_identity, now

if TYPE_CHECKING:
    from .lifecycle import Slot

__all__ = ("DEFAULT_LEASE_TTL", "forget", "lease_ttl", "track")

_RETRY_FRACTION = 0.1  # after a failed renewal, retry after this fraction of the TTL
_IDLE_LINGER = 5.0  # seconds an idle keeper waits for new slots before it ends


def lease_ttl(limiter: Any) -> float:
    """The limiter's ``lease_ttl`` in seconds, or 30 s when it has none."""
    ttl = getattr(limiter, "lease_ttl", None)
    if isinstance(ttl, int | float) and not isinstance(ttl, bool) and 0 < ttl < math.inf:
        return float(ttl)
    return DEFAULT_LEASE_TTL


class _Keeper:
    __slots__ = ("_alarm", "_groups", "_renewing", "_running", "_tasks", "_wake")

    def __init__(self) -> None:
        # ttl -> slots in due order (slot -> when it is next due)
        self._groups: dict[float, OrderedDict[Slot, float]] = {}
        self._running = False
        self._renewing = 0  # renewals in flight
        self._alarm = math.inf  # when the sleeping keeper wakes up by itself
        self._wake: anyio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def add(self, slot: Slot, due: float, ttl: float) -> None:
        group = self._groups.get(ttl)
        if group is None:
            group = self._groups[ttl] = OrderedDict()
        if group and due < next(reversed(group.values())):
            # A retry comes due before slots added earlier: keep the group sorted.
            later = [(s, d) for s, d in group.items() if d > due]
            for s, _ in later:
                del group[s]
            group[slot] = due
            group.update(later)
        else:
            group[slot] = due
        if not self._running:
            self._running = True
            _spawn(self)
        elif due < self._alarm and self._wake is not None:
            self._wake.set()

    def remove(self, slot: Slot, ttl: float) -> None:
        group = self._groups.get(ttl)
        if group is not None:
            group.pop(slot, None)

    def _next_due(self) -> float | None:
        dues = [next(iter(g.values())) for g in self._groups.values() if g]
        return min(dues) if dues else None

    async def main(self) -> None:
        idle_since: float | None = None
        try:
            # Renewals run side by side in this task group: one that hangs (a stuck database
            # connection) must not hold up the renewal of any other slot.
            async with anyio.create_task_group() as tg:
                while True:
                    due = self._next_due()
                    current = now()
                    if due is not None and due <= current:
                        idle_since = None
                        for slot, ttl in self._pop_due(current):
                            self._renewing += 1
                            tg.start_soon(self._renew, slot, ttl)
                        continue
                    if due is None and not self._renewing:
                        idle_since = current if idle_since is None else idle_since
                        if current - idle_since >= _IDLE_LINGER:
                            return
                        self._alarm = idle_since + _IDLE_LINGER
                    else:
                        idle_since = None
                        self._alarm = math.inf if due is None else due
                    self._wake = anyio.Event()
                    with anyio.move_on_after(self._alarm - current):
                        await self._wake.wait()
                    self._wake = None
        finally:
            self._running = False
            self._wake = None
            self._alarm = math.inf

    def _pop_due(self, current: float) -> list[tuple[Slot, float]]:
        batch: list[tuple[Slot, float]] = []
        for ttl, group in self._groups.items():
            while group and next(iter(group.values())) <= current:
                slot, _ = group.popitem(last=False)
                batch.append((slot, ttl))
        return batch

    async def _renew(self, slot: Slot, ttl: float) -> None:
        try:
            await self._renew_once(slot, ttl)
        finally:
            self._renewing -= 1
            if not self._renewing and self._wake is not None:
                self._wake.set()  # the keeper may now start to linger

    async def _renew_once(self, slot: Slot, ttl: float) -> None:
        started = now()
        try:
            # A renewal that hangs must not outlive the lease it is trying to save.
            with anyio.fail_after(max(0.0, slot._renewed_at + ttl - started)):
                renewed = await slot.limiter.renew(slot.lease)
        except Exception as exc:
            if slot._released:
                return
            slot._renewal_failed(exc)
            expires = slot._renewed_at + ttl
            current = now()
            if current >= expires:
                slot._lose()
            else:
                self.add(slot, min(expires, current + ttl * _RETRY_FRACTION), ttl)
            return
        if slot._released:
            return
        if renewed is None:
            slot._lose()
            return
        slot.lease = renewed
        slot._renewed_at = started
        self.add(slot, started + ttl / 3, ttl)


def _spawn(keeper: _Keeper) -> None:
    loop = loop_identity()
    if isinstance(loop, asyncio.AbstractEventLoop):
        # A fresh context: not the one of whichever request happened to start the keeper.
        task = loop.create_task(keeper.main(), context=contextvars.Context())
        keeper._tasks.add(task)
        task.add_done_callback(keeper._tasks.discard)
    else:
        import trio

        trio.lowlevel.spawn_system_task(keeper.main)


# The keeper of the loop that ran most recently: one identity check on the hot path. A
# program runs one loop at a time; a new loop (a new test, a new anyio.run) gets a new keeper.
_keepers: tuple[object, _Keeper] = (object(), _Keeper())


def _keeper() -> _Keeper:
    global _keepers
    loop = loop_identity()
    entry = _keepers  # read once: another thread may replace it meanwhile
    if entry[0] is not loop:
        entry = _keepers = (loop, _Keeper())
    return entry[1]


def track(slot: Slot) -> None:
    """Renew ``slot``'s lease until :func:`forget` is called or the lease is lost."""
    ttl = slot._ttl = lease_ttl(slot.limiter)
    slot._keeper = _keeper()
    slot._keeper.add(slot, slot._renewed_at + ttl / 3, ttl)


def forget(slot: Slot) -> None:
    """Stop renewing ``slot`` (it was released)."""
    if slot._keeper is not None:
        slot._keeper.remove(slot, slot._ttl)
