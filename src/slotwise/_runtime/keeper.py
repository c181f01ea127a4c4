"""Lease renewal for the held slots of an event loop, scheduled by one task, not one per slot.

The keeper is a system task of its event loop, started when the first slot whose lease must
be renewed is held there (slots of a limiter that ties leases to their slots, such as
`MemoryLimiter`, need none). A slot's first renewal is kept in an insertion-ordered group per
lease TTL (slots arrive in due order, so adding and removing one is O(1) and a released slot
leaves nothing behind); later renewals and retries, which complete in any order, go to a heap.
Each renewal runs in a short task of its own, so one that hangs delays no other. Each lease is
renewed every third of its TTL; a renewal that fails in any way (an exception, a cancellation
that is not the keeper's own, a hang past the lease) is reported and retried until the lease
would have expired; a lease the limiter no longer holds, or one that expires while its
renewals fail or hang, is lost, which cancels the slot's body. Nothing a limiter or a
subscriber raises stops the keeper.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import anyio

from .._config import DEFAULT_LEASE_TTL
from .loop import Loop, own_cancellation

if TYPE_CHECKING:
    from .lifecycle import Slot

__all__ = ("DEFAULT_LEASE_TTL", "lease_ttl", "track")

_RETRY_FRACTION = 0.1  # after a failed renewal, retry after this fraction of the TTL
_IDLE_LINGER = 5.0  # seconds an idle keeper waits for new slots before it ends

_logger = logging.getLogger("slotwise")


def lease_ttl(limiter: Any) -> float:
    """The limiter's `lease_ttl` in seconds, or 30 s when it has none."""
    ttl = getattr(limiter, "lease_ttl", None)
    if isinstance(ttl, int | float) and not isinstance(ttl, bool) and 0 < ttl < math.inf:
        return float(ttl)
    return DEFAULT_LEASE_TTL


class _Keeper:
    __slots__ = (
        "_alarm",
        "_deadlines",
        "_groups",
        "_later",
        "_loop",
        "_renewing",
        "_running",
        "_seq",
        "_wake",
    )

    def __init__(self, loop: Loop) -> None:
        self._loop = loop
        # A slot's first renewal: ttl -> slots in due order (slot -> due). Slots arrive in
        # due order, so adding and removing one is O(1) and a released slot leaves nothing.
        self._groups: dict[float, OrderedDict[Slot, float]] = {}
        # Later renewals and retries, which come back in any order: a heap of
        # (due, seq, slot, ttl); an entry of a slot released meanwhile is skipped when due.
        self._later: list[tuple[float, int, Slot, float]] = []
        # When the lease of a slot whose renewal is in flight runs out: a renewal that does not
        # return in time (one blocked in a thread cannot be cancelled) loses the lease then.
        self._deadlines: list[tuple[float, int, Slot]] = []
        self._seq = itertools.count()
        self._running = False
        self._renewing = 0  # renewals in flight
        self._alarm = math.inf  # when the sleeping keeper wakes up by itself
        self._wake: anyio.Event | None = None

    def add(self, slot: Slot, due: float, ttl: float) -> None:
        """Schedule a newly held slot's first renewal."""
        group = self._groups.get(ttl)
        if group is None:
            group = self._groups[ttl] = OrderedDict()
        group[slot] = due
        self._scheduled(due)

    def remaining(self, slot: Slot) -> float:
        """How long ``slot``'s lease lives yet without another renewal (at least 0.1 s)."""
        return max(0.1, slot._renewed_at + slot._ttl - self._loop.now())

    def forget(self, slot: Slot) -> None:
        """Stop renewing ``slot`` (it was released)."""
        group = self._groups.get(slot._ttl)
        if group is not None:
            group.pop(slot, None)

    def _again(self, slot: Slot, due: float, ttl: float) -> None:
        heapq.heappush(self._later, (due, next(self._seq), slot, ttl))
        self._scheduled(due)

    def _scheduled(self, due: float) -> None:
        if not self._running:
            self._running = True
            self._loop.spawn(self._main)
        elif due < self._alarm and self._wake is not None:
            self._wake.set()

    def _next_due(self) -> float | None:
        later = self._later
        while later and later[0][2]._released:
            heapq.heappop(later)
        deadlines = self._deadlines
        while deadlines and (deadlines[0][2]._released or deadlines[0][2]._lost):
            heapq.heappop(deadlines)
        dues = [next(iter(g.values())) for g in self._groups.values() if g]
        if later:
            dues.append(later[0][0])
        if deadlines:
            dues.append(deadlines[0][0])
        return min(dues) if dues else None

    async def _main(self) -> None:
        try:
            while True:
                try:
                    await self._serve()
                    return
                except Exception:
                    # A fault of the keeper's own: the slots it renews must not pay for it.
                    _logger.exception("slotwise: the lease keeper failed; it carries on")
                    await anyio.sleep(0.01)
        finally:
            self._running = False
            self._wake = None
            self._alarm = math.inf

    async def _serve(self) -> None:
        loop = self._loop
        idle_since: float | None = None
        # Renewals run side by side in this task group: one that hangs (a stuck database
        # connection) must not hold up the renewal of any other slot.
        async with anyio.create_task_group() as tg:
            while True:
                due = self._next_due()
                current = loop.now()
                if due is not None and due <= current:
                    idle_since = None
                    deadlines = self._deadlines
                    while deadlines and deadlines[0][0] <= current:
                        _, _, slot = heapq.heappop(deadlines)
                        if slot._renewed_at + slot._ttl <= current:
                            slot._lose()  # its renewal is still out, and the lease is over
                    for slot, ttl in self._pop_due(current):
                        renew_nowait = getattr(type(slot.limiter), "renew_nowait", None)
                        if renew_nowait is None:
                            self._renewing += 1
                            heapq.heappush(
                                deadlines, (slot._renewed_at + ttl, next(self._seq), slot)
                            )
                            tg.start_soon(self._renew, slot, ttl)
                            continue
                        # A limiter that renews without awaiting needs no task.
                        try:
                            renewed = renew_nowait(slot.limiter, slot.lease)
                        except BaseException as exc:
                            self._failed(slot, ttl, exc)
                        else:
                            self._renewed(slot, ttl, current, renewed)
                    continue
                if due is None and not self._renewing:
                    idle_since = current if idle_since is None else idle_since
                    self._alarm = idle_since + _IDLE_LINGER
                    # Against the alarm itself: `current - idle_since` can stay below the
                    # linger at the very time the alarm (rounded) names.
                    if current >= self._alarm:
                        return
                else:
                    idle_since = None
                    self._alarm = math.inf if due is None else due
                self._wake = anyio.Event()
                with anyio.move_on_at(self._alarm):  # the clock `current` is read from
                    await self._wake.wait()
                self._wake = None

    def _pop_due(self, current: float) -> list[tuple[Slot, float]]:
        batch: list[tuple[Slot, float]] = []
        for ttl, group in self._groups.items():
            while group and next(iter(group.values())) <= current:
                slot, _ = group.popitem(last=False)
                batch.append((slot, ttl))
        later = self._later
        while later and later[0][0] <= current:
            _, _, slot, ttl = heapq.heappop(later)
            if not slot._released:
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
        started = self._loop.now()
        try:
            # A renewal that hangs must not outlive the lease it is trying to save.
            with anyio.fail_after(max(0.0, slot._renewed_at + ttl - started)):
                renewed = await slot.limiter.renew(slot.lease)
        except BaseException as exc:
            if own_cancellation(exc, self._loop):
                raise
            self._failed(slot, ttl, exc)
        else:
            self._renewed(slot, ttl, started, renewed)

    def _renewed(self, slot: Slot, ttl: float, started: float, renewed: Any) -> None:
        if slot._released or slot._lost:
            return
        if renewed is None:
            slot._lose()
            return
        slot.lease = renewed
        slot._renewed_at = started
        self._again(slot, started + ttl / 3, ttl)

    def _failed(self, slot: Slot, ttl: float, exc: BaseException) -> None:
        if slot._released or slot._lost:
            return
        slot._renewal_failed(exc)
        expires = slot._renewed_at + ttl
        current = self._loop.now()
        if current >= expires:
            slot._lose()
        else:
            self._again(slot, min(expires, current + ttl * _RETRY_FRACTION), ttl)


def track(slot: Slot, loop: Loop, since: float) -> None:
    """Renew ``slot``'s lease on ``loop`` until it is released or the lease is lost.

    ``since`` is the earliest the lease can have been granted (when the request began to
    wait): the first renewal comes a third of a TTL after it, so a waiter whose loop stalled
    between the grant and its resumption renews as soon as it resumes. The lease counts as
    lost only once a TTL has passed since the slot was taken without a renewal returning.
    """
    keeper = loop.keeper
    if keeper is None:
        keeper = loop.keeper = _Keeper(loop)
    ttl = slot._ttl = lease_ttl(slot.limiter)
    slot._renewed_at = slot._acquired_at
    slot._keeper = keeper
    if since < slot._acquired_at:
        keeper._again(slot, since + ttl / 3, ttl)  # out of the first renewals' order
    else:
        keeper.add(slot, since + ttl / 3, ttl)
