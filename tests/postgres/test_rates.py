"""Rates, tokens and provider pushback on PostgresLimiter: the behaviours of MemoryLimiter
(tests/test_rates.py) with the buckets, the pause and the limits stored with the limiter, so
that every process honours them; and across worker processes.

Two limiter objects with the same name are two processes as far as the database can tell
(each has its own owner id, caches and poller); the multi-process tests start real ones.
Grant times are read from a trigger on the leases table (the database clock), never from
this process's clock. PostgresLimiter is asyncio-only: these tests run on asyncio (see
conftest), except one that checks the clear failure under trio.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import anyio
import psycopg
import pytest

from slotwise import (
    Adaptive,
    ConcurrencyConfigError,
    ConcurrencyEvent,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
    Rate,
    Workload,
    acquire,
)
from slotwise.postgres import PostgresLimiter, schema_sql

from .test_processes import HISTORY, finish, spawn

pytestmark = pytest.mark.anyio

Make = Callable[..., PostgresLimiter[Any]]


async def record_grants(dsn: str, schema: str) -> None:
    """Record every grant and end of a lease (run once the tables exist)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(HISTORY.replace("{s}", f'"{schema}"').encode())


async def grants(dsn: str, schema: str) -> list[tuple[str, float]]:
    """(workload, granted_at) of every lease granted so far, in grant order (database
    clock, seconds since the epoch)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            f'SELECT workload, extract(epoch FROM granted_at)::float8 FROM "{schema}".history '
            "ORDER BY granted_at".encode()
        )
        return [(str(w), float(t)) for w, t in await cur.fetchall()]


def within_bucket(times: list[float], capacity: int, per: float, slack: float = 0.02) -> bool:
    """Whether grants at ``times`` fit a token bucket of ``capacity`` per ``per`` seconds
    that started full: in every interval, at most the capacity plus what refilled in it.
    ``slack`` covers the moments between a transaction's ``now`` and its grant statement."""
    times = sorted(times)
    rate = capacity / per
    return all(
        j - i + 1 <= capacity + (times[j] - times[i] + slack) * rate
        for i in range(len(times))
        for j in range(i, len(times))
    )


def collect(limiter: PostgresLimiter[Any]) -> list[ConcurrencyEvent]:
    events: list[ConcurrencyEvent] = []
    limiter.subscribe(events.append)
    return events


async def queued(limiter: PostgresLimiter[Any], count: int) -> bool:
    return (await limiter.stats()).queued >= count


# -- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": Rate(requests=0)}, "rate.requests must be a positive integer"),
        ({"rate": Rate()}, "rate limits nothing"),
        (
            {
                "rate": Rate(requests=10, per=60),
                "workloads": {"a": Workload(rate=Rate(requests=20, per=60))},
            },
            r"workloads\['a'\].rate allows 20 requests per 60s, more than the limiter's",
        ),
        ({"adaptive": Adaptive(min_concurrent=9)}, r"adaptive.min_concurrent \(9\) is above"),
    ],
)
def test_invalid_rates_name_the_setting(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConcurrencyConfigError, match=message):
        PostgresLimiter("postgresql://unused", name="x", max_concurrent=8, **kwargs)


async def test_processes_must_agree_on_the_rates(make: Make) -> None:
    async with make(max_concurrent=2, rate=Rate(requests=10)):
        other = make(max_concurrent=2, rate=Rate(requests=20))
        with pytest.raises(ConcurrencyConfigError, match="stored with different limits"):
            await other.start()
        with pytest.raises(ConcurrencyConfigError, match="stored with different limits"):
            await make(max_concurrent=2).start()


# -- requests per period, on the database clock ---------------------------------------------


async def test_a_burst_then_the_refill_rate_across_processes(
    make: Make, tagged_dsn: str, schema: str
) -> None:
    first = make(max_concurrent=10, rate=Rate(requests=2, per=1.0))
    second = make(max_concurrent=10, rate=Rate(requests=2, per=1.0))
    await first.start()
    await record_grants(tagged_dsn, schema)
    first_events, second_events = collect(first), collect(second)

    async def request(limiter: PostgresLimiter[Any]) -> None:
        async with limiter.slot():
            pass

    async with anyio.create_task_group() as tg:
        for index in range(6):
            tg.start_soon(request, (first, second)[index % 2])
    times = [t for _, t in await grants(tagged_dsn, schema)]
    assert len(times) == 6
    assert within_bucket(times, capacity=2, per=1.0)
    # A burst of two, then one every half second: the last grant about 2 s after the first.
    assert times[-1] - times[0] >= 2.0 - 0.02
    acquired = [e for e in first_events + second_events if e.kind == "acquired"]
    assert sorted(e.waited_for for e in acquired) == [(), ()] + [("requests",)] * 4


async def test_a_waiter_is_woken_when_its_bucket_refills_not_at_the_next_poll(
    make: Make,
) -> None:
    # Polls half a minute apart: only the wake computed from the bucket can grant in time.
    limits: dict[str, Any] = {
        "max_concurrent": 5,
        "rate": Rate(requests=1, per=1.0),
        "poll_interval": 30.0,
        "queue_entry_ttl": 120.0,  # entries are refreshed every third of it, by a poll
    }
    taker, waiter = make(**limits), make(**limits)
    async with taker.slot():
        pass
    with anyio.fail_after(10):
        async with waiter.slot():
            pass


async def test_a_workload_rate_is_a_ceiling_inside_the_limiters(
    make: Make, tagged_dsn: str, schema: str
) -> None:
    limits: dict[str, Any] = {
        "max_concurrent": 10,
        "rate": Rate(requests=10, per=1.0),
        "workloads": {"slow": Workload(rate=Rate(requests=1, per=1.0)), "fast": Workload()},
    }
    limiter, other = make(**limits), make(**limits)
    await limiter.start()
    await record_grants(tagged_dsn, schema)

    async def request(limiter: PostgresLimiter[Any], workload: str) -> None:
        async with limiter.slot(workload):
            pass

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(request, limiter, "slow")
        for _ in range(3):
            tg.start_soon(request, other, "fast")
    history = await grants(tagged_dsn, schema)
    slow = [t for w, t in history if w == "slow"]
    fast = [t for w, t in history if w == "fast"]
    assert within_bucket(slow, capacity=1, per=1.0)
    # "slow" waiting for its own bucket holds up nobody else.
    assert max(fast) < slow[1]


async def test_max_wait_ends_a_wait_for_a_bucket(make: Make) -> None:
    limiter = make(
        max_concurrent=5,
        rate=Rate(requests=1, per=60.0),
        workloads={"default": Workload(max_wait=0.3)},
    )
    async with limiter.slot():
        pass
    with pytest.raises(ConcurrencyTimeoutError):
        async with limiter.slot():
            pytest.fail("the bucket refills only in a minute")
    assert (await limiter.stats()).queued == 0


# -- tokens -----------------------------------------------------------------------------------


async def test_token_estimates_are_charged_and_corrected_for_every_process(make: Make) -> None:
    limits: dict[str, Any] = {
        "max_concurrent": 10,
        "rate": Rate(tokens=1000, per=1000.0),  # refills one token a second
        "workloads": {"default": Workload(max_wait=0.3)},
    }
    limiter, other = make(**limits), make(**limits)

    async def level(limiter: PostgresLimiter[Any]) -> float:
        return (await limiter.stats()).buckets["tokens"].level

    async with limiter.slot(tokens=800) as first:
        assert await level(other) == pytest.approx(200, abs=5)
        first.used_tokens(300)  # a smaller answer than feared: 500 come back
        assert await level(limiter) == pytest.approx(700, abs=5)
        assert await level(other) == pytest.approx(700, abs=5)
    async with other.slot(tokens=700) as second:
        second.used_tokens(900)  # more than estimated: the bucket goes below zero
    assert await level(limiter) == pytest.approx(-200, abs=5)
    with pytest.raises(ConcurrencyTimeoutError):
        async with limiter.slot(tokens=1):
            pytest.fail("the bucket is overspent")


async def test_a_correction_is_stored_without_a_release(make: Make, eventually: Any) -> None:
    limiter = make(max_concurrent=2, rate=Rate(tokens=1000, per=1000.0))
    other = make(max_concurrent=2, rate=Rate(tokens=1000, per=1000.0))

    async def spent(limiter: PostgresLimiter[Any]) -> bool:
        return (await limiter.stats()).buckets["tokens"].level < 500

    async with limiter.slot(tokens=100) as slot:
        slot.used_tokens(600)
        # Stored by the limiter on its own within poll_interval: `other` sees it while the
        # slot is still held.
        await eventually(lambda: spent(other))


async def test_a_request_larger_than_a_bucket_fails_at_once(make: Make) -> None:
    limiter = make(
        max_concurrent=2,
        rate=Rate(tokens=1000),
        workloads={"small": Workload(rate=Rate(tokens=100)), "big": Workload()},
    )
    events = collect(limiter)
    with pytest.raises(ConcurrencyConfigError, match=r"a request of 1001 tokens can never"):
        async with limiter.slot("big", tokens=1001):
            pytest.fail("never granted")
    with pytest.raises(ConcurrencyConfigError, match=r"bucket 'small.tokens' holds at most 100"):
        async with limiter.slot("small", tokens=101):
            pytest.fail("never granted")
    assert [e.kind for e in events].count("config-error") == 2
    assert (await limiter.stats()).queued == 0


async def test_a_request_without_an_estimate_costs_no_tokens(make: Make) -> None:
    limiter = make(max_concurrent=4, rate=Rate(tokens=10))
    async with limiter.slot(), limiter.slot(allow_nested=True):
        assert (await limiter.stats()).buckets["tokens"].level == 10


# -- one decision: priority and buckets -------------------------------------------------------


async def test_no_lower_priority_request_overtakes_one_waiting_for_the_same_bucket(
    make: Make, eventually: Any
) -> None:
    limits: dict[str, Any] = {
        "max_concurrent": 10,
        "rate": Rate(tokens=1000, per=2.0),  # 500 a second
        "workloads": {"interactive": Workload(priority=10), "background": Workload()},
    }
    limiter, other = make(**limits), make(**limits)
    order: list[str] = []

    async def request(limiter: PostgresLimiter[Any], workload: str, tokens: int) -> None:
        async with limiter.slot(workload, tokens=tokens, allow_nested=True):
            order.append(workload)

    async def both_waiting() -> bool:
        return await queued(limiter, 2)

    async with limiter.slot("background", tokens=900), anyio.create_task_group() as tg:  # 100 left
        tg.start_soon(request, limiter, "interactive", 500)  # waits 0.8 s for its 500
        await eventually(lambda: queued(limiter, 1))
        tg.start_soon(request, other, "background", 50)  # fits now, but must not overtake
        await eventually(lambda: both_waiting() if not order else _true())
    assert order == ["interactive", "background"]


@pytest.mark.parametrize("listen", [True, False], ids=["notified", "polled"])
async def test_what_a_request_waited_for_reaches_the_process_that_waits(
    make: Make, listen: bool, eventually: Any
) -> None:
    granter = make(max_concurrent=5, rate=Rate(requests=1, per=60.0))
    waiter = make(max_concurrent=5, rate=Rate(requests=1, per=60.0), listen=listen)
    events = collect(waiter)
    async with granter.slot():
        pass
    async with anyio.create_task_group() as tg:
        tg.start_soon(_enter, waiter, "default")
        await eventually(lambda: queued(granter, 1))
        # The bucket refills only in a minute; lifting the rate grants the waiter, in the
        # other process's transaction.
        await granter.set_limits(rate=None)
    [acquired] = [e for e in events if e.kind == "acquired"]
    assert acquired.waited_for == ("requests",)


# -- pushback ---------------------------------------------------------------------------------


async def test_one_refusal_pauses_every_process_until_retry_after(
    make: Make, tagged_dsn: str, schema: str, eventually: Any
) -> None:
    limiter, other = make(max_concurrent=3), make(max_concurrent=3)
    await limiter.start()
    await record_grants(tagged_dsn, schema)
    events = collect(limiter)
    other_events = collect(other)
    async with limiter.slot() as held, limiter.slot(allow_nested=True) as refused:
        refused.throttled(retry_after=1.0, reason="429")
        paused_until = (await other.stats()).paused_until
        assert paused_until is not None
        async with anyio.create_task_group() as tg:
            for count in range(1, 4):
                tg.start_soon(_enter, other, "default")
                await eventually(lambda count=count: queued(limiter, count))
        assert not held.released  # held slots are untouched
    history = await grants(tagged_dsn, schema)
    assert len(history) == 5
    assert all(t >= paused_until for _, t in history[2:])  # nothing during the pause
    [paused] = [e for e in events if e.kind == "paused"]
    assert paused.reason == "429"
    assert paused.until == pytest.approx(paused_until, abs=0.5)
    assert [e.waited_for for e in other_events if e.kind == "acquired"] == [("pause",)] * 3
    assert (await other.stats()).paused_until is None


async def test_the_refused_requests_own_release_grants_nothing_during_the_pause(
    make: Make, tagged_dsn: str, schema: str, eventually: Any
) -> None:
    limiter, other = make(max_concurrent=1), make(max_concurrent=1)
    await limiter.start()
    await record_grants(tagged_dsn, schema)
    async with anyio.create_task_group() as tg:
        async with limiter.slot() as refused:
            tg.start_soon(_enter, other, "default")
            await eventually(lambda: queued(limiter, 1))
            refused.throttled(retry_after=1.0)
        # The release above freed the only slot; the pause was stored first.
        paused_until = (await limiter.stats()).paused_until
        assert paused_until is not None
    history = await grants(tagged_dsn, schema)
    assert len(history) == 2
    assert paused_until is not None
    assert history[1][1] >= paused_until


async def test_a_waits_max_wait_keeps_running_during_a_pause(make: Make) -> None:
    limiter = make(max_concurrent=4, workloads={"default": Workload(max_wait=0.3)})
    async with limiter.slot() as slot:
        slot.throttled(retry_after=30.0)
        with anyio.fail_after(10), pytest.raises(ConcurrencyTimeoutError):
            async with limiter.slot(allow_nested=True):
                pytest.fail("paused")


async def test_without_retry_after_the_pause_backs_off_across_processes(
    make: Make, dsn: str, schema: str
) -> None:
    limiter, other = make(max_concurrent=5), make(max_concurrent=5)

    async def backoffs() -> int:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            cur = await conn.execute(f'SELECT backoffs FROM "{schema}".limiters'.encode())
            row = await cur.fetchone()
            assert row is not None
            return int(row[0])

    fine = await acquire(limiter=limiter)
    slots = [await acquire(limiter=other) for _ in range(3)]
    # Three requests in flight refused together: one burst, one pause of about a second,
    # counted in the database whichever process refuses.
    for slot in slots:
        slot.throttled()
    await other.stats()  # stored now (else soon, by a task of its own)
    stats = await limiter.stats()
    assert stats.paused_until is not None
    assert 0.75 - 0.5 <= stats.paused_until - time.time() <= 1.25
    assert await backoffs() == 1
    # A request granted after that pause and refused with no success between them: 2 s.
    again = await acquire(limiter=limiter)
    assert time.time() >= stats.paused_until - 0.05
    again.throttled()
    await limiter.stats()
    stats = await other.stats()
    assert stats.paused_until is not None
    assert 1.5 - 0.5 <= stats.paused_until - time.time() <= 2.5
    assert await backoffs() == 2
    await again.release()
    assert await backoffs() == 2  # a refused request's release is no success
    # A success (a request the provider did not refuse) starts the backoff again from a
    # second; the refused requests' releases are no successes.
    await fine.release()
    assert await backoffs() == 0
    for slot in slots:
        await slot.release()
    assert await backoffs() == 0


# -- the adaptive limit -----------------------------------------------------------------------


async def test_the_adaptive_limit_is_shared_falls_on_pushback_and_climbs_on_success(
    make: Make,
) -> None:
    limits: dict[str, Any] = {"max_concurrent": 8, "adaptive": Adaptive(min_concurrent=2)}
    limiter, other = make(**limits), make(**limits)
    events = collect(limiter)
    async with limiter.slot() as slot:
        slot.throttled(retry_after=0.0)
    assert (await other.stats()).effective_max_concurrent == 4
    # A burst of refusals of requests in flight together counts once.
    slots = [await acquire(limiter=limiter) for _ in range(3)]
    for slot in slots:
        slot.throttled(retry_after=0.0)
    for slot in slots:
        await slot.release()
    assert (await other.stats()).effective_max_concurrent == 2
    # Successes of slots granted with the limit full (or after one that was), with at least
    # half the limit in use at their release: one more slot per round trip (as many counted
    # successes as the limit). Waves at the limit, the last granted released first: at a
    # limit of 3, the release that leaves one in use does not count.
    for n in (2, 3, 3):
        held = [await acquire(limiter=limiter) for _ in range(n)]
        for slot in reversed(held):
            await slot.release()
    assert (await other.stats()).effective_max_concurrent == 4
    # Two slots at a time at a limit of 4: 4 is never tried, however many succeed.
    for _ in range(4):
        first, second = await acquire(limiter=limiter), await acquire(limiter=limiter)
        await second.release()
        await first.release()
    assert (await other.stats()).effective_max_concurrent == 4
    # One slot at a time, a quarter of the limit: says nothing of the room above it.
    for _ in range(4 * 4):
        async with limiter.slot():
            pass
    assert (await other.stats()).effective_max_concurrent == 4
    changes = [(e.old, e.new, e.reason) for e in events if e.kind == "limit-changed"]
    assert changes == [
        (8, 4, "pushback"),
        (4, 2, "pushback"),
        (2, 3, "recovered"),
        (3, 4, "recovered"),
    ]


async def test_unused_reservations_count_as_occupied_for_the_climb(make: Make) -> None:
    # As with MemoryLimiter: "chat" uses 3 of its 8 reserved slots, the rest no one else can
    # take, so the limit (at the reservation, "batch" can take nothing) is full and climbs,
    # once: 9 is not tried by the slots granted with 8 occupied.
    limits: dict[str, Any] = {
        "max_concurrent": 20,
        "workloads": {"batch": Workload(), "chat": Workload(reserved=8)},
        "default_workload": "batch",
        "adaptive": Adaptive(min_concurrent=8, slow_start=True),
    }
    limiter, other = make(**limits), make(**limits)
    assert (await other.stats()).effective_max_concurrent == 8
    held = [await acquire("chat", limiter=limiter) for _ in range(3)]
    for slot in held:
        await slot.release()
    assert (await other.stats()).effective_max_concurrent == 9
    with anyio.fail_after(10):
        async with other.slot("batch"):
            pass


async def test_cancelled_and_failed_requests_are_no_successes(make: Make) -> None:
    # A cancelled or failed body says nothing of the provider's room: the shared adaptive
    # limit does not climb on it.
    limits: dict[str, Any] = {
        "max_concurrent": 8,
        "adaptive": Adaptive(min_concurrent=2, slow_start=True),
    }
    limiter, other = make(**limits), make(**limits)
    assert (await other.stats()).effective_max_concurrent == 2
    with anyio.move_on_after(0.2):
        async with limiter.slot():
            await anyio.sleep(5)  # cancelled
    with pytest.raises(ValueError, match="the body failed"):
        async with limiter.slot():
            raise ValueError("the body failed")
    slot = await acquire(limiter=limiter)
    await slot.release("failed")
    # Released together in one round, a failure beside a success: only the success climbs.
    failed, fine = await acquire(limiter=limiter), await acquire(limiter=limiter)
    async with anyio.create_task_group() as tg:
        tg.start_soon(failed.release, "cancelled")
        tg.start_soon(fine.release)
    assert (await other.stats()).effective_max_concurrent == 3
    # Three in use of 3, the last granted released first: a success that tried the limit.
    held = [await acquire(limiter=limiter) for _ in range(3)]
    for slot in reversed(held):
        await slot.release()
    assert (await other.stats()).effective_max_concurrent == 4


async def test_shrinking_never_revokes_a_held_slot(make: Make) -> None:
    limits: dict[str, Any] = {"max_concurrent": 4, "adaptive": Adaptive(min_concurrent=1)}
    limiter, other = make(**limits), make(**limits)
    slots = [await acquire(limiter=limiter) for _ in range(4)]
    slots[0].throttled(retry_after=0.0)
    await limiter.stats()
    stats = await other.stats()
    assert stats.effective_max_concurrent == 2
    assert stats.active == 4
    assert all(not s.released for s in slots)
    got = anyio.Event()

    async def newcomer() -> None:
        async with other.slot():
            got.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(newcomer)
        for slot in slots[:2]:
            await slot.release()
            await anyio.sleep(0.3)  # several polls
            assert not got.is_set()  # 3, then 2 active: not under the limit of 2
        await slots[2].release()
        with anyio.fail_after(10):
            await got.wait()
    await slots[3].release()


# -- set_limits -------------------------------------------------------------------------------


async def test_set_limits_is_validated_stored_and_seen_by_every_process(make: Make) -> None:
    limiter, other = make(max_concurrent=2), make(max_concurrent=2)
    events = collect(limiter)
    with pytest.raises(ConcurrencyConfigError, match="max_concurrent must be a positive"):
        await limiter.set_limits(max_concurrent=0)
    assert (await other.stats()).max_concurrent == 2  # unchanged
    await limiter.set_limits(max_concurrent=3, rate=Rate(requests=100))
    stats = await other.stats()
    assert stats.max_concurrent == 3
    assert stats.buckets["requests"].capacity == 100
    assert other.max_concurrent == 3
    # The other process grants under the new limit.
    async with other.slot(), other.slot(allow_nested=True), other.slot(allow_nested=True):
        assert (await limiter.stats()).active == 3
    # A process started later with the limits it was deployed with takes the stored ones.
    late = make(max_concurrent=2)
    await late.start()
    assert late.max_concurrent == 3
    await other.set_limits(rate=None)
    assert (await limiter.stats()).buckets == {}
    # New limits deployed with on_conflict="replace" drop those set at run time.
    deployed = make(max_concurrent=5, on_conflict="replace")
    await deployed.start()
    assert (await deployed.stats()).max_concurrent == 5
    assert [(e.old, e.new, e.reason) for e in events if e.kind == "limit-changed"] == [
        (2, 3, "set_limits")
    ]


async def test_set_limits_refuses_the_waiters_of_a_removed_workload_in_every_process(
    make: Make, eventually: Any
) -> None:
    limits: dict[str, Any] = {
        "max_concurrent": 1,
        "workloads": {"old": Workload(), "kept": Workload()},
    }
    limiter, other = make(**limits), make(**limits)
    errors: list[BaseException] = []

    async def waits_for_old() -> None:
        try:
            async with other.slot("old"):
                pytest.fail("its workload is gone")
        except ConcurrencyConfigError as exc:
            errors.append(exc)

    async with limiter.slot("old"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waits_for_old)
            await eventually(lambda: queued(limiter, 1))
            await limiter.set_limits(workloads={"kept": Workload()})
        assert len(errors) == 1
        assert "removed" in str(errors[0])
        # The failed request's entry leaves the queue with its process's next cycle, which
        # that process's stats() waits for.
        await other.stats()
        stats = await limiter.stats()
        assert stats.workloads["old"].active == 1  # still counted, until released
        assert stats.queued == 0
        with anyio.move_on_after(0.3) as waited:
            async with other.slot("kept"):
                pytest.fail("the old workload's slot still counts")
        assert waited.cancelled_caught
    async with other.slot("kept"):
        pass
    with pytest.raises(ConcurrencyConfigError, match="unknown workload 'old'"):
        async with other.slot("old"):
            pass


async def test_set_limits_fails_the_waiters_a_smaller_bucket_can_never_hold(
    make: Make, eventually: Any
) -> None:
    # As a request too large for a bucket fails at once, one waiting when set_limits() makes
    # the bucket too small fails then, in the process where it waits; and its claim on the
    # bucket no longer holds back the smaller request behind it.
    limits: dict[str, Any] = {"max_concurrent": 4, "rate": Rate(tokens=1_000)}
    limiter, other = make(**limits), make(**limits)
    errors: list[BaseException] = []
    small = anyio.Event()

    async def large() -> None:
        try:
            async with other.slot(tokens=500):
                pytest.fail("a bucket of 400 can never hold 500 tokens")
        except ConcurrencyConfigError as exc:
            errors.append(exc)

    async def behind() -> None:
        async with other.slot(tokens=20, allow_nested=True):
            small.set()

    async with limiter.slot(tokens=900):  # 100 tokens left, refilling slowly
        async with anyio.create_task_group() as tg:
            tg.start_soon(large)
            await eventually(lambda: queued(limiter, 1))
            tg.start_soon(behind)
            await eventually(lambda: queued(limiter, 2))
            assert not small.is_set()  # held back by the larger request's claim
            await limiter.set_limits(rate=Rate(tokens=400))
            with anyio.fail_after(5):
                await small.wait()
        assert len(errors) == 1
        assert "can never be granted" in str(errors[0])
        assert "'tokens'" in str(errors[0])
        await other.stats()  # its next cycle takes the failed request's entry out
        assert (await limiter.stats()).queued == 0


# -- per-workload queue bounds ----------------------------------------------------------------


async def test_a_workload_queue_bound_holds_across_processes(make: Make, eventually: Any) -> None:
    limits: dict[str, Any] = {
        "max_concurrent": 1,
        "max_queued": 10,
        "workloads": {"background": Workload(max_queued=2), "interactive": Workload()},
    }
    limiter, other = make(**limits), make(**limits)
    holder = await acquire("background", limiter=limiter)
    async with anyio.create_task_group() as tg:
        for count in (1, 2):
            tg.start_soon(_enter, (limiter, other)[count % 2], "background")
            await eventually(lambda count=count: queued(limiter, count))
        with (
            anyio.fail_after(10),
            pytest.raises(ConcurrencyQueueFullError, match="workload 'background'"),
        ):
            async with other.slot("background"):
                pass
        tg.start_soon(_enter, other, "interactive")
        await eventually(lambda: queued(limiter, 3))
        await holder.release()
    assert (await limiter.stats()).active == 0


async def test_a_workload_queue_bound_refuses_the_last_of_requests_made_together(
    make: Make,
) -> None:
    # Requests made together enter the database as one batch, in call order: the bound
    # counts the batch's own entries, and refuses the last ones.
    limiter = make(
        max_concurrent=1,
        workloads={"background": Workload(max_queued=2), "interactive": Workload()},
    )
    holder = await acquire("background", limiter=limiter)
    outcomes: dict[int, str] = {}
    refused = anyio.Event()

    async def request(n: int) -> None:
        try:
            async with limiter.slot("background", allow_nested=True):
                outcomes[n] = "served"
        except ConcurrencyQueueFullError as exc:
            outcomes[n] = str(exc)
            if len(outcomes) == 2:
                refused.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for n in range(4):
                tg.start_soon(request, n)
            await refused.wait()
            await holder.release()
    full = (
        "2 requests of workload 'background' are already waiting (its max_queued=2) "
        "(limiter 'claude', workload 'background')"
    )
    assert outcomes == {0: "served", 1: "served", 2: full, 3: full}


async def _true() -> bool:
    return True


async def _enter(limiter: PostgresLimiter[Any], workload: str) -> None:
    async with limiter.slot(workload, allow_nested=True):
        pass


# -- what the provider says is left -----------------------------------------------------------


async def test_the_providers_remaining_count_lowers_the_shared_bucket(make: Make) -> None:
    limits: dict[str, Any] = {"max_concurrent": 5, "rate": Rate(requests=10, per=100.0)}
    limiter, other = make(**limits), make(**limits)
    async with limiter.slot() as slot:
        slot.provider_remaining(requests=2)  # the provider counted other clients too
        await limiter.stats()  # stored now (else within poll_interval)
        assert (await other.stats()).buckets["requests"].level == pytest.approx(2, abs=0.1)
        slot.provider_remaining(requests=8)  # more than slotwise thinks: ignored
        await limiter.stats()
        assert (await other.stats()).buckets["requests"].level == pytest.approx(2, abs=0.1)


# -- trio -------------------------------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_under_trio_the_new_calls_fail_at_once_with_a_clear_error(dsn: str) -> None:
    limiter: PostgresLimiter[Any] = PostgresLimiter(
        dsn, max_concurrent=2, rate=Rate(requests=10), adaptive=Adaptive(min_concurrent=1)
    )
    with pytest.raises(ConcurrencyConfigError, match="asyncio only"):
        await limiter.set_limits(max_concurrent=1)
    with pytest.raises(ConcurrencyConfigError, match="asyncio only"):
        await limiter.stats()
    with pytest.raises(ConcurrencyConfigError, match="asyncio only"):
        async with limiter.slot(tokens=5):
            pytest.fail("the body must not run")


# -- an existing installation -----------------------------------------------------------------

# The tables as the first release of PostgresLimiter created them.
FIRST_SCHEMA = """
CREATE SCHEMA {s};
CREATE TABLE {s}.limiters (
    name text PRIMARY KEY, settings jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE {s}.queue (
    entry_id uuid PRIMARY KEY, limiter text NOT NULL, workload text NOT NULL,
    owner uuid NOT NULL, request_id text NOT NULL, seq bigserial NOT NULL,
    enqueued_at timestamptz NOT NULL, deadline timestamptz, stale_at timestamptz NOT NULL,
    lease_ttl double precision NOT NULL);
CREATE INDEX queue_by_limiter ON {s}.queue (limiter, enqueued_at, seq);
CREATE INDEX queue_by_owner ON {s}.queue (owner);
CREATE TABLE {s}.leases (
    lease_id uuid PRIMARY KEY, limiter text NOT NULL, workload text NOT NULL,
    owner uuid NOT NULL, entry_id uuid, request_id text, granted_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL);
CREATE INDEX leases_by_limiter ON {s}.leases (limiter, expires_at);
CREATE INDEX leases_by_entry ON {s}.leases (entry_id);
"""


async def test_an_existing_installation_is_upgraded_in_place(
    make: Make, dsn: str, schema: str
) -> None:
    stored = {
        "max_concurrent": 2,
        "max_queued": None,
        "workloads": {
            "default": {"max_concurrent": 2, "reserved": 0, "priority": 0, "max_wait": None}
        },
    }
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(FIRST_SCHEMA.replace("{s}", f'"{schema}"').encode())
        await conn.execute(
            f'INSERT INTO "{schema}".limiters (name, settings) VALUES (%s, %s::jsonb)'.encode(),
            ["claude", json.dumps(stored)],
        )
        # A slot held by a worker of the earlier version.
        await conn.execute(
            f'INSERT INTO "{schema}".leases VALUES (gen_random_uuid(), %s, %s, '
            "gen_random_uuid(), NULL, 'old', now(), now() + interval '1 minute')".encode(),
            ["claude", "default"],
        )
    with pytest.raises(ConcurrencyConfigError, match="apply schema_sql"):
        await make(max_concurrent=2, ensure_schema=False).start()
    # The limits stored by the earlier version still agree with this one's.
    limiter = make(max_concurrent=2)
    async with limiter.slot():
        stats = await limiter.stats()
        assert stats.active == 2  # the earlier worker's slot counts
    # Applying the DDL again changes nothing.
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(schema_sql(schema).encode())
    async with make(max_concurrent=2, ensure_schema=False).slot():
        pass


# -- worker processes -------------------------------------------------------------------------


async def test_four_processes_never_exceed_the_rate_over_any_window(
    dsn: str, tagged_dsn: str, schema: str
) -> None:
    rate: dict[str, Any] = {"requests": 10, "per": 1.0}
    spec: dict[str, Any] = {
        "mode": "load",
        "dsn": tagged_dsn,
        "schema": schema,
        "name": "rated",
        "max_concurrent": 8,
        "rate": rate,
        "poll_interval": 0.05,
        "requests": 12,
        "parallel": 12,
        "cancel": 0.0,
        "max_hold": 0.01,
        "synchronous_commit": False,
    }
    async with PostgresLimiter(
        tagged_dsn, name="rated", schema=schema, max_concurrent=8, rate=Rate(**rate)
    ) as limiter:
        await record_grants(dsn, schema)
        procs = [spawn({**spec, "seed": seed}) for seed in range(4)]
        outcomes: dict[str, int] = {}
        for proc in procs:
            out = await anyio.to_thread.run_sync(finish, proc)
            for key, count in json.loads(out.splitlines()[-1]).items():
                outcomes[key] = outcomes.get(key, 0) + count
        assert (await limiter.stats()).queued == 0
    assert outcomes == {"completed": 48}
    times = [t for _, t in await grants(dsn, schema)]
    assert len(times) == 48
    assert within_bucket(times, capacity=10, per=1.0)


async def test_a_refusal_in_one_process_pauses_the_others(
    dsn: str, tagged_dsn: str, schema: str, eventually: Any
) -> None:
    spec: dict[str, Any] = {
        "mode": "load",
        "dsn": tagged_dsn,
        "schema": schema,
        "name": "pushed",
        "max_concurrent": 2,
        "poll_interval": 0.05,
        "requests": 40,
        "parallel": 10,
        "cancel": 0.0,
        "max_hold": 0.02,
        "synchronous_commit": False,
    }
    async with PostgresLimiter(tagged_dsn, name="pushed", schema=schema, max_concurrent=2) as me:
        await record_grants(dsn, schema)
        procs = [spawn({**spec, "seed": seed}) for seed in range(3)]

        async def started() -> bool:
            return len(await grants(dsn, schema)) >= 10

        await eventually(started)
        async with me.slot() as slot:
            slot.throttled(retry_after=1.0)
            paused_until = (await me.stats()).paused_until
        assert paused_until is not None
        for proc in procs:
            out = await anyio.to_thread.run_sync(finish, proc)
            assert json.loads(out.splitlines()[-1]) == {"completed": 40}
    times = [t for _, t in await grants(dsn, schema)]
    assert len(times) == 121
    # The pause was stored at paused_until - 1.0 (database clock): no grant from then on
    # before its end, in any process; the workers did go on afterwards.
    assert [t for t in times if paused_until - 1.0 < t < paused_until] == []
    assert any(t >= paused_until for t in times)
