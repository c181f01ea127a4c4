"""Limits learned from the provider on PostgresLimiter: stored with the limiter's buckets, so
that every process holds and refills no more than the provider allows; and an adaptive limit's
slow start, stored with the limiter too. PostgresLimiter is asyncio-only: these tests run on
asyncio (see conftest)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from slotwise import Adaptive, Rate, Workload, acquire
from slotwise.postgres import PostgresLimiter

pytestmark = pytest.mark.anyio

Make = Callable[..., PostgresLimiter[Any]]
TWICE: dict[str, Any] = {
    "max_concurrent": 8,
    "rate": Rate(requests=1200, tokens=200_000, per=60.0),
}


async def test_a_learned_limit_caps_the_shared_buckets_for_every_process(make: Make) -> None:
    limiter, other = make(**TWICE), make(**TWICE)
    async with limiter.slot(tokens=1_000) as slot:
        slot.provider_limits(requests=600, tokens=100_000)
        await limiter.stats()  # stored now (else within poll_interval)
        buckets = (await other.stats()).buckets
        assert (buckets["requests"].capacity, buckets["tokens"].capacity) == (600, 100_000)
        assert buckets["tokens"].level <= 100_000
    # Another process's grants are charged against the learned capacity too.
    async with other.slot(tokens=1_000):
        pass
    assert (await limiter.stats()).buckets["tokens"].capacity == 100_000


async def test_a_learned_limit_never_raises_the_shared_capacity(make: Make) -> None:
    limiter, other = make(**TWICE), make(**TWICE)
    async with limiter.slot() as slot:
        slot.provider_limits(tokens=100_000)
        slot.provider_limits(tokens=900_000)  # above the configured rate: the configured one
        await limiter.stats()
    buckets = (await other.stats()).buckets
    assert buckets["tokens"].capacity == 200_000


async def test_an_adaptive_limit_in_slow_start_begins_at_min_concurrent_everywhere(
    make: Make,
) -> None:
    limits: dict[str, Any] = {
        "max_concurrent": 16,
        "adaptive": Adaptive(min_concurrent=2, slow_start=True),
    }
    limiter, other = make(**limits), make(**limits)
    assert (await other.stats()).effective_max_concurrent == 2
    # Waves at the limit, the last granted released first: its success tried the limit and
    # climbs one slot (the others were granted with fewer occupied): 3, then 4.
    for n in (2, 3):
        held = [await acquire(limiter=limiter) for _ in range(n)]
        for slot in reversed(held):
            await slot.release()
    assert (await other.stats()).effective_max_concurrent == 4
    async with limiter.slot() as slot:
        slot.throttled(retry_after=0.0)
    await limiter.stats()
    assert (await other.stats()).effective_max_concurrent == 2
    first, second = await acquire(limiter=other), await acquire(limiter=other)
    await second.release()
    # Slow start ended with the pushback, for every process: the climb is additive now (one
    # slot after as many successes as the limit; slow start would be at 3 already).
    assert (await limiter.stats()).effective_max_concurrent == 2
    await first.release()
    assert (await limiter.stats()).effective_max_concurrent == 3


async def test_a_reserved_slot_granted_over_a_lowered_limit_proves_only_the_limit(
    make: Make, dsn: str, schema: str
) -> None:
    # 14 batch slots held, one refused: the limit falls to 8 while the 14 are still held. The
    # chat workload's reserved slot is still granted (a reservation is never lent); the
    # slots it tried must be the limit in force, 8, not the 16 occupied (the state's
    # `slots_tried`, as MemoryLimiter keeps it), or its success would climb the limit back
    # to 16 on demand that never filled it.
    limiter = make(
        max_concurrent=16,
        workloads={"chat": Workload(reserved=2), "batch": Workload()},
        default_workload="batch",
        adaptive=Adaptive(min_concurrent=2),
    )
    batch = [await acquire("batch", limiter=limiter) for _ in range(14)]
    batch[0].throttled(retry_after=0.0)
    assert (await limiter.stats()).effective_max_concurrent == 8
    chat = await acquire("chat", limiter=limiter)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            f'SELECT tried FROM "{schema}".leases WHERE workload = %s'.encode(), ("chat",)
        )
        assert await cur.fetchall() == [(8,)]
    await chat.release()
    for slot in batch:
        await slot.release()
    assert (await limiter.stats()).effective_max_concurrent == 8
