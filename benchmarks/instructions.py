"""Instructions per operation, for valgrind's callgrind: figures that do not depend on the load.

One run performs one operation ``n`` times after a warm-up, on asyncio or trio, with slotwise's
``MemoryLimiter``, anyio's ``CapacityLimiter`` or the floor (``benchmarks.floor``'s
``FloorLimiter`` with every duty), limit 8:

- ``cycle``: ``async with limiter.slot(): pass`` (``async with limiter:`` for anyio), the
  uncontended cycle, after 200 warm-up cycles;
- ``handoff``: ``n`` waiters started behind 8 holders, parked, then handed the slot one after
  the other when the holders leave (task creation included, for both peers);
- ``cancel``: ``n`` waiters started behind 8 holders, parked, then all cancelled at once (each
  asyncio task by ``task.cancel()``, each trio task by its own cancel scope, as the
  cancellation section does), task creation and parking included: beside ``handoff``, the
  difference is what a cancellation costs against a grant;
- ``tools``: ``n`` batches of the tool-calls section's 1,000 calls over 8 pools, after one to
  warm up, by peer ``toolbox`` (``ToolBox.run``), ``floor`` (``limiter.slot()`` per call and
  nothing else) or ``semaphores`` (the stacked semaphores of the loop: ``asyncio.gather`` and
  ``asyncio.Semaphore``, or a trio nursery and ``trio.Semaphore``).

Run each twice, with two sizes, and divide the difference of the totals by the difference of
the sizes: start-up and imports cancel out::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python -m benchmarks.instructions cycle slotwise 1000 asyncio
    ... cycle slotwise 4000 asyncio     # (total(4000) - total(1000)) / 3000
    ... handoff slotwise 500 trio
    ... handoff slotwise 2000 trio      # (total(2000) - total(500)) / 1500

valgrind prints the total on its last line (``I refs``). The tool batches, per call::

    ... tools toolbox 2 asyncio
    ... tools toolbox 4 asyncio         # (total(4) - total(2)) / 2000

``--opcodes`` counts instead the Python opcodes that the interpreter executes (``sys.settrace``
with ``f_trace_opcodes``), for sizes ``n`` and ``2 n``, and prints the difference per
operation, in all and by function: how much Python each operation runs, without valgrind::

    python -m benchmarks.instructions --opcodes tools toolbox 1 asyncio
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from types import FrameType
from typing import Any

import anyio
import trio

from slotwise import MemoryLimiter

from . import tools
from .floor import FloorLimiter

LIMIT = 8


def _enter(peer: str) -> Callable[[], AbstractAsyncContextManager[Any]]:
    if peer == "slotwise":
        return MemoryLimiter(max_concurrent=LIMIT).slot
    if peer == "floor":
        return FloorLimiter(LIMIT).slot
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


def _tasks(peer: str) -> tuple[anyio.Event, Callable[[], Any], Callable[[], Any]]:
    """A gate, a holder that keeps its slot until the gate opens, and a waiter that takes
    its slot and leaves."""
    enter = _enter(peer)
    gate = anyio.Event()

    async def holder() -> None:
        async with enter():
            await gate.wait()

    async def waiter() -> None:
        async with enter():
            pass

    return gate, holder, waiter


async def _turns() -> None:
    for _ in range(5):
        await anyio.lowlevel.checkpoint()


async def handoff(peer: str, n: int) -> None:
    gate, holder, waiter = _tasks(peer)
    async with anyio.create_task_group() as tg:
        for _ in range(LIMIT):
            tg.start_soon(holder)
        await _turns()
        for _ in range(n):
            tg.start_soon(waiter)
        await _turns()
        gate.set()


async def cancel(peer: str, n: int, backend: str) -> None:
    gate, holder, waiter = _tasks(peer)  # every waiter is cancelled before its turn
    if backend == "asyncio":
        loop = asyncio.get_running_loop()
        holders = [loop.create_task(holder()) for _ in range(LIMIT)]
        await _turns()
        waiters = [loop.create_task(waiter()) for _ in range(n)]
        await _turns()
        for task in waiters:
            task.cancel()
        await _turns()
        gate.set()
        await asyncio.gather(*holders, *waiters, return_exceptions=True)
        return

    async def scoped(scope: trio.CancelScope) -> None:
        with scope:
            await waiter()

    async with trio.open_nursery() as nursery:
        for _ in range(LIMIT):
            nursery.start_soon(holder)
        await _turns()
        scopes = [trio.CancelScope() for _ in range(n)]
        for scope in scopes:
            nursery.start_soon(scoped, scope)
        await _turns()
        for scope in scopes:
            scope.cancel()
        await _turns()
        gate.set()


async def tool_batches(peer: str, n: int, backend: str) -> None:
    box = tools.toolbox()
    run_batch = {
        "toolbox": box.run,
        "floor": tools.slots_only(box),
        "semaphores": tools.stacked(backend),
    }[peer]
    calls = tools.batch(tools.CALLS)
    for _ in range(n + 1):  # one to warm up
        await run_batch(calls)


def _run(kind: str, peer: str, n: int, backend: str) -> None:
    if kind == "tools":
        anyio.run(tool_batches, peer, n, backend, backend=backend)
    elif kind == "cancel":
        anyio.run(cancel, peer, n, backend, backend=backend)
    else:
        anyio.run(cycle if kind == "cycle" else handoff, peer, n, backend=backend)


PEERS = {
    "cycle": ("slotwise", "anyio", "floor"),
    "handoff": ("slotwise", "anyio", "floor"),
    "cancel": ("slotwise", "anyio", "floor"),
    "tools": ("toolbox", "floor", "semaphores"),
}


def _traced(kind: str, peer: str, n: int, backend: str) -> Counter[str]:
    """The Python opcodes that a run executes, by function."""
    counts: Counter[str] = Counter()

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            counts[f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}"] += 1
        return trace

    sys.settrace(trace)
    try:
        _run(kind, peer, n, backend)
    finally:
        sys.settrace(None)
    return counts


def opcodes(kind: str, peer: str, n: int, backend: str) -> str:
    """The Python opcodes of one operation: the runs of sizes ``n`` and ``2 n`` traced, the
    difference divided by the operations it adds."""
    added = _traced(kind, peer, 2 * n, backend)
    added.subtract(_traced(kind, peer, n, backend))
    operations = n * (tools.CALLS if kind == "tools" else 1)
    lines = [f"{kind} {peer} {backend}: {added.total() / operations:,.0f} opcodes per operation"]
    for name, count in added.most_common(15):
        lines.append(f"{count / operations:8.1f}  {name}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    count = argv[:1] == ["--opcodes"]
    if count:
        argv = argv[1:]
    if len(argv) != 4 or argv[0] not in PEERS or argv[1] not in PEERS[argv[0]]:
        raise SystemExit(__doc__)
    kind, peer, n, backend = argv
    if count:
        print(opcodes(kind, peer, int(n), backend))
    else:
        _run(kind, peer, int(n), backend)


if __name__ == "__main__":
    main(sys.argv[1:])
