"""Events (kinds, fields, delivery, subscriptions) and stats."""

from __future__ import annotations

import functools
import logging
import time
import typing
from typing import Any, Literal

import anyio
import attrs
import pytest
from trio.testing import MockClock

import slotwise
from slotwise import (
    AcquiredEvent,
    AcquireRequest,
    ConcurrencyConfigError,
    ConcurrencyEvent,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
    ConfigErrorEvent,
    Lease,
    LeaseLostEvent,
    LimitChangedEvent,
    LimiterErrorEvent,
    MemoryLimiter,
    PausedEvent,
    QueueFullEvent,
    ReleasedEvent,
    ReleaseFailedEvent,
    RenewalFailedEvent,
    SupportsLease,
    TimedOutEvent,
    WaitCancelledEvent,
    WaitStartedEvent,
    Workload,
)

pytestmark = pytest.mark.anyio

COMMON = {
    "kind",
    "limiter",
    "workload",
    "run_id",
    "root_run_id",
    "parent_run_id",
    "request_id",
    "timestamp",
}

# The documented table of events: kind -> (class, extra fields).
TABLE: dict[str, tuple[type[Any], set[str]]] = {
    "wait-started": (WaitStartedEvent, {"deadline"}),
    "acquired": (AcquiredEvent, {"lease_id", "wait_time", "waited_for"}),
    "timed-out": (TimedOutEvent, {"wait_time"}),
    "queue-full": (QueueFullEvent, {"wait_time"}),
    "wait-cancelled": (WaitCancelledEvent, {"wait_time"}),
    "limiter-error": (LimiterErrorEvent, {"wait_time", "error"}),
    "config-error": (ConfigErrorEvent, {"error"}),
    "released": (ReleasedEvent, {"lease_id", "hold_time", "outcome"}),
    "renewal-failed": (RenewalFailedEvent, {"lease_id", "error"}),
    "lease-lost": (LeaseLostEvent, {"lease_id", "hold_time"}),
    "release-failed": (ReleaseFailedEvent, {"lease_id", "error"}),
    "paused": (PausedEvent, {"until", "reason"}),
    "limit-changed": (LimitChangedEvent, {"old", "new", "reason"}),
}


def on_mock_clock() -> pytest.MarkDecorator:
    """Run the test on trio with a virtual clock that jumps whenever every task sleeps."""
    return pytest.mark.parametrize(
        "anyio_backend",
        [pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock")],
    )


def fields_of(event: ConcurrencyEvent) -> dict[str, Any]:
    return attrs.asdict(event)


def of_request(events: list[ConcurrencyEvent], request_id: str | None) -> list[ConcurrencyEvent]:
    return [e for e in events if e.request_id == request_id]


# -- the event classes ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(TABLE))
def test_each_kind_has_the_fields_of_the_table(kind: str) -> None:
    cls, extra = TABLE[kind]
    assert set(attrs.fields_dict(cls)) == COMMON | extra
    assert typing.get_type_hints(cls)["kind"] == Literal[kind]
    assert attrs.fields_dict(cls)["kind"].default == kind
    attrs.resolve_types(cls)


@pytest.mark.parametrize("kind", list(TABLE))
def test_events_are_frozen(kind: str) -> None:
    cls, extra = TABLE[kind]
    values: dict[str, Any] = dict.fromkeys(COMMON - {"kind"})
    values.update(limiter="claude", timestamp=1.0)
    values.update(dict.fromkeys(extra, "x"))
    if "outcome" in extra:
        values["outcome"] = "completed"
    event = cls(**values)
    assert event.kind == kind
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        event.limiter = "other"
    match event:
        case ReleasedEvent(outcome=outcome):
            assert outcome == "completed"
        case _:
            assert event.kind != "released"


def test_every_kind_is_in_the_union() -> None:
    union = set(typing.get_args(ConcurrencyEvent))
    assert {cls for cls, _ in TABLE.values()} <= union
    # Every class of the union has its own kind, and EventKind names exactly those kinds.
    union_kinds = [attrs.fields_dict(cls)["kind"].default for cls in union]
    assert len(set(union_kinds)) == len(union)
    assert set(typing.get_args(slotwise.EventKind)) == set(union_kinds)


# -- a full cycle -----------------------------------------------------------------------------


def cycle_limiter() -> MemoryLimiter[str]:
    return MemoryLimiter(
        name="claude",
        max_concurrent=1,
        workloads={"interactive": Workload(max_wait=60.0), "background": Workload()},
        default_workload="background",
    )


async def test_a_full_cycle_emits_wait_started_acquired_released() -> None:
    limiter = cycle_limiter()
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)
    held = await slotwise.acquire(limiter=limiter)
    ids: dict[str, str | None] = {}
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:

                async def waiter() -> None:
                    async with (
                        slotwise.run(limiter=limiter, workload="interactive") as run,
                        slotwise.slot() as slot,
                    ):
                        ids.update(run_id=run.run_id, request_id=slot.request_id)
                        ids.update(lease_id=slot.lease_id)

                tg.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()
                await held.release()
    finally:
        unsubscribe()
    mine = of_request(events, ids["request_id"])
    assert [e.kind for e in mine] == ["wait-started", "acquired", "released"]
    started, acquired, released = mine
    for event in mine:
        assert event.limiter == "claude"
        assert event.workload == "interactive"
        assert event.run_id == ids["run_id"]
        assert event.root_run_id == ids["run_id"]
        assert event.parent_run_id is None
        assert event.timestamp > 0
    assert isinstance(started, WaitStartedEvent)
    assert started.deadline is not None
    # An epoch time, max_wait (60 s) after the request started.
    assert 0 < started.deadline - started.timestamp <= 60.0
    assert isinstance(acquired, AcquiredEvent)
    assert acquired.lease_id == ids["lease_id"]
    assert acquired.wait_time >= 0
    assert isinstance(released, ReleasedEvent)
    assert released.lease_id == ids["lease_id"]
    assert released.hold_time >= 0
    assert released.outcome == "completed"
    assert started.timestamp <= acquired.timestamp <= released.timestamp
    # The holder's own cycle: no deadline (no max_wait, no run), released after the waiter
    # was queued.
    theirs = of_request(events, held.request_id)
    assert [e.kind for e in theirs] == ["wait-started", "acquired", "released"]
    first = theirs[0]
    assert isinstance(first, WaitStartedEvent)
    assert first.deadline is None
    assert first.run_id is None
    assert first.workload == "background"


async def test_the_wait_deadline_is_the_earlier_of_max_wait_and_the_run_budget() -> None:
    limiter = cycle_limiter()
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)
    try:
        async with slotwise.run(limiter=limiter, workload="interactive", timeout=10.0):
            async with slotwise.slot():
                pass
            async with slotwise.run(timeout=1000.0), slotwise.slot():
                pass
    finally:
        unsubscribe()
    started = [e for e in events if isinstance(e, WaitStartedEvent)]
    assert len(started) == 2
    for event in started:
        # The run's 10 s budget comes before interactive's max_wait (60 s); a child's longer
        # timeout cannot extend it.
        assert event.deadline is not None
        assert 0 < event.deadline - event.timestamp <= 10.0


@on_mock_clock()
async def test_wait_and_hold_times_are_measured() -> None:
    limiter = cycle_limiter()
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)
    held = await slotwise.acquire(limiter=limiter)
    try:
        async with anyio.create_task_group() as tg:

            async def waiter() -> None:
                async with slotwise.slot(limiter=limiter):
                    await anyio.sleep(3.0)

            tg.start_soon(waiter)
            await anyio.sleep(5.0)
            await held.release()
    finally:
        unsubscribe()
    acquired = [e for e in events if isinstance(e, AcquiredEvent)]
    released = [e for e in events if isinstance(e, ReleasedEvent)]
    assert acquired[0].wait_time == 0
    assert acquired[1].wait_time >= 5.0
    assert released[0].hold_time >= 5.0
    assert released[1].hold_time >= 3.0


async def test_failures_emit_their_kinds() -> None:
    limiter = MemoryLimiter(
        name="claude",
        max_concurrent=1,
        max_queued=1,
        workloads={"fast": Workload(max_wait=0), "slow": Workload()},
        default_workload="slow",
    )
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)
    held = await slotwise.acquire(limiter=limiter)
    try:
        with pytest.raises(ConcurrencyConfigError) as config:
            await slotwise.acquire("nope", limiter=limiter)
        with pytest.raises(ConcurrencyTimeoutError) as timeout:
            await slotwise.acquire("fast", limiter=limiter)
        cancelled = anyio.CancelScope()
        request_ids: list[str | None] = []

        async def waiter() -> None:
            with cancelled:
                await slotwise.acquire(limiter=limiter)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(ConcurrencyQueueFullError) as full:
                await slotwise.acquire(limiter=limiter)
            request_ids = [e.request_id for e in events if e.kind == "wait-started"]
            cancelled.cancel()
    finally:
        unsubscribe()
        await held.release()
    by_kind = {e.kind: e for e in events if e.request_id != held.request_id}
    config_event = by_kind["config-error"]
    assert isinstance(config_event, ConfigErrorEvent)
    assert config_event.request_id == config.value.request_id
    assert "nope" in config_event.error
    timed_out = by_kind["timed-out"]
    assert isinstance(timed_out, TimedOutEvent)
    assert timed_out.request_id == timeout.value.request_id
    assert timed_out.workload == "fast"
    assert timed_out.wait_time >= 0
    queue_full = by_kind["queue-full"]
    assert isinstance(queue_full, QueueFullEvent)
    assert queue_full.request_id == full.value.request_id
    wait_cancelled = by_kind["wait-cancelled"]
    assert isinstance(wait_cancelled, WaitCancelledEvent)
    assert wait_cancelled.request_id in request_ids
    assert wait_cancelled.workload == "slow"


# -- subscriptions --------------------------------------------------------------------------


class Custom:
    """A custom limiter: just the four members of the protocol."""

    def __init__(self, name: str = "custom") -> None:
        self.name = name
        self._inner = MemoryLimiter(name=name, max_concurrent=1)

    async def acquire(self, request: AcquireRequest) -> Lease:
        return await self._inner.acquire(request)

    async def renew(self, lease: SupportsLease) -> Lease | None:
        return await self._inner.renew(lease)

    async def release(self, lease: SupportsLease) -> None:
        await self._inner.release(lease)


class SlottedCustom:
    """A custom limiter that cannot be weakly referenced."""

    __slots__ = ("_inner", "name")

    def __init__(self, name: str = "slotted") -> None:
        self.name = name
        self._inner = MemoryLimiter(name=name, max_concurrent=1)

    async def acquire(self, request: AcquireRequest) -> Lease:
        return await self._inner.acquire(request)

    async def renew(self, lease: SupportsLease) -> Lease | None:
        return await self._inner.renew(lease)

    async def release(self, lease: SupportsLease) -> None:
        await self._inner.release(lease)


@attrs.define
class UnhashableCustom:
    """A custom limiter that compares by value, and so cannot be hashed."""

    name: str = "unhashable"
    _inner: MemoryLimiter[str] = attrs.field(factory=lambda: MemoryLimiter(max_concurrent=1))

    async def acquire(self, request: AcquireRequest) -> Lease:
        return await self._inner.acquire(request)

    async def renew(self, lease: SupportsLease) -> Lease | None:
        return await self._inner.renew(lease)

    async def release(self, lease: SupportsLease) -> None:
        await self._inner.release(lease)


async def use(limiter: Any) -> str | None:
    async with slotwise.slot(limiter=limiter) as slot:
        return slot.request_id


async def test_limiter_subscribe_receives_only_that_limiter() -> None:
    mine, other = MemoryLimiter(name="mine", max_concurrent=1), MemoryLimiter(max_concurrent=1)
    events: list[ConcurrencyEvent] = []
    unsubscribe = mine.subscribe(events.append)
    try:
        await use(other)
        request_id = await use(mine)
    finally:
        unsubscribe()
    assert [e.kind for e in events] == ["wait-started", "acquired", "released"]
    assert {e.request_id for e in events} == {request_id}
    assert {e.limiter for e in events} == {"mine"}


async def test_subscribe_without_a_limiter_receives_every_limiter() -> None:
    limiters = [MemoryLimiter(name="memory", max_concurrent=1), Custom(), SlottedCustom()]
    events: list[ConcurrencyEvent] = []
    unsubscribe = slotwise.subscribe(events.append, limiter=None)
    try:
        for limiter in limiters:
            await use(limiter)
    finally:
        unsubscribe()
    assert [e.limiter for e in events if e.kind == "released"] == [
        "memory",
        "custom",
        "slotted",
    ]


@pytest.mark.parametrize("factory", [Custom, SlottedCustom, UnhashableCustom])
async def test_subscribe_to_a_custom_limiter(factory: Any) -> None:
    limiter, other = factory(), factory()
    events: list[ConcurrencyEvent] = []
    unsubscribe = slotwise.subscribe(events.append, limiter=limiter)
    try:
        await use(other)
        request_id = await use(limiter)
    finally:
        unsubscribe()
    if factory is not UnhashableCustom:
        # (Two UnhashableCustom objects are equal; which of them the events name is moot.)
        assert {e.request_id for e in events} == {request_id}
    assert [e.kind for e in events][-3:] == ["wait-started", "acquired", "released"]
    await use(limiter)
    assert request_id in {e.request_id for e in events}
    assert len([e for e in events if e.kind == "released"]) <= 2


async def test_unsubscribe_stops_delivery_and_is_idempotent() -> None:
    limiter = MemoryLimiter(max_concurrent=1)
    first: list[ConcurrencyEvent] = []
    second: list[ConcurrencyEvent] = []
    unsubscribe_first = limiter.subscribe(first.append)
    unsubscribe_second = limiter.subscribe(second.append)
    await use(limiter)
    unsubscribe_first()
    unsubscribe_first()
    await use(limiter)
    assert len(first) == 3
    assert len(second) == 6
    unsubscribe_second()
    unsubscribe_second()
    await use(limiter)
    assert (len(first), len(second)) == (3, 6)

    everywhere: list[ConcurrencyEvent] = []
    unsubscribe_everywhere = slotwise.subscribe(everywhere.append)
    await use(limiter)
    unsubscribe_everywhere()
    unsubscribe_everywhere()
    await use(limiter)
    assert len(everywhere) == 3


async def test_a_repeated_unsubscribe_leaves_other_subscriptions_of_the_same_callback() -> None:
    limiter = MemoryLimiter(max_concurrent=1)
    events: list[ConcurrencyEvent] = []
    unsubscribe_first = limiter.subscribe(events.append)
    limiter.subscribe(events.append)
    unsubscribe_first()
    unsubscribe_first()  # idempotent: the second subscription stays
    await use(limiter)
    assert [e.kind for e in events] == ["wait-started", "acquired", "released"]


async def test_a_raising_subscriber_is_logged_and_never_breaks_a_slot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limiter = MemoryLimiter(name="claude", max_concurrent=1)

    def broken(event: ConcurrencyEvent) -> None:
        raise RuntimeError(f"subscriber bug on {event.kind}")

    after: list[ConcurrencyEvent] = []
    unsubscribe_broken = limiter.subscribe(broken)
    unsubscribe_everywhere = slotwise.subscribe(broken)
    unsubscribe_after = limiter.subscribe(after.append)
    ran = False
    try:
        with caplog.at_level(logging.ERROR, logger="slotwise"):
            async with limiter.slot():
                ran = True
            with pytest.raises(ValueError, match="body"):
                async with limiter.slot():
                    raise ValueError("body")
    finally:
        unsubscribe_broken()
        unsubscribe_everywhere()
        unsubscribe_after()
    assert ran
    assert [e.kind for e in after] == ["wait-started", "acquired", "released"] * 2
    errors = [r for r in caplog.records if r.name == "slotwise" and r.levelno >= logging.ERROR]
    assert len(errors) == 12  # two broken subscriptions, six events
    assert all(r.exc_info is not None for r in errors)
    assert (await limiter.stats()).active == 0


# -- stats ----------------------------------------------------------------------------------


async def test_stats_match_what_is_held_and_queued() -> None:
    limiter = MemoryLimiter(
        max_concurrent=5,
        workloads={
            "interactive": Workload(reserved=1, priority=10),
            "background": Workload(max_concurrent=3),
        },
    )
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)
    assert set(stats.workloads) == {"interactive", "background"}
    assert stats.workloads["background"].max_concurrent == 3
    assert stats.workloads["interactive"].reserved == 1

    background = [await slotwise.acquire("background", limiter=limiter) for _ in range(3)]
    interactive = [await slotwise.acquire("interactive", limiter=limiter) for _ in range(2)]
    async with anyio.create_task_group() as tg:
        for workload, count in (("background", 2), ("interactive", 3)):
            for _ in range(count):
                tg.start_soon(functools.partial(slotwise.acquire, workload, limiter=limiter))
        await anyio.wait_all_tasks_blocked()
        stats = await limiter.stats()
        assert (stats.active, stats.queued) == (5, 5)
        assert (stats.workloads["background"].active, stats.workloads["background"].queued) == (
            3,
            2,
        )
        assert (
            stats.workloads["interactive"].active,
            stats.workloads["interactive"].queued,
        ) == (2, 3)
        tg.cancel_scope.cancel()
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (5, 0)
    for slot in background[:2]:
        await slot.release()
    stats = await limiter.stats()
    assert stats.active == 3
    assert stats.workloads["background"].active == 1
    for slot in (*background[2:], *interactive):
        await slot.release()
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)
    assert all(w.active == 0 and w.queued == 0 for w in stats.workloads.values())


async def test_timestamps_are_epoch_seconds() -> None:
    limiter = MemoryLimiter(max_concurrent=1)
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)
    before = time.time()
    try:
        await use(limiter)
    finally:
        unsubscribe()
    after = time.time()
    assert all(before <= e.timestamp <= after for e in events)
    assert all(isinstance(fields_of(e)["timestamp"], float) for e in events)
