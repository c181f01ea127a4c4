"""PostgresLimiter under load: database transactions, grant latency, throughput.

    python benchmarks/postgres_load.py [--dsn postgresql://postgres@127.0.0.1:5432/test]

Runs in a database of its own (``slotwise_bench``, created if missing) so that the server's
transaction counters count this benchmark alone. Four measurements, the first three against the
reference design in the same run (``polling``: every waiting request runs its own allocation
transaction every ``poll_interval``, no notifications):

1. idle queue: 200 waiting requests in 4 processes, every slot held, poll_interval 100 ms:
   committed transactions per second, and CPU (clients and server backends, in cores);
2. grant latency after a release: two processes hand one slot back and forth; the time
   from the start of ``release()`` in one to ``acquire()`` returning in the other; beside
   it the floor of such a hand-off on this server (``floor``: raw psycopg, the same round
   trips, nothing else; ``floor-1rt``: the release in one round trip);
3. throughput: 4 processes x 50 tasks take and release slots of an 8-slot limiter as fast
   as they can, with durable and with asynchronous commits;
4. the steps of a hand-off: the median time of each, from ``release()`` in one process to
   ``acquire()`` returning in the other (the release's round, the notification, the read
   of the grant), to say which bounds the latency.

Beside them, the ceiling of the server for the kind of transaction every allocation is:
``pgbench`` (from ``pg_config --bindir``), 4 clients for 5 s, each transaction locking one row
of a one-row table of the benchmark's own (``SELECT ... FOR UPDATE``), updating it and
committing, durable and asynchronous. A limiter's allocations serialise on its row lock the
same way, so its transactions per second cannot exceed that figure; its grants per second can,
by granting several slots per transaction.

``--only idle|latency|steps|throughput|pgbench`` (repeatable) runs some sections alone.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from functools import partial
from typing import Any

import anyio
import psycopg

from slotwise import AcquireRequest
from slotwise.postgres import PostgresLimiter

BENCH_DB = "slotwise_bench"


# -- the reference design: one allocation transaction per waiter per poll ------------------


async def polling_acquire(limiter: PostgresLimiter[Any], request: AcquireRequest) -> Any:
    """Acquire as the reference implementation does: each waiter polls on its own."""
    from slotwise.postgres._round import Waiter

    waiter = Waiter(request.workload, "r", 3600.0)
    entry_id = waiter.entry_id
    cycle = await limiter._run(partial(limiter._cycle, enqueue=[waiter], asked=[entry_id]))
    beat = anyio.current_time()
    while entry_id not in cycle.granted:
        await anyio.sleep(limiter.poll_interval)
        heartbeat = anyio.current_time() - beat > limiter.queue_entry_ttl / 3
        if heartbeat:
            beat = anyio.current_time()
        cycle = await limiter._run(
            partial(limiter._cycle, asked=[entry_id], heartbeat=heartbeat, alive=True)
        )
    return cycle.granted[entry_id]


# -- worker processes ---------------------------------------------------------------------


def limiter_for(spec: dict[str, Any]) -> PostgresLimiter[Any]:
    return PostgresLimiter(
        spec["dsn"],
        name=spec["name"],
        schema="bench",
        max_concurrent=spec["max_concurrent"],
        poll_interval=spec.get("poll_interval", 0.1),
        listen=spec["design"] == "notify",
        synchronous_commit=spec.get("synchronous_commit", True),
    )


async def acquire(limiter: PostgresLimiter[Any], design: str) -> Any:
    request = AcquireRequest(workload="default", request_id="r")
    if design == "polling":
        return await polling_acquire(limiter, request)
    return await limiter.acquire(request)


async def worker_wait(spec: dict[str, Any]) -> None:
    """Queue ``waiters`` requests that never get a slot, for ``seconds``."""
    async with limiter_for(spec) as limiter:
        with anyio.move_on_after(spec["seconds"]):
            async with anyio.create_task_group() as tg:
                for _ in range(spec["waiters"]):
                    tg.start_soon(acquire, limiter, spec["design"])
    print(json.dumps({}))


def timed_steps(log: list[tuple[str, float]]) -> None:
    """In this worker process: log when PostgresLimiter's transactions start and end
    (``tx``; ``rd`` for the lock-free read of a grant) and when a notification arrives
    (``note``)."""
    cls: Any = PostgresLimiter
    transaction, notified = cls._transaction, cls._notified
    cycle, check_lock = cls._cycle, cls._check_lock

    async def timed(
        self: Any, body: Any, retry: bool, read: bool = False, ddl: bool = False
    ) -> Any:
        kind = "rd" if read else "tx"
        log.append((f"{kind}0", time.time()))
        try:
            return await transaction(self, body, retry, read, ddl)
        finally:
            log.append((f"{kind}1", time.time()))

    def note(self: Any, payload: str) -> None:
        log.append(("note", time.time()))
        notified(self, payload)

    async def allocation(self: Any, conn: Any, **kwargs: Any) -> Any:
        try:
            return await cycle(self, conn, **kwargs)
        finally:
            log.append(("decided", time.time()))  # the round's statements sent, not synced

    def locked(self: Any, row: Any) -> None:
        log.append(("locked", time.time()))  # the first round trip's answer is here
        check_lock(self, row)

    cls._transaction, cls._notified, cls._cycle, cls._check_lock = timed, note, allocation, locked


async def worker_pingpong(spec: dict[str, Any]) -> None:
    """Take the single slot, hold it briefly, release it; log release and grant times (and,
    with ``steps``, the times of each step in between: see timed_steps)."""
    log: list[tuple[str, float]] = []
    if spec.get("steps"):
        timed_steps(log)
    async with limiter_for(spec) as limiter:
        for _ in range(spec["rounds"]):
            lease = await acquire(limiter, spec["design"])
            log.append(("got", time.time()))
            await anyio.sleep(0.01)  # long enough for the other process to queue
            log.append(("rel", time.time()))
            await limiter.release(lease)
            await anyio.sleep(0.002)
    print(json.dumps(log))


async def worker_throughput(spec: dict[str, Any]) -> None:
    """Take and release slots as fast as possible for ``seconds``; print the count."""
    count = 0
    async with limiter_for(spec) as limiter:
        deadline = anyio.current_time() + spec["seconds"]

        async def loop() -> None:
            nonlocal count
            while anyio.current_time() < deadline:
                lease = await acquire(limiter, spec["design"])
                count += 1
                await limiter.release(lease)

        async with anyio.create_task_group() as tg:
            for _ in range(spec["tasks"]):
                tg.start_soon(loop)
    print(json.dumps(count))


FLOOR_TABLE = "slotwise_pgbench.token"
FLOOR_CHANNEL = "slotwise_floor"


async def worker_floor(spec: dict[str, Any]) -> None:
    """``pingpong`` without slotwise: the least a hand-off through the server takes with the
    same round trips as a PostgresLimiter's, from the same kind of client (psycopg, asyncio).

    The slot is one row naming its holder. The release is one transaction of two round trips,
    as a limiter's round: the lock (``BEGIN`` and ``SELECT ... FOR UPDATE``, pipelined), then
    the hand-over, its ``NOTIFY`` and ``COMMIT`` (pipelined). The other process, woken by the
    notification on a connection that listens, reads the row (one statement in autocommit, as
    a limiter reads its grant) and holds the slot when it names it. Nothing else: no queue,
    no sweep, no decision, no lease, no task to wake. ``floor-1rt`` releases in one round trip
    (the update locks the row itself): the least a design deciding in the server could take."""
    me = spec["who"]
    log: list[tuple[str, float]] = []
    sync = [] if spec["synchronous_commit"] else ["SET LOCAL synchronous_commit = off"]
    listen = await psycopg.AsyncConnection.connect(spec["dsn"], autocommit=True)
    conn = await psycopg.AsyncConnection.connect(spec["dsn"], autocommit=True)
    async with listen, conn:
        await listen.execute(f"LISTEN {FLOOR_CHANNEL}")
        for _ in range(spec["rounds"]):
            while True:
                cur = await conn.execute(f"SELECT holder FROM {FLOOR_TABLE} WHERE id = 1")
                row = await cur.fetchone()
                if row is not None and row[0] == me:
                    break
                # Until a notification, or a poll interval (a notification missed).
                async for _ in listen.notifies(timeout=spec["poll_interval"], stop_after=1):
                    pass
            log.append(("got", time.time()))
            await anyio.sleep(0.01)  # long enough for the other process to wait
            log.append(("rel", time.time()))
            async with conn.pipeline():
                await conn.execute("BEGIN")
                for statement in sync:
                    await conn.execute(statement)
                if spec["design"] == "floor":
                    cur = await conn.execute(
                        f"SELECT holder FROM {FLOOR_TABLE} WHERE id = 1 FOR UPDATE"
                    )
                    await cur.fetchone()  # the first round trip: the lock
                await conn.execute(f"UPDATE {FLOOR_TABLE} SET holder = %s WHERE id = 1", [1 - me])
                await conn.execute(f"NOTIFY {FLOOR_CHANNEL}")
                await conn.execute("COMMIT")
            await anyio.sleep(0.002)
    print(json.dumps(log))


WORKERS = {
    "wait": worker_wait,
    "pingpong": worker_pingpong,
    "throughput": worker_throughput,
    "floor": worker_floor,
}


# -- the driver -----------------------------------------------------------------------------


def spawn(spec: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--worker", json.dumps(spec)], stdout=subprocess.PIPE, text=True
    )


def results(procs: list[subprocess.Popen[str]]) -> list[Any]:
    out = []
    for proc in procs:
        stdout, _ = proc.communicate()
        assert proc.returncode == 0, f"worker failed: {proc.returncode}"
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def commits(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            [BENCH_DB],
        ).fetchone()
        assert row is not None
        return int(row[0])


def backend_cpu(dsn: str) -> float:
    """CPU seconds used so far by the server processes serving the benchmark database."""
    total = 0.0
    with psycopg.connect(dsn, autocommit=True) as conn:
        pids = [
            r[0]
            for r in conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", [BENCH_DB])
        ]
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def prepare(admin_dsn: str) -> str:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [BENCH_DB]).fetchone():
            pass
        else:
            conn.execute(f'CREATE DATABASE "{BENCH_DB}"')
    dsn = psycopg.conninfo.make_conninfo(admin_dsn, dbname=BENCH_DB)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute('DROP SCHEMA IF EXISTS "bench" CASCADE')
    return dsn


async def hold_all(dsn: str, name: str, slots: int) -> tuple[PostgresLimiter[Any], list[Any]]:
    holder: PostgresLimiter[Any] = PostgresLimiter(
        dsn, name=name, schema="bench", max_concurrent=slots, lease_ttl=600
    )
    await holder.start()
    leases = [
        await holder.acquire(AcquireRequest(workload="default", request_id="h"))
        for _ in range(slots)
    ]
    return holder, leases


async def idle_queue(
    dsn: str, design: str, durable: bool, seconds: float = 8.0
) -> dict[str, float]:
    name = f"idle-{design}-{durable}"
    holder, leases = await hold_all(dsn, name, 4)
    spec = {
        "kind": "wait",
        "dsn": dsn,
        "name": name,
        "max_concurrent": 4,
        "design": design,
        "waiters": 50,
        "synchronous_commit": durable,
        "seconds": seconds + 4,
        "poll_interval": 0.1,
    }
    usage0 = os.times()
    procs = [spawn(spec) for _ in range(4)]
    with anyio.fail_after(60):  # start-up and queueing: measure only the steady state
        for _ in itertools.count():
            if (await holder.stats()).queued >= 200:
                break
            await anyio.sleep(0.2)
    await anyio.sleep(0.5)
    c0, b0, t0 = commits(dsn), backend_cpu(dsn), time.monotonic()
    await anyio.sleep(seconds)
    c1, b1, t1 = commits(dsn), backend_cpu(dsn), time.monotonic()
    await anyio.to_thread.run_sync(results, procs)
    usage1 = os.times()
    for lease in leases:
        await holder.release(lease)
    await holder.aclose()
    client = (
        usage1.children_user
        + usage1.children_system
        - usage0.children_user
        - usage0.children_system
    )
    return {
        "transactions_per_s": (c1 - c0) / (t1 - t0),
        "server_cpu_cores": (b1 - b0) / (t1 - t0),
        # clients ran for about seconds + 4 s (start-up included): an upper bound
        "client_cpu_cores": client / (seconds + 4),
    }


async def two_workers(spec: dict[str, Any]) -> list[tuple[float, str, int]]:
    """Run two worker processes (``who`` 0 and 1) and merge their logs: (time, event, who),
    in time order."""
    logs = await anyio.to_thread.run_sync(results, [spawn({**spec, "who": who}) for who in (0, 1)])
    return sorted((t, kind, who) for who, log in enumerate(logs) for kind, t in log)


async def latency(dsn: str, design: str, durable: bool, rounds: int = 200) -> dict[str, float]:
    spec = {
        "kind": "floor" if design.startswith("floor") else "pingpong",
        "dsn": dsn,
        "name": f"latency-{design}-{durable}",
        "synchronous_commit": durable,
        "max_concurrent": 1,
        "design": design,
        "rounds": rounds,
        "poll_interval": 0.1,
    }
    if design.startswith("floor"):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA IF NOT EXISTS slotwise_pgbench")
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {FLOOR_TABLE} (id int PRIMARY KEY, holder int)"
            )
            conn.execute(
                f"INSERT INTO {FLOOR_TABLE} VALUES (1, 0) ON CONFLICT (id) DO UPDATE SET holder = 0"
            )
    events = await two_workers(spec)
    waits: list[float] = []
    last_release: tuple[float, int] | None = None
    for t, kind, who in events:
        if kind == "rel":
            last_release = (t, who)
        elif last_release is not None and last_release[1] != who:
            waits.append((t - last_release[0]) * 1000)
            last_release = None
    waits.sort()
    return {
        "handoffs": len(waits),
        "p50_ms": statistics.median(waits),
        "p99_ms": waits[min(len(waits) - 1, int(len(waits) * 0.99))],
    }


# The steps of a hand-off, in order: (what, from, to, in which process: 0 the releasing one).
STEPS = (
    ("release() to its round's start", "rel", "tx0", 0),
    ("round: connection, lock, sweep, load (first round trip)", "tx0", "locked", 0),
    ("round: the decision", "locked", "decided", 0),
    ("round: grant, notification, commit (second round trip)", "decided", "tx1", 0),
    ("the notification reaches the waiting process", "decided", "note", 1),
    ("its poller wakes for it", "note", "rd0", 1),
    ("its read of the grant (third round trip)", "rd0", "rd1", 1),
    ("acquire() returns", "rd1", "got", 1),
)


async def steps(dsn: str, durable: bool, rounds: int = 300) -> dict[str, float]:
    """The median of each step of a hand-off (``pingpong`` with timestamps in between): from
    ``release()`` in one process, its round's transaction (connection, lock, sweep, load,
    decision, grant, notification, commit), the notification's arrival in the other, its
    poller's read of the grant, and ``acquire()`` returning there."""
    spec = {
        "kind": "pingpong",
        "dsn": dsn,
        "name": f"steps-{durable}",
        "synchronous_commit": durable,
        "max_concurrent": 1,
        "design": "notify",
        "rounds": rounds,
        "poll_interval": 0.1,
        "steps": True,
    }
    events = await two_workers(spec)
    spans: dict[str, list[float]] = {label: [] for label, *_ in STEPS}
    spans["hand-off"] = []
    for i, (start, kind, who) in enumerate(events):
        if kind != "rel":
            continue
        # Each step's first event after its own start, in the process it happens in.
        at = {"rel": start}
        for _, first, last, side in STEPS:
            found = next(
                (
                    t
                    for t, k, w in events[i + 1 :]
                    if k == last and w == (who if side == 0 else 1 - who) and t >= at[first]
                ),
                None,
            )
            if found is None:
                break
            at[last] = found
        else:
            if at["got"] - start < 0.2:  # a hand-off, not the end of the run
                # The commit's answer and the notification race: the chain follows the
                # notification.
                for label, first, last, _ in STEPS:
                    spans[label].append((at[last] - at[first]) * 1000)
                spans["hand-off"].append((at["got"] - start) * 1000)
    return {f"{label}, p50 ms": statistics.median(v) for label, v in spans.items() if v} | {
        "handoffs": len(spans["hand-off"])
    }


async def throughput(dsn: str, design: str, durable: bool, seconds: float = 6.0) -> float:
    spec = {
        "kind": "throughput",
        "dsn": dsn,
        "name": f"tp-{design}-{durable}",
        "max_concurrent": 8,
        "design": design,
        "tasks": 50,
        "seconds": seconds,
        "synchronous_commit": durable,
        "poll_interval": 0.1,
    }
    procs = [spawn(spec) for _ in range(4)]
    counts = await anyio.to_thread.run_sync(results, procs)
    return float(sum(counts)) / seconds


# -- the server's ceiling: pgbench, one locked row -------------------------------------------

PGBENCH_SCRIPT = """\
BEGIN;
{sync}
SELECT n FROM slotwise_pgbench.one WHERE id = 1 FOR UPDATE;
UPDATE slotwise_pgbench.one SET n = n + 1 WHERE id = 1;
COMMIT;
"""


def pgbench_binary() -> str:
    found = shutil.which("pgbench")
    if found:
        return found
    bindir = subprocess.run(
        ["pg_config", "--bindir"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return os.path.join(bindir, "pgbench")


def pgbench_ceiling(dsn: str, durable: bool, seconds: int = 5) -> float:
    """Transactions per second of pgbench, 4 clients, each locking and updating one row of a
    one-row table (in a schema of the benchmark's own, in its database), then committing."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA IF NOT EXISTS slotwise_pgbench")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS slotwise_pgbench.one (id int PRIMARY KEY, n bigint)"
        )
        conn.execute("INSERT INTO slotwise_pgbench.one VALUES (1, 0) ON CONFLICT DO NOTHING")
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    sync = "" if durable else "SET LOCAL synchronous_commit = off;"
    script = os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"slotwise-pgbench-{os.getpid()}-{durable}.sql"
    )
    with open(script, "w") as f:
        f.write(PGBENCH_SCRIPT.format(sync=sync))
    try:
        args = [pgbench_binary(), "-n", "-c", "4", "-j", "2", "-T", str(seconds), "-f", script]
        for flag, key in (("-h", "host"), ("-p", "port"), ("-U", "user")):
            if info.get(key):
                args += [flag, str(info[key])]
        args.append(str(info.get("dbname", BENCH_DB)))
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(script)
    match = re.search(r"tps = ([0-9.]+)", out)
    assert match is not None, out
    return float(match.group(1))


SECTIONS = ("pgbench", "idle", "latency", "steps", "throughput")


async def main(admin_dsn: str, only: list[str]) -> None:
    dsn = prepare(admin_dsn)
    report: dict[str, Any] = {"cpu_count": os.cpu_count(), "load_before": os.getloadavg()}
    sections = only or SECTIONS

    def ceiling(when: str) -> None:
        if "pgbench" in sections:
            for durable in (True, False):
                key = f"pgbench_one_row_tps[durable={durable}]{when}"
                report[key] = pgbench_ceiling(dsn, durable)
                print(key, report[key], flush=True)

    ceiling("")
    if "idle" in sections:
        for durable in (True, False):
            for design in ("polling", "notify"):
                key = f"idle_queue[{design}, durable={durable}]"
                report[key] = await idle_queue(dsn, design, durable)
                print(key, report[key], flush=True)
    if "latency" in sections:
        for design, durable in (
            ("polling", True),
            ("notify", True),
            ("floor", True),
            ("floor-1rt", True),
            ("notify", False),
            ("floor", False),
            ("floor-1rt", False),
        ):
            key = f"latency[{design}, durable={durable}]"
            report[key] = await latency(dsn, design, durable)
            print(key, report[key], flush=True)
    if "steps" in sections:
        for durable in (True, False):
            key = f"latency_steps[notify, durable={durable}]"
            report[key] = await steps(dsn, durable)
            print(key, report[key], flush=True)
    if "throughput" in sections:
        for design in ("polling", "notify"):
            for durable in (True, False):
                key = f"grants_per_s[{design}, durable={durable}]"
                report[key] = await throughput(dsn, design, durable)
                print(key, report[key], flush=True)
    ceiling(" (after)")  # again at the end: the disk's flush time drifts
    for durable in (True, False):
        tps = [report.get(f"pgbench_one_row_tps[durable={durable}]{w}") for w in ("", " (after)")]
        grants = report.get(f"grants_per_s[notify, durable={durable}]")
        if grants and tps[0] and tps[1]:
            key = f"grants_per_s / pgbench_tps [durable={durable}]"
            report[key] = grants / statistics.mean(tps)
            print(key, round(report[key], 2), flush=True)
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--worker")
    parser.add_argument("--only", action="append", choices=SECTIONS, default=[])
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        asyncio.run(WORKERS[spec["kind"]](spec))
    else:
        asyncio.run(main(args.dsn, args.only))
