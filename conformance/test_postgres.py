"""The conformance suite against PostgresLimiter, on the server in SLOTWISE_POSTGRES_DSN.

PostgresLimiter is asyncio-only (psycopg's async API), so the cases run on asyncio alone.
Without a reachable server the cases skip, unless SLOTWISE_REQUIRE_SERVICES=1.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from slotwise.conformance import ConformanceCase, conformance_cases

psycopg = pytest.importorskip("psycopg")
from slotwise.postgres import PostgresLimiter  # noqa: E402

pytestmark = pytest.mark.anyio

DSN = os.environ.get("SLOTWISE_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
SCHEMA = f"slotwise_conformance_{uuid.uuid4().hex[:12]}"


@asynccontextmanager
async def create_limiter(**limits: Any) -> AsyncIterator[PostgresLimiter[Any]]:
    async with PostgresLimiter(DSN, schema=SCHEMA, poll_interval=0.02, **limits) as limiter:
        yield limiter


@asynccontextmanager
async def block_storage(limiter: PostgresLimiter[Any]) -> AsyncIterator[None]:
    """Hold the limiter's row lock from another connection, as a stalled process would."""
    await limiter.stats()  # the limiter's row exists once it has started
    async with await psycopg.AsyncConnection.connect(DSN) as conn, conn.transaction():
        await conn.execute(
            f'SELECT 1 FROM "{SCHEMA}".limiters WHERE name = %s FOR UPDATE', [limiter.name]
        )
        yield


# The capabilities a limiter declares (the others it has unless it skips them).
SUPPORTS: frozenset[str] = frozenset({"rates", "pushback", "workload_max_queued"})
CASES = conformance_cases(create_limiter, supports=SUPPORTS, block_storage=block_storage)


@pytest.fixture
def anyio_backend() -> str:
    """PostgresLimiter is asyncio-only."""
    return "asyncio"


@pytest.fixture(scope="module", autouse=True)
def server() -> Iterator[None]:
    try:
        with psycopg.connect(DSN, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        reason = f"PostgreSQL is unreachable at {DSN}: {exc}"
        if os.environ.get("SLOTWISE_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{reason} (SLOTWISE_REQUIRE_SERVICES=1)")
        pytest.skip(reason)
    yield
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')


def test_postgres_limiter_skips_only_what_it_does_not_declare() -> None:
    undeclared = {"workload_max_queued", "rates", "pushback"} - SUPPORTS
    skipped = {case.name for case in CASES if case.skip_reason is not None}
    assert skipped == {case.name for case in CASES if case.requires & undeclared}


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
async def test_conformance(case: ConformanceCase) -> None:
    await case.run()
