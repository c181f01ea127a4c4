"""Threads: `with limiter.sync_slot():` beside `threading.Semaphore`, doing the same work.

- Uncontended: one thread enters and leaves a limit of 8 that is never full, timed on the
  process's CPU time like the async cycle.
- Hand-off: N threads blocked behind a full limit of 8. The clock starts when the eight
  holders leave and stops when the last of the N threads has had its slot and ended; each
  release wakes the next thread, which enters, leaves, and hands the slot on. Timed on the
  wall clock: waking a blocked thread is the operating system's work as much as the
  process's, and the time until all are served is what a thread pool sees.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio

from slotwise import MemoryLimiter

from ._harness import FULL, SLOTWISE, TINY, Row, Size, best, clock, no_gc

__all__ = ("LIMIT", "SEMAPHORE", "run")

SECTION = "sync"
LIMIT = 8
SEMAPHORE = "threading.Semaphore"
BACKEND = "threads"
# Threads blocked behind the full limit, for each size of run.
HANDOFF_THREADS = {FULL: (100, 1_000), TINY: (10, 20)}


class _Peer:
    """A limit of 8 as its users drive it from threads: how to enter it, and how many
    threads wait for it."""

    enter: Callable[[], contextlib.AbstractContextManager[Any]]
    hold: Callable[[], contextlib.AbstractContextManager[Any]]
    waiting: Callable[[], int]

    def __init__(self, name: str) -> None:
        self.name = name
        if name == SLOTWISE:
            limiter: MemoryLimiter[str] = MemoryLimiter(max_concurrent=LIMIT)
            self.enter = limiter.sync_slot
            self.hold = lambda: limiter.sync_slot(allow_nested=True)
            self.waiting = lambda: anyio.run(limiter.stats).queued
        else:
            semaphore = threading.Semaphore(LIMIT)
            # A C-level callable that returns the semaphore: no Python frame per cycle.
            self.enter = itertools.repeat(semaphore).__next__
            self.hold = self.enter
            # threading.Semaphore has no public statistics.
            self.waiting = lambda: len(semaphore._cond._waiters)  # type: ignore[attr-defined]


def _cycles(name: str, n: int) -> float:
    enter = _Peer(name).enter  # a local: the loop below is what is timed
    start = clock()
    for _ in range(n):
        with enter():
            pass
    return clock() - start


def _handoff(name: str, n: int) -> float:
    peer = _Peer(name)

    def waiter() -> None:
        with peer.enter():
            pass

    with contextlib.ExitStack() as holders:
        for _ in range(LIMIT):
            holders.enter_context(peer.hold())
        threads = [threading.Thread(target=waiter) for _ in range(n)]
        for thread in threads:
            thread.start()
        while peer.waiting() < n:
            time.sleep(0.001)
        with no_gc():
            start = time.perf_counter()
            holders.close()
            for thread in threads:
                thread.join()
            return time.perf_counter() - start
    raise AssertionError("unreachable")


def run(size: Size, backends: list[str]) -> list[Row]:
    """The uncontended cycle (microseconds) and the hand-off between threads (grants per
    second) of `sync_slot()` and `threading.Semaphore`; ``backends`` does not apply."""
    rows: list[Row] = []
    for name in (SLOTWISE, SEMAPHORE):
        _cycles(name, min(size.cycles, 1_000))  # warm up
        samples = []
        for _ in range(size.repeats):
            with no_gc():
                samples.append(_cycles(name, size.cycles) / size.cycles)
        rows.append(
            Row(
                section=SECTION,
                backend=BACKEND,
                peer=name,
                n=size.cycles,
                value=best(samples) * 1e6,
                unit="us/cycle",
                extra="uncontended",
                group=f"{SECTION}/uncontended",
            )
        )
    for n in HANDOFF_THREADS.get(size, HANDOFF_THREADS[TINY]):
        for name in (SLOTWISE, SEMAPHORE):
            # Twice the repetitions: a wall clock on a shared machine is noisy.
            per_grant = best([_handoff(name, n) / n for _ in range(2 * size.repeats)])
            rows.append(
                Row(
                    section=SECTION,
                    backend=BACKEND,
                    peer=name,
                    n=n,
                    value=1.0 / per_grant,
                    unit="grants/s",
                    extra=f"hand-off, {per_grant * 1e6:.2f} us/grant",
                    group=f"{SECTION}/hand-off/{n}",
                )
            )
    return rows
