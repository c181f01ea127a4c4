"""The `slot()` context of a built-in limiter: one object per workload, shared by every request
that asks `slot(workload)` with no other argument, each entry a slot of its own.

A shared object must still end the right slot at each exit: the innermost one its task
entered, or the one an async generator entered when that generator is closed, wherever it
is closed.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import AsyncIterator

import anyio
import pytest

import slotwise
from slotwise import ConcurrencyConfigError, MemoryLimiter, Workload

pytestmark = pytest.mark.anyio


def test_slot_returns_one_object_per_known_workload_and_none_kept_otherwise() -> None:
    limiter = MemoryLimiter(
        max_concurrent=4,
        workloads={"chat": Workload(), "batch": Workload()},
        default_workload="chat",
    )
    assert limiter.slot() is limiter.slot()
    assert limiter.slot("chat") is limiter.slot("chat")
    assert limiter.slot("batch") is limiter.slot("batch")
    assert limiter.slot("chat") is not limiter.slot("batch")
    assert limiter.slot() is not limiter.slot("chat")  # None resolves at entry, not here
    # Any other argument makes a context of its own, as does a name the limiter lacks.
    assert limiter.slot(tokens=10) is not limiter.slot(tokens=10)
    assert limiter.slot(allow_nested=True) is not limiter.slot(allow_nested=True)
    assert limiter.slot("nope") is not limiter.slot("nope")
    # Not kept: names the limiter lacks do not grow it (10,000 kept would be over 1 MB).
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for index in range(10_000):
            limiter.slot(f"nope-{index}")
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 50_000


async def test_one_shared_context_gives_each_task_its_own_slot_within_the_limit() -> None:
    limiter = MemoryLimiter(max_concurrent=3)
    shared = limiter.slot()
    inside = peak = 0
    held: list[slotwise.Slot] = []

    async def use() -> None:
        nonlocal inside, peak
        async with shared as slot:
            held.append(slot)
            inside += 1
            peak = max(peak, inside)
            await anyio.sleep(0.001)
            inside -= 1
        assert slot.released

    async with anyio.create_task_group() as tg:
        for _ in range(30):
            tg.start_soon(use)
    assert peak == 3
    assert len({id(slot) for slot in held}) == 30
    assert all(slot.released for slot in held)
    assert limiter.stats_nowait().active == 0


async def test_a_shared_context_entered_inside_itself_ends_its_slots_innermost_first() -> None:
    limiter = MemoryLimiter(max_concurrent=2)
    with pytest.raises(ConcurrencyConfigError, match="already holds a slot"):
        async with limiter.slot(), limiter.slot():
            pass  # pragma: no cover
    assert limiter.stats_nowait().active == 0
    nested = limiter.slot(allow_nested=True)
    async with nested as outer:
        async with nested as inner:
            assert not outer.released
            assert not inner.released
        assert inner.released
        assert not outer.released
    assert outer.released


async def test_a_removed_workload_is_refused_through_its_kept_context() -> None:
    limiter = MemoryLimiter(
        max_concurrent=2, workloads={"a": Workload(), "b": Workload()}, default_workload="a"
    )
    kept = limiter.slot("b")
    await limiter.set_limits(workloads={"a": Workload()})
    with pytest.raises(ConcurrencyConfigError, match="'b'"):
        async with kept:
            pass  # pragma: no cover
    await limiter.set_limits(workloads={"a": Workload(), "b": Workload()})
    async with limiter.slot("b") as slot:
        assert slot.workload == "b"
    assert limiter.stats_nowait().active == 0


async def test_leaving_a_slot_ends_it_not_the_slot_a_generator_took_inside_it() -> None:
    # The task enters the context, then runs a generator that enters the same context object
    # and stops at its yield: leaving the task's block ends the task's slot; the generator's
    # stays held until the generator is closed.
    limiter = MemoryLimiter(max_concurrent=2)
    shared = limiter.slot(allow_nested=True)

    async def stream() -> AsyncIterator[int]:
        async with shared:
            yield 1

    generator = stream()
    async with shared as mine:
        await generator.__anext__()
    assert mine.released
    assert limiter.stats_nowait().active == 1
    await generator.aclose()
    assert limiter.stats_nowait().active == 0
    async with limiter.slot():  # nothing is left held by this task: no nested refusal
        pass


async def test_a_generator_closed_inside_its_own_slot_ends_only_that_slot() -> None:
    # The generator's slot is the innermost one of the task when it is closed there.
    limiter = MemoryLimiter(max_concurrent=2)

    async def stream() -> AsyncIterator[int]:
        async with limiter.slot():
            yield 1

    generator = stream()
    await generator.__anext__()
    assert limiter.stats_nowait().active == 1
    await generator.aclose()
    assert limiter.stats_nowait().active == 0
    async with limiter.slot():  # the task's guard holds nothing any more
        assert limiter.stats_nowait().active == 1
