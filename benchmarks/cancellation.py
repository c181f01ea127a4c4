"""Cancelling half of ``N`` queued waiters, in random order.

asyncio.Semaphore removes a cancelled waiter with ``deque.remove``, a scan of the queue, so
cancelling half of N waiters costs it O(N**2): its cost per cancel grows with N, which the
two sizes show. At 100,000 waiters that is tens of seconds, so there it runs once, and the
other peers (linear) take the best of as many repetitions as at 20,000.
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import trio

from ._harness import (
    ASYNCIO_SEMAPHORE,
    Peer,
    Row,
    Size,
    best,
    clock,
    in_task_tree,
    no_gc,
    peers_for,
    start_waiters,
)

__all__ = ("run",)

SECTION = "cancellation"
LIMIT = 8
SEED = 7


async def _once(peer: Peer, backend: str, n: int) -> float:
    async def body(nursery: trio.Nursery | None) -> float:
        limiter: Any = peer.make(LIMIT)
        waiters = await start_waiters(
            peer, limiter, backend=backend, limit=LIMIT, count=n, nursery=nursery
        )
        chosen = random.Random(SEED).sample(waiters.cancels, n // 2)
        waiters.expect(len(chosen))
        with no_gc():
            start = clock()
            for cancel in chosen:
                cancel()
            await waiters.wait()
            elapsed = clock() - start
        # The other half passes through the limiter (linear for every peer).
        waiters.expect(n - len(chosen))
        waiters.open_gate()
        await waiters.wait()
        return elapsed / len(chosen)

    return float(await in_task_tree(backend, body))


async def _measure(backend: str, size: Size) -> list[Row]:
    rows = []
    for n in size.cancel:
        repeats = max(1, (size.repeats + 1) // 2)
        peers = peers_for(backend)
        # The peers take turns within each repetition (see uncontended).
        samples: list[list[float]] = [[] for _ in peers]
        for repeat in range(repeats):
            for peer, peer_samples in zip(peers, samples, strict=True):
                if repeat and n > 20_000 and peer.name == ASYNCIO_SEMAPHORE:
                    continue  # quadratic: about 20 s a run at 100,000 waiters, so once
                peer_samples.append(await _once(peer, backend, n))
        for peer, peer_samples in zip(peers, samples, strict=True):
            per_cancel = best(peer_samples)
            rows.append(
                Row(
                    section=SECTION,
                    backend=backend,
                    peer=peer.name,
                    n=n,
                    value=per_cancel * 1e6,
                    unit="us/cancel",
                    extra=f"{n // 2:,} cancelled",
                    group=f"{SECTION}/{backend}/{n}",
                )
            )
    return rows


def run(size: Size, backends: list[str]) -> list[Row]:
    """Cost per cancellation of a queued waiter, half of the queue cancelled at random."""
    rows: list[Row] = []
    for backend in backends:
        rows += anyio.run(_measure, backend, size, backend=backend)
    return rows
