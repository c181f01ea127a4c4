"""Uncontended slot cycle: one task enters and leaves a limiter that always has room."""

from __future__ import annotations

import anyio

from ._harness import Row, Size, best, clock, no_gc, peers_for

__all__ = ("run",)

SECTION = "uncontended"


async def _cycles(enter: object, n: int) -> float:
    enter_fn = enter  # a local: the loop below is what is timed
    start = clock()
    for _ in range(n):
        async with enter_fn():  # type: ignore[operator]
            pass
    return clock() - start


async def _measure(backend: str, size: Size) -> list[Row]:
    rows = []
    for peer in peers_for(backend, with_trio_limiter=True):
        limiter = peer.make(8)
        enter = peer.enter(limiter)
        await _cycles(enter, min(size.cycles, 1_000))  # warm up
        samples = []
        for _ in range(size.repeats):
            with no_gc():
                samples.append(await _cycles(enter, size.cycles) / size.cycles)
        rows.append(
            Row(
                section=SECTION,
                backend=backend,
                peer=peer.name,
                n=size.cycles,
                value=best(samples) * 1e6,
                unit="us/cycle",
                group=f"{SECTION}/{backend}",
            )
        )
    return rows


def run(size: Size, backends: list[str]) -> list[Row]:
    """Time ``async with`` enter+exit on a limiter of 8 that is never full."""
    rows: list[Row] = []
    for backend in backends:
        rows += anyio.run(_measure, backend, size, backend=backend)
    return rows
