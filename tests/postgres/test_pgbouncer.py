"""PostgresLimiter through PgBouncer in transaction mode: no session state is needed.

Each transaction may run on a different server connection, so nothing may rely on a session:
no session advisory locks, no prepared statements, no temporary tables, no LISTEN on the
pooled connections. Notifications then need a direct connection (``listen=<conninfo>``) or
are off (``listen=False``: timed polling alone). asyncio only (see conftest).
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import psycopg
import pytest

from slotwise import AcquireRequest, Workload
from slotwise.postgres import PostgresLimiter

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("listen", ["off", "direct"])
async def test_through_pgbouncer_in_transaction_mode(
    pgbouncer_dsn: str, tagged_dsn: str, schema: str, listen: str
) -> None:
    bouncer = psycopg.conninfo.make_conninfo(pgbouncer_dsn, dbname="test")
    limits: dict[str, Any] = {
        "name": "bounced",
        "schema": schema,
        "max_concurrent": 3,
        "workloads": {"fast": Workload(priority=1), "slow": Workload(max_concurrent=1)},
        "poll_interval": 0.05,
        "listen": False if listen == "off" else tagged_dsn,
    }
    active = {"fast": 0, "slow": 0}
    peak = {"fast": 0, "slow": 0, "total": 0}
    rng = random.Random(3)
    async with PostgresLimiter(bouncer, **limits) as a, PostgresLimiter(bouncer, **limits) as b:

        async def one(limiter: PostgresLimiter[Any], workload: str) -> None:
            with anyio.move_on_after(rng.uniform(0, 0.3) if rng.random() < 0.2 else None):
                async with limiter.slot(workload):
                    active[workload] += 1
                    try:
                        peak[workload] = max(peak[workload], active[workload])
                        peak["total"] = max(peak["total"], sum(active.values()))
                        await anyio.sleep(rng.uniform(0, 0.02))
                    finally:  # a body cancelled by move_on_after leaves too
                        active[workload] -= 1

        async with anyio.create_task_group() as tg:
            for _ in range(40):
                tg.start_soon(one, rng.choice([a, b]), rng.choice(["fast", "slow"]))
        assert peak["total"] <= 3
        assert peak["slow"] <= 1
        assert peak["total"] >= 2
        stats = await a.stats()
        assert (stats.active, stats.queued) == (0, 0)
        # Expiry and renewal work the same through the bouncer.
        lease = await a.acquire(AcquireRequest(workload="slow", request_id="r"))
        assert await a.renew(lease) is not None
        await a.release(lease)
        assert await a.renew(lease) is None
