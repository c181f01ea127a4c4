"""Lease renewal for every held slot of an event loop, by one task, not one per slot.

The keeper is a system task of the running event loop, started when the first slot is held
and ending when none is. It renews each lease every third of its limiter's ``lease_ttl``,
retries a renewal that raises until the lease would have expired, and declares the lease
lost (cancelling the slot's body) when the limiter says it is gone or time runs out.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
from anyio.lowlevel import RunVar

if TYPE_CHECKING:
    from .lifecycle import Slot

__all__ = ("DEFAULT_LEASE_TTL", "track")

DEFAULT_LEASE_TTL = 30.0
_RETRY_FRACTION = 0.1  # after a failed renewal, retry at this fraction of the ttl

_keeper: RunVar[_Keeper] = RunVar("slotwise_keeper")


def lease_ttl(limiter: Any) -> float:
    ttl = getattr(limiter, "lease_ttl", None)
    return float(ttl) if isinstance(ttl, int | float) and ttl > 0 else DEFAULT_LEASE_TTL


class _Keeper:
    __slots__ = ("_due", "_running", "_seq", "_tasks", "_wake")

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Slot]] = []
        self._seq = itertools.count()
        self._running = False
        self._wake: anyio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def schedule(self, slot: Slot, at: float) -> None:
        if self._due and at < self._due[0][0] and self._wake is not None:
            self._wake.set()
        heapq.heappush(self._due, (at, next(self._seq), slot))
        if not self._running:
            self._running = True
            _spawn(self._main)

    async def _main(self) -> None:
        try:
            while self._due:
                at, _, slot = self._due[0]
                if slot._released or slot._lost:
                    heapq.heappop(self._due)
                    continue
                now = anyio.current_time()
                if at > now:
                    self._wake = anyio.Event()
                    with anyio.move_on_after(at - now):
                        await self._wake.wait()
                    self._wake = None
                    continue
                batch = []
                while self._due and self._due[0][0] <= now:
                    batch.append(heapq.heappop(self._due)[2])
                async with anyio.create_task_group() as tg:
                    for slot in batch:
                        if not (slot._released or slot._lost):
                            tg.start_soon(self._renew, slot)
        finally:
            self._running = False
            self._wake = None

    async def _renew(self, slot: Slot) -> None:
        started = anyio.current_time()
        ttl = lease_ttl(slot.limiter)
        try:
            renewed = await slot.limiter.renew(slot.lease)
        except Exception as exc:
            if slot._released:
                return
            slot._renewal_failed(exc)
            expires = slot._renewed_at + ttl
            if anyio.current_time() >= expires:
                slot._lose()
            else:
                self.schedule(slot, min(expires, anyio.current_time() + ttl * _RETRY_FRACTION))
            return
        if slot._released:
            return
        if renewed is None:
            slot._lose()
            return
        slot.lease = renewed
        slot._renewed_at = started
        self.schedule(slot, started + ttl / 3)


def _spawn(fn: Callable[[], Awaitable[None]]) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        import trio

        trio.lowlevel.spawn_system_task(fn)
    else:
        keeper = _keeper.get()
        task: asyncio.Task[None] = loop.create_task(fn())  # type: ignore[arg-type]
        keeper._tasks.add(task)
        task.add_done_callback(keeper._tasks.discard)


def track(slot: Slot) -> None:
    """Renew ``slot``'s lease until it is released or lost."""
    try:
        keeper = _keeper.get()
    except LookupError:
        keeper = _Keeper()
        _keeper.set(keeper)
    ttl = lease_ttl(slot.limiter)
    keeper.schedule(slot, slot._renewed_at + ttl / 3 if math.isfinite(ttl) else math.inf)
