"""PostgresLimiter across worker processes: overlap on the database clock, crashes, first use.

Grant and release times are recorded by a trigger on the leases table, on the database clock
(``clock_timestamp()`` inside the transactions that grant and end leases; an expired lease
ends at its ``expires_at``), so the overlap computed from them is the number of valid leases.
PostgresLimiter is asyncio-only: these tests run on asyncio (see conftest).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

import slotwise
from slotwise import AcquireRequest, Workload
from slotwise.postgres import PostgresLimiter

pytestmark = pytest.mark.anyio

WORKER = str(Path(__file__).with_name("_worker.py"))

HISTORY = """
CREATE TABLE {s}.history (
    lease_id uuid PRIMARY KEY, workload text, granted_at timestamptz, ended_at timestamptz
);
CREATE FUNCTION {s}.record() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO {s}.history VALUES (NEW.lease_id, NEW.workload, clock_timestamp(), NULL);
    ELSE
        UPDATE {s}.history SET ended_at = least(clock_timestamp(), OLD.expires_at)
        WHERE lease_id = OLD.lease_id;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER record AFTER INSERT OR DELETE ON {s}.leases
    FOR EACH ROW EXECUTE FUNCTION {s}.record();
"""


async def no_queue(limiter: PostgresLimiter[Any]) -> bool:
    return (await limiter.stats()).queued == 0


def spawn(spec: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKER, json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    # An end and a start at the same instant do not overlap: an end is recorded before the
    # grant that reuses its slot.
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


async def test_four_processes_never_exceed_the_limits(
    dsn: str, tagged_dsn: str, schema: str
) -> None:
    workloads = {
        "interactive": {"reserved": 1, "priority": 10},
        "background": {"max_concurrent": 3},
        "batch": {"max_concurrent": 2},
    }
    spec: dict[str, Any] = {
        "mode": "load",
        "dsn": tagged_dsn,
        "schema": schema,
        "name": "shared",
        "max_concurrent": 4,
        "workloads": workloads,
        "poll_interval": 0.05,
        "lease_ttl": 5.0,
        "requests": 120,
        # Asynchronous commit changes no allocation decision; it keeps this test short on
        # a machine whose disk flushes slowly.
        "synchronous_commit": False,
        "parallel": 25,
        "cancel": 0.25,
    }
    limiter = PostgresLimiter(
        tagged_dsn,
        name="shared",
        schema=schema,
        max_concurrent=4,
        workloads={k: Workload(**v) for k, v in workloads.items()},
    )
    async with limiter:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(HISTORY.replace("{s}", f'"{schema}"').encode())
        procs = [spawn({**spec, "seed": seed}) for seed in range(4)]
        outcomes: dict[str, int] = {}
        for proc in procs:
            out = await anyio.to_thread.run_sync(finish, proc)
            for key, count in json.loads(out.splitlines()[-1]).items():
                outcomes[key] = outcomes.get(key, 0) + count
        stats = await limiter.stats()
        assert (stats.active, stats.queued) == (0, 0)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            cur = await conn.execute(
                f"SELECT workload, extract(epoch FROM granted_at)::float8, "
                f"extract(epoch FROM coalesce(ended_at, clock_timestamp()))::float8 "
                f'FROM "{schema}".history'.encode()
            )
            rows = await cur.fetchall()
    assert outcomes.get("completed", 0) >= 240, outcomes
    assert outcomes.get("cancelled", 0) > 0, outcomes
    assert set(outcomes) <= {"completed", "cancelled"}, outcomes
    assert len(rows) >= outcomes["completed"]
    assert max_overlap([(start, end) for _, start, end in rows]) <= 4
    by_workload = {
        name: max_overlap([(s, e) for w, s, e in rows if w == name]) for name in workloads
    }
    assert by_workload["background"] <= 3
    assert by_workload["batch"] <= 2
    # Reservations are strict: the other workloads share only 4 - 1 slots.
    assert max_overlap([(s, e) for w, s, e in rows if w != "interactive"]) <= 3


async def test_killed_worker_slots_return_and_its_queue_entries_vanish(
    tagged_dsn: str, schema: str
) -> None:
    spec: dict[str, Any] = {
        "mode": "hold",
        "dsn": tagged_dsn,
        "schema": schema,
        "name": "crash",
        "max_concurrent": 2,
        "lease_ttl": 2.0,
        "queue_entry_ttl": 1.0,
        "poll_interval": 0.05,
        "hold": 2,
        "queue": 3,
    }
    proc = spawn(spec)
    try:
        line = await anyio.to_thread.run_sync(proc.stdout.readline)  # type: ignore[union-attr]
        assert line.strip() == "ready", proc.stderr.read() if proc.stderr else ""
        survivor: PostgresLimiter[Any] = PostgresLimiter(
            tagged_dsn,
            name="crash",
            schema=schema,
            max_concurrent=2,
            lease_ttl=2.0,
            poll_interval=0.05,
        )
        async with survivor:
            stats = await survivor.stats()
            assert (stats.active, stats.queued) == (2, 3)
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate()
            started = anyio.current_time()
            # The dead worker's two slots come back after its leases expire (lease_ttl = 2 s,
            # then one poll); the bound here is generous because the machine is shared.
            leases = [
                await survivor.acquire(
                    AcquireRequest(workload="default", request_id=str(i), deadline=started + 20)
                )
                for i in range(2)
            ]
            stats = await survivor.stats()
            assert (stats.active, stats.queued) == (2, 0)
            for lease in leases:
                await survivor.release(lease)
    finally:
        proc.kill()
        proc.communicate()


async def test_queue_entries_of_a_dead_worker_vanish(
    tagged_dsn: str, schema: str, eventually: Any
) -> None:
    spec: dict[str, Any] = {
        "mode": "hold",
        "dsn": tagged_dsn,
        "schema": schema,
        "name": "stale",
        "max_concurrent": 1,
        "lease_ttl": 30.0,
        "queue_entry_ttl": 1.0,
        "poll_interval": 0.05,
        "hold": 0,
        "queue": 0,
    }
    holder: PostgresLimiter[Any] = PostgresLimiter(
        tagged_dsn, name="stale", schema=schema, max_concurrent=1, poll_interval=0.05
    )
    async with holder:
        lease = await holder.acquire(AcquireRequest(workload="default", request_id="h"))
        proc = spawn({**spec, "queue": 2})
        try:
            line = await anyio.to_thread.run_sync(proc.stdout.readline)  # type: ignore[union-attr]
            assert line.strip() == "ready", proc.stderr.read() if proc.stderr else ""
            assert (await holder.stats()).queued == 2
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate()
        finally:
            proc.kill()
            proc.communicate()
        # Once stale, the dead entries no longer count, and the next allocation deletes them:
        # the slot freed below is not granted to a dead entry.
        await eventually(lambda: no_queue(holder))
        await holder.release(lease)
        async with await psycopg.AsyncConnection.connect(tagged_dsn) as conn:
            cur = await conn.execute(f'SELECT count(*) FROM "{schema}".queue'.encode())
            assert await cur.fetchone() == (0,)
        async with holder.slot():
            assert (await holder.stats()).active == 1


async def test_concurrent_first_use_of_a_fresh_schema(tagged_dsn: str, schema: str) -> None:
    spec: dict[str, Any] = {
        "mode": "start",
        "dsn": tagged_dsn,
        "schema": schema,
        "name": "fresh",
        "max_concurrent": 2,
    }
    procs = [spawn(spec) for _ in range(4)]
    for proc in procs:
        assert (await anyio.to_thread.run_sync(finish, proc)).strip() == "ok"


async def test_a_worker_with_other_limits_fails(tagged_dsn: str, schema: str) -> None:
    async with PostgresLimiter(tagged_dsn, name="x", schema=schema, max_concurrent=2):
        proc = spawn(
            {"mode": "start", "dsn": tagged_dsn, "schema": schema, "name": "x", "max_concurrent": 3}
        )
        _, err = await anyio.to_thread.run_sync(proc.communicate)
        assert proc.returncode != 0
        assert "ConcurrencyConfigError" in err
        assert slotwise.ConcurrencyConfigError.__name__ in err


async def test_a_dead_workers_waiting_requests_are_not_granted(
    tagged_dsn: str, schema: str, eventually: Any
) -> None:
    # Its queue entries live until queue_entry_ttl (60 s here), but from about a second
    # after it died (five of its poll intervals, at least one second) they are passed over:
    # the slot freed below goes to the live request queued after them, not to a dead one
    # for lease_ttl (60 s here).
    spec: dict[str, Any] = {
        "mode": "hold",
        "dsn": tagged_dsn,
        "schema": schema,
        "name": "dead",
        "max_concurrent": 1,
        "lease_ttl": 60.0,
        "queue_entry_ttl": 60.0,
        "poll_interval": 0.05,
        "hold": 0,
        "queue": 2,
    }
    survivor: PostgresLimiter[Any] = PostgresLimiter(
        tagged_dsn, name="dead", schema=schema, max_concurrent=1, lease_ttl=60.0, poll_interval=0.05
    )
    async with survivor:
        held = await survivor.acquire(AcquireRequest(workload="default", request_id="held"))
        proc = spawn(spec)
        try:
            line = await anyio.to_thread.run_sync(proc.stdout.readline)  # type: ignore[union-attr]
            assert line.strip() == "ready", proc.stderr.read() if proc.stderr else ""
            got: list[Any] = []

            async def wait() -> None:
                got.append(
                    await survivor.acquire(AcquireRequest(workload="default", request_id="live"))
                )

            # Far below lease_ttl: the slot must not have gone to a dead request.
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(wait)
                    await eventually(lambda: queued(survivor, 3))
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.communicate()
                    await anyio.sleep(2.0)  # past the dead worker's last word
                    await survivor.release(held)
            await survivor.release(got[0])
        finally:
            proc.kill()
            proc.communicate()


async def queued(limiter: PostgresLimiter[Any], count: int) -> bool:
    return (await limiter.stats()).queued >= count
