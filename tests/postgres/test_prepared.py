"""Prepared statements: a limiter whose pool reaches the server itself (``listen=True``)
plans the statements of its rounds once per connection; one that may go through PgBouncer
in transaction mode (``listen=False`` or a ``listen`` conninfo) prepares nothing; and a
server that loses them (PgBouncer with ``listen=True``) costs a retry, not a failure."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest
from psycopg_pool import AsyncConnectionPool

from slotwise import AcquireRequest
from slotwise.postgres import PostgresLimiter

pytestmark = pytest.mark.anyio


async def _one_round(limiter: PostgresLimiter[Any]) -> None:
    lease = await limiter.acquire(AcquireRequest(workload="default", request_id="r"))
    await limiter.release(lease)


async def _prepared(pool: AsyncConnectionPool[Any]) -> list[str]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT statement FROM pg_prepared_statements", prepare=False)
        return [row[0] for row in await cur.fetchall()]


@pytest.mark.parametrize("listen", [True, False])
async def test_statements_are_prepared_only_when_the_pool_reaches_the_server(
    tagged_dsn: str, schema: str, listen: bool
) -> None:
    async with (
        AsyncConnectionPool(
            tagged_dsn, min_size=1, max_size=1, open=False, kwargs={"autocommit": True}
        ) as pool,
        PostgresLimiter(
            pool, name="prep", schema=schema, max_concurrent=2, listen=listen
        ) as limiter,
    ):
        for _ in range(3):
            await _one_round(limiter)
        statements = await _prepared(pool)
    if listen:
        assert any("FOR UPDATE" in s for s in statements), statements
    else:
        assert statements == []


async def test_the_rounds_prepared_statements_run_on_generic_plans(
    tagged_dsn: str, schema: str
) -> None:
    """Left to choose (plan_cache_mode=auto), the server plans the sweep and the load again
    at every execution, while the limiter's row lock is held: the rounds ask for generic
    plans (planned once per connection) instead."""
    async with (
        AsyncConnectionPool(
            tagged_dsn, min_size=1, max_size=1, open=False, kwargs={"autocommit": True}
        ) as pool,
        PostgresLimiter(pool, name="plans", schema=schema, max_concurrent=2) as limiter,
    ):
        async with pool.connection() as conn:
            if conn.info.server_version < 140000:
                pytest.skip("pg_prepared_statements counts the plans from PostgreSQL 14 on")
        for _ in range(8):
            await _one_round(limiter)
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements",
                prepare=False,
            )
            plans = {row[0]: (row[1], row[2]) for row in await cur.fetchall()}
        # Not changed for anything else on the connection.
        async with pool.connection() as conn:
            cur = await conn.execute("SHOW plan_cache_mode", prepare=False)
            assert await cur.fetchone() == ("auto",)
    rounds = {s: p for s, p in plans.items() if "FOR UPDATE" in s or "WITH live AS" in s}
    assert len(rounds) == 2, plans
    for statement, (generic, custom) in rounds.items():
        assert custom == 0, (statement, generic, custom)
        assert generic >= 8, (statement, generic, custom)


async def test_statements_the_server_lost_cost_a_retry_and_are_prepared_no_more(
    tagged_dsn: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """PgBouncer in transaction mode hands each transaction any server connection: the
    statements prepared on one are unknown on the next. DEALLOCATE ALL on the pool's one
    connection, behind psycopg's back, does the same: the next rounds must still succeed,
    and prepare nothing."""
    async with (
        AsyncConnectionPool(
            tagged_dsn, min_size=1, max_size=1, open=False, kwargs={"autocommit": True}
        ) as pool,
        PostgresLimiter(pool, name="prep", schema=schema, max_concurrent=2) as limiter,
    ):
        await _one_round(limiter)
        assert await _prepared(pool)
        async with pool.connection() as conn:
            # Behind psycopg's back (libpq itself), as a server connection that
            # PgBouncer swapped in would be.
            conn.pgconn.exec_(b"DEALLOCATE ALL")
        with caplog.at_level(logging.WARNING, logger="slotwise"):
            for _ in range(3):
                await _one_round(limiter)
        assert await _prepared(pool) == []
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "slotwise" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 1, warnings
    assert "prepares no statements from now on" in warnings[0]
    assert "listen=False" in warnings[0]


async def test_a_grant_whose_statement_the_server_lost_is_retried_unprepared(
    tagged_dsn: str, schema: str
) -> None:
    """The grant is sent with the commit, unfetched: its error arrives as the transaction
    ends. A statement that failed committed nothing, so the round is retried."""
    async with (
        AsyncConnectionPool(
            tagged_dsn, min_size=1, max_size=1, open=False, kwargs={"autocommit": True}
        ) as pool,
        PostgresLimiter(pool, name="prep", schema=schema, max_concurrent=1) as limiter,
    ):
        for _ in range(2):
            await _one_round(limiter)
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT name, statement FROM pg_prepared_statements", prepare=False
            )
            grants = [name for name, statement in await cur.fetchall() if "pg_notify" in statement]
            assert grants
            for name in grants:
                conn.pgconn.exec_(f'DEALLOCATE "{name}"'.encode())
        await _one_round(limiter)
        await _one_round(limiter)
        assert (await limiter.stats()).active == 0


async def test_a_waiters_read_whose_statement_the_server_lost_is_retried_unprepared(
    tagged_dsn: str, schema: str, eventually: Any
) -> None:
    """A process reads its grants after a notification with one statement outside any
    transaction; the server losing it must not fail that process's waiters."""
    async with (
        AsyncConnectionPool(
            tagged_dsn, min_size=1, max_size=1, open=False, kwargs={"autocommit": True}
        ) as pool,
        PostgresLimiter(
            tagged_dsn, name="prep", schema=schema, max_concurrent=1, poll_interval=0.05
        ) as holder,
        PostgresLimiter(
            pool, name="prep", schema=schema, max_concurrent=1, poll_interval=5
        ) as waiter,
    ):
        leases: list[Any] = []

        async def wait() -> None:
            leases.append(await waiter.acquire(AcquireRequest(workload="default", request_id="w")))

        async def one_queued() -> bool:
            return (await holder.stats()).queued >= 1

        for n in range(2):
            held = await holder.acquire(AcquireRequest(workload="default", request_id="h"))
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)
                await eventually(one_queued)
                if n == 1:  # its statements are prepared by now: lose them
                    async with pool.connection() as conn:
                        conn.pgconn.exec_(b"DEALLOCATE ALL")
                await holder.release(held)
            await waiter.release(leases.pop())
