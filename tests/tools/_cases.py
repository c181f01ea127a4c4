"""Tests that every limiter must pass under a ToolBox (seed 000's list, and the atomic pair).

Each case takes ``make(**settings)``, which returns a limiter (or an awaitable of one) built
with ``MemoryLimiter``'s keyword arguments, so the same case runs on MemoryLimiter and on
PostgresLimiter. Concurrency is counted where the handlers run, never inferred from results.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio

import slotwise
from slotwise import Workload
from slotwise.tools import ToolBox, ToolCall, ToolResult

Make = Callable[..., Any]


async def build(make: Make, **settings: Any) -> Any:
    limiter = make(**settings)
    return await limiter if inspect.isawaitable(limiter) else limiter


class Activity:
    """Handlers running at once, per pool and in total, counted inside the handlers."""

    def __init__(self) -> None:
        self.active: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self.total = 0
        self.peak_total = 0
        self.entered: list[str] = []

    @contextmanager
    def running(self, pool: str, call: str) -> Iterator[None]:
        self.entered.append(call)
        self.active[pool] += 1
        self.total += 1
        self.peak[pool] = max(self.peak[pool], self.active[pool])
        self.peak_total = max(self.peak_total, self.total)
        try:
            yield
        finally:
            self.active[pool] -= 1
            self.total -= 1


def counted(
    box: ToolBox[Any],
    activity: Activity,
    name: str,
    *,
    pool: str,
    hold: float = 0.0,
    gate: anyio.Event | None = None,
    fail: bool = False,
    **options: Any,
) -> None:
    """Register tool ``name``: it counts itself in ``activity``, holds ``hold`` seconds (or
    until ``gate`` is set), then raises if ``fail``, else returns its ``tag`` argument."""

    async def handler(tag: str) -> str:
        with activity.running(pool, tag):
            if gate is not None:
                await gate.wait()
            await anyio.sleep(hold)
            if fail:
                raise RuntimeError(f"{name} broke")
            return tag

    box.tool(name=name, pool=pool, **options)(handler)


def calls(*names: str) -> list[ToolCall]:
    """One call per name, with ids ``c0``, ``c1``, ... and the id as the ``tag`` argument."""
    return [
        ToolCall(id=f"c{i}", name=name, arguments={"tag": f"c{i}"}) for i, name in enumerate(names)
    ]


async def idle(limiter: Any) -> bool:
    stats = await limiter.stats()
    return bool(stats.active == 0 and stats.queued == 0)


async def until(check: Callable[[], Awaitable[bool] | bool]) -> None:
    """Let the other tasks run until ``check()`` holds; fail after 20 s."""
    with anyio.fail_after(20):
        while True:
            ok = check()
            if inspect.isawaitable(ok):
                ok = await ok
            if ok:
                return
            await anyio.sleep(0.001)


# -- the cases ---------------------------------------------------------------------------------


async def case_limits_counted(make: Make, hold: float) -> None:
    """The most handlers running at once in each pool and in total, counted: each pool reaches
    its ceiling on its own and never passes it; together they fill the global limit and never
    pass it."""
    limiter = await build(
        make,
        name="tools",
        max_concurrent=4,
        workloads={
            "a": Workload(max_concurrent=2),
            "b": Workload(max_concurrent=3, max_wait=60.0),
            "c": Workload(),
        },
        default_workload="c",
    )
    box = ToolBox(limiter=limiter)
    activity = Activity()
    for pool in "abc":
        counted(box, activity, pool, pool=pool, hold=hold)
    for pool, ceiling in (("a", 2), ("b", 3), ("c", 4)):
        activity.peak.clear()
        results = await box.run(calls(*[pool] * 6))
        assert [r.error for r in results] == [None] * 6
        assert activity.peak[pool] == ceiling
    activity.peak.clear()
    activity.peak_total = 0
    results = await box.run(calls(*"abc" * 6))
    assert [r.content for r in results] == [f"c{i}" for i in range(18)]
    assert activity.peak_total == 4
    assert activity.peak["a"] <= 2
    assert activity.peak["b"] <= 3
    assert await idle(limiter)


async def case_failing_call_gives_its_slot_back(make: Make) -> None:
    """With one slot, calls after a failing one still run: its slot came back."""
    limiter = await build(make, name="tools", max_concurrent=1)
    box = ToolBox(limiter=limiter)
    activity = Activity()
    counted(box, activity, "boom", pool="default", fail=True)
    counted(box, activity, "fine", pool="default")
    with anyio.fail_after(20):
        results = await box.run(calls("boom", "fine", "boom", "fine"))
    assert [r.error for r in results] == ["failed", None, "failed", None]
    assert results[0].content == "Tool 'boom' failed: RuntimeError: boom broke"
    assert activity.entered == ["c0", "c1", "c2", "c3"]
    assert activity.peak_total == 1
    assert await idle(limiter)


async def case_cancelled_queued_calls_never_run(make: Make) -> None:
    """Cancelling the batch while one call runs and two wait (one in the limiter's queue, one
    in the batch behind another call of its pool): neither waiting call ever enters its
    handler, and no slot is left held or queued."""
    limiter = await build(
        make,
        name="tools",
        max_concurrent=2,
        workloads={"p": Workload(max_concurrent=1), "q": Workload()},
        default_workload="p",
    )
    box = ToolBox(limiter=limiter)
    activity = Activity()
    gate = anyio.Event()
    counted(box, activity, "block", pool="p", gate=gate)
    counted(box, activity, "same_pool", pool="p")
    counted(box, activity, "other_pool", pool="q", gate=gate)
    events: list[slotwise.ConcurrencyEvent] = []
    unsubscribe = slotwise.subscribe(events.append, limiter=limiter)
    try:
        async with limiter.slot("q"):  # another holder: one slot is left for the batch
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(box.run, calls("block", "same_pool", "other_pool"))

                    # c0 and c2 ask for the one slot left; the loser waits in the limiter's
                    # queue, and c1 in the batch, behind c0 in its pool.
                    async def queued() -> bool:
                        return bool(activity.total == 1 and (await limiter.stats()).queued == 1)

                    await until(queued)
                    scope.cancel()
        [ran] = activity.entered
        await until(lambda: idle(limiter))
    finally:
        unsubscribe()
    ends = {
        e.call_id: (e.kind, getattr(e, "reason", None) or getattr(e, "outcome", None))
        for e in events
        if e.kind in ("tool-finished", "tool-rejected")
    }
    assert ends == {
        call: ("tool-finished" if call == ran else "tool-rejected", "cancelled")
        for call in ("c0", "c1", "c2")
    }
    assert activity.entered == [ran]
    assert ran in ("c0", "c2")


async def case_two_runs_share_the_pools(make: Make, hold: float) -> None:
    """Two runs using one ToolBox (built outside them) share its limits: four calls, two
    slots, never more than two at once."""
    limiter = await build(
        make, name="tools", max_concurrent=3, workloads={"p": Workload(max_concurrent=2)}
    )
    box = ToolBox(limiter=limiter)
    activity = Activity()
    counted(box, activity, "work", pool="p", hold=hold)
    run_ids: list[str] = []

    async def agent() -> None:
        async with slotwise.run() as run:
            run_ids.append(run.run_id)
            results = await box.run(calls("work", "work"))
            assert [r.error for r in results] == [None, None]

    async with anyio.create_task_group() as tg:
        tg.start_soon(agent)
        tg.start_soon(agent)
    assert len(set(run_ids)) == 2
    assert activity.peak["p"] == 2
    assert await idle(limiter)


async def case_the_pair_is_admitted_atomically(make: Make, slow_max_wait: float | None) -> None:
    """Global limit 4, a pool of 1 with a queue: while the pool's calls wait in the limiter's
    queue, the other pools' calls keep all 3 remaining slots busy (stacked semaphores would
    have each queued call hold a global slot while it waits for its pool)."""
    limiter = await build(
        make,
        name="tools",
        max_concurrent=4,
        workloads={
            "slow": Workload(max_concurrent=1, max_wait=slow_max_wait),
            "fast": Workload(max_concurrent=2),
            "other": Workload(),
        },
        default_workload="other",
    )
    box = ToolBox(limiter=limiter)
    activity = Activity()
    slow_gate, other_gate = anyio.Event(), anyio.Event()
    counted(box, activity, "slow", pool="slow", gate=slow_gate)
    counted(box, activity, "fast", pool="fast", gate=other_gate)
    counted(box, activity, "other", pool="other", gate=other_gate)
    results: list[ToolResult] = []

    async def agent(*names: str) -> None:
        async with slotwise.run():
            results.extend(await box.run(calls(*names)))

    async with anyio.create_task_group() as tg:
        for _ in range(4):  # four agents call the slow tool at once: one runs, three queue
            tg.start_soon(agent, "slow")

        async def slow_queue() -> bool:
            stats = await limiter.stats()
            return bool(activity.total == 1 and stats.workloads["slow"].queued == 3)

        await until(slow_queue)
        tg.start_soon(agent, "fast", "other", "fast", "other", "fast", "other")
        await until(lambda: activity.total == 4)
        assert activity.active["slow"] == 1
        assert activity.active["fast"] + activity.active["other"] == 3
        stats = await limiter.stats()
        assert (stats.active, stats.workloads["slow"].queued) == (4, 3)
        other_gate.set()
        # The other pools' calls all run while the slow pool's queue still waits.
        await until(lambda: activity.total == 1 and len(activity.entered) == 7)
        assert (await limiter.stats()).workloads["slow"].queued == 3
        slow_gate.set()
    assert [r.error for r in results] == [None] * 10
    assert activity.peak_total == 4
    assert activity.peak["slow"] == 1
    assert await idle(limiter)
