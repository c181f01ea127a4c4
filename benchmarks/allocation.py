"""Allocation throughput with four workloads, reservations and priorities.

Two paths: the pure core (``slotwise._core.state.LimiterState``, whose ``release`` runs
``slotwise._core.rules.allocate``), driven synchronously; and a ``MemoryLimiter`` with the
same workloads, driven by queued tasks. Each is compared with the same path and one
workload, so the ratio is what the rules cost.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

import anyio
import trio

from slotwise import MemoryLimiter, Workload
from slotwise._config import build_settings
from slotwise._core.state import LimiterState

from ._harness import Peer, Row, Size, clock, in_task_tree, no_gc, start_waiters

__all__ = ("FOUR_WORKLOADS", "run")

SECTION = "allocation"
LIMIT = 16
FOUR_WORKLOADS = {
    "interactive": Workload(reserved=4, priority=10),
    "agents": Workload(max_concurrent=10, reserved=2, priority=5),
    "background": Workload(max_concurrent=8, priority=0),
    "batch": Workload(max_concurrent=4, priority=-1),
}
ONE_WORKLOAD = {"default": Workload()}
FOUR = "4 workloads"
ONE = "1 workload"


def _core_once(workloads: dict[str, Workload], n: int) -> float:
    settings = build_settings(
        name="bench",
        max_concurrent=LIMIT,
        max_queued=None,
        lease_ttl=30.0,
        workloads=workloads,
        default_workload=None,
    )
    state = LimiterState(settings.rules, max_queued=None, lease_ttl=30.0)
    names = list(workloads)
    held: collections.deque[str] = collections.deque()
    for i in range(n + LIMIT):
        ticket, _ = state.submit(names[i % len(names)], 0.0)
        if ticket.lease is not None:
            held.append(ticket.lease.lease_id)
    granted = 0
    release = state.release
    with no_gc():
        start = clock()
        while held:
            for ticket in release(held.popleft(), 0.0):
                held.append(ticket.lease.lease_id)  # type: ignore[union-attr]
                granted += 1
        elapsed = clock() - start
    assert granted == n, (granted, n)
    assert not state.queued, state.queued
    return granted / elapsed


class _Workloads:
    """Waiters spread round-robin over the limiter's workloads."""

    def __init__(self, limiter: MemoryLimiter[str]) -> None:
        self.limiter = limiter
        self._names = itertools.cycle(list(limiter.workloads))

    def enter(self) -> Any:
        return self.limiter.slot(next(self._names))


async def _memory_once(workloads: dict[str, Workload], backend: str, n: int) -> float:
    async def waiting(spread: _Workloads) -> int:
        return (await spread.limiter.stats()).queued

    peer = Peer(
        name="slotwise.MemoryLimiter",
        make=lambda limit: _Workloads(MemoryLimiter(max_concurrent=limit, workloads=workloads)),
        enter=lambda spread: spread.enter,
        waiting=waiting,
    )

    async def body(nursery: trio.Nursery | None) -> float:
        spread = peer.make(LIMIT)
        waiters = await start_waiters(
            peer, spread, backend=backend, limit=LIMIT, count=n, nursery=nursery
        )
        with no_gc():
            start = clock()
            waiters.open_gate()
            await waiters.wait()
            return n / (clock() - start)

    return float(await in_task_tree(backend, body))


async def _memory_best(workloads: dict[str, Workload], backend: str, n: int, runs: int) -> float:
    return max([await _memory_once(workloads, backend, n) for _ in range(runs)])


def _row(path: str, backend: str, label: str, n: int, value: float) -> Row:
    return Row(
        section=SECTION,
        backend=backend,
        peer=f"{path}, {label}",
        n=n,
        value=value,
        unit="grants/s",
        group=f"{SECTION}/{path}/{backend}",
    )


def run(size: Size, backends: list[str]) -> list[Row]:
    """Grants per second through the pure core and through MemoryLimiter."""
    n = size.allocation
    repeats = size.repeats
    runs = max(1, (repeats + 1) // 2)
    rows = [
        _row("core", "-", label, n, max(_core_once(workloads, n) for _ in range(repeats)))
        for label, workloads in ((FOUR, FOUR_WORKLOADS), (ONE, ONE_WORKLOAD))
    ]
    for backend in backends:
        for label, workloads in ((FOUR, FOUR_WORKLOADS), (ONE, ONE_WORKLOAD)):
            best = anyio.run(_memory_best, workloads, backend, n, runs, backend=backend)
            rows.append(_row("MemoryLimiter", backend, label, n, best))
    return rows
