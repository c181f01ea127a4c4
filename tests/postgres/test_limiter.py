"""PostgresLimiter in one process: the protocol, limits, queueing, configuration, failures.

PostgresLimiter is asyncio-only, so these tests run on asyncio (the conftest overrides
``anyio_backend``), except one that checks the clear failure under trio.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import subprocess
import sys
import time
import uuid
from typing import Any

import anyio
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import slotwise
import slotwise.httpx
from slotwise import AcquireRequest, Workload
from slotwise.postgres import PostgresLimiter, schema_sql

pytestmark = pytest.mark.anyio


async def queued(limiter: PostgresLimiter[Any], count: int) -> bool:
    return (await limiter.stats()).queued >= count


def request(workload: str = "default", deadline: float | None = None) -> AcquireRequest:
    return AcquireRequest(workload=workload, request_id="test", deadline=deadline)


async def test_acquire_renew_release(make: Any) -> None:
    limiter = make(max_concurrent=2)
    lease = await limiter.acquire(request())
    assert (await limiter.stats()).active == 1
    renewed = await limiter.renew(lease)
    assert renewed is not None
    assert renewed.lease_id == lease.lease_id
    assert renewed.expires_at >= lease.expires_at
    await limiter.release(lease)
    await limiter.release(lease)  # idempotent
    assert await limiter.renew(lease) is None
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)
    assert stats.workloads["default"].max_concurrent == 2


async def test_lease_ids_are_never_reused(make: Any) -> None:
    limiter = make(max_concurrent=1)
    seen = set()
    for _ in range(5):
        lease = await limiter.acquire(request())
        assert lease.lease_id not in seen
        seen.add(lease.lease_id)
        await limiter.release(lease)


async def test_unrenewed_lease_expires_and_goes_to_a_waiter(make: Any) -> None:
    limiter = make(max_concurrent=1, lease_ttl=0.5)
    first = await limiter.acquire(request())  # never renewed: no slot() around it
    second = await limiter.acquire(request())  # waits until the first expires
    assert await limiter.renew(first) is None
    assert await limiter.renew(second) is not None
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (1, 0)
    await limiter.release(second)


async def test_slots_never_exceed_the_limits_under_cancellation(make: Any) -> None:
    limiter = make(
        max_concurrent=3,
        workloads={
            "interactive": Workload(reserved=1, priority=10),
            "background": Workload(max_concurrent=2),
        },
    )
    active = {"interactive": 0, "background": 0}
    peak = {"interactive": 0, "background": 0, "total": 0}
    rng = random.Random(1)

    async def one(workload: str) -> None:
        with anyio.move_on_after(rng.uniform(0, 0.2) if rng.random() < 0.3 else None):
            async with limiter.slot(workload):
                active[workload] += 1
                try:
                    peak[workload] = max(peak[workload], active[workload])
                    peak["total"] = max(peak["total"], sum(active.values()))
                    await anyio.sleep(rng.uniform(0, 0.02))
                finally:  # a body cancelled by move_on_after leaves too
                    active[workload] -= 1

    async with anyio.create_task_group() as tg:
        for _ in range(60):
            tg.start_soon(one, rng.choice(["interactive", "background"]))
    assert peak["total"] <= 3
    assert peak["background"] <= 2
    assert peak["total"] >= 2  # the test did exercise concurrency
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)


async def test_queue_full(make: Any, eventually: Any) -> None:
    limiter = make(max_concurrent=1, max_queued=1)
    held = await limiter.acquire(request())
    async with anyio.create_task_group() as tg:
        tg.start_soon(limiter.acquire, request())
        await eventually(lambda: queued(limiter, 1))
        with pytest.raises(slotwise.ConcurrencyQueueFullError):
            async with limiter.slot():
                pytest.fail("the body must not run")
        assert (await limiter.stats()).queued == 1
        await limiter.release(held)
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (1, 0)


@pytest.mark.parametrize("max_wait", [0.0, 0.2])
async def test_max_wait(make: Any, max_wait: float) -> None:
    limiter = make(max_concurrent=1, workloads={"default": Workload(max_wait=max_wait)})
    held = await limiter.acquire(request())
    with pytest.raises(slotwise.ConcurrencyTimeoutError):
        async with limiter.slot():
            pytest.fail("the body must not run")
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (1, 0)
    await limiter.release(held)


async def test_run_budget_ends_the_wait(make: Any) -> None:
    limiter = make(max_concurrent=1)
    held = await limiter.acquire(request())
    with pytest.raises(slotwise.ConcurrencyTimeoutError):
        async with slotwise.run(limiter=limiter, timeout=0.2), slotwise.slot():
            pytest.fail("the body must not run")
    assert (await limiter.stats()).queued == 0
    await limiter.release(held)


async def test_cancelled_waiters_leave_the_queue_and_leak_nothing(make: Any) -> None:
    limiter = make(max_concurrent=2)
    rng = random.Random(7)

    async def one() -> None:
        with anyio.move_on_after(rng.uniform(0, 0.1)):
            async with limiter.slot():
                await anyio.sleep(rng.uniform(0, 0.03))

    async with anyio.create_task_group() as tg:
        for _ in range(40):
            tg.start_soon(one)
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)


async def test_reservations_and_ceilings_across_two_limiter_objects(make: Any) -> None:
    limits: dict[str, Any] = {
        "max_concurrent": 3,
        "workloads": {
            "interactive": Workload(reserved=1, priority=10),
            "background": Workload(max_concurrent=2, max_wait=0.2),
        },
    }
    a, b = make(**limits), make(**limits)
    held = [await a.acquire(request("background")) for _ in range(2)]
    # b's background waits at the ceiling; the reserved slot still goes to interactive.
    with pytest.raises(slotwise.ConcurrencyTimeoutError):
        async with b.slot("background"):
            pytest.fail("the background ceiling is reached")
    interactive = await b.acquire(request("interactive"))
    stats = await a.stats()
    assert stats.workloads["background"].active == 2
    assert stats.workloads["interactive"].active == 1
    for lease in held:
        await a.release(lease)
    await b.release(interactive)


async def test_priority_and_hand_off_across_two_limiter_objects(make: Any, eventually: Any) -> None:
    limits: dict[str, Any] = {
        "max_concurrent": 1,
        "workloads": {"high": Workload(priority=10), "low": Workload()},
    }
    a, b = make(**limits), make(**limits)
    held = await a.acquire(request("low"))
    order: list[str] = []

    async def wait(limiter: PostgresLimiter[Any], workload: str) -> None:
        async with limiter.slot(workload):
            order.append(workload)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, a, "low")
        await eventually(lambda: queued(a, 1))
        tg.start_soon(wait, b, "high")
        await eventually(lambda: queued(a, 2))
        await a.release(held)
    assert order == ["high", "low"]


async def test_mismatched_limits_fail_and_replace_overwrites(make: Any) -> None:
    first = make(max_concurrent=2)
    await first.start()
    other = make(max_concurrent=3)
    with pytest.raises(slotwise.ConcurrencyConfigError, match="different limits"):
        async with other.slot():
            pytest.fail("the body must not run")
    replacing = make(max_concurrent=3, on_conflict="replace")
    async with replacing.slot():
        pass
    # The first process's limits are now stale: it refuses to allocate with them.
    with pytest.raises(slotwise.ConcurrencyConfigError, match="changed by another process"):
        async with first.slot():
            pytest.fail("the body must not run")


async def test_schema_sql_and_ensure_schema_false(dsn: str, make: Any, schema: str) -> None:
    odd = schema + ' "odd" name'
    try:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(schema_sql(odd).encode())
        limiter = make(max_concurrent=1, schema=odd, ensure_schema=False)
        async with limiter.slot():
            assert (await limiter.stats()).active == 1
    finally:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(
                psycopg.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    psycopg.sql.Identifier(odd)
                )
            )


async def test_a_worker_that_waited_for_the_schema_lock_leaves_the_tables_alone(
    dsn: str, make: Any, schema: str
) -> None:
    # Workers starting together on a fresh database: this one finds no tables and waits for
    # the schema lock while another creates them and starts allocating (its transaction
    # holds the leases table). Run again, the DDL's ALTER TABLE would wait for that
    # transaction (a deadlock once the other waits for this worker in turn); the worker must
    # find the tables current and start without touching them.
    async with (
        await psycopg.AsyncConnection.connect(dsn) as creator,
        await psycopg.AsyncConnection.connect(dsn) as user,
    ):
        await creator.execute(
            "SELECT pg_advisory_xact_lock(hashtext('slotwise schema'), hashtext(%s))", [schema]
        )
        limiter = make(max_concurrent=1, db_timeout=2.0)
        done = anyio.Event()

        async def start() -> None:
            await limiter.start()
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(start)
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as probe:
                for _ in range(200):
                    cur = await probe.execute(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                    )
                    if (await cur.fetchone()) == (1,):
                        break
                    await anyio.sleep(0.02)
                else:
                    pytest.fail("the worker never waited for the schema lock")
            await creator.execute(schema_sql(schema).encode())
            await creator.commit()
            await user.execute(
                psycopg.sql.SQL("LOCK TABLE {}.leases IN ROW EXCLUSIVE MODE").format(
                    psycopg.sql.Identifier(schema)
                )
            )
            with anyio.fail_after(1.5):
                await done.wait()
            await user.rollback()
        async with limiter.slot():
            assert (await limiter.stats()).active == 1


async def test_missing_tables_fail_closed(make: Any) -> None:
    limiter = make(max_concurrent=1, ensure_schema=False)
    with pytest.raises(slotwise.ConcurrencyLimiterError) as info:
        async with limiter.slot():
            pytest.fail("the body must not run")
    assert isinstance(info.value.__cause__, psycopg.errors.UndefinedTable)


async def test_unreachable_database_fails_closed(make: Any) -> None:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        "postgresql://postgres@127.0.0.1:1/test", min_size=1, open=False, timeout=0.5
    )
    await pool.open(wait=False)
    try:
        limiter = make(conninfo=pool, max_concurrent=1)
        with pytest.raises(slotwise.ConcurrencyLimiterError):
            async with limiter.slot():
                pytest.fail("the body must not run")
    finally:
        await pool.close()


async def test_a_pool_passed_in_stays_open(tagged_dsn: str, schema: str) -> None:
    async with AsyncConnectionPool(
        tagged_dsn, min_size=1, max_size=2, kwargs={"autocommit": True}
    ) as pool:
        limiter: PostgresLimiter[Any] = PostgresLimiter(pool, max_concurrent=1, schema=schema)
        async with limiter, limiter.slot():
            pass
        assert not pool.closed
        async with pool.connection() as conn:
            await conn.execute("SELECT 1")


async def test_connection_loss_recovers_without_over_grant(
    dsn: str, make: Any, schema: str
) -> None:
    limiter = make(max_concurrent=2)
    peak = active = 0
    errors: list[BaseException] = []

    async def one() -> None:
        nonlocal peak, active
        try:
            async with limiter.slot():
                active += 1
                try:
                    peak = max(peak, active)
                    await anyio.sleep(0.02)
                finally:
                    active -= 1
        except slotwise.ConcurrencyLimiterError as exc:
            errors.append(exc)

    async def terminate() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            for _ in range(3):
                await anyio.sleep(0.1)
                await conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = %s",
                    [schema],
                )

    async with anyio.create_task_group() as tg:
        tg.start_soon(terminate)
        for _ in range(30):
            tg.start_soon(one)
    assert peak <= 2
    for exc in errors:  # a failure is a clear limiter error caused by the database
        assert isinstance(exc.__cause__, psycopg.Error)
    # Afterwards the limiter works again, and nothing stayed held or queued.
    async with limiter.slot():
        pass
    stats = await limiter.stats()
    assert stats.queued == 0
    assert stats.active == 0


async def test_invalid_settings(dsn: str) -> None:
    with pytest.raises(slotwise.ConcurrencyConfigError, match="max_concurrent"):
        PostgresLimiter(dsn, max_concurrent=0)
    with pytest.raises(slotwise.ConcurrencyConfigError, match="poll_interval"):
        PostgresLimiter(dsn, max_concurrent=1, poll_interval=0)
    with pytest.raises(slotwise.ConcurrencyConfigError, match="on_conflict"):
        PostgresLimiter(dsn, max_concurrent=1, on_conflict="merge")  # type: ignore[arg-type]
    with pytest.raises(slotwise.ConcurrencyConfigError, match="first argument"):
        PostgresLimiter(42, max_concurrent=1)  # type: ignore[arg-type]


def test_built_outside_an_event_loop_and_protocol(dsn: str) -> None:
    limiter: PostgresLimiter[Any] = PostgresLimiter(dsn, name="claude", max_concurrent=8)
    assert isinstance(limiter, slotwise.Limiter)
    assert limiter.lease_ttl == 30.0
    assert limiter.queue_entry_ttl == 15.0
    assert "'claude'" in repr(limiter)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_trio_fails_at_once_with_a_clear_error(dsn: str) -> None:
    limiter: PostgresLimiter[Any] = PostgresLimiter(dsn, max_concurrent=1)
    with pytest.raises(slotwise.ConcurrencyConfigError, match="asyncio only"):
        async with limiter.slot():
            pytest.fail("the body must not run")


def test_import_slotwise_does_not_import_psycopg() -> None:
    code = "import sys, slotwise; assert 'psycopg' not in sys.modules, 'psycopg imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


async def test_a_limiter_starts_again_after_a_failed_start_and_after_aclose(
    make: Any,
) -> None:
    await make(max_concurrent=1).start()
    limiter = make(max_concurrent=2)
    with pytest.raises(slotwise.ConcurrencyConfigError):
        await limiter.start()
    assert limiter.pool.closed  # a failed start holds no connections
    replacing = make(max_concurrent=2, on_conflict="replace")
    async with replacing:
        pass
    async with limiter.slot():  # the same object, now that the stored limits agree
        pass
    await limiter.aclose()
    async with limiter.slot():
        pass


async def test_a_notification_delivers_a_grant_made_by_another_process(make: Any) -> None:
    # Polling every 30 s: a grant that arrives within the 10 s bound came by notification.
    limits: dict[str, Any] = {"max_concurrent": 1, "poll_interval": 30.0, "queue_entry_ttl": 120}
    a, b = make(**limits), make(**limits)
    held = await a.acquire(request())
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            with anyio.fail_after(10):
                lease = await b.acquire(request())
            await b.release(lease)

        tg.start_soon(wait)
        await eventually_queued(a)
        await a.release(held)  # grants b's request in this transaction; NOTIFY tells b
    stats = await a.stats()
    assert (stats.active, stats.queued) == (0, 0)


async def eventually_queued(limiter: PostgresLimiter[Any]) -> None:
    with anyio.fail_after(20):
        for _ in range(10_000):
            if await queued(limiter, 1):
                return
            await anyio.sleep(0.01)


# -- the database slow, blocked or gone ----------------------------------------------------


def causes(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None:
        chain.append(current)
        current = current.__cause__
    return chain


async def test_a_refused_database_fails_closed_within_db_timeout(schema: str) -> None:
    # Port 1 refuses at once: the request fails within a bound set by db_timeout (it used
    # to retry a 30 s pool timeout five times), naming the refusal.
    limiter: PostgresLimiter[Any] = PostgresLimiter(
        "postgresql://postgres@127.0.0.1:1/test?connect_timeout=2",
        schema=schema,
        max_concurrent=1,
        db_timeout=1.0,
    )
    try:
        with anyio.fail_after(15), pytest.raises(slotwise.ConcurrencyLimiterError) as info:
            async with limiter.slot():
                pytest.fail("the body must not run")
        chain = causes(info.value)
        assert any(isinstance(exc, psycopg.OperationalError) for exc in chain[1:]), chain
        assert "refused" in str(info.value).lower() or "failed" in str(info.value).lower()
    finally:
        await limiter.aclose()


async def test_an_exhausted_pool_fails_closed_within_db_timeout(make: Any, tagged_dsn: str) -> None:
    # Every connection of the caller's pool is held elsewhere: waiting for one is bounded by
    # db_timeout, not by the pool's own timeout (here 10 s) times the retries.
    async with AsyncConnectionPool(
        tagged_dsn, min_size=1, max_size=1, timeout=10, kwargs={"autocommit": True}
    ) as pool:
        limiter = make(conninfo=pool, max_concurrent=1, db_timeout=0.5)
        await limiter.start()
        async with pool.connection():  # the pool's only connection, held
            with anyio.fail_after(8), pytest.raises(slotwise.ConcurrencyLimiterError) as info:
                async with limiter.slot():
                    pytest.fail("the body must not run")
        assert "no free connection in the pool" in str(info.value)
        async with limiter.slot():  # and it works again once a connection is free
            pass


async def test_a_stalled_lock_holder_bounds_release_and_acquire_keeps_its_deadline(
    make: Any, dsn: str, schema: str
) -> None:
    # Another process stalled while it held the limiter's row lock: a request with a 0.5 s
    # deadline ends at it, and a release gives up after db_timeout (the lease expires by
    # itself), instead of both waiting for the stall to end.
    limiter = make(max_concurrent=1, db_timeout=1.0)
    held = await limiter.acquire(request())
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
        await conn.execute(f'SELECT 1 FROM "{schema}".limiters FOR UPDATE'.encode())
        started = anyio.current_time()
        with anyio.fail_after(4), pytest.raises(slotwise.ConcurrencyTimeoutError):
            await limiter.acquire(request(deadline=started + 0.5))
        with anyio.fail_after(6), pytest.raises(psycopg.OperationalError):
            await limiter.release(held)
    await limiter.release(held)
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)


async def test_cancelled_waits_print_no_warnings_and_normal_use_logs_nothing(
    make: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    caplog.set_level(logging.DEBUG, logger="slotwise")
    limiter = make(max_concurrent=2)
    rng = random.Random(3)

    async def one() -> None:
        with anyio.move_on_after(rng.uniform(0, 0.05)):
            async with limiter.slot():
                await anyio.sleep(rng.uniform(0, 0.02))

    async with anyio.create_task_group() as tg:
        for _ in range(60):
            tg.start_soon(one)
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)
    await limiter.aclose()
    assert [record.getMessage() for record in caplog.records] == []


# -- the database's limits on what it is given ---------------------------------------------


async def test_a_long_multibyte_grant_list_never_fails_an_allocation(
    make: Any, eventually: Any
) -> None:
    # One cycle grants 35 slots to another process's requests of a workload whose name is
    # 60 Japanese characters (180 bytes): the notification must not fail the allocation.
    workload = "日本語のワークロード" * 6
    limits: dict[str, Any] = {
        "max_concurrent": 35,
        "workloads": {workload: Workload()},
        "queue_entry_ttl": 120,
    }
    holder = make(**limits, lease_ttl=1.0)
    waiting = make(**limits, poll_interval=30.0)  # grants reach it by notification only
    releaser = make(**limits)
    for _ in range(35):
        await holder.acquire(request(workload))  # never renewed: they expire together
    got: list[Any] = []

    async def wait() -> None:
        got.append(await waiting.acquire(request(workload)))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for _ in range(35):
                tg.start_soon(wait)
            await eventually(lambda: queued(releaser, 35))
            await anyio.sleep(1.2)  # the holder's leases expire
            # One cycle of another process grants all 35 (and notifies the waiting one).
            await releaser.release(
                slotwise.Lease(lease_id=str(uuid.uuid4()), workload=workload, expires_at=0.0)
            )
    assert len(got) == 35
    assert (await releaser.stats()).active == 35


async def test_huge_ttls_are_refused_and_huge_waits_wait(make: Any, eventually: Any) -> None:
    for setting in ("lease_ttl", "queue_entry_ttl"):
        with pytest.raises(slotwise.ConcurrencyConfigError, match=setting):
            make(max_concurrent=1, **{setting: 1e13})
    limiter = make(max_concurrent=1, workloads={"default": Workload(max_wait=1e13)})
    held = await limiter.acquire(request())
    far = anyio.current_time() + 1e13
    with anyio.move_on_after(1) as waited:  # it waits, instead of failing
        await limiter.acquire(request(deadline=far))
    assert waited.cancelled_caught
    got: list[Any] = []

    async def wait() -> None:
        got.append(await limiter.acquire(request(deadline=far)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await eventually(lambda: queued(limiter, 1))
        await limiter.release(held)
    assert len(got) == 1
    await limiter.release(got[0])


# -- limits replaced while leases are held --------------------------------------------------


async def test_replaced_limits_count_every_held_lease_and_old_holders_release(
    make: Any,
) -> None:
    old = make(max_concurrent=4, workloads={"old": Workload()})
    held = [await old.acquire(request("old")) for _ in range(4)]
    new = make(max_concurrent=2, workloads={"new": Workload(max_wait=0.3)}, on_conflict="replace")
    # The 4 old leases still run: nothing is granted under max_concurrent=2.
    with pytest.raises(slotwise.ConcurrencyTimeoutError):
        async with new.slot("new"):
            pytest.fail("4 leases are held: no slot of 2 is free")
    for lease in held[:3]:
        await old.release(lease)  # the old holder can still release under the new limits
    async with new.slot("new"):  # one old lease is left: one slot is free, not two
        with pytest.raises(slotwise.ConcurrencyTimeoutError):
            async with new.slot("new", allow_nested=True):
                pytest.fail("an old lease and this slot hold both slots")
    await old.release(held[3])
    async with new.slot("new"), new.slot("new", allow_nested=True):
        assert (await new.stats()).active == 2


# -- the listener ---------------------------------------------------------------------------


async def listener_pid(dsn: str, schema: str) -> int | None:
    """The backend of a limiter's listening connection (tagged with the schema's name)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
            "AND query LIKE 'LISTEN%%' AND state = 'idle'",
            [schema],
        )
        row = await cur.fetchone()
    return None if row is None else int(row[0])


async def test_a_forged_notification_grants_nothing(
    make: Any, dsn: str, schema: str, eventually: Any
) -> None:
    # Any role may NOTIFY on the channel: a payload that claims a grant for a waiting
    # entry (its owner and entry id are readable in the queue table) must not be believed.
    limits: dict[str, Any] = {"max_concurrent": 1, "poll_interval": 30.0, "queue_entry_ttl": 120}
    a, b = make(**limits), make(**limits)
    held = await a.acquire(request())
    got: list[Any] = []

    async def wait() -> None:
        got.append(await b.acquire(request()))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await eventually(lambda: queued(a, 1))

            async def listening() -> bool:
                return await listener_pid(dsn, schema) is not None

            await eventually(listening)
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                cur = await conn.execute(
                    f'SELECT owner::text, entry_id::text FROM "{schema}".queue'.encode()
                )
                owner, entry_id = await cur.fetchone()  # type: ignore[misc]
                forged = str(uuid.uuid4())
                for payload in (
                    {"g": [[owner, entry_id, forged, "default", 4e9]]},
                    {"k": [owner]},
                    {"k": "*"},
                    "not json",
                ):
                    await conn.execute(
                        "SELECT pg_notify(%s, %s)", [f"slotwise.{schema}", json.dumps(payload)]
                    )
            await anyio.sleep(0.5)
            assert got == [], "a forged notification was taken for a grant"
            assert (await a.stats()).active == 1
            await a.release(held)  # a true grant, told by a true notification
    assert len(got) == 1
    assert got[0].lease_id != forged
    assert await b.renew(got[0]) is not None
    await b.release(got[0])


async def test_the_listening_connection_has_tcp_keepalive(
    make: Any, dsn: str, schema: str, eventually: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[Any] = []
    connect = psycopg.AsyncConnection.connect

    async def recording(*args: Any, **kwargs: Any) -> Any:
        conn = await connect(*args, **kwargs)
        made.append(conn)
        return conn

    monkeypatch.setattr(psycopg.AsyncConnection, "connect", recording)
    limiter = make(max_concurrent=1)
    held = await limiter.acquire(request())
    async with anyio.create_task_group() as tg:
        tg.start_soon(limiter.acquire, request())

        async def listening() -> bool:
            return await listener_pid(dsn, schema) is not None

        await eventually(listening)
        pid = await listener_pid(dsn, schema)
        (conn,) = [c for c in made if not c.closed and c.info.backend_pid == pid]
        params = conn.info.get_parameters()
        assert params.get("keepalives") == "1", params
        assert "keepalives_idle" in params
        await limiter.release(held)


# -- threads, event loops and sync code -----------------------------------------------------


async def test_sync_code_is_refused_with_what_to_do(make: Any) -> None:
    limiter = make(max_concurrent=1)

    def in_a_thread() -> None:
        with slotwise.sync_slot(limiter=limiter):
            pytest.fail("the body must not run")

    with pytest.raises(slotwise.ConcurrencyConfigError) as info:
        await anyio.to_thread.run_sync(in_a_thread)
    assert "async with limiter.slot()" in str(info.value)
    assert "its own PostgresLimiter with the same name" in str(info.value)
    # The same advice when a sync HTTP client is given one.
    with pytest.raises(slotwise.ConcurrencyConfigError) as info:
        slotwise.httpx.sync_client(limiter=limiter)
    assert "cannot limit a sync client" in str(info.value)
    assert "its own PostgresLimiter with the same name" in str(info.value)


async def test_a_second_event_loop_is_refused_at_once(make: Any, eventually: Any) -> None:
    # Busy on this loop (a slot held, a request waiting), the limiter is used from an event
    # loop of another thread: a clear error at once, where that request used to wait forever
    # (its grant would have been handed over on this loop).
    limiter = make(max_concurrent=1)
    held = await limiter.acquire(request())

    async def elsewhere() -> None:
        async with limiter.slot():
            pytest.fail("the body must not run")

    def other_loop() -> None:
        asyncio.run(asyncio.wait_for(elsewhere(), 10))

    async with anyio.create_task_group() as tg:
        tg.start_soon(limiter.acquire, request())
        await eventually(lambda: queued(limiter, 1))
        with pytest.raises(slotwise.ConcurrencyConfigError, match="another event loop"):
            await anyio.to_thread.run_sync(other_loop)
        await limiter.release(held)


def test_one_event_loop_after_another(tagged_dsn: str, schema: str) -> None:
    # asyncio.run() twice in a script, without aclose() in between: the second loop starts
    # the limiter anew (the first one's tasks ended with it).
    limiter: PostgresLimiter[Any] = PostgresLimiter(tagged_dsn, schema=schema, max_concurrent=1)

    async def use() -> int:
        async with limiter.slot():
            return (await limiter.stats()).active

    assert asyncio.run(use()) == 1
    assert asyncio.run(use()) == 1

    async def close() -> None:
        await limiter.aclose()

    asyncio.run(close())


# A script whose event loop ends, without aclose(), while the limiter's pool is still opening a
# connection: the first connection is made at once and serves the slot; every later one (the
# pool grows when the first transaction finds it empty) takes 30 s.
_ENDS_WHILE_CONNECTING = """
import asyncio, sys
import psycopg
from slotwise.postgres import PostgresLimiter

connect = psycopg.AsyncConnection.connect.__func__
begun = 0

async def slow_after_the_first(cls, *args, **kwargs):
    global begun
    begun += 1
    if begun > 1:
        await asyncio.sleep(30)
    return await connect(cls, *args, **kwargs)

psycopg.AsyncConnection.connect = classmethod(slow_after_the_first)
limiter = PostgresLimiter(sys.argv[1], name="claude", schema=sys.argv[2], max_concurrent=1)

async def hold():
    async with limiter.slot():
        await asyncio.sleep(3600)

async def use():
    async with limiter.slot():
        pass
    if sys.argv[3] == "hold":  # a task still holds a slot when the loop ends
        asyncio.get_running_loop().create_task(hold())
        while not (await limiter.stats()).active:
            await asyncio.sleep(0.01)
    print("connections begun:", begun, flush=True)

asyncio.run(use())
print("asyncio.run() returned", flush=True)
"""


def _end_while_connecting(dsn: str, schema: str, mode: str) -> None:
    script = subprocess.run(
        [sys.executable, "-c", _ENDS_WHILE_CONNECTING, dsn, schema, mode],
        capture_output=True,
        text=True,
        timeout=25,  # less than the slow connection: a hang fails here
    )
    assert script.returncode == 0, script.stderr
    lines = script.stdout.splitlines()
    begun = int(lines[0].rpartition(" ")[2])
    assert begun >= 2, script.stdout  # the pool did grow: the case the test is about
    assert lines[-1] == "asyncio.run() returned"
    assert "failed" not in script.stderr, script.stderr  # a release that did not go through


def test_an_event_loop_ends_while_the_pool_opens_a_connection(tagged_dsn: str, schema: str) -> None:
    # psycopg_pool swallows the cancellation of a pool worker that is opening a connection
    # (it catches CancelledError there): when asyncio.run() cancelled the tasks left at its
    # end, that worker went back to wait for work and asyncio.run() never returned. The
    # limiter now closes its own pool when its loop ends, which stops every worker.
    _end_while_connecting(tagged_dsn, schema, "return")


async def test_a_slot_held_when_the_event_loop_ends_is_released(
    tagged_dsn: str, schema: str, make: Any
) -> None:
    # The task holding it is cancelled with the loop: its release goes through the pool,
    # which the limiter closes only once the other tasks have ended.
    await anyio.to_thread.run_sync(_end_while_connecting, tagged_dsn, schema, "hold")
    other = make(max_concurrent=1)
    assert (await other.stats()).active == 0
    with anyio.fail_after(5):  # not after the lease's 30 s
        async with other.slot():
            pass


def test_two_limiters_end_with_their_event_loop(tagged_dsn: str, schema: str) -> None:
    # Each limiter's pool guard waits for the tasks cancelled with it, not for the other
    # limiter's guard, which waits for its own in turn: asyncio.run() returns at once, not
    # when their patience (3 x db_timeout: 30 s here) runs out.
    limiters = [
        PostgresLimiter(tagged_dsn, name=name, schema=schema, max_concurrent=1, db_timeout=10)
        for name in ("first", "second")
    ]

    async def use() -> None:
        for limiter in limiters:
            async with limiter.slot():
                pass

    began = time.monotonic()
    asyncio.run(use())
    assert time.monotonic() - began < 15
    assert all(limiter.pool.closed for limiter in limiters)


async def test_aclose_with_requests_waiting_leaves_nothing_running(make: Any) -> None:
    limiter = make(max_concurrent=1)
    held = await limiter.acquire(request())
    errors: list[BaseException] = []

    async def wait() -> None:
        try:
            await limiter.acquire(request())
        except slotwise.ConcurrencyLimiterError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(wait)
        await eventually_queued(limiter)
        await limiter.aclose()
    assert len(errors) == 3
    # Nothing of the limiter runs on after aclose(): no poller, no listener, no transaction.
    await anyio.sleep(0.2)
    names = {task.get_coro().__qualname__ for task in asyncio.all_tasks()}  # type: ignore[union-attr]
    assert not any(
        name.startswith("PostgresLimiter.") or name == "_close_at_loop_end" for name in names
    ), names
    # The closed requests left the queue with it: the slot freed next is not lost to one.
    assert (await limiter.stats()).queued == 0
    await limiter.release(held)
    with anyio.fail_after(10):
        async with limiter.slot():
            pass
