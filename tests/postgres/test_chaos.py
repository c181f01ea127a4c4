"""PostgresLimiter through database faults: a restart, a kill -9 of the server, cut connections.

These tests run a PostgreSQL cluster of their own, never the shared server: ``initdb`` and the
server binary from ``pg_config --bindir``, a data directory and a unix socket in a temporary
folder, the server stopped or killed by its process id. Four worker processes hold and wait
for slots through each fault (tests/postgres/_worker.py, mode "chaos"); their bodies' intervals
are read on ``time.monotonic()``, one clock for every process of the machine. Each fault must
end with no over-grant, every request either granted or failed with a slotwise error, no
worker hung, every waiter served again after recovery, and no slot lost for longer than
``lease_ttl``. PostgresLimiter is asyncio-only: these tests run on asyncio (see conftest).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

import slotwise
from slotwise.postgres import PostgresLimiter

pytestmark = pytest.mark.anyio

WORKER = str(Path(__file__).with_name("_worker.py"))

MAX_CONCURRENT = 3
LEASE_TTL = 2.0
# A request may end with these; anything else ends its worker with a traceback.
SLOTWISE_OUTCOMES = {
    "completed",
    "cancelled",
    "ConcurrencyLimiterError",
    "ConcurrencyTimeoutError",
    "ConcurrencyLeaseLostError",
}


@pytest.fixture
def schema() -> str:
    """A schema of the throwaway server's (which goes with it)."""
    return f"chaos_{uuid.uuid4().hex[:12]}"


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
        [sys.executable, WORKER, json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """Close the worker's stdin (it stops) and read what it saw; a worker that does not
    end within 30 s hangs, and fails the test."""
    out, err = proc.communicate(input="", timeout=30)
    assert proc.returncode == 0, err
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


async def through(
    cluster: Any, schema: str, fault: Callable[[], Awaitable[None]], **spec: Any
) -> None:
    """Four workers take slots while ``fault`` strikes the server; then check what they saw."""
    spec = {
        "mode": "chaos",
        "dsn": cluster.dsn,
        "schema": schema,
        "name": "chaos",
        "max_concurrent": MAX_CONCURRENT,
        "lease_ttl": LEASE_TTL,
        "queue_entry_ttl": 3.0,
        "poll_interval": 0.05,
        "db_timeout": 1.0,
        "tasks": 4,
        **spec,
    }
    procs = [spawn({**spec, "seed": seed}) for seed in range(4)]
    try:
        for proc in procs:
            line = await anyio.to_thread.run_sync(proc.stdout.readline)  # type: ignore[union-attr]
            assert line.strip() == "started", proc.stderr.read() if proc.stderr else ""
        await anyio.sleep(1.0)
        await fault()
        recovered = time.monotonic()
        # A slot whose release failed in the fault comes back within lease_ttl of the
        # recovery; in the second after that, every slot must be in use again.
        await anyio.sleep(LEASE_TTL + 3.0)
        results = [await anyio.to_thread.run_sync(finish, proc) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    intervals = [(begin, end) for result in results for begin, end in result["intervals"]]
    outcomes: dict[str, int] = {}
    for result in results:
        for outcome, count in result["outcomes"].items():
            outcomes[outcome] = outcomes.get(outcome, 0) + count
    assert set(outcomes) <= SLOTWISE_OUTCOMES, outcomes
    assert max_overlap(intervals) <= MAX_CONCURRENT, "an over-grant"
    for seed, result in enumerate(results):  # every worker is served again after recovery
        assert any(begin > recovered for begin, _ in result["intervals"]), (seed, outcomes)
    settled = recovered + LEASE_TTL + 1.0
    late = [(max(begin, settled), end) for begin, end in intervals if end > settled]
    assert max_overlap(late) == MAX_CONCURRENT, "a slot stayed lost past lease_ttl"
    observer: PostgresLimiter[Any] = PostgresLimiter(
        cluster.dsn, name="chaos", schema=schema, max_concurrent=MAX_CONCURRENT
    )
    async with observer:
        stats = await observer.stats()
        assert (stats.active, stats.queued) == (0, 0)


async def test_a_server_restart_mid_run(cluster: Any, schema: str) -> None:
    async def restart() -> None:
        await anyio.to_thread.run_sync(cluster.stop)
        await anyio.sleep(0.5)
        await anyio.to_thread.run_sync(cluster.start)

    await through(cluster, schema, restart)


async def test_a_kill_9_of_the_server(cluster: Any, schema: str) -> None:
    async def kill() -> None:
        await anyio.to_thread.run_sync(cluster.kill)
        await anyio.sleep(0.5)
        await anyio.to_thread.run_sync(cluster.start)  # crash recovery from the WAL

    await through(cluster, schema, kill)


async def test_connections_cut(cluster: Any, schema: str) -> None:
    # The listening connections dropped again and again (grants then reach a waiter by the
    # next poll, every 0.5 s here, until the listener is back), then every connection at once.
    async def terminate(which: str) -> None:
        async with await psycopg.AsyncConnection.connect(cluster.dsn, autocommit=True) as conn:
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() "
                f"AND {which}".encode()
            )

    async def cut() -> None:
        for _ in range(4):
            await terminate("query LIKE 'LISTEN%'")
            await anyio.sleep(0.3)
        await terminate("true")

    await through(cluster, schema, cut, poll_interval=0.5)


async def test_the_database_down_fails_closed_then_recovers(cluster: Any, schema: str) -> None:
    limiter: PostgresLimiter[Any] = PostgresLimiter(
        cluster.dsn, schema=schema, max_concurrent=1, db_timeout=1.0
    )
    async with limiter:
        async with limiter.slot():
            pass
        await anyio.to_thread.run_sync(cluster.stop)
        try:
            # Refused connections: a limiter error within a few db_timeouts, the cause kept.
            with anyio.fail_after(10), pytest.raises(slotwise.ConcurrencyLimiterError) as info:
                async with limiter.slot():
                    pytest.fail("the body must not run")
            assert isinstance(info.value.__cause__, psycopg.OperationalError)
        finally:
            await anyio.to_thread.run_sync(cluster.start)
        with anyio.fail_after(10):  # the same limiter serves again once the server is back
            async with limiter.slot():
                assert (await limiter.stats()).active == 1
