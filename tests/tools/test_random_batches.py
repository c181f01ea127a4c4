"""Random batches (Hypothesis) of tools that sleep, fail, time out, are unknown or badly called,
in random pools, some sequential, some batches cancelled part-way. Every time:

- one result per call, in the calls' order, matched by id (when the batch is not cancelled);
- each result's error is one the call could have had;
- no pool ever runs more handlers than its ceiling, nor all of them more than the limit
  (counted inside the handlers);
- no slot is left held or queued afterwards, and no handler is left running;
- sequential calls never overlap and start in the order given;
- every call ends with exactly one tool event (finished or rejected), unless the batch was
  cancelled before it started, and a handler ran for a call if and only if it had a
  tool-started event.

On trio the clock is virtual (MockClock); on asyncio it is real, with shorter times.
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from slotwise import MemoryLimiter, Workload
from slotwise.tools import ToolBox, ToolCall, ToolFinishedEvent, ToolRejectedEvent, ToolStartedEvent

from ._cases import Activity

KINDS = ("sleep", "fail", "slow", "unknown", "bad-arguments")
TIMEOUT = 3.0  # the "slow" tools' timeout; they sleep longer
# The error each kind of call ends with when it runs (any of them may also find no slot).
EXPECTED: dict[str, tuple[str | None, ...]] = {
    "unknown": ("unknown-tool",),
    "sleep": (None,),
    "fail": ("failed",),
    "slow": ("timed-out",),
    "bad-arguments": ("invalid-arguments",),
}


@attrs.frozen
class Call:
    kind: str
    pool: int
    delay: float
    sequential: bool
    writes: bool


@attrs.frozen
class Scenario:
    max_concurrent: int
    pools: tuple[tuple[int, float | None], ...]  # (ceiling, max_wait) per pool
    calls: tuple[Call, ...]
    cancel_at: float | None


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    limit = draw(st.integers(1, 4))
    pools = tuple(
        (draw(st.integers(1, limit)), draw(st.sampled_from([None, 0.0, 2.0, 6.0])))
        for _ in range(draw(st.integers(1, 3)))
    )
    calls = draw(
        st.lists(
            st.builds(
                Call,
                kind=st.sampled_from(KINDS),
                pool=st.integers(0, len(pools) - 1),
                delay=st.sampled_from([0.0, 1.0, 2.5, 4.0]),
                sequential=st.booleans(),
                writes=st.booleans(),
            ),
            max_size=12,
        )
    )
    cancel_at = draw(st.none() | st.sampled_from([0.0, 0.5, 1.5, 3.5, 7.0]))
    return Scenario(max_concurrent=limit, pools=pools, calls=tuple(calls), cancel_at=cancel_at)


def tool_name(call: Call) -> str:
    """The tool a call names: badly called tools are "sleep" ones; unknown ones are never
    registered."""
    kind = "sleep" if call.kind == "bad-arguments" else call.kind
    return f"{kind}-{call.pool}-{'seq' if call.sequential else 'par'}-{call.writes}"


def handler(call: Call, activity: Activity, chain: Activity, unit: float) -> Any:
    """A tool of the call's kind: it counts itself, sleeps, then fails or returns its tag."""

    async def run(tag: str, delay: float) -> str:
        with activity.running(f"p{call.pool}", tag):
            if call.sequential:
                with chain.running("chain", tag):
                    await anyio.sleep(delay * unit)
            else:
                await anyio.sleep(delay * unit)
        if call.kind == "fail":
            raise RuntimeError("broke")
        return tag

    return run


async def play(scenario: Scenario, unit: float) -> None:
    limiter = MemoryLimiter(
        name="tools",
        max_concurrent=scenario.max_concurrent,
        workloads={
            f"p{n}": Workload(
                max_concurrent=ceiling, max_wait=None if wait is None else wait * unit
            )
            for n, (ceiling, wait) in enumerate(scenario.pools)
        },
        default_workload="p0",
    )
    box = ToolBox(limiter=limiter)
    activity = Activity()
    chain = Activity()
    for call in scenario.calls:
        name = tool_name(call)
        if call.kind == "unknown" or name in box.tools:
            continue

        box.tool(
            name=name,
            pool=f"p{call.pool}",
            timeout=TIMEOUT * unit if call.kind == "slow" else None,
            sequential=call.sequential,
            writes=call.writes,
        )(handler(attrs.evolve(call, kind=name.split("-")[0]), activity, chain, unit))

    batch = []
    for i, call in enumerate(scenario.calls):
        delay = TIMEOUT + 5 if call.kind == "slow" else call.delay
        arguments: dict[str, Any] = {"tag": f"c{i}", "delay": delay}
        if call.kind == "bad-arguments":
            arguments = {"tag": f"c{i}"}
        batch.append(ToolCall(id=f"c{i}", name=tool_name(call), arguments=arguments))

    events: list[Any] = []
    unsubscribe = limiter.subscribe(events.append)
    results = None
    try:
        with anyio.move_on_after(
            math.inf if scenario.cancel_at is None else scenario.cancel_at * unit
        ):
            results = await box.run(batch)
    finally:
        unsubscribe()

    # Limits, counted where the handlers run; nothing left behind.
    for n, (ceiling, _) in enumerate(scenario.pools):
        assert activity.peak[f"p{n}"] <= ceiling
    assert activity.peak_total <= scenario.max_concurrent
    assert activity.total == 0
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)

    # Sequential calls: one at a time, in the order given.
    assert chain.peak_total <= 1
    sequential = [f"c{i}" for i, c in enumerate(scenario.calls) if c.sequential]
    assert chain.entered == [tag for tag in sequential if tag in chain.entered]

    # One ending event per call; a handler ran exactly for the calls that started.
    tool_events = [
        e for e in events if isinstance(e, ToolStartedEvent | ToolFinishedEvent | ToolRejectedEvent)
    ]
    endings = [e.call_id for e in tool_events if not isinstance(e, ToolStartedEvent)]
    if endings or results is not None:
        assert sorted(endings) == sorted(call.id for call in batch)
    else:  # cancelled before the batch started: nothing happened at all
        assert tool_events == []
    started = [e.call_id for e in tool_events if isinstance(e, ToolStartedEvent)]
    assert sorted(started) == sorted(activity.entered)

    if results is None:
        assert scenario.cancel_at is not None
        return
    assert [r.call_id for r in results] == [call.id for call in batch]
    for call, result in zip(scenario.calls, results, strict=True):
        allowed = set(EXPECTED[call.kind])
        if call.kind in ("sleep", "fail", "slow"):
            allowed.add("concurrency-limit")
        assert result.error in allowed, (call, result)
        if result.error is None:
            assert result.content == result.call_id
            assert result.effect == "done"
        elif result.error in ("failed", "timed-out"):
            assert result.effect == ("unknown" if call.writes else "none")
        else:
            assert result.effect == "none"
            assert result.call_id not in activity.entered


BACKENDS = [
    pytest.param("trio", 1.0, id="trio-mockclock"),
    pytest.param("asyncio", 0.003, id="asyncio"),
]


@pytest.mark.parametrize(("backend", "unit"), BACKENDS)
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(scenario=scenarios())
def test_random_batches_keep_every_invariant(backend: str, unit: float, scenario: Scenario) -> None:
    options: dict[str, Any] = {}
    if backend == "trio":
        options["backend_options"] = {"clock": MockClock(autojump_threshold=0)}
    anyio.run(play, scenario, unit, backend=backend, **options)
