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


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    # An end and a start at the same instant do not overlap.
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


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


async def test_two_processes_share_the_pools_of_one_toolbox_configuration(
    tagged_dsn: str, schema: str
) -> None:
    spec = {"dsn": tagged_dsn, "schema": schema, "name": "tools", "batches": 3, "calls": 16}
    procs = [spawn({**spec, "seed": seed}) for seed in (1, 2)]
    outputs = [await anyio.to_thread.run_sync(finish, proc) for proc in procs]
    intervals = [
        (worker, pool, start, end)
        for worker, output in enumerate(outputs)
        for _, pool, start, end in output["intervals"]
    ]
    assert max_overlap([(s, e) for _, _, s, e in intervals]) == _pg_worker.MAX_CONCURRENT
    for pool, ceiling in _pg_worker.POOLS.items():
        assert max_overlap([(s, e) for _, p, s, e in intervals if p == pool]) <= ceiling
    # The two processes ran at the same time: some of their calls overlapped.
    firsts = [(s, e) for w, _, s, e in intervals if w == 0]
    seconds = [(s, e) for w, _, s, e in intervals if w == 1]
    assert any(s1 < e2 and s2 < e1 for s1, e1 in firsts for s2, e2 in seconds)
    # Within each process, the sequential tool's calls never overlapped.
    for output in outputs:
        chain = [(s, e) for tool, _, s, e in output["intervals"] if tool == "update_customer"]
        assert chain
        assert max_overlap(chain) == 1
    errors: dict[str, int] = {}
    for output in outputs:
        for key, count in output["errors"].items():
            errors[key] = errors.get(key, 0) + count
    assert sum(errors.values()) == 2 * 3 * 16
    assert set(errors) <= {"none", "failed", "timed-out"}, errors
    async with _pg_worker.limiter_for(spec) as limiter:
        stats = await limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)
