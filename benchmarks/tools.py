"""Tool calls: one batch of calls of tools that return at once, spread over 8 pools.

slotwise's ``ToolBox.run`` (one slot of a MemoryLimiter per call, its pool a workload) against
the design of the stacked semaphores: a task per call, a global semaphore, then one semaphore
per tool, gathered (``asyncio.gather`` on asyncio, a nursery on trio). The figure is the cost
per call, the batch's CPU time divided by its calls; tools that return at once leave only the
machinery to measure. The ToolBox also does what the semaphores cannot: one atomic admission
of the pair, results by id, budgets and events. A third row, as many workers as the ToolBox
runs calls at once, taking ``limiter.slot()`` around each call and doing nothing else, shows
how much of the ToolBox's cost is the slot lifecycle itself.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import trio

from slotwise import MemoryLimiter, Workload
from slotwise.tools import ToolBox, ToolCall

from ._harness import Row, Size, best, clock, no_gc

__all__ = ("CALLS", "GOAL", "run")

SECTION = "tools"
CALLS = 1_000
POOLS = 8
GLOBAL = 8  # calls at once in all
PER_POOL = 2  # calls at once per pool (one pool per tool)
GOAL = 3.0  # the ToolBox's cost per call, at most this many times the semaphores'

TOOLBOX = "slotwise.tools.ToolBox"
SLOTS_ONLY = "limiter.slot() per call"
PEERS = {
    "asyncio": "asyncio.gather + asyncio.Semaphore",
    "trio": "trio nursery + trio.Semaphore",
}


async def instant(n: int) -> int:
    """A tool that returns at once."""
    return n


NAMES = [f"tool_{p}" for p in range(POOLS)]


def batch(calls: int) -> list[ToolCall]:
    return [
        ToolCall(id=f"call_{n}", name=NAMES[n % POOLS], arguments={"n": n}) for n in range(calls)
    ]


def toolbox() -> ToolBox[str]:
    limiter = MemoryLimiter(
        name="tools",
        max_concurrent=GLOBAL,
        workloads={name: Workload(max_concurrent=PER_POOL) for name in NAMES},
    )
    box = ToolBox(limiter=limiter)
    for name in NAMES:
        box.tool(name=name, pool=name)(instant)
    return box


def slots_only(box: ToolBox[str]) -> Callable[[list[ToolCall]], Awaitable[list[Any]]]:
    """The ToolBox's floor: as many calls at once as the ToolBox runs (the limiter's 8 slots:
    one worker per pool, each taking its pool's calls in turn), each call in `limiter.slot()`
    around the handler, and nothing else (no choice of the next call, no results, checks or
    events)."""

    async def run_batch(calls: list[ToolCall]) -> list[Any]:
        results: list[Any] = [None] * len(calls)
        queues: dict[str, deque[int]] = {name: deque() for name in NAMES}
        for i, call in enumerate(calls):
            queues[call.name].append(i)

        async def work(pool: str) -> None:
            queue = queues[pool]
            while queue:
                i = queue.popleft()
                async with box.limiter.slot(pool, allow_nested=True):
                    results[i] = await instant(**calls[i].arguments)

        async with anyio.create_task_group() as tg:
            for name in NAMES:
                for _ in range(max(1, min(PER_POOL, GLOBAL // POOLS))):
                    tg.start_soon(work, name)
        return results

    return run_batch


def stacked(backend: str) -> Callable[[list[ToolCall]], Awaitable[list[Any]]]:
    """Seed 000's design: the global semaphore first, then the tool's own."""
    if backend == "asyncio":
        glob = asyncio.Semaphore(GLOBAL)
        own = {name: asyncio.Semaphore(PER_POOL) for name in NAMES}

        async def call_asyncio(call: ToolCall) -> Any:
            async with glob, own[call.name]:
                return await instant(**call.arguments)

        async def gather(calls: list[ToolCall]) -> list[Any]:
            return await asyncio.gather(*map(call_asyncio, calls), return_exceptions=True)

        return gather

    tglob = trio.Semaphore(GLOBAL)
    town = {name: trio.Semaphore(PER_POOL) for name in NAMES}

    async def nursery(calls: list[ToolCall]) -> list[Any]:
        results: list[Any] = [None] * len(calls)

        async def call_trio(i: int, call: ToolCall) -> None:
            async with tglob, town[call.name]:
                results[i] = await instant(**call.arguments)

        async with trio.open_nursery() as tasks:
            for i, call in enumerate(calls):
                tasks.start_soon(call_trio, i, call)
        return results

    return nursery


async def _per_call(
    run_batches: list[Callable[[list[ToolCall]], Awaitable[list[Any]]]], size: Size
) -> list[float]:
    """The best cost per call of each way of running the batch. The ways take their samples
    in turn, so that a slower spell of the machine falls on all of them, not on one."""
    calls = batch(min(CALLS, size.cycles))
    for run_batch in run_batches:
        results = await run_batch(calls)  # warm up, and check that every call ran
        assert len(results) == len(calls)
    samples: list[list[float]] = [[] for _ in run_batches]
    for _ in range(size.repeats * 2):
        for run_batch, taken in zip(run_batches, samples, strict=True):
            with no_gc():
                start = clock()
                await run_batch(calls)
                taken.append((clock() - start) / len(calls))
    return [best(taken) for taken in samples]


async def _measure(backend: str, size: Size) -> list[Row]:
    box = toolbox()
    mine, floor, theirs = await _per_call([box.run, slots_only(box), stacked(backend)], size)
    ratio = mine / theirs
    n = min(CALLS, size.cycles)
    common = {"section": SECTION, "backend": backend, "n": n, "unit": "us/call"}
    group = f"{SECTION}/{backend}"
    return [
        Row(
            **common,
            peer=TOOLBOX,
            value=mine * 1e6,
            group=group,
            extra=f"goal <= {GOAL:g}x: {'met' if ratio <= GOAL else 'MISSED'} ({ratio:.2f}x)",
        ),
        Row(**common, peer=SLOTS_ONLY, value=floor * 1e6, group=group),
        Row(**common, peer=PEERS[backend], value=theirs * 1e6, group=group),
    ]


def run(size: Size, backends: list[str]) -> list[Row]:
    """Time one batch of tool calls through a ToolBox and through stacked semaphores."""
    rows: list[Row] = []
    for backend in backends:
        rows += anyio.run(_measure, backend, size, backend=backend)
    return rows
