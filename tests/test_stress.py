"""Random schedules: the limits hold, and nothing leaks, whatever is cancelled when.

Every body counts itself in and out, so the test sees how many requests actually run at
once, per workload and in total; a monitor checks the documented allocation invariants on the
limiter's own stats while the schedule runs; at the end every slot must be free and grantable.

The Hypothesis tests drive each schedule from a random seed and run it with ``anyio.run``: on
asyncio with a real clock (tiny durations) and on trio with a fresh ``MockClock`` per example.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping

import anyio
import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

import slotwise
from slotwise import (
    AcquireRequest,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
    Lease,
    MemoryLimiter,
    Workload,
)

pytestmark = pytest.mark.anyio

_request_ids = itertools.count()


def req(workload: str, *, deadline: float | None = None) -> AcquireRequest:
    return AcquireRequest(
        workload=workload, request_id=f"s-{next(_request_ids)}", deadline=deadline
    )


@attrs.frozen
class Rule:
    ceiling: int
    reserved: int


@attrs.frozen
class Config:
    max_concurrent: int
    max_queued: int | None
    workloads: Mapping[str, Workload]

    def rules(self) -> dict[str, Rule]:
        return {
            name: Rule(
                ceiling=w.max_concurrent or self.max_concurrent,
                reserved=w.reserved,
            )
            for name, w in self.workloads.items()
        }

    def limiter(self, unit: float = 1.0) -> MemoryLimiter[str]:
        """The limiter, with each ``max_wait`` read as a number of time units."""
        return MemoryLimiter(
            name="stress",
            max_concurrent=self.max_concurrent,
            max_queued=self.max_queued,
            workloads={
                name: w if w.max_wait is None else attrs.evolve(w, max_wait=w.max_wait * unit)
                for name, w in self.workloads.items()
            },
        )


def has_room(config: Config, active: Mapping[str, int], workload: str) -> bool:
    """The allocation rule, written out again independently of the library."""
    rules = config.rules()
    shared = config.max_concurrent - sum(r.reserved for r in rules.values())
    in_shared = sum(max(0, active[name] - rule.reserved) for name, rule in rules.items())
    rule = rules[workload]
    held = active[workload]
    return held < rule.ceiling and (held < rule.reserved or in_shared < shared)


@st.composite
def configs(draw: st.DrawFn) -> Config:
    max_concurrent = draw(st.integers(1, 4))
    count = draw(st.integers(1, 3))
    left = max_concurrent
    workloads = {}
    for index in range(count):
        ceiling = draw(st.none() | st.integers(1, max_concurrent))
        reserved = draw(st.integers(0, min(left, ceiling or max_concurrent)))
        left -= reserved
        workloads[f"w{index}"] = Workload(
            max_concurrent=ceiling,
            reserved=reserved,
            priority=draw(st.integers(0, 2)),
            max_wait=draw(st.sampled_from([None, None, 0.0, 3.0])),
        )
    if left == 0:
        # No shared capacity: a workload without a reservation can never be served, so its
        # requests must give up on their own.
        for name, w in workloads.items():
            if w.reserved == 0 and w.max_wait is None:
                workloads[name] = attrs.evolve(w, max_wait=3.0)
    max_queued = draw(st.sampled_from([None, None, 0, 3, 10]))
    return Config(max_concurrent=max_concurrent, max_queued=max_queued, workloads=workloads)


@attrs.define
class Census:
    """Who runs a body right now, and the most that ever did."""

    config: Config
    active: dict[str, int]
    peak_total: int = 0
    peak: dict[str, int] = attrs.field(factory=dict)
    bodies: int = 0

    def enter(self, workload: str) -> None:
        self.active[workload] += 1
        self.bodies += 1
        total = sum(self.active.values())
        self.peak_total = max(self.peak_total, total)
        self.peak[workload] = max(self.peak.get(workload, 0), self.active[workload])
        rules = self.config.rules()
        assert total <= self.config.max_concurrent, self.active
        assert self.active[workload] <= rules[workload].ceiling, self.active
        shared = self.config.max_concurrent - sum(r.reserved for r in rules.values())
        in_shared = sum(max(0, self.active[n] - r.reserved) for n, r in rules.items())
        assert in_shared <= shared, self.active  # reservations are never lent

    def leave(self, workload: str) -> None:
        self.active[workload] -= 1


async def check_invariants(limiter: MemoryLimiter[str], config: Config, census: Census) -> None:
    stats = await limiter.stats()
    active = {name: w.active for name, w in stats.workloads.items()}
    assert stats.active == sum(active.values()) <= config.max_concurrent
    assert stats.queued == sum(w.queued for w in stats.workloads.values())
    for name, w in stats.workloads.items():
        assert w.active <= config.rules()[name].ceiling
        # No waiter is left waiting while its workload has room (no lost wake-up).
        assert w.queued == 0 or not has_room(config, active, name), stats
        # A body runs only with a lease.
        assert census.active[name] <= w.active


async def assert_all_free(limiter: MemoryLimiter[str], config: Config) -> None:
    """Nothing is held or queued, and every slot can be taken again at once."""
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (0, 0), stats
    active = dict.fromkeys(config.workloads, 0)
    leases: list[Lease] = []
    for name in config.workloads:
        while has_room(config, active, name):
            leases.append(await limiter.acquire(req(name, deadline=anyio.current_time())))
            active[name] += 1
    # Then every workload is full: no phantom capacity was left behind.
    for name in config.workloads:
        with pytest.raises((ConcurrencyTimeoutError, ConcurrencyQueueFullError)):
            await limiter.acquire(req(name, deadline=anyio.current_time()))
    assert len(leases) <= config.max_concurrent
    if all(rule.ceiling == config.max_concurrent for rule in config.rules().values()):
        assert len(leases) == config.max_concurrent
    for lease in leases:
        await limiter.release(lease)
    assert (await limiter.stats()).active == 0


async def run_schedule(config: Config, seed: int, tasks: int, unit: float) -> Census:
    """Run ``tasks`` random requests against a fresh limiter; return the census.

    ``unit`` is the time scale of holds, delays and timeouts (virtual seconds on a mock
    clock, a millisecond on a real one).
    """
    rng = random.Random(seed)
    limiter = config.limiter(unit)
    names = list(config.workloads)
    census = Census(config=config, active=dict.fromkeys(names, 0))
    waiting: dict[int, anyio.CancelScope] = {}  # requests not yet in their body
    cancelled: set[int] = set()  # requests whose scope was cancelled by hand
    done = anyio.Event()

    async def pause() -> None:
        choice = rng.random()
        if choice < 0.4:
            for _ in range(rng.randrange(4)):
                await anyio.lowlevel.checkpoint()
        else:
            await anyio.sleep(unit * rng.choice([0.5, 1, 2, 5]))

    def cancel_a_waiter() -> None:
        # Right after a release the oldest waiter is the likeliest to have just been granted
        # and not yet resumed: cancel it (or any other) with no checkpoint in between.
        if waiting and rng.random() < 0.5:
            key = min(waiting) if rng.random() < 0.5 else rng.choice(list(waiting))
            cancelled.add(key)
            waiting.pop(key).cancel()

    async def body(key: int, workload: str) -> None:
        # A request cancelled before its body began never runs it, even when the slot was
        # granted at that very moment.
        assert key not in cancelled
        census.enter(workload)
        try:
            await pause()
            if rng.random() < 0.1:
                raise ValueError("the provider failed")
        finally:
            census.leave(workload)

    async def request(key: int, tg: anyio.abc.TaskGroup) -> None:
        await pause()
        workload = rng.choice(names)
        mode = rng.choice(["slot", "slot", "cancel", "move_on", "by_hand"])
        scope = anyio.CancelScope()
        if mode == "cancel":
            tg.start_soon(cancel_later, key, scope)
        elif mode == "move_on":
            scope = anyio.move_on_after(unit * rng.choice([0, 0.5, 1, 3]))
        waiting[key] = scope
        try:
            with scope:
                if mode == "by_hand":
                    slot = await slotwise.acquire(workload, limiter=limiter)
                    waiting.pop(key, None)
                    try:
                        await body(key, workload)
                    finally:
                        # Released by another task, whatever ended the body.
                        tg.start_soon(slot.release)
                    return
                async with limiter.slot(workload) as held:
                    waiting.pop(key, None)
                    assert held.workload == workload
                    await body(key, workload)
                cancel_a_waiter()
        except (ConcurrencyTimeoutError, ConcurrencyQueueFullError, ValueError):
            pass
        finally:
            waiting.pop(key, None)

    async def cancel_later(key: int, scope: anyio.CancelScope) -> None:
        await pause()
        if key in waiting:
            cancelled.add(key)
        scope.cancel()

    async def monitor() -> None:
        while not done.is_set():
            await check_invariants(limiter, config, census)
            await pause()

    async with anyio.create_task_group() as outer:
        outer.start_soon(monitor)
        async with anyio.create_task_group() as tg:
            for key in range(tasks):
                tg.start_soon(request, key, tg)
        done.set()
    await check_invariants(limiter, config, census)
    await assert_all_free(limiter, config)
    return census


def run_example(backend: str, config: Config, seed: int, tasks: int) -> Census:
    """One schedule in its own event loop: asyncio on a real clock (a unit is 1 ms), or trio
    on a fresh mock clock (a unit is one virtual second)."""
    unit = 0.001 if backend == "asyncio" else 1.0

    async def schedule() -> Census:
        # A hang (a lost wake-up) fails here instead of stalling the run.
        with anyio.fail_after(1000 * unit + 30):
            return await run_schedule(config, seed, tasks, unit)

    options = {} if backend == "asyncio" else {"clock": MockClock(autojump_threshold=0)}
    census = anyio.run(schedule, backend=backend, backend_options=options)
    assert census.peak_total <= config.max_concurrent
    return census


schedules = given(config=configs(), seed=st.integers(0, 2**32 - 1), tasks=st.integers(1, 60))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@schedules
def test_random_schedules_on_asyncio(config: Config, seed: int, tasks: int) -> None:
    run_example("asyncio", config, seed, tasks)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@schedules
def test_random_schedules_on_trio_with_a_mock_clock(config: Config, seed: int, tasks: int) -> None:
    run_example("trio", config, seed, tasks)


@pytest.mark.parametrize("seed", [1, 2])
async def test_hundreds_of_tasks_on_a_real_clock(seed: int) -> None:
    config = Config(
        max_concurrent=6,
        max_queued=None,
        workloads={
            "interactive": Workload(reserved=2, priority=10, max_wait=50),
            "background": Workload(max_concurrent=4),
            "batch": Workload(max_concurrent=2, priority=1, max_wait=0),
        },
    )
    with anyio.fail_after(120):
        # 3 ms units: a loop turn of 400 tasks on a busy machine stays small against them.
        census = await run_schedule(config, seed, tasks=400, unit=0.003)
    # The limits were reached, so the count above is a real test of them.
    assert census.peak_total == 6
    assert census.peak["background"] == 4
    assert census.bodies > 100


@pytest.mark.parametrize(
    "anyio_backend",
    [pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock")],
)
async def test_hundreds_of_tasks_on_a_mock_clock() -> None:
    config = Config(
        max_concurrent=8,
        max_queued=200,
        workloads={
            "interactive": Workload(reserved=2, priority=10, max_wait=60.0),
            "background": Workload(max_concurrent=6, max_wait=300.0),
        },
    )
    census = await run_schedule(config, seed=7, tasks=500, unit=1.0)
    assert census.peak_total == 8
    assert census.peak["background"] == 6


# -- a waiter cancelled as it is granted ------------------------------------------------------


async def test_the_only_woken_waiter_cancelled_after_grant_gives_the_slot_back() -> None:
    limiter = MemoryLimiter(max_concurrent=1)
    held = await limiter.acquire(req("default"))
    scope = anyio.CancelScope()
    ran = False

    async def waiter() -> None:
        nonlocal ran
        with scope:
            async with limiter.slot():
                ran = True
                await anyio.lowlevel.checkpoint()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            await limiter.release(held)
            # The release granted the slot to the waiter, which has not resumed yet.
            assert "1/1 active, 0 queued" in repr(limiter)
            scope.cancel()
        stats = await limiter.stats()
        assert (stats.active, stats.queued) == (0, 0)
        # Every later request still gets the slot: in turn, and one after another.
        order: list[int] = []

        async def later(index: int) -> None:
            async with limiter.slot():
                order.append(index)
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            for index in range(5):
                tg.start_soon(later, index)
                await anyio.wait_all_tasks_blocked()
        assert order == list(range(5))
        for _ in range(3):
            lease = await limiter.acquire(req("default", deadline=anyio.current_time()))
            await limiter.release(lease)
    # The slot granted as its request was cancelled was given back before any body ran.
    assert not ran


async def test_a_waiter_cancelled_after_grant_hands_the_slot_to_the_next() -> None:
    limiter = MemoryLimiter(max_concurrent=1)
    held = await limiter.acquire(req("default"))
    first = anyio.CancelScope()
    got: list[str] = []

    async def waiter(name: str, scope: anyio.CancelScope) -> None:
        with scope:
            lease = await limiter.acquire(req("default"))
            got.append(name)
            await limiter.release(lease)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, "first", first)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(waiter, "second", anyio.CancelScope())
            await anyio.wait_all_tasks_blocked()
            await limiter.release(held)
            first.cancel()
    # Either the first waiter kept its grant (the cancellation came too late to matter) or
    # it gave the slot back; the second one is served either way.
    assert got in (["second"], ["first", "second"])
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)


async def test_cancel_right_after_grant_never_over_grants() -> None:
    limiter = MemoryLimiter(max_concurrent=2)
    inside = peak = 0
    scopes: list[anyio.CancelScope] = []
    rng = random.Random(3)

    async def worker() -> None:
        nonlocal inside, peak
        scope = anyio.CancelScope()
        scopes.append(scope)
        with scope:
            async with limiter.slot():
                inside += 1
                try:
                    peak = max(peak, inside)
                    assert inside <= 2
                    for _ in range(rng.randrange(3)):
                        await anyio.lowlevel.checkpoint()
                finally:
                    inside -= 1
            # Released synchronously: cancel the next waiters, likely just granted.
            for victim in [s for s in scopes if s is not scope][: rng.randrange(3)]:
                victim.cancel()
        scopes.remove(scope)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for _ in range(300):
                tg.start_soon(worker)
    assert peak == 2
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)
    for _ in range(2):
        await limiter.acquire(req("default", deadline=anyio.current_time()))
    with pytest.raises(ConcurrencyTimeoutError):
        await limiter.acquire(req("default", deadline=anyio.current_time()))
