"""What every benchmark shares: result rows, sizes, the peers, and backend-neutral waiters.

Each peer is driven the way its users drive it (``async with limiter.slot()`` for slotwise,
``async with limiter`` for the others), through the same waiter coroutine, so the only thing
that differs between two rows of one table is the limiter.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import platform
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Any

import anyio
import anyio.lowlevel
import attrs
import trio

from slotwise import MemoryLimiter

__all__ = (
    "ANYIO",
    "ASYNCIO_SEMAPHORE",
    "PEER_NAMES",
    "SLOTWISE",
    "Peer",
    "Row",
    "Size",
    "TRIO_LIMITER",
    "TRIO_SEMAPHORE",
    "Waiters",
    "best",
    "clock",
    "cpu_model",
    "format_table",
    "in_task_tree",
    "no_gc",
    "peers_for",
    "settle",
    "start_waiters",
)

SLOTWISE = "slotwise.MemoryLimiter"
ANYIO = "anyio.CapacityLimiter"
ASYNCIO_SEMAPHORE = "asyncio.Semaphore"
TRIO_SEMAPHORE = "trio.Semaphore"
TRIO_LIMITER = "trio.CapacityLimiter"


@attrs.frozen(kw_only=True)
class Row:
    """One measured figure.

    ``group`` gathers the rows compared with each other: their ``ratio`` is slotwise's figure
    divided by this row's figure (1.00 on slotwise's own row).
    """

    section: str
    backend: str
    peer: str
    n: int
    value: float
    unit: str
    group: str
    extra: str = ""
    ratio: float | None = None
    note: str = ""


@attrs.frozen(kw_only=True)
class Size:
    """How much work a run does; ``tiny`` only proves that every benchmark still runs."""

    cycles: int  # uncontended slot cycles per repetition
    repeats: int  # repetitions; the best is kept
    handoff: tuple[int, ...]  # waiters queued behind a full limiter
    cancel: tuple[int, ...]  # waiters, half of which are cancelled
    memory: int  # waiters whose memory is measured
    allocation: int  # queued requests per allocation repetition


FULL = Size(
    cycles=20_000,
    repeats=5,
    handoff=(100, 1_000, 10_000, 100_000),
    cancel=(20_000, 100_000),
    memory=10_000,
    allocation=10_000,
)
TINY = Size(
    cycles=50,
    repeats=1,
    handoff=(10, 20, 40, 80),
    cancel=(40, 100),
    memory=50,
    allocation=100,
)


@attrs.frozen(kw_only=True)
class Peer:
    """A limiter to compare: how to build it, enter it, and count its waiters."""

    name: str
    make: Callable[[int], Any]
    enter: Callable[[Any], Callable[[], AbstractAsyncContextManager[Any]]]
    waiting: Callable[[Any], Awaitable[int]]


async def _slotwise_waiting(limiter: MemoryLimiter[str]) -> int:
    return (await limiter.stats()).queued


async def _stats_waiting(limiter: Any) -> int:
    return int(limiter.statistics().tasks_waiting)


async def _asyncio_semaphore_waiting(semaphore: asyncio.Semaphore) -> int:
    # asyncio.Semaphore has no public statistics.
    return len(semaphore._waiters or ())


def _itself(limiter: Any) -> Callable[[], Any]:
    # A C-level callable that returns the limiter: no Python frame added to the measured loop.
    return itertools.repeat(limiter).__next__


_PEERS = {
    SLOTWISE: Peer(
        name=SLOTWISE,
        make=lambda limit: MemoryLimiter(max_concurrent=limit),
        enter=lambda limiter: limiter.slot,
        waiting=_slotwise_waiting,
    ),
    ANYIO: Peer(name=ANYIO, make=anyio.CapacityLimiter, enter=_itself, waiting=_stats_waiting),
    ASYNCIO_SEMAPHORE: Peer(
        name=ASYNCIO_SEMAPHORE,
        make=asyncio.Semaphore,
        enter=_itself,
        waiting=_asyncio_semaphore_waiting,
    ),
    TRIO_LIMITER: Peer(
        name=TRIO_LIMITER, make=trio.CapacityLimiter, enter=_itself, waiting=_stats_waiting
    ),
    TRIO_SEMAPHORE: Peer(
        name=TRIO_SEMAPHORE, make=trio.Semaphore, enter=_itself, waiting=_stats_waiting
    ),
}

PEER_NAMES = tuple(_PEERS)


def peers_for(backend: str, *, with_trio_limiter: bool = False) -> list[Peer]:
    """slotwise first, then the peers native to ``backend``."""
    if backend == "asyncio":
        names = [SLOTWISE, ANYIO, ASYNCIO_SEMAPHORE]
    else:
        names = [SLOTWISE, ANYIO, TRIO_SEMAPHORE]
        if with_trio_limiter:
            names.insert(2, TRIO_LIMITER)
    return [_PEERS[name] for name in names]


def best(samples: list[float]) -> float:
    """The least disturbed of several repetitions of the same measurement."""
    return min(samples)


@contextmanager
def no_gc() -> Iterator[None]:
    """Time without the cyclic garbage collector, as ``timeit`` does."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# -- waiters: one task per request, on either backend ---------------------------------------


class Waiters:
    """Tasks queued on one limiter, started by :func:`start_waiters`.

    ``holders`` tasks take the whole capacity and keep it until :meth:`open_gate`; the
    ``count`` tasks behind them each take one slot, leave at once, and count themselves done.
    """

    def __init__(self, backend: str, count: int) -> None:
        self.backend = backend
        self.count = count
        self.finished = 0
        self.gate = anyio.Event()
        self.all_done = anyio.Event()
        self.cancels: list[Callable[[], None]] = []
        self._target = count
        self._finished_for_target = 0

    def expect(self, finished: int) -> None:
        """Make :meth:`wait` return once ``finished`` more waiters have ended."""
        self._target = finished
        self._finished_for_target = 0
        self.all_done = anyio.Event()

    def _one_done(self) -> None:
        self.finished += 1
        self._finished_for_target += 1
        if self._finished_for_target == self._target:
            self.all_done.set()

    def open_gate(self) -> None:
        self.gate.set()

    async def wait(self) -> None:
        await self.all_done.wait()


async def _holder(enter: Callable[[], AbstractAsyncContextManager[Any]], waiters: Waiters) -> None:
    async with enter():
        await waiters.gate.wait()


async def _waiter(enter: Callable[[], AbstractAsyncContextManager[Any]], waiters: Waiters) -> None:
    try:
        async with enter():
            pass
    finally:
        waiters._one_done()


async def settle(peer: Peer, limiter: Any, expected: int) -> None:
    """Yield until ``expected`` waiters are parked in the limiter's queue."""
    for _ in range(1000):
        if await peer.waiting(limiter) >= expected:
            return
        await anyio.lowlevel.checkpoint()
    raise RuntimeError(f"{peer.name}: only {await peer.waiting(limiter)} of {expected} queued")


async def start_waiters(
    peer: Peer,
    limiter: Any,
    *,
    backend: str,
    limit: int,
    count: int,
    nursery: trio.Nursery | None,
    holders: bool = True,
    cancellable: bool = True,
) -> Waiters:
    """Fill ``limiter`` with ``limit`` holders, queue ``count`` waiters behind them, and return
    once they are all parked. On trio the tasks run in ``nursery``, each in its own cancel
    scope; on asyncio they are plain tasks."""
    waiters = Waiters(backend, count)
    enter = peer.enter(limiter)
    spawn = _spawner(backend, nursery, waiters)
    if holders:
        for _ in range(limit):
            spawn(_holder(enter, waiters), cancellable=False)
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
    for _ in range(count):
        spawn(_waiter(enter, waiters), cancellable=cancellable)
    await settle(peer, limiter, count)
    return waiters


def _spawner(backend: str, nursery: trio.Nursery | None, waiters: Waiters) -> Callable[..., None]:
    if backend == "asyncio":
        loop = asyncio.get_running_loop()

        def spawn_asyncio(coro: Any, *, cancellable: bool) -> None:
            task = loop.create_task(coro)
            if cancellable:
                waiters.cancels.append(task.cancel)  # type: ignore[arg-type]

        return spawn_asyncio
    assert nursery is not None

    async def scoped(coro: Any, scope: trio.CancelScope) -> None:
        with scope:
            await coro

    def spawn_trio(coro: Any, *, cancellable: bool) -> None:
        scope = trio.CancelScope()
        nursery.start_soon(scoped, coro, scope)
        if cancellable:
            waiters.cancels.append(scope.cancel)

    return spawn_trio


async def in_task_tree(backend: str, body: Callable[[trio.Nursery | None], Awaitable[Any]]) -> Any:
    """Run ``body(nursery)``: a trio nursery on trio, None on asyncio."""
    if backend == "trio":
        async with trio.open_nursery() as nursery:
            return await body(nursery)
    return await body(None)


def clock() -> float:
    """CPU time of this process, in seconds.

    Every benchmark here is bound by the event loop's own work (no I/O, no timers), so on an
    idle machine this equals wall time; on a shared one it leaves out the time the process
    waits for a core, which wall time would charge to whichever peer happened to run then.
    """
    return time.process_time()


def cpu_model() -> str:
    """The CPU model named by /proc/cpuinfo, or the platform's guess."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _figure(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:,.2f}"


def format_table(
    rows: Sequence[Row], *, ratio: str = "slotwise / peer", sections: bool = False
) -> str:
    """Rows as an aligned text table; ``ratio`` heads the ratio's column, and ``sections``
    adds a column with each row's section."""
    header = ("backend", *(("section",) if sections else ()), "peer", "N", "figure", "unit")
    header += (ratio, "")
    lines = [
        (
            row.backend,
            *((row.section,) if sections else ()),
            row.peer,
            f"{row.n:,}",
            _figure(row.value),
            row.unit,
            f"{row.ratio:.2f}x" if row.ratio is not None else "-",
            row.extra,
        )
        for row in rows
    ]
    widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(len(header))]
    first = 3 if sections else 2  # N, the figure and the ratio are right-aligned
    right = {first, first + 1, first + 3}

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    rule = "  ".join("-" * width for width in widths).rstrip()
    return "\n".join([fmt(header), rule, *(fmt(cells) for cells in lines)])
