"""Instructions per operation, for valgrind's callgrind: figures that do not depend on the load.

One run performs one operation ``n`` times after a warm-up, on asyncio or trio, with slotwise's
``MemoryLimiter`` or anyio's ``CapacityLimiter`` (limit 8):

- ``cycle``: ``async with limiter.slot(): pass`` (``async with limiter:`` for anyio), the
  uncontended cycle, after 200 warm-up cycles;
- ``handoff``: ``n`` waiters started behind 8 holders, parked, then handed the slot one after
  the other when the holders leave (task creation included, for both peers).

Run each twice, with two sizes, and divide the difference of the totals by the difference of
the sizes: start-up and imports cancel out::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python -m benchmarks.instructions cycle slotwise 1000 asyncio
    ... cycle slotwise 4000 asyncio     # (total(4000) - total(1000)) / 3000
    ... handoff slotwise 500 trio
    ... handoff slotwise 2000 trio      # (total(2000) - total(500)) / 1500

valgrind prints the total on its last line (``I refs``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio

from slotwise import MemoryLimiter

LIMIT = 8


def _enter(peer: str) -> Callable[[], AbstractAsyncContextManager[Any]]:
    if peer == "slotwise":
        return MemoryLimiter(max_concurrent=LIMIT).slot
    limiter = anyio.CapacityLimiter(LIMIT)
    return lambda: limiter


async def cycle(peer: str, n: int) -> None:
    enter = _enter(peer)
    for _ in range(200):
        async with enter():
            pass
    for _ in range(n):
        async with enter():
            pass


async def handoff(peer: str, n: int) -> None:
    enter = _enter(peer)
    gate = anyio.Event()

    async def holder() -> None:
        async with enter():
            await gate.wait()

    async def waiter() -> None:
        async with enter():
            pass

    async with anyio.create_task_group() as tg:
        for _ in range(LIMIT):
            tg.start_soon(holder)
        for _ in range(5):
            await anyio.lowlevel.checkpoint()
        for _ in range(n):
            tg.start_soon(waiter)
        for _ in range(5):
            await anyio.lowlevel.checkpoint()
        gate.set()


def main(argv: list[str]) -> None:
    kind, peer, n, backend = argv
    if kind not in ("cycle", "handoff") or peer not in ("slotwise", "anyio"):
        raise SystemExit(__doc__)
    anyio.run(cycle if kind == "cycle" else handoff, peer, int(n), backend=backend)


if __name__ == "__main__":
    main(sys.argv[1:])
