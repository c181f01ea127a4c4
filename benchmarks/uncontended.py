"""Uncontended slot cycle: one task enters and leaves a limiter that always has room."""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from ._harness import Peer, Row, Size, best, clock, no_gc, peers_for

__all__ = ("measure", "run")

SECTION = "uncontended"


async def _cycles(enter: object, n: int) -> float:
    enter_fn = enter  # a local: the loop below is what is timed
    start = clock()
    for _ in range(n):
        async with enter_fn():  # type: ignore[operator]
            pass
    return clock() - start


async def measure(peers: Sequence[Peer], backend: str, size: Size) -> list[Row]:
    """The cycle of each of ``peers`` on the running loop, a row each."""
    enters = [peer.enter(peer.make(8)) for peer in peers]
    for enter in enters:
        await _cycles(enter, min(size.cycles, 1_000))  # warm up
    # The peers take turns within each repetition: a drift of the machine (its load, its
    # clock speed) hits them all alike, and each keeps its best.
    samples: list[list[float]] = [[] for _ in peers]
    for _ in range(size.repeats):
        for enter, peer_samples in zip(enters, samples, strict=True):
            with no_gc():
                peer_samples.append(await _cycles(enter, size.cycles) / size.cycles)
    return [
        Row(
            section=SECTION,
            backend=backend,
            peer=peer.name,
            n=size.cycles,
            value=best(peer_samples) * 1e6,
            unit="us/cycle",
            group=f"{SECTION}/{backend}",
        )
        for peer, peer_samples in zip(peers, samples, strict=True)
    ]


async def _measure(backend: str, size: Size) -> list[Row]:
    return await measure(peers_for(backend, with_trio_limiter=True), backend, size)


def run(size: Size, backends: list[str]) -> list[Row]:
    """Time ``async with`` enter+exit on a limiter of 8 that is never full."""
    rows: list[Row] = []
    for backend in backends:
        rows += anyio.run(_measure, backend, size, backend=backend)
    return rows
