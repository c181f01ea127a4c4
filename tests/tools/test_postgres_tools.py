"""ToolBox on PostgresLimiter: seed 000's list and the atomic pair in one process, then two
processes sharing one ToolBox configuration. PostgresLimiter is asyncio-only, so these tests
run on asyncio alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from slotwise.postgres import PostgresLimiter

from . import _pg_worker
from ._cases import (
    case_cancelled_queued_calls_never_run,
    case_failing_call_gives_its_slot_back,
    case_limits_counted,
    case_the_pair_is_admitted_atomically,
    case_two_runs_share_the_pools,
)

pytestmark = pytest.mark.anyio

HOLD = 0.1


@pytest.fixture
def anyio_backend() -> str:
    """PostgresLimiter is asyncio-only (psycopg's async API)."""
    return "asyncio"


@pytest.fixture
def make(tagged_dsn: str, schema: str, limiters: list[Any]) -> Callable[..., Any]:
    def make(**settings: Any) -> PostgresLimiter[Any]:
        limiter: PostgresLimiter[Any] = PostgresLimiter(
            tagged_dsn, schema=schema, poll_interval=0.02, **settings
        )
        limiters.append(limiter)
        return limiter

    return make


async def test_limits_are_counted_per_pool_and_in_total(make: Callable[..., Any]) -> None:
    await case_limits_counted(make, HOLD)


async def test_a_failing_call_gives_its_slot_back(make: Callable[..., Any]) -> None:
    await case_failing_call_gives_its_slot_back(make)


async def test_cancelled_queued_calls_never_run(make: Callable[..., Any]) -> None:
    await case_cancelled_queued_calls_never_run(make)


async def test_two_runs_share_the_pools(make: Callable[..., Any]) -> None:
    await case_two_runs_share_the_pools(make, HOLD)


@pytest.mark.parametrize("slow_max_wait", [None, 60.0])
async def test_the_global_limit_and_the_pool_are_admitted_together(
    make: Callable[..., Any], slow_max_wait: float | None
) -> None:
    await case_the_pair_is_admitted_atomically(make, slow_max_wait)


def spawn(spec: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(Path(_pg_worker.__file__)), json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    result: dict[str, Any] = json.loads(out.splitlines()[-1])
    return result


Entry = tuple[int, str, str, str, str]  # worker, "+" or "-", tool, pool, call id


def peak(entries: list[Entry]) -> int:
    """The most handlers running at once, replaying (part of) the journal; every handler that
    started has ended."""
    running = top = 0
    for entry in entries:
        running += 1 if entry[1] == "+" else -1
        top = max(top, running)
    assert running == 0
    return top


# What each kind of call ends with: (error, effect) for tools that do not write and that do.
ENDS: dict[str, dict[bool, tuple[str | None, str]]] = {
    "sleep": {False: (None, "done"), True: (None, "done")},
    "fail": {False: ("failed", "none"), True: ("failed", "unknown")},
    "slow": {False: ("timed-out", "none"), True: ("timed-out", "unknown")},
}


async def test_two_processes_share_the_pools_of_one_toolbox_configuration(
    tagged_dsn: str, schema: str, tmp_path: Path
) -> None:
    """Two processes, each running batches of tools that sleep, fail and time out, one batch
    cancelled part-way, on one ToolBox configuration: the handlers running at once, counted
    across both processes in their shared journal, never exceed a pool's ceiling nor the
    global limit; each process's sequential calls never overlap and start in the order given;
    every batch that ends has one result per call, in order; no slot is left."""
    journal = tmp_path / "journal"
    spec = {
        "dsn": tagged_dsn,
        "schema": schema,
        "name": "tools",
        "batches": 4,
        "calls": 16,
        "cancel": 2,
        "journal": str(journal),
    }
    procs = [spawn({**spec, "seed": seed, "worker": worker}) for worker, seed in enumerate((1, 2))]
    outputs = [await anyio.to_thread.run_sync(finish, proc) for proc in procs]
    entries: list[Entry] = [tuple(json.loads(line)) for line in journal.read_text().splitlines()]
    tools = _pg_worker.TOOLS

    # Limits, counted across both processes (the global one reached).
    assert peak(entries) == _pg_worker.MAX_CONCURRENT
    for pool, ceiling in _pg_worker.POOLS.items():
        assert 1 <= peak([e for e in entries if e[3] == pool]) <= ceiling, pool
    # The two processes ran at the same time: both had handlers running at some point.
    running = {0: 0, 1: 0}
    both = False
    for worker, edge, *_ in entries:
        running[worker] += 1 if edge == "+" else -1
        both |= all(running.values())
    assert both

    kinds: set[str] = set()
    for worker, output in enumerate(outputs):
        mine = [e for e in entries if e[0] == worker]
        # Within each process, the sequential calls never overlapped.
        assert peak([e for e in mine if tools[e[2]][1]]) == 1
        for number, batch in enumerate(output["batches"]):
            plan = [tuple(call) for call in batch["calls"]]
            ids = [call_id for call_id, _, _ in plan]
            started = [e[4] for e in mine if e[1] == "+" and e[4] in ids]
            assert len(started) == len(set(started))
            # The sequential calls started in the order given.
            chain = [call_id for call_id, name, _ in plan if tools[name][1]]
            chained = [call_id for call_id in started if call_id in chain]
            assert chained == chain[: len(chained)]
            if number == spec["cancel"]:
                # Cancelled part-way: some calls ran, the others never entered their handler.
                assert batch["results"] is None
                assert _pg_worker.CANCEL_AFTER <= len(started) < len(ids)
                continue
            assert sorted(started) == sorted(ids)
            # One result per call, in the calls' order, each as its kind ends.
            assert [r[0] for r in batch["results"]] == ids
            for (call_id, name, kind), (_, error, effect, content) in zip(
                plan, batch["results"], strict=True
            ):
                assert (error, effect) == ENDS[kind][tools[name][1]], (call_id, name, kind)
                if error is None:
                    assert content == call_id
                kinds.add(kind)
            assert len(chain) >= 2
    assert kinds == set(_pg_worker.KINDS)

    # No slot left: one left held would count here until its lease expired (lease_ttl, 30 s).
    async with _pg_worker.limiter_for(spec) as limiter:
        stats = await limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)
