"""PostgresLimiter's rounds: one transaction per process per round carries the releases,
requests and withdrawals of all its tasks, and grants as many waiters as fit.

The transactions are counted by wrapping the limiter's one way into the database
(``_transaction``). asyncio only (see conftest).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from anyio.lowlevel import checkpoint

from slotwise import AcquireRequest
from slotwise.postgres import PostgresLimiter

pytestmark = pytest.mark.anyio


def request() -> AcquireRequest:
    return AcquireRequest(workload="default", request_id="test")


async def queued(limiter: PostgresLimiter[Any], count: int) -> bool:
    return (await limiter.stats()).queued >= count


@pytest.fixture
def transactions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The transactions every PostgresLimiter runs from now on, by the body's name."""
    ran: list[str] = []
    original = PostgresLimiter._transaction

    async def counted(self: Any, body: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        ran.append(getattr(body, "func", body).__name__)
        return await original(self, body, *args)

    monkeypatch.setattr(PostgresLimiter, "_transaction", counted)
    return ran


async def test_releases_of_many_tasks_go_in_one_transaction_that_grants_the_waiters(
    make: Any, transactions: list[str], eventually: Any
) -> None:
    # No timed poll during the test: only the releases make a round.
    limiter = make(max_concurrent=8, poll_interval=30, queue_entry_ttl=120)
    held = [await limiter.acquire(request()) for _ in range(8)]
    got: list[Any] = []

    async def wait() -> None:
        got.append(await limiter.acquire(request()))

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(wait)
        await eventually(lambda: queued(limiter, 5))
        transactions.clear()
        # Eight tasks release at once: one round sends the eight releases and grants the
        # five waiters of this process in the same transaction.
        async with anyio.create_task_group() as releasing:
            for lease in held:
                releasing.start_soon(limiter.release, lease)
    assert len(got) == 5
    assert transactions == ["_cycle"]
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (5, 0)
    for lease in got:
        await limiter.release(lease)


async def test_a_release_under_way_when_the_limiter_closes_is_still_made(make: Any) -> None:
    limiter = make(max_concurrent=2)
    other = make(max_concurrent=2)
    held = [await limiter.acquire(request()) for _ in range(2)]
    async with anyio.create_task_group() as tg:
        for lease in held:
            tg.start_soon(limiter.release, lease)
        await checkpoint()  # the releases are in the poller's round, or about to be
        await limiter.aclose()
    stats = await other.stats()
    assert (stats.active, stats.queued) == (0, 0)


async def test_a_release_that_starts_while_the_limiter_closes_is_made_and_leaves_it_usable(
    make: Any,
) -> None:
    # The release comes after aclose() began (the limiter is no longer started): it must
    # not start the limiter again under aclose(), whose pool it would then lose.
    limiter = make(max_concurrent=2)
    other = make(max_concurrent=2)
    lease = await limiter.acquire(request())
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(limiter.aclose)
            await checkpoint()  # aclose() is under way
            tg.start_soon(limiter.release, lease)
    assert (await other.stats()).active == 0
    with anyio.fail_after(5):
        again = await limiter.acquire(request())
    await limiter.release(again)
    await limiter.aclose()


async def test_releases_are_sent_when_the_poller_died_of_something_else(
    make: Any, eventually: Any
) -> None:
    # A poller ended by anything but aclose() (here: cancelled from outside) leaves the
    # release it carried queued; a new poller must send it.
    limiter = make(max_concurrent=2)
    other = make(max_concurrent=2)
    lease = await limiter.acquire(request())
    with anyio.fail_after(20):  # the release hung
        async with anyio.create_task_group() as tg:
            tg.start_soon(limiter.release, lease)
            await checkpoint()
            assert limiter._poller is not None
            limiter._poller.cancel()
    await eventually(lambda: released(other))


async def released(limiter: PostgresLimiter[Any]) -> bool:
    return (await limiter.stats()).active == 0
