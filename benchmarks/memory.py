"""Memory per waiting request, measured with tracemalloc.

``N`` waiters are queued behind a full limiter; the memory they hold (their tasks and
coroutine frames included) is divided by ``N``. A task parked on a bare event is measured the
same way, so the ``over a parked task`` figure is what the limiter adds to a task that would
wait anyway.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import attrs
import sniffio
import trio

from ._harness import Peer, Row, Size, in_task_tree, peers_for, settle, start_waiters

__all__ = ("run",)

SECTION = "memory"
LIMIT = 8
BARE = "task parked on an Event"


def _native_event() -> asyncio.Event | trio.Event:
    return asyncio.Event() if sniffio.current_async_library() == "asyncio" else trio.Event()


@attrs.define(eq=False)
class _Parked(AbstractAsyncContextManager[None]):
    """The least a waiting request can cost: a task parked on one of its loop's own events."""

    event: asyncio.Event | trio.Event = attrs.field(factory=_native_event)
    parked: int = 0

    async def __aenter__(self) -> None:
        self.parked += 1
        await self.event.wait()

    async def __aexit__(self, *exc_info: object) -> None:
        return None


async def _parked_waiting(parked: _Parked) -> int:
    return parked.parked


_BARE_PEER = Peer(
    name=BARE,
    make=lambda limit: _Parked(),
    enter=lambda parked: lambda: parked,
    waiting=_parked_waiting,
)


async def _bytes_per_waiter(peer: Peer, backend: str, n: int) -> float:
    async def body(nursery: trio.Nursery | None) -> float:
        limiter: Any = peer.make(LIMIT)
        bare = peer is _BARE_PEER
        # Holders and one round of waiters first, so that one-off allocations (a keeper
        # task, caches, free lists) are not charged to the measured waiters.
        warm = await start_waiters(
            peer,
            limiter,
            backend=backend,
            limit=LIMIT,
            count=LIMIT,
            nursery=nursery,
            holders=not bare,
        )
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        waiters = await start_waiters(
            peer,
            limiter,
            backend=backend,
            limit=LIMIT,
            count=n,
            nursery=nursery,
            holders=False,
            cancellable=False,
        )
        await settle(peer, limiter, n + LIMIT)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        if bare:
            limiter.event.set()
        warm.expect(LIMIT)
        waiters.expect(n)
        warm.open_gate()
        await warm.wait()
        await waiters.wait()
        return (after - before) / n

    tracemalloc.start()
    try:
        return float(await in_task_tree(backend, body))
    finally:
        tracemalloc.stop()


async def _measure(backend: str, size: Size) -> list[Row]:
    n = size.memory
    bare = await _bytes_per_waiter(_BARE_PEER, backend, n)
    rows = [
        Row(
            section=SECTION,
            backend=backend,
            peer=BARE,
            n=n,
            value=bare,
            unit="bytes/waiter",
            group=f"{SECTION}/{backend}",
        )
    ]
    for peer in peers_for(backend):
        total = await _bytes_per_waiter(peer, backend, n)
        rows.append(
            Row(
                section=SECTION,
                backend=backend,
                peer=peer.name,
                n=n,
                value=total,
                unit="bytes/waiter",
                extra=f"{total - bare:,.0f} over a parked task",
                group=f"{SECTION}/{backend}",
            )
        )
    return rows


def run(size: Size, backends: list[str]) -> list[Row]:
    """Bytes held per queued waiter, for slotwise and each peer."""
    rows: list[Row] = []
    for backend in backends:
        rows += anyio.run(_measure, backend, size, backend=backend)
    return rows
