"""ToolBox on MemoryLimiter, on asyncio and trio: admission, results, waits, timeouts,
cancellation, budgets and events."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import sys
import types
from typing import Any

import anyio
import attrs
import pytest
from trio.testing import MockClock

import slotwise
from slotwise import ConcurrencyConfigError, MemoryLimiter, Workload
from slotwise.tools import (
    ToolBox,
    ToolCall,
    ToolFinishedEvent,
    ToolRejectedEvent,
    ToolResult,
    ToolStartedEvent,
)

from ._cases import (
    Activity,
    calls,
    case_cancelled_queued_calls_never_run,
    case_failing_call_gives_its_slot_back,
    case_limits_counted,
    case_the_pair_is_admitted_atomically,
    case_two_runs_share_the_pools,
    counted,
    idle,
    until,
)

pytestmark = pytest.mark.anyio

HOLD = 0.01


def on_mock_clock() -> pytest.MarkDecorator:
    """Run the test on trio with a virtual clock that jumps whenever every task sleeps."""
    return pytest.mark.parametrize(
        "anyio_backend",
        [pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock")],
    )


def box_of(max_concurrent: int = 4, **workloads: Workload) -> ToolBox[str]:
    limiter = MemoryLimiter(
        name="tools",
        max_concurrent=max_concurrent,
        workloads=workloads or {"default": Workload()},
        default_workload="default" if "default" in workloads or not workloads else None,
    )
    return ToolBox(limiter=limiter)


class Recorder:
    """Every event of a limiter, while subscribed."""

    def __init__(self, limiter: Any) -> None:
        self.events: list[slotwise.ConcurrencyEvent] = []
        self.stop = slotwise.subscribe(self.events.append, limiter=limiter)

    def tool_events(self) -> list[Any]:
        return [e for e in self.events if e.kind.startswith("tool-")]


# -- seed 000's list and the atomic pair ----------------------------------------------------------


async def test_limits_are_counted_per_pool_and_in_total() -> None:
    await case_limits_counted(MemoryLimiter, HOLD)


async def test_a_failing_call_gives_its_slot_back() -> None:
    await case_failing_call_gives_its_slot_back(MemoryLimiter)


async def test_cancelled_queued_calls_never_run() -> None:
    await case_cancelled_queued_calls_never_run(MemoryLimiter)


async def test_two_runs_share_the_pools() -> None:
    await case_two_runs_share_the_pools(MemoryLimiter, HOLD)


@pytest.mark.parametrize("slow_max_wait", [None, 60.0])
async def test_the_global_limit_and_the_pool_are_admitted_together(
    slow_max_wait: float | None,
) -> None:
    await case_the_pair_is_admitted_atomically(MemoryLimiter, slow_max_wait)


async def test_a_toolbox_made_per_run_limits_only_that_run() -> None:
    activity = Activity()

    async def agent() -> None:
        box = box_of(max_concurrent=2)  # built inside the run: its limit is this run's alone
        counted(box, activity, "work", pool="default", hold=HOLD)
        async with slotwise.run():
            await box.run(calls("work", "work"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(agent)
        tg.start_soon(agent)
    assert activity.peak_total == 4


# -- results --------------------------------------------------------------------------------------


async def test_one_result_per_call_in_the_calls_order_whatever_finishes_first() -> None:
    box = box_of()

    @box.tool
    async def echo(text: str, delay: float) -> str:
        await anyio.sleep(delay)
        return text

    batch = [
        ToolCall(id=f"id-{n}", name="echo", arguments={"text": f"t{n}", "delay": (5 - n) / 100})
        for n in range(5)
    ]
    results = await box.run(batch)
    assert [(r.call_id, r.name, r.content) for r in results] == [
        (f"id-{n}", "echo", f"t{n}") for n in range(5)
    ]
    assert all(r.error is None and r.effect == "done" and not r.is_error for r in results)
    assert all(r.duration > 0 and r.truncated == 0 for r in results)


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ([ToolCall(id="", name="echo")], "no id"),
        ([ToolCall(id=1, name="echo")], "ids are non-empty strings, got 1"),  # type: ignore[arg-type]
        ([ToolCall(id="a", name="echo"), ToolCall(id="a", name="echo")], "share the id 'a'"),
    ],
)
async def test_missing_or_repeated_ids_are_refused_before_anything_runs(
    batch: list[ToolCall], message: str
) -> None:
    box = box_of()
    ran: list[str] = []

    @box.tool
    async def echo() -> str:
        ran.append("echo")
        return ""

    with pytest.raises(ValueError, match=message):
        await box.run([ToolCall(id="first", name="echo"), *batch])
    assert ran == []


async def test_unknown_tools_and_bad_arguments_are_results_that_take_no_slot() -> None:
    box = box_of()
    recorder = Recorder(box.limiter)

    @box.tool
    async def lookup(customer_id: str, *, full: bool = False) -> dict[str, Any]:
        return {"id": customer_id, "full": full}

    results = await box.run(
        [
            ToolCall(id="1", name="nope", arguments={}),
            ToolCall(id="2", name="lookup", arguments={}),
            ToolCall(id="3", name="lookup", arguments={"customer_id": "c", "colour": "red"}),
            ToolCall(id="4", name="lookup", arguments='{"customer_id": '),
            ToolCall(id="5", name="lookup", arguments="[1, 2]"),
            ToolCall(id="6", name="lookup", arguments='{"customer_id": "c7", "full": true}'),
        ]
    )
    recorder.stop()
    assert [r.error for r in results] == [
        "unknown-tool",
        "invalid-arguments",
        "invalid-arguments",
        "invalid-arguments",
        "invalid-arguments",
        None,
    ]
    assert results[0].content == "Unknown tool 'nope'. The tools are: lookup."
    assert "missing a required argument: 'customer_id'" in results[1].content
    assert "unexpected keyword argument 'colour'" in results[2].content
    assert "not valid JSON" in results[3].content
    assert "must be a JSON object" in results[4].content
    assert json.loads(results[5].content) == {"id": "c7", "full": True}
    assert all(r.effect == "none" and r.is_error for r in results[:5])
    # Only the good call asked for a slot.
    assert [e.kind for e in recorder.events if e.kind == "acquired"] == ["acquired"]


async def test_a_handler_exception_is_an_error_result_without_traceback() -> None:
    box = box_of()

    @box.tool(writes=True)
    async def charge(card: str) -> str:
        raise LookupError("no such customer")

    @box.tool
    async def read(card: str) -> str:
        raise KeyError  # no message

    results = await box.run(
        [
            ToolCall(id="1", name="charge", arguments={"card": "4111-1111"}),
            ToolCall(id="2", name="read", arguments={"card": "4111-1111"}),
        ]
    )
    assert results[0].content == "Tool 'charge' failed: LookupError: no such customer"
    assert results[1].content == "Tool 'read' failed: KeyError"
    assert [(r.error, r.effect) for r in results] == [("failed", "unknown"), ("failed", "none")]
    assert all("Traceback" not in r.content and "4111" not in r.content for r in results)


async def test_what_a_handler_returns_becomes_the_content() -> None:
    box = box_of()
    values: dict[str, Any] = {
        "text": "plain text",
        "data": {"ünïcode": [1, 2.5, None, True]},
        "nothing": None,
        "opaque": object(),
        "count": 42,
        "flag": False,
        "level": enum.IntEnum("Level", "low high").high,
    }

    @box.tool
    async def give(kind: str) -> Any:
        return values[kind]

    results = await box.run([ToolCall(id=k, name="give", arguments={"kind": k}) for k in values])
    assert results[0].content == "plain text"
    assert results[1].content == '{"ünïcode": [1, 2.5, null, true]}'
    assert results[2].content == "null"
    assert (results[3].error, results[3].effect) == ("failed", "done")
    assert "returned a object, which is not JSON" in results[3].content
    assert [r.content for r in results[4:]] == ["42", "false", "2"]


# -- sequential tools -----------------------------------------------------------------------------


async def test_sequential_calls_run_one_at_a_time_in_order_beside_the_parallel_ones() -> None:
    box = box_of(max_concurrent=8)
    log: list[str] = []
    chain_active = 0
    chain_peak = 0
    overlapped_parallel = False
    parallel_active = 0

    async def write(tag: str) -> str:
        nonlocal chain_active, chain_peak, overlapped_parallel
        chain_active += 1
        chain_peak = max(chain_peak, chain_active)
        overlapped_parallel |= parallel_active > 0
        log.append(f"start {tag}")
        await anyio.sleep(HOLD)
        log.append(f"end {tag}")
        chain_active -= 1
        return tag

    box.tool(name="create_invoice", sequential=True, writes=True)(write)
    box.tool(name="send_invoice", sequential=True, writes=True)(write)

    @box.tool
    async def read(tag: str) -> str:
        nonlocal parallel_active
        parallel_active += 1
        await anyio.sleep(HOLD * 3)
        parallel_active -= 1
        return tag

    names = ["create_invoice", "read", "send_invoice", "read", "create_invoice", "send_invoice"]
    results = await box.run(calls(*names))
    assert [r.content for r in results] == [f"c{i}" for i in range(6)]
    chained = [f"c{i}" for i, name in enumerate(names) if name != "read"]
    assert log == [f"{edge} {tag}" for tag in chained for edge in ("start", "end")]
    assert chain_peak == 1
    assert overlapped_parallel


async def test_a_chain_goes_on_after_a_failed_call() -> None:
    box = box_of()
    activity = Activity()
    counted(box, activity, "fails", pool="default", fail=True, sequential=True)
    counted(box, activity, "works", pool="default", sequential=True)
    results = await box.run(calls("fails", "works", "fails"))
    assert [r.error for r in results] == ["failed", None, "failed"]
    assert activity.entered == ["c0", "c1", "c2"]


# -- waiting or failing fast ----------------------------------------------------------------------


async def test_a_fail_fast_pool_refuses_at_once_what_it_cannot_start() -> None:
    box = box_of(
        max_concurrent=4, default=Workload(), payments=Workload(max_concurrent=1, max_wait=0)
    )
    activity = Activity()
    counted(box, activity, "refund", pool="payments", hold=HOLD, writes=True)
    results = await box.run(calls("refund", "refund", "refund"))
    assert [r.error for r in results] == [None, "concurrency-limit", "concurrency-limit"]
    assert [r.effect for r in results] == ["done", "none", "none"]
    assert results[1].content == (
        "Tool 'refund' did not run: no slot was free in its pool 'payments' in time "
        "(too many calls at once). It was not retried."
    )
    assert activity.entered == ["c0"]


async def test_a_batch_asks_the_limiter_for_no_more_slots_than_it_could_grant() -> None:
    box = box_of(max_concurrent=3, default=Workload(), search=Workload(max_concurrent=2))
    activity = Activity()
    gate = anyio.Event()
    counted(box, activity, "search", pool="search", gate=gate)
    counted(box, activity, "read", pool="default", gate=gate)
    async with anyio.create_task_group() as tg:
        tg.start_soon(box.run, calls("search", "search", "search", "read", "read", "search"))
        await until(lambda: activity.total == 3)
        # The other calls wait in the batch: none queues in the limiter behind its own batch.
        stats = await box.limiter.stats()
        assert (stats.active, stats.queued) == (3, 0)
        assert sorted(activity.entered) == ["c0", "c1", "c3"]  # trio runs them in any order
        gate.set()
    assert activity.peak_total == 3
    assert activity.peak["search"] == 2
    assert sorted(activity.entered) == ["c0", "c1", "c2", "c3", "c4", "c5"]


async def test_a_batchs_calls_start_by_their_pools_priority_then_in_the_models_order() -> None:
    box = box_of(max_concurrent=1, low=Workload(), high=Workload(priority=5))
    activity = Activity()
    counted(box, activity, "chat", pool="low", hold=HOLD)
    counted(box, activity, "alert", pool="high", hold=HOLD)
    results = await box.run(calls("chat", "chat", "alert", "chat", "alert"))
    assert [r.error for r in results] == [None] * 5
    assert activity.entered == ["c2", "c4", "c0", "c1", "c3"]
    assert activity.peak_total == 1


async def test_a_batch_leaves_a_pools_reserved_slots_to_that_pool() -> None:
    box = box_of(max_concurrent=3, default=Workload(), audit=Workload(reserved=1))
    activity = Activity()
    gate = anyio.Event()
    counted(box, activity, "read", pool="default", gate=gate)
    counted(box, activity, "audit", pool="audit", gate=gate)
    async with anyio.create_task_group() as tg:
        tg.start_soon(box.run, calls("read", "read", "read", "read", "audit"))
        await until(lambda: activity.total == 3)
        # Two reads share the unreserved slots; the audit call takes its reserved one at once.
        assert sorted(activity.entered) == ["c0", "c1", "c4"]
        assert (await box.limiter.stats()).queued == 0
        gate.set()
    assert activity.peak_total == 3


async def test_a_fail_fast_call_its_own_batch_leaves_no_room_for_is_refused_at_once() -> None:
    box = box_of(max_concurrent=1, default=Workload(), payments=Workload(max_wait=0))
    activity = Activity()
    counted(box, activity, "read", pool="default", hold=HOLD)
    counted(box, activity, "refund", pool="payments")
    results = await box.run(calls("read", "refund", "read"))
    assert [r.error for r in results] == [None, "concurrency-limit", None]
    assert results[1].wait_time == 0.0
    assert activity.entered == ["c0", "c2"]


async def test_a_pool_the_reservations_leave_no_room_asks_the_limiter_all_the_same() -> None:
    # The reservations take both slots: the limiter can never grant the "spare" pool, and the
    # batch lets it answer (after max_wait) rather than leaving the calls unstarted.
    box = box_of(max_concurrent=2, owned=Workload(reserved=2), spare=Workload(max_wait=0.05))
    activity = Activity()
    counted(box, activity, "own", pool="owned")
    counted(box, activity, "borrow", pool="spare")
    with anyio.fail_after(10):
        results = await box.run(calls("borrow", "borrow", "own"))
    assert [r.error for r in results] == ["concurrency-limit", "concurrency-limit", None]
    assert activity.entered == ["c2"]
    assert await idle(box.limiter)


@on_mock_clock()
async def test_a_sequential_call_waits_its_turn_in_the_batch_not_before_a_call_chosen_first() -> (
    None
):
    box = box_of(max_concurrent=1, default=Workload(max_wait=3.0))
    activity = Activity()
    counted(box, activity, "write", pool="default", hold=2.0, sequential=True)
    counted(box, activity, "read", pool="default", hold=2.0)
    queued = []

    async def watch() -> None:
        while True:
            queued.append((await box.limiter.stats()).queued)
            await anyio.sleep(0.5)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        results = await box.run(calls("write", "read", "write"))
        tg.cancel_scope.cancel()
    # c1's turn comes when c0 ends, before c2's: the chain's next call does not take its slot.
    assert [(r.error, round(r.wait_time)) for r in results] == [(None, 0), (None, 2), (None, 2)]
    assert activity.entered == ["c0", "c1", "c2"]
    assert set(queued) == {0}


@on_mock_clock()
async def test_a_call_waiting_in_the_batch_is_refused_when_its_pools_max_wait_ends() -> None:
    box = box_of(max_concurrent=2, default=Workload(), search=Workload(max_wait=1.0))
    activity = Activity()
    counted(box, activity, "read", pool="default", hold=10.0)
    counted(box, activity, "search", pool="search", hold=1.0)
    refused_at = []

    def record(event: slotwise.ConcurrencyEvent) -> None:
        if isinstance(event, ToolRejectedEvent):
            refused_at.append((event.call_id, anyio.current_time()))

    unsubscribe = slotwise.subscribe(record, limiter=box.limiter)
    try:
        results = await box.run(calls("read", "read", "search"))
    finally:
        unsubscribe()
    # The two reads fill the limiter for 10 s; the search waits in the batch and is refused
    # when its 1 s is up, not when a read ends.
    assert [(r.error, r.wait_time) for r in results] == [
        (None, 0.0),
        (None, 0.0),
        ("concurrency-limit", 1.0),
    ]
    assert refused_at == [("c2", 1.0)]


@on_mock_clock()
async def test_a_sequential_call_waiting_in_the_batch_past_its_max_wait_does_not_stall_the_chain() -> (
    None
):
    box = box_of(
        max_concurrent=2,
        search=Workload(max_concurrent=1, max_wait=1.0),
        notes=Workload(max_concurrent=1),
    )
    activity = Activity()
    counted(box, activity, "crawl", pool="search", hold=10.0)
    counted(box, activity, "lookup", pool="search", hold=1.0, sequential=True)
    counted(box, activity, "write", pool="notes", hold=1.0, sequential=True)
    started = anyio.current_time()
    results = await box.run(calls("crawl", "lookup", "write"))
    # c1 waits in the batch behind c0 (its pool holds one); refused at 1 s, the chain goes on.
    assert [(r.error, r.wait_time) for r in results] == [
        (None, 0.0),
        ("concurrency-limit", 1.0),
        (None, 0.0),
    ]
    assert activity.entered == ["c0", "c2"]
    assert anyio.current_time() - started == 10.0


async def test_a_sequential_call_of_a_fail_fast_pool_without_room_is_refused_and_the_chain_goes_on() -> (
    None
):
    box = box_of(max_concurrent=1, default=Workload(), payments=Workload(max_wait=0))
    activity = Activity()
    counted(box, activity, "read", pool="default", hold=HOLD)
    counted(box, activity, "charge", pool="payments", sequential=True)
    counted(box, activity, "note", pool="default", sequential=True)
    results = await box.run(calls("read", "charge", "note"))
    assert [r.error for r in results] == [None, "concurrency-limit", None]
    assert activity.entered == ["c0", "c2"]


class _Stating:
    """A limiter that states settings of its own, changed in place, over a MemoryLimiter."""

    name = "stating"

    def __init__(self) -> None:
        self.inner = MemoryLimiter(name="inner", max_concurrent=3)
        self.max_concurrent = 3
        self.workloads = {"default": Workload(max_concurrent=1)}

    async def acquire(self, request: Any) -> Any:
        return await self.inner.acquire(request)

    async def renew(self, lease: Any) -> Any:
        return await self.inner.renew(lease)

    async def release(self, lease: Any) -> Any:
        return await self.inner.release(lease)


async def test_a_batch_follows_settings_a_limiter_changed_in_place() -> None:
    limiter = _Stating()
    box = ToolBox(limiter=limiter)
    activity = Activity()
    counted(box, activity, "work", pool="default", hold=HOLD)
    await box.run(calls("work", "work", "work"))
    assert activity.peak_total == 1
    limiter.workloads["default"] = Workload(max_concurrent=3)
    await box.run(calls("work", "work", "work"))
    assert activity.peak_total == 3


async def test_a_fail_fast_pool_busy_with_another_run_refuses_without_waiting() -> None:
    box = box_of(
        max_concurrent=4, default=Workload(), payments=Workload(max_concurrent=1, max_wait=0)
    )
    activity = Activity()
    gate = anyio.Event()
    counted(box, activity, "hold_payments", pool="payments", gate=gate)
    counted(box, activity, "refund", pool="payments")
    async with anyio.create_task_group() as tg:
        tg.start_soon(box.run, calls("hold_payments"))
        await until(lambda: activity.total == 1)
        with anyio.fail_after(5):
            [result] = await box.run(calls("refund"))
        gate.set()
    assert result.error == "concurrency-limit"
    assert result.wait_time < 1.0
    assert activity.entered == ["c0"]


@on_mock_clock()
async def test_a_call_waits_up_to_its_pools_max_wait_from_the_start_of_the_batch() -> None:
    box = box_of(
        max_concurrent=4, default=Workload(), search=Workload(max_concurrent=1, max_wait=10.0)
    )
    activity = Activity()
    counted(box, activity, "search", pool="search", hold=4.0)
    results = await box.run(calls("search", "search", "search", "search"))
    # Each search holds the only slot 4 s; a call may wait 10 s from the batch's start. The
    # last one's turn would come at 12 s: it is refused at 10 s, without asking for a slot.
    assert [r.error for r in results] == [None, None, None, "concurrency-limit"]
    assert [round(r.wait_time) for r in results] == [0, 4, 8, 10]
    assert activity.entered == ["c0", "c1", "c2"]


@on_mock_clock()
async def test_a_wait_in_the_limiters_queue_ends_at_the_bound_of_the_batch() -> None:
    box = box_of(
        max_concurrent=4, default=Workload(), search=Workload(max_concurrent=1, max_wait=10.0)
    )
    activity = Activity()
    counted(box, activity, "search", pool="search", hold=7.0)
    counted(box, activity, "hog", pool="search", hold=100.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(box.run, calls("hog"))  # another run holds the pool from t=0 to t=100
        await until(lambda: activity.total == 1)
        with anyio.fail_after(50):
            results = await box.run(calls("search", "search"))
        tg.cancel_scope.cancel()
    # c0 times out in the limiter's queue at 10 s; c1 then has nothing left to wait.
    assert [(r.error, round(r.wait_time)) for r in results] == [
        ("concurrency-limit", 10),
        ("concurrency-limit", 10),
    ]
    assert activity.entered == ["c0"]


@on_mock_clock()
async def test_a_sequential_calls_wait_counts_from_its_turn_in_the_chain() -> None:
    box = box_of(
        max_concurrent=4, default=Workload(), search=Workload(max_concurrent=1, max_wait=10.0)
    )
    activity, hog = Activity(), Activity()
    counted(box, hog, "hog", pool="search", hold=20.0)
    counted(box, activity, "write", pool="default", hold=7.0, sequential=True)
    counted(box, activity, "index", pool="search", sequential=True)
    counted(box, activity, "search", pool="search")
    async with anyio.create_task_group() as tg:
        tg.start_soon(box.run, calls("hog"))  # another run holds the search pool until t=20
        await until(lambda: hog.total == 1)
        with anyio.fail_after(50):
            results = await box.run(calls("write", "write", "index", "search"))
    # The parallel search waits 10 s from the batch's start and is refused; the sequential
    # index's turn comes at 14 s, and it may wait 10 s from there: it gets the slot at 20 s.
    assert [(r.error, round(r.wait_time)) for r in results] == [
        (None, 0),
        (None, 0),
        (None, 6),
        ("concurrency-limit", 10),
    ]
    assert activity.entered == ["c0", "c1", "c2"]


@on_mock_clock()
async def test_the_runs_budget_bounds_the_wait_and_the_run_raises() -> None:
    box = box_of(max_concurrent=1)
    activity = Activity()
    counted(box, activity, "slow", pool="default", hold=100.0)
    recorder = Recorder(box.limiter)
    with pytest.raises(TimeoutError):
        async with slotwise.run(timeout=5.0):
            await box.run(calls("slow", "slow"))
    recorder.stop()
    assert activity.entered == ["c0"]
    assert await idle(box.limiter)
    ends = [e for e in recorder.tool_events() if e.kind != "tool-started"]
    assert [(e.call_id, e.kind) for e in ends] == [
        ("c0", "tool-finished"),
        ("c1", "tool-rejected"),
    ] or [(e.call_id, e.kind) for e in ends] == [("c1", "tool-rejected"), ("c0", "tool-finished")]
    assert all(getattr(e, "outcome", getattr(e, "reason", None)) == "cancelled" for e in ends)


# -- timeouts and cancellation --------------------------------------------------------------------


@pytest.mark.parametrize("writes", [True, False])
async def test_a_timeout_cancels_the_handler_and_releases_its_slot(writes: bool) -> None:
    box = box_of(max_concurrent=1)
    reached: list[str] = []

    @box.tool(timeout=0.05, writes=writes)
    async def stuck() -> str:
        try:
            await anyio.sleep(60)  # stands for I/O: the cancellation reaches it
        except anyio.get_cancelled_exc_class():
            reached.append("cancelled")
            raise
        return "never"

    @box.tool
    async def after() -> str:
        return "ran"

    recorder = Recorder(box.limiter)
    with anyio.fail_after(10):
        results = await box.run([ToolCall(id="1", name="stuck"), ToolCall(id="2", name="after")])
    recorder.stop()
    assert reached == ["cancelled"]
    assert (results[0].error, results[0].effect) == ("timed-out", "unknown" if writes else "none")
    assert results[0].content.startswith("Tool 'stuck' did not finish within 0.05 s")
    assert ("may or may not have taken effect" in results[0].content) is writes
    assert results[0].duration >= 0.05
    assert results[1].content == "ran"
    released = [e for e in recorder.events if isinstance(e, slotwise.ReleasedEvent)]
    assert len(released) == 2
    assert await idle(box.limiter)


async def test_cancelling_the_run_cancels_running_calls_and_leaves_no_slot() -> None:
    box = box_of(max_concurrent=2)
    activity = Activity()
    cancelled: list[str] = []

    @box.tool(writes=True)
    async def work(tag: str) -> str:
        with activity.running("default", tag):
            try:
                await anyio.sleep(60)
            except anyio.get_cancelled_exc_class():
                cancelled.append(tag)
                raise
        return tag

    recorder = Recorder(box.limiter)
    with contextlib.suppress(slotwise.RunCancelledError):
        async with slotwise.run() as run, anyio.create_task_group() as tg:
            tg.start_soon(box.run, calls("work", "work", "work"))
            await until(lambda: activity.total == 2)
            run.cancel()
        pytest.fail("a cancelled run raises RunCancelledError")
    recorder.stop()
    assert run.cancelled
    assert sorted(cancelled) == ["c0", "c1"]
    assert sorted(activity.entered) == ["c0", "c1"]
    assert await idle(box.limiter)
    outcomes = sorted(e.outcome for e in recorder.events if isinstance(e, slotwise.ReleasedEvent))
    assert outcomes == ["cancelled", "cancelled"]
    finished = [e for e in recorder.events if isinstance(e, ToolFinishedEvent)]
    assert sorted((e.call_id, e.outcome, e.effect) for e in finished) == [
        ("c0", "cancelled", "unknown"),
        ("c1", "cancelled", "unknown"),
    ]
    [rejected] = [e for e in recorder.events if isinstance(e, ToolRejectedEvent)]
    assert (rejected.call_id, rejected.reason) == ("c2", "cancelled")


# -- limiter failures -----------------------------------------------------------------------------


class Broken:
    """A custom limiter whose acquire fails."""

    name = "broken"

    async def acquire(self, request: slotwise.AcquireRequest) -> slotwise.Lease:
        raise OSError("the database is down")

    async def renew(self, lease: slotwise.SupportsLease) -> None:
        return None

    async def release(self, lease: slotwise.SupportsLease) -> None:
        return None


class Forgetful:
    """A custom limiter that grants slots but never renews them: a lease is lost within a
    third of its time to live."""

    name = "forgetful"
    lease_ttl = 0.3

    def __init__(self) -> None:
        self.inner = MemoryLimiter(max_concurrent=2, lease_ttl=self.lease_ttl)

    async def acquire(self, request: slotwise.AcquireRequest) -> slotwise.SupportsLease:
        return await self.inner.acquire(request)

    async def renew(self, lease: slotwise.SupportsLease) -> None:
        return None

    async def release(self, lease: slotwise.SupportsLease) -> None:
        await self.inner.release(lease)


async def test_a_failing_limiter_is_a_result_and_the_handler_never_runs() -> None:
    box = ToolBox(limiter=Broken())
    ran: list[str] = []

    @box.tool
    async def work() -> str:
        ran.append("work")
        return "done"

    recorder = Recorder(box.limiter)
    [result] = await box.run([ToolCall(id="1", name="work")])
    recorder.stop()
    assert (result.error, result.effect) == ("limiter-error", "none")
    assert "OSError: the database is down" in result.content
    assert ran == []
    [rejected] = [e for e in recorder.events if isinstance(e, ToolRejectedEvent)]
    assert rejected.reason == "limiter-error"


@pytest.mark.parametrize("writes", [True, False])
async def test_a_lost_lease_stops_the_handler(writes: bool) -> None:
    box = ToolBox(limiter=Forgetful())
    cancelled: list[str] = []

    @box.tool(writes=writes)
    async def work() -> str:
        try:
            await anyio.sleep(60)
        except anyio.get_cancelled_exc_class():
            cancelled.append("work")
            raise
        return "never"

    with anyio.fail_after(20):
        [result] = await box.run([ToolCall(id="1", name="work")])
    assert cancelled == ["work"]
    assert (result.error, result.effect) == ("limiter-error", "unknown" if writes else "none")
    assert result.content == "Tool 'work' was stopped: its slot's lease was lost."


# -- result budget --------------------------------------------------------------------------------


async def test_the_result_budget_cuts_only_what_does_not_fit() -> None:
    limiter = MemoryLimiter(name="tools", max_concurrent=4)
    box = ToolBox(limiter=limiter, result_budget=1_000)

    @box.tool
    async def text(size: int) -> str:
        return "x" * size

    sizes = [100, 250, 900, 2_000]
    results = await box.run(
        [ToolCall(id=str(i), name="text", arguments={"size": s}) for i, s in enumerate(sizes)]
    )
    # An equal share is 250: 100 and 250 stay whole; 650 left for the two larger ones.
    assert [r.truncated for r in results] == [0, 0, 900 - 325, 2_000 - 325]
    assert [r.content for r in results[:2]] == ["x" * 100, "x" * 250]
    for result, size in zip(results[2:], sizes[2:], strict=True):
        body, note = result.content.split("\n", 1)
        assert body == "x" * 325
        assert note == (
            f"[{size - 325:,} of {size:,} characters cut to fit the tool output budget: "
            "ask for less, with a narrower query, to see more]"
        )
    assert sum(len(r.content.split("\n", 1)[0]) for r in results) == 1_000


async def test_results_that_fit_the_budget_are_whole() -> None:
    box = ToolBox(limiter=MemoryLimiter(max_concurrent=2), result_budget=30)

    @box.tool
    async def text(size: int) -> str:
        return "y" * size

    results = await box.run(
        [ToolCall(id=str(s), name="text", arguments={"size": s}) for s in (10, 20)]
    )
    assert [(len(r.content), r.truncated) for r in results] == [(10, 0), (20, 0)]


# -- the per-run call budget ----------------------------------------------------------------------


async def test_the_call_budget_counts_a_run_and_its_child_runs() -> None:
    box = ToolBox(limiter=MemoryLimiter(max_concurrent=4), max_calls_per_run=4)
    nested: list[list[ToolResult]] = []

    @box.tool
    async def lookup() -> str:
        return "found"

    @box.tool
    async def delegate() -> str:
        # A nested agent: a child run of the caller's run, using the same ToolBox.
        async with slotwise.run():
            nested.append(await box.run([ToolCall(id=f"n{i}", name="lookup") for i in range(3)]))
        return "delegated"

    async with slotwise.run():
        first = await box.run([ToolCall(id="a", name="delegate"), ToolCall(id="b", name="nope")])
        second = await box.run([ToolCall(id="c", name="lookup")])
    # The parent made 1 counted call (an unknown tool does not count), its child 3 more.
    assert [r.error for r in first] == [None, "unknown-tool"]
    assert [r.error for r in nested[0]] == [None, None, None]
    assert [(r.error, r.effect) for r in second] == [("budget-exhausted", "none")]
    assert second[0].content == "Tool 'lookup' did not run: this run has made its 4 tool calls."

    # Another run, and each batch outside any run, has a budget of its own.
    async with slotwise.run():
        assert [r.error for r in await box.run([ToolCall(id="d", name="lookup")])] == [None]
    for _ in range(2):
        outside = await box.run([ToolCall(id=str(i), name="lookup") for i in range(5)])
        assert [r.error for r in outside] == [None] * 4 + ["budget-exhausted"]


async def test_calls_a_cancelled_batch_never_admitted_do_not_count() -> None:
    box = ToolBox(limiter=MemoryLimiter(max_concurrent=1), max_calls_per_run=3)
    activity = Activity()
    counted(box, activity, "work", pool="default", hold=60.0)
    counted(box, activity, "quick", pool="default")
    async with slotwise.run():
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(box.run, calls("work", "work", "work"))
                await until(lambda: activity.total == 1)
                scope.cancel()
        # The first call was admitted (and counted); the two behind it never were.
        results = await box.run(calls("quick", "quick", "quick"))
    assert [r.error for r in results] == [None, None, "budget-exhausted"]


# -- events ---------------------------------------------------------------------------------------


async def test_tool_events_carry_lineage_tool_pool_times_and_outcome_never_arguments() -> None:
    secret = "sk-live-4242-secret"
    box = ToolBox(
        limiter=MemoryLimiter(
            name="tools",
            max_concurrent=2,
            workloads={"search": Workload(max_concurrent=1, max_wait=0), "default": Workload()},
        )
    )

    @box.tool(pool="search")
    async def search(query: str) -> str:
        await anyio.sleep(HOLD)
        return f"found {query}"

    @box.tool
    async def leak(token: str) -> str:
        raise ValueError(f"bad token {token}")

    everything: list[slotwise.ConcurrencyEvent] = []
    stop = slotwise.subscribe(everything.append)
    try:
        async with slotwise.run(run_id="agent") as run:
            results = await box.run(
                [
                    ToolCall(id="s1", name="search", arguments={"query": secret}),
                    ToolCall(id="s2", name="search", arguments={"query": secret}),
                    ToolCall(id="l1", name="leak", arguments={"token": secret}),
                    ToolCall(id="x1", name="nope", arguments={"token": secret}),
                    ToolCall(id="b1", name="search", arguments={"q": secret}),
                ]
            )
    finally:
        stop()
    assert secret in results[0].content  # the model gets its results...
    for event in everything:  # ...the events never carry arguments or results
        assert secret not in repr(event)
        assert secret not in json.dumps(attrs.asdict(event), default=str)
    tool_events = [
        e
        for e in everything
        if isinstance(e, ToolStartedEvent | ToolFinishedEvent | ToolRejectedEvent)
    ]
    assert {(e.run_id, e.root_run_id, e.parent_run_id) for e in tool_events} == {
        (run.run_id, run.root_run_id, None)
    }
    by_call = {
        call: [e for e in tool_events if e.call_id == call]
        for call in ("s1", "s2", "l1", "x1", "b1")
    }
    started, finished = by_call["s1"]
    assert isinstance(started, ToolStartedEvent)
    assert isinstance(finished, ToolFinishedEvent)
    assert (finished.tool, finished.pool, finished.workload, finished.limiter) == (
        "search",
        "search",
        "search",
        "tools",
    )
    assert (finished.outcome, finished.effect, finished.exception) == ("completed", "done", None)
    assert finished.duration >= HOLD
    assert finished.request_id == started.request_id is not None
    acquired = [e for e in everything if isinstance(e, slotwise.AcquiredEvent)]
    assert started.request_id in {e.request_id for e in acquired}
    [busy] = by_call["s2"]
    assert isinstance(busy, ToolRejectedEvent)
    assert (busy.reason, busy.pool) == ("concurrency-limit", "search")
    failed = by_call["l1"][-1]
    assert isinstance(failed, ToolFinishedEvent)
    assert (failed.outcome, failed.exception, failed.pool) == ("failed", "ValueError", "default")
    [unknown] = by_call["x1"]
    assert isinstance(unknown, ToolRejectedEvent)
    assert (unknown.reason, unknown.pool, unknown.tool) == ("unknown-tool", None, "nope")
    [invalid] = by_call["b1"]
    assert isinstance(invalid, ToolRejectedEvent)
    assert invalid.reason == "invalid-arguments"


async def test_a_batch_outside_any_run_is_a_run_of_its_own() -> None:
    box = box_of()

    @box.tool
    async def where() -> str:
        run = slotwise.current_run()
        assert run is not None
        return run.run_id

    recorder = Recorder(box.limiter)
    first = await box.run([ToolCall(id="1", name="where")])
    second = await box.run([ToolCall(id="1", name="where")])
    recorder.stop()
    assert first[0].content != second[0].content
    runs = {e.run_id for e in recorder.tool_events()}
    assert runs == {first[0].content, second[0].content}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_batch_runs_while_another_thread_is_still_importing_trio(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A module is in sys.modules from the moment its import starts: while a thread that is
    # about to run trio imports it, a batch on asyncio in another thread finds a trio module
    # without its attributes yet.
    half_imported = types.ModuleType("trio")
    monkeypatch.setitem(sys.modules, "trio", half_imported)
    box = box_of()

    @box.tool
    async def ping() -> str:
        return "pong"

    [result] = await box.run([ToolCall(id="1", name="ping")])
    assert (result.error, result.content) == (None, "pong")


class Halt(BaseException):
    """Not an Exception, and not a cancellation either."""


async def test_a_handler_raising_a_base_exception_finishes_failed_like_its_slot() -> None:
    box = box_of()

    @box.tool
    async def halt() -> str:
        await anyio.sleep(HOLD)
        raise Halt("stop")

    recorder = Recorder(box.limiter)
    with pytest.raises(Halt):
        await box.run([ToolCall(id="1", name="halt")])
    recorder.stop()
    [released] = [e for e in recorder.events if isinstance(e, slotwise.ReleasedEvent)]
    [finished] = [e for e in recorder.events if isinstance(e, ToolFinishedEvent)]
    assert released.outcome == "failed"
    assert (finished.outcome, finished.exception) == ("failed", "Halt")
    assert await idle(box.limiter)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("others", [0, 2])
async def test_a_cancelled_error_nobody_sent_this_batch_is_the_handlers_failure(
    others: int,
) -> None:
    # A handler that awaits a task another part of the program cancelled (an HTTP client
    # cancelling its own request task) raises CancelledError while nothing cancels the
    # batch: a failed call, not a cancelled batch (nor, with several workers, a task group
    # that takes it for its own cancellation and drops the other calls).
    box = box_of()

    @box.tool
    async def fetch() -> str:
        inner = asyncio.ensure_future(asyncio.sleep(10))
        await asyncio.sleep(0)
        inner.cancel()
        return await inner

    @box.tool
    async def ok() -> str:
        await anyio.sleep(HOLD)
        return "ok"

    calls = [ToolCall(id="a", name="fetch")] + [
        ToolCall(id=f"o{n}", name="ok") for n in range(others)
    ]
    results = await box.run(calls)
    assert [(r.call_id, r.error) for r in results] == [("a", "failed")] + [
        (f"o{n}", None) for n in range(others)
    ]
    assert results[0].content == "Tool 'fetch' failed: CancelledError"
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    assert await idle(box.limiter)


# -- configuration --------------------------------------------------------------------------------


def test_registration_checks_its_settings() -> None:
    box = box_of(search=Workload(max_concurrent=1), other=Workload())

    async def handler() -> str:
        return ""

    def sync_handler() -> str:
        return ""

    with pytest.raises(ConcurrencyConfigError, match="unknown workload 'serch'"):
        box.tool(pool="serch")(handler)
    with pytest.raises(ConcurrencyConfigError, match="several workloads and no default"):
        box.tool(handler)
    with pytest.raises(ConcurrencyConfigError, match="timeout must be a positive number"):
        box.tool(pool="search", timeout=0)(handler)
    with pytest.raises(TypeError, match="must be an async function"):
        box.tool(pool="search")(sync_handler)  # type: ignore[type-var]
    assert box.tool(pool="search")(handler) is handler
    with pytest.raises(ConcurrencyConfigError, match="already registered"):
        box.tool(pool="other")(handler)
    assert box.tools["handler"].pool == "search"
    assert repr(box) == "<slotwise.tools.ToolBox limiter='tools' tools: handler (search)>"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"limiter": object()}, "must be a limiter"),
        ({"limiter": MemoryLimiter(max_concurrent=1), "result_budget": 0}, "result_budget"),
        ({"limiter": MemoryLimiter(max_concurrent=1), "max_calls_per_run": 1.5}, "max_calls_per"),
    ],
)
def test_a_toolbox_checks_its_settings(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConcurrencyConfigError, match=message):
        ToolBox(**settings)


def test_import_slotwise_does_not_import_the_tools() -> None:
    import subprocess
    import sys

    code = "import sys, slotwise; print('slotwise.tools' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_batch_result_is_the_value_the_constructor_makes() -> None:
    """The batch fills its results' slots directly (`make_result`): the same frozen value as
    `ToolResult(...)`, every field included (a field added to `ToolResult` fails here)."""
    from slotwise.tools._values import make_result

    made = make_result("call_1", "search", "found", "timed-out", "unknown", 1.5, 2.5)
    built = ToolResult(
        call_id="call_1",
        name="search",
        content="found",
        error="timed-out",
        effect="unknown",
        wait_time=1.5,
        duration=2.5,
    )
    assert made == built
    assert attrs.asdict(made) == attrs.asdict(built)
    assert [field.name for field in attrs.fields(ToolResult)] == [
        "call_id",
        "name",
        "content",
        "error",
        "effect",
        "wait_time",
        "duration",
        "truncated",
    ]
    assert made.truncated == 0
    assert made.is_error
    assert hash(made) == hash(built)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        made.content = "changed"  # type: ignore[misc]
