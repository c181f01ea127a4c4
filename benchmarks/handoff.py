"""Contended hand-off: ``N`` waiters queued behind a full limiter of 8 pass through it.

The clock starts when the eight holders leave and stops when the last waiter has had its
slot, so task creation is not measured, only the grants: each release hands the slot to
the next waiter, which enters, leaves, and hands it on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import trio

from ._harness import Peer, Row, Size, best, clock, in_task_tree, no_gc, peers_for, start_waiters

__all__ = ("LIMIT", "measure", "repeats_for", "run")

SECTION = "hand-off"
LIMIT = 8


def repeats_for(n: int, size: Size) -> int:
    """More repetitions for the small, noisy sizes; fewer where one takes seconds."""
    if n <= 1_000:
        return size.repeats * 2
    if n <= 10_000:
        return size.repeats
    return max(1, (size.repeats + 1) // 3)


async def _once(peer: Peer, backend: str, n: int) -> float:
    async def body(nursery: trio.Nursery | None) -> float:
        limiter: Any = peer.make(LIMIT)
        waiters = await start_waiters(
            peer, limiter, backend=backend, limit=LIMIT, count=n, nursery=nursery
        )
        with no_gc():
            start = clock()
            waiters.open_gate()
            await waiters.wait()
            return clock() - start

    return float(await in_task_tree(backend, body))


async def measure(
    peers: Sequence[Peer], backend: str, size: Size, sizes: Sequence[int]
) -> list[Row]:
    """The hand-off of each of ``peers`` on the running loop at each N of ``sizes``."""
    rows = []
    for n in sizes:
        # The peers take turns within each repetition (see uncontended).
        samples: list[list[float]] = [[] for _ in peers]
        for _ in range(repeats_for(n, size)):
            for peer, peer_samples in zip(peers, samples, strict=True):
                peer_samples.append(await _once(peer, backend, n) / n)
        for peer, peer_samples in zip(peers, samples, strict=True):
            per_grant = best(peer_samples)
            rows.append(
                Row(
                    section=SECTION,
                    backend=backend,
                    peer=peer.name,
                    n=n,
                    value=1.0 / per_grant,
                    unit="grants/s",
                    extra=f"{per_grant * 1e6:.2f} us/grant",
                    group=f"{SECTION}/{backend}/{n}",
                )
            )
    return rows


async def _measure(backend: str, size: Size) -> list[Row]:
    return await measure(peers_for(backend), backend, size, size.handoff)


def run(size: Size, backends: list[str]) -> list[Row]:
    """Grants per second, and cost per grant, at every queue length of ``size.handoff``."""
    rows: list[Row] = []
    for backend in backends:
        rows += anyio.run(_measure, backend, size, backend=backend)
    return rows
