"""A `slot()` context and the slots it ends: a context object entered by many tasks, or inside
itself, and async generators that enter slots, wherever they are closed; a limiter's
`validate_workload` wherever the limiter defines it.

The faults that a review found in a faster form of the lifecycle (one context object shared
by every `limiter.slot()` call, `validate_workload` looked up on the limiter's class), one
test each, and the same faults reached through one context object that a user shares.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

import slotwise
from slotwise import ConcurrencyConfigError, MemoryLimiter, Workload
from slotwise._runtime import lifecycle

pytestmark = pytest.mark.anyio


async def _started_in_another_task(generator: AsyncIterator[int]) -> AsyncIterator[int]:
    """``generator``, run to its first yield by a task that has then ended."""

    async def start() -> None:
        await generator.__anext__()

    async with anyio.create_task_group() as tg:
        tg.start_soon(start)
    return generator


async def test_one_context_entered_by_many_tasks_gives_each_its_own_slot() -> None:
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


async def test_a_context_entered_inside_itself_ends_its_slots_innermost_first() -> None:
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


async def test_a_removed_workload_is_refused_through_a_context_made_before() -> None:
    limiter = MemoryLimiter(
        max_concurrent=2, workloads={"a": Workload(), "b": Workload()}, default_workload="a"
    )
    kept = limiter.slot("b")
    await limiter.set_limits(workloads={"a": Workload()})
    with pytest.raises(ConcurrencyConfigError, match="'b'"):
        async with kept:
            pass  # pragma: no cover
    await limiter.set_limits(workloads={"a": Workload(), "b": Workload()})
    async with kept as slot:
        assert slot.workload == "b"
    assert limiter.stats_nowait().active == 0


async def test_a_generator_that_enters_two_slots_in_one_frame_ends_both() -> None:
    a = MemoryLimiter(name="a", max_concurrent=2)
    b = MemoryLimiter(name="b", max_concurrent=2)

    async def two_limiters() -> AsyncIterator[int]:
        async with a.slot(), b.slot():
            yield 1

    async def nested() -> AsyncIterator[int]:
        async with a.slot(), a.slot(allow_nested=True):
            yield 1

    for make in (two_limiters, nested):
        async for _ in make():
            assert a.stats_nowait().active > 0
        assert a.stats_nowait().active == 0
        assert b.stats_nowait().active == 0
        generator = make()  # closed at its yield, by the task that runs it
        await generator.__anext__()
        await generator.aclose()
        assert a.stats_nowait().active == 0
        assert b.stats_nowait().active == 0


async def test_closing_a_wrapped_generator_ends_its_slot_not_the_closers() -> None:
    # The generator enters its slot through AsyncExitStack (so not from its own frame) in one
    # task; another task closes it from inside a slot of the same limiter: the closer keeps
    # its slot while its body runs, and the generator's ends (its context's one open entry).
    limiter = MemoryLimiter(max_concurrent=2)

    async def stream() -> AsyncIterator[int]:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(limiter.slot())
            yield 1

    generator = await _started_in_another_task(stream())
    assert limiter.stats_nowait().active == 1
    async with limiter.slot() as mine:
        await generator.aclose()
        assert not mine.released
        assert limiter.stats_nowait().active == 1
    assert mine.released


class Forwarding:
    """A limiter that forwards every attribute to another, through __getattr__."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Static:
    """A limiter whose validate_workload is a staticmethod."""

    name = "static"

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    @staticmethod
    def validate_workload(workload: str | None) -> str:
        return workload or "chat"

    async def acquire(self, request: Any) -> Any:
        return await self._inner.acquire(request)

    async def renew(self, lease: Any) -> Any:
        return await self._inner.renew(lease)

    async def release(self, lease: Any) -> None:
        await self._inner.release(lease)


@pytest.mark.parametrize("wrap", [Forwarding, Static])
async def test_validate_workload_is_used_wherever_the_limiter_defines_it(wrap: Any) -> None:
    inner = MemoryLimiter(max_concurrent=2, workloads={"chat": Workload()}, default_workload="chat")
    async with slotwise.slot(limiter=wrap(inner)) as slot:
        assert slot.workload == "chat"
    assert inner.stats_nowait().active == 0


async def test_a_shared_context_ends_a_generators_slot_not_its_closers() -> None:
    # One context object, entered by a generator in one task, and by another task that
    # closes the generator inside its own slot: each exit ends its own slot.
    limiter = MemoryLimiter(max_concurrent=4)
    shared = limiter.slot(allow_nested=True)

    async def stream() -> AsyncIterator[int]:
        async with shared:
            yield 1

    generator = await _started_in_another_task(stream())
    assert limiter.stats_nowait().active == 1
    async with shared as mine:
        await generator.aclose()
        assert not mine.released
        assert limiter.stats_nowait().active == 1  # the closer's own, the generator's back
    assert mine.released
    assert limiter.stats_nowait().active == 0


async def test_a_task_started_in_a_slot_closes_a_generator_after_its_parent_left() -> None:
    # The task inherits its parent's record of held slots; the parent leaves its slot (of the
    # same context object as the generator's) before the task closes the generator.
    limiter = MemoryLimiter(max_concurrent=4)
    shared = limiter.slot()

    async def stream() -> AsyncIterator[int]:
        async with shared:
            yield 1

    generator = await _started_in_another_task(stream())
    parent_left = anyio.Event()
    closed: list[bool] = []

    async def close() -> None:
        await parent_left.wait()
        await generator.aclose()  # raised RuntimeError (a context token used twice)
        closed.append(True)

    async with anyio.create_task_group() as tg:
        async with shared:
            tg.start_soon(close)
        parent_left.set()
    assert closed == [True]
    assert limiter.stats_nowait().active == 0


def test_a_sync_generator_that_enters_two_slots_in_one_frame_ends_both() -> None:
    limiter = MemoryLimiter(max_concurrent=2)

    def rows() -> Any:
        with limiter.sync_slot(), limiter.sync_slot(allow_nested=True):
            yield 1

    for _ in rows():
        assert limiter.stats_nowait().active == 2
    assert limiter.stats_nowait().active == 0
    generator = rows()
    next(generator)
    generator.close()
    assert limiter.stats_nowait().active == 0


async def test_a_slot_released_by_hand_is_still_its_own_exits() -> None:
    # A shared context entered inside itself, in one task and in a task started inside it:
    # an inner slot released by hand is ended by its own exit, which never ends the outer.
    limiter = MemoryLimiter(max_concurrent=4)
    shared = limiter.slot(allow_nested=True)
    async with shared as outer:
        async with shared as inner:
            await inner.release()
        assert not outer.released

        async def child() -> None:
            async with shared as mine:
                await mine.release()

        async with anyio.create_task_group() as tg:
            tg.start_soon(child)
        assert not outer.released
        assert limiter.stats_nowait().active == 1
    assert outer.released
    assert limiter.stats_nowait().active == 0


def test_a_sync_slot_released_by_hand_is_still_its_own_exits() -> None:
    limiter = MemoryLimiter(max_concurrent=2)
    shared = limiter.sync_slot(allow_nested=True)
    with shared as outer:
        with shared as inner:
            inner.release_sync()
        assert not outer.released
        assert limiter.stats_nowait().active == 1
    assert outer.released


async def test_a_generator_closed_elsewhere_leaves_nothing_alive_in_its_consumer() -> None:
    # The consumer runs the generator to its yield (its slot is recorded in the consumer's
    # context), another task closes it: the ended slot keeps neither the generator's frame
    # (its locals) alive nor a place in the consumer's record of held slots.
    limiter = MemoryLimiter(max_concurrent=2)

    class Payload:
        pass

    payloads: list[weakref.ref[Payload]] = []

    async def stream() -> AsyncIterator[int]:
        payload = Payload()
        payloads.append(weakref.ref(payload))
        async with limiter.slot():
            yield 1

    for _ in range(3):
        generator = stream()
        await generator.__anext__()

        async def close(generator: Any = generator) -> None:
            await generator.aclose()

        async with anyio.create_task_group() as tg:
            tg.start_soon(close)
        del generator
        assert limiter.stats_nowait().active == 0
    gc.collect()
    assert [ref() for ref in payloads] == [None, None, None]
    async with limiter.slot():  # the consumer's next slot forgets the ended ones
        assert len(lifecycle._holding.get()) == 1


async def test_overlapping_generators_keep_no_ended_slot_alive() -> None:
    # Each stream starts before the previous one is closed: a slot's record of the slots held
    # before it must not keep them alive once they have ended.
    limiter = MemoryLimiter(max_concurrent=3)
    slots: list[weakref.ref[slotwise.Slot]] = []

    async def stream() -> AsyncIterator[int]:
        async with limiter.slot(allow_nested=True) as slot:
            slots.append(weakref.ref(slot))
            del slot
            yield 1

    previous: Any = None
    for _ in range(50):
        generator = stream()
        await generator.__anext__()
        if previous is not None:
            await previous.aclose()
        previous = generator
    await previous.aclose()
    del previous, generator
    gc.collect()
    assert limiter.stats_nowait().active == 0
    assert sum(ref() is not None for ref in slots) == 0


async def test_a_stack_closed_by_another_task_ends_the_slot_it_entered() -> None:
    # Entered through AsyncExitStack and closed by a task started before the entry, where
    # nothing records the slot: the context's one open entry ends.
    limiter = MemoryLimiter(max_concurrent=2)
    handed = contextlib.AsyncExitStack()
    entered = anyio.Event()

    async def close() -> None:
        await entered.wait()
        await handed.aclose()

    async with anyio.create_task_group() as tg:
        tg.start_soon(close)
        held = await handed.enter_async_context(limiter.slot())
        entered.set()
    assert held.released
    assert limiter.stats_nowait().active == 0


@contextlib.asynccontextmanager
async def _held_by_another_task(context: Any, limiter: Any = None) -> AsyncIterator[None]:
    """``context`` entered by another task (in a run of ``limiter``, if given) for as long as
    the block runs; its slot must be held still when the block ends."""
    entered = anyio.Event()
    leave = anyio.Event()

    async def hold() -> None:
        async with contextlib.AsyncExitStack() as stack:
            if limiter is not None:
                await stack.enter_async_context(slotwise.run(limiter=limiter))
            slot = await stack.enter_async_context(context)
            assert slot.limiter is not None
            entered.set()
            await leave.wait()
            assert not slot.released

    async with anyio.create_task_group() as tg:
        tg.start_soon(hold)
        await entered.wait()
        yield
        leave.set()


async def test_an_unlimited_entry_never_ends_another_entrys_slot() -> None:
    # One object, entered inside a run (limited by the run's limiter) and outside any run
    # (nothing limited), each through an exit stack: the unlimited exit never ends the
    # limited entry, the one open entry that its task does not record.
    limiter = MemoryLimiter(max_concurrent=2)
    shared = slotwise.slot()
    async with _held_by_another_task(shared, limiter):
        async with contextlib.AsyncExitStack() as stack:
            free = await stack.enter_async_context(shared)
            assert free.limiter is None
        assert limiter.stats_nowait().active == 1
    assert limiter.stats_nowait().active == 0


async def test_an_exit_called_once_too_often_ends_no_other_entrys_slot() -> None:
    # Misuse: an entry's exit called again while another task's entry of the same object is
    # the only open one. The stray exit ends nothing (it is no exit stack's).
    limiter = MemoryLimiter(max_concurrent=1)
    shared = limiter.slot()
    await shared.__aenter__()
    await shared.__aexit__(None, None, None)
    async with _held_by_another_task(shared):
        await shared.__aexit__(None, None, None)
        assert limiter.stats_nowait().active == 1
    assert limiter.stats_nowait().active == 0


async def test_an_ended_slot_kept_by_its_user_keeps_no_slot_held_before_it() -> None:
    # The usual exit ends the slot as every exit does: its nested-guard token (whose old
    # value is the tuple of slots held before it) goes with it.
    limiter = MemoryLimiter(max_concurrent=2)
    async with limiter.slot() as outer, limiter.slot(allow_nested=True) as inner:
        pass
    outer_ref = weakref.ref(outer)
    del outer
    gc.collect()
    assert inner.released
    assert outer_ref() is None
