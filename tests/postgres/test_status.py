"""``python -m slotwise status`` against the PostgreSQL tests' server: the JSON document and
the table of a limiter with held and queued slots in two workloads, read without knowing its
limits; a missing schema, tables or limiter, and a refused connection, each reported in one
line; ``--watch`` refreshing in place and riding out a lost connection.

The limiters run on asyncio (PostgresLimiter is asyncio-only); the command is synchronous and
runs in a worker thread, as it would in a process of its own.
"""

from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import anyio
import psycopg
import pytest

from slotwise import AcquireRequest, Workload
from slotwise.__main__ import main
from slotwise.postgres import PostgresLimiter
from slotwise.postgres._status import StatusError, _show, _snapshots

pytestmark = pytest.mark.anyio

LONG = "background-batch-jobs-of-the-nightly-reindex"
LIMITS: dict[str, Any] = {
    "name": "claude",
    "max_concurrent": 3,
    "max_queued": 50,
    "workloads": {
        "interactive": Workload(
            max_concurrent=1, reserved=1, priority=10, max_wait=60.0, max_queued=5
        ),
        LONG: Workload(max_concurrent=2, max_wait=120.0),
    },
}
STORED = {
    "max_concurrent": 3,
    "max_queued": 50,
    "workloads": {
        "interactive": {
            "max_concurrent": 1,
            "reserved": 1,
            "priority": 10,
            "max_wait": 60.0,
            "max_queued": 5,
        },
        LONG: {"max_concurrent": 2, "reserved": 0, "priority": 0, "max_wait": 120.0},
    },
}


# Queue entries as processes leave them (stale_at, deadline from now): live, abandoned (its
# process stopped refreshing it), past its deadline, and live without a deadline.
ENTRIES = [("1 min", "1 min"), ("-1 s", "1 min"), ("1 min", "-1 s"), ("1 min", None)]


def request(workload: str, request_id: str) -> AcquireRequest:
    return AcquireRequest(workload=workload, request_id=request_id)


async def status(*args: str) -> tuple[int, str, str]:
    """Run the command in a thread; its exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()

    def run() -> int:
        stdout, stderr = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = out, err
        try:
            return main(["status", *args])
        finally:
            sys.stdout, sys.stderr = stdout, stderr

    code = await anyio.to_thread.run_sync(run)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
async def busy(
    tagged_dsn: str, schema: str, limiters: list[Any], eventually: Any
) -> AsyncIterator[tuple[PostgresLimiter[Any], PostgresLimiter[Any]]]:
    """Two processes (limiter objects) of 'claude': the first holds every slot (1 interactive,
    2 of the long workload); three requests wait, the first of them the first's interactive;
    and a second limiter, 'openai', with one slot held."""

    def make(**kwargs: Any) -> PostgresLimiter[Any]:
        limiter: PostgresLimiter[Any] = PostgresLimiter(
            tagged_dsn, schema=schema, poll_interval=0.05, **kwargs
        )
        limiters.append(limiter)
        return limiter

    a, b = make(**LIMITS), make(**LIMITS)
    other = make(name="openai", max_concurrent=2)
    await a.acquire(request("interactive", "held-i"))
    await a.acquire(request(LONG, "held-1"))
    await a.acquire(request(LONG, "held-2"))
    await other.acquire(request("default", "elsewhere"))
    async with anyio.create_task_group() as tg:
        for n, (limiter, workload) in enumerate(
            [(a, "interactive"), (b, "interactive"), (b, LONG)], start=1
        ):
            tg.start_soon(limiter.acquire, request(workload, f"waiting-{n}"))
            await eventually(partial(queued, a, n))
        yield a, b
        tg.cancel_scope.cancel()


async def queued(limiter: PostgresLimiter[Any], count: int) -> bool:
    return (await limiter.stats()).queued >= count


async def test_json_reads_the_limits_slots_queues_and_processes(
    busy: Any, tagged_dsn: str, schema: str
) -> None:
    code, out, err = await status("--dsn", tagged_dsn, "--schema", schema, "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert set(doc) == {"version", "schema", "database_time", "limiters"}
    assert (doc["version"], doc["schema"]) == (1, schema)
    assert list(doc["limiters"]) == ["claude", "openai"]
    claude = doc["limiters"]["claude"]
    assert set(claude) == {
        "limits",
        "limits_updated_at",
        "active",
        "queued",
        "expired",
        "workloads",
        "oldest_waiter",
        "expiring_first",
        "processes",
    }
    assert claude["limits"] == STORED
    assert (claude["active"], claude["queued"], claude["expired"]) == (3, 3, 0)
    # Workloads by priority; the longest wait is the first waiter's.
    assert list(claude["workloads"]) == ["interactive", LONG]
    interactive, background = claude["workloads"].values()
    assert (interactive["active"], interactive["queued"]) == (1, 2)
    assert (background["active"], background["queued"]) == (2, 1)
    assert interactive["longest_wait"] > background["longest_wait"] > 0

    # Two processes: the first holds the three slots and waits once; the second waits twice.
    processes = claude["processes"]
    first, second = processes
    assert processes[first] == {
        "active": 3,
        "queued": 1,
        "next_expiry": processes[first]["next_expiry"],
        "longest_wait": interactive["longest_wait"],
        "workloads": {"interactive": {"active": 1, "queued": 1}, LONG: {"active": 2, "queued": 0}},
    }
    assert 0 < processes[first]["next_expiry"] <= 30
    assert processes[second]["workloads"] == {
        "interactive": {"active": 0, "queued": 1},
        LONG: {"active": 0, "queued": 1},
    }
    assert (processes[second]["active"], processes[second]["next_expiry"]) == (0, None)

    waiter = claude["oldest_waiter"]
    assert waiter["workload"] == "interactive"
    assert waiter["owner"] == first
    assert waiter["request_id"] == "waiting-1"
    assert waiter["waited"] == interactive["longest_wait"]
    assert 0 < waiter["deadline_in"] < 60

    expiring = claude["expiring_first"]
    assert sorted(lease["request_id"] for lease in expiring) == ["held-1", "held-2", "held-i"]
    assert [lease["expires_in"] for lease in expiring] == sorted(
        lease["expires_in"] for lease in expiring
    )
    for lease in expiring:
        assert lease["owner"] == first
        assert 0 < lease["expires_in"] <= 30
        assert lease["held"] >= 0

    openai = doc["limiters"]["openai"]
    assert (openai["active"], openai["queued"]) == (1, 0)
    assert openai["limits"]["workloads"]["default"]["max_concurrent"] == 2

    code, out, _ = await status(
        "--dsn", tagged_dsn, "--schema", schema, "--json", "--name", "openai"
    )
    assert code == 0
    assert list(json.loads(out)["limiters"]) == ["openai"]


async def test_expired_leases_are_not_active(
    tagged_dsn: str, schema: str, limiters: list[Any]
) -> None:
    limiter: PostgresLimiter[Any] = PostgresLimiter(
        tagged_dsn, schema=schema, name="claude", max_concurrent=2, lease_ttl=0.2
    )
    limiters.append(limiter)
    await limiter.acquire(request("default", "left"))  # never renewed
    await anyio.sleep(0.4)
    code, out, _ = await status("--dsn", tagged_dsn, "--schema", schema, "--json")
    claude = json.loads(out)["limiters"]["claude"]
    assert (code, claude["active"], claude["expired"]) == (0, 0, 1)
    assert (claude["expiring_first"], claude["processes"]) == ([], {})


async def test_queued_counts_what_the_limiter_counts(
    tagged_dsn: str, schema: str, limiters: list[Any]
) -> None:
    limiter: PostgresLimiter[Any] = PostgresLimiter(
        tagged_dsn, schema=schema, name="claude", max_concurrent=1
    )
    limiters.append(limiter)
    await limiter.start()
    with psycopg.connect(tagged_dsn, autocommit=True) as conn:
        for stale, deadline in ENTRIES:
            conn.execute(
                f"""INSERT INTO "{schema}".queue (entry_id, limiter, workload, owner,
                        request_id, enqueued_at, deadline, stale_at, lease_ttl)
                    VALUES (gen_random_uuid(), 'claude', 'default', gen_random_uuid(), 'r',
                            now(), now() + %s::interval, now() + %s::interval, 30)""",
                [deadline, stale],
            )
    code, out, _ = await status("--dsn", tagged_dsn, "--schema", schema, "--json")
    claude = json.loads(out)["limiters"]["claude"]
    assert code == 0
    assert claude["queued"] == (await limiter.stats()).queued == 2
    assert len(claude["processes"]) == 2


async def test_the_table_fits_80_columns_one_line_a_row(
    busy: Any, tagged_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = await status("--dsn", tagged_dsn, "--schema", schema)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80, out
    assert lines[0].startswith(f"slotwise status · schema {schema} · ")

    def row(pattern: str) -> list[str]:
        return [line for line in lines if re.match(pattern, line)]

    assert row(r"claude +3/3 active · 3 queued \(max 50\) · 2 processes$")
    assert row(r"openai +1/2 active · 0 queued · 1 process$")
    # Workloads: active/ceiling, queued (/its own max_queued, when it has one), longest wait,
    # reserved, priority, max wait.
    assert row(r"interactive +1/1 +2/5 +\d+\.\ds +1 +10 +1m00s$"), out
    assert row(r"background-batch-jo… +2/2 +1 +\d+\.\ds +0 +0 +2m00s$"), out
    assert row(r"default +1/2 +0 +- +0 +0 +none$")
    assert row(r"Oldest waiter: interactive \d+\.\ds \(gives up in \d+s\), process \w{8}, ")
    # Processes: one row per workload, the process named on its first.
    assert len(row(r"\w{8}  interactive +1 +1 +\d+s +\d+\.\ds$")) == 1
    assert len(row(r"\w{8}  interactive +0 +1 +- +\d+\.\ds$")) == 1
    assert len(row(r" {8}  background-batch-jo… +[02] +[01] *$")) == 2
    # The leases that expire first: one row each.
    assert len(row(r"\w{8}  (interactive|background-batch-jo…) +\w{8}  held-\S+ ")) == 3


async def test_an_empty_schema(tagged_dsn: str, schema: str, limiters: list[Any]) -> None:
    limiter = PostgresLimiter(tagged_dsn, schema=schema, max_concurrent=1)
    limiters.append(limiter)
    await limiter.start()  # creates the tables and stores its row
    with psycopg.connect(tagged_dsn, autocommit=True) as conn:
        conn.execute(f'DELETE FROM "{schema}".limiters')
    code, out, _ = await status("--dsn", tagged_dsn, "--schema", schema, "--json")
    assert (code, json.loads(out)["limiters"]) == (0, {})
    code, out, _ = await status("--dsn", tagged_dsn, "--schema", schema)
    assert code == 0
    assert "No limiters are stored in this schema yet." in out


async def test_a_missing_schema_tables_or_limiter_is_one_line(
    tagged_dsn: str, schema: str, limiters: list[Any]
) -> None:
    for as_json in ([], ["--json"]):
        code, out, err = await status("--dsn", tagged_dsn, "--schema", schema, *as_json)
        assert (code, out) == (1, "")
        assert err == (
            f"slotwise status: schema '{schema}' does not exist in database 'test': no "
            "PostgresLimiter has used it (pass --schema if the limiters use another one)\n"
        )
    with psycopg.connect(tagged_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        conn.execute(f'CREATE TABLE "{schema}".limiters (name text)')
    code, _, err = await status("--dsn", tagged_dsn, "--schema", schema)
    assert code == 1
    assert "has no slotwise tables (missing: queue, leases)" in err
    assert err.count("\n") == 1

    with psycopg.connect(tagged_dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    limiter = PostgresLimiter(tagged_dsn, schema=schema, name="claude", max_concurrent=1)
    limiters.append(limiter)
    await limiter.start()
    code, out, err = await status("--dsn", tagged_dsn, "--schema", schema, "--name", "gpt")
    assert (code, out) == (1, "")
    assert err == (
        f"slotwise status: no limiter named 'gpt' in schema '{schema}' "
        "(limiters stored there: 'claude')\n"
    )


def test_a_refused_connection_is_one_line(dsn: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    refused = psycopg.conninfo.make_conninfo(dsn, host="127.0.0.1", port=port)
    result = subprocess.run(
        [sys.executable, "-m", "slotwise", "status", "--dsn", refused],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith("slotwise status: cannot connect to PostgreSQL: ")
    assert "Connection refused" in result.stderr
    assert result.stderr.count("\n") == 1  # one line, no traceback


async def test_watch_refreshes_and_rides_out_a_lost_connection(
    tagged_dsn: str, schema: str, limiters: list[Any]
) -> None:
    limiter: PostgresLimiter[Any] = PostgresLimiter(
        tagged_dsn, schema=schema, name="claude", max_concurrent=2
    )
    limiters.append(limiter)
    lease = await limiter.acquire(request("default", "one"))
    await limiter.aclose()  # only the status command's connection is left

    def terminate() -> None:
        with psycopg.connect(tagged_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = %s AND pid <> pg_backend_pid()",
                [schema],
            )

    def watch() -> list[Any]:
        seen: list[Any] = []
        results = _snapshots(tagged_dsn, schema=schema, name=None, watch=0.1)
        for result in results:
            seen.append(result)
            if len(seen) == 1:
                terminate()
            if len(seen) == 3:
                results.close()
        return seen

    first, lost, back = await anyio.to_thread.run_sync(watch)
    assert first["limiters"]["claude"]["active"] == 1
    assert isinstance(lost, StatusError)
    assert back["limiters"]["claude"]["active"] == 1
    assert back["database_time"] > first["database_time"]
    del lease


def test_watch_redraws_in_place() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    def doc(active: int) -> dict[str, Any]:
        return {
            "version": 1,
            "schema": "slotwise",
            "database_time": "2030-01-01T00:00:00.000Z",
            "limiters": {
                "claude": {
                    "limits": {"max_concurrent": 4, "max_queued": None, "workloads": {}},
                    "limits_updated_at": "2030-01-01T00:00:00.000Z",
                    "active": active,
                    "queued": 0,
                    "expired": 0,
                    "workloads": {},
                    "oldest_waiter": None,
                    "expiring_first": [],
                    "processes": {},
                }
            },
        }

    out = Terminal()
    failure = StatusError("the database failed")
    assert _show(iter([doc(1), failure, doc(2)]), 0.1, out) == 0
    text = out.getvalue()
    assert "1/4 active" in text
    assert "2/4 active" in text
    assert "the database failed (retrying)" in text
    assert "\x1b[2K\x1b[1A" in text  # the previous frame is erased, not scrolled past


async def test_json_watch_prints_one_document_a_line_until_the_reader_stops(
    tagged_dsn: str, schema: str, limiters: list[Any]
) -> None:
    limiter = PostgresLimiter(tagged_dsn, schema=schema, name="claude", max_concurrent=2)
    limiters.append(limiter)
    await limiter.start()
    command = [sys.executable, "-m", "slotwise", "status", "--dsn", tagged_dsn]
    command += ["--schema", schema, "--json", "--watch", "0.1"]

    def watch() -> tuple[list[bytes], int, bytes]:
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
            assert process.stdout is not None
            assert process.stderr is not None
            lines = [process.stdout.readline(), process.stdout.readline()]
            process.stdout.close()  # as `| head -2` does
            code = process.wait(timeout=30)
            return lines, code, process.stderr.read()

    lines, code, errors = await anyio.to_thread.run_sync(watch)
    assert (code, errors) == (0, b"")  # no BrokenPipeError traceback
    first, second = (json.loads(line) for line in lines)
    assert first["limiters"]["claude"]["active"] == 0
    assert second["database_time"] > first["database_time"]
