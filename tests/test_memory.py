"""MemoryLimiter: allocation order, reservations, ceilings, queue bounds, waits and leases.

Grant order is observed from the outside: waiters are queued one at a time (each blocked
before the next arrives), then slots are freed one at a time and the order in which the
waiters wake is recorded.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import anyio
import pytest
from trio.testing import MockClock

from slotwise import (
    AcquireRequest,
    ConcurrencyEvent,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
    Lease,
    MemoryLimiter,
    Workload,
)

pytestmark = pytest.mark.anyio

_request_ids = itertools.count()


def on_mock_clock() -> pytest.MarkDecorator:
    """Run the test on trio with a virtual clock that jumps whenever every task sleeps."""
    return pytest.mark.parametrize(
        "anyio_backend",
        [pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock")],
    )


def on_real_asyncio() -> pytest.MarkDecorator:
    return pytest.mark.parametrize("anyio_backend", ["asyncio"])


def req(workload: str = "default", *, deadline: float | None = None) -> AcquireRequest:
    return AcquireRequest(
        workload=workload, request_id=f"t-{next(_request_ids)}", deadline=deadline
    )


def now_or_never(workload: str = "default") -> AcquireRequest:
    """A request whose deadline has passed: take a free slot or fail at once."""
    return req(workload, deadline=anyio.current_time())


async def grant_order(
    limiter: MemoryLimiter[str], held: Sequence[Lease], arrivals: Sequence[tuple[str, str]]
) -> list[str]:
    """Queue ``arrivals`` (name, workload) in that order, then free the ``held`` leases one at
    a time, then each granted waiter's lease in turn; return the names in grant order.

    Waiters that are never granted are cancelled; every granted lease is released.
    """
    order: list[str] = []
    leases: dict[str, Lease] = {}

    async def waiter(name: str, workload: str) -> None:
        leases[name] = await limiter.acquire(req(workload))
        order.append(name)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for name, workload in arrivals:
                tg.start_soon(waiter, name, workload)
                await anyio.wait_all_tasks_blocked()
            assert order == []
            assert (await limiter.stats()).queued == len(arrivals)
            pending = list(held)
            freed = 0
            while len(order) < len(arrivals):
                if pending:
                    await limiter.release(pending.pop(0))
                elif freed < len(order):
                    await limiter.release(leases[order[freed]])
                    freed += 1
                else:
                    break
                await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
    for name in order[freed:]:
        await limiter.release(leases[name])
    return order


# -- the example of the reference behaviour -------------------------------------------------


def seed_limiter(lease_ttl: float = 30.0) -> MemoryLimiter[str]:
    return MemoryLimiter(
        name="claude",
        max_concurrent=8,
        max_queued=200,
        lease_ttl=lease_ttl,
        workloads={
            "interactive": Workload(reserved=2, priority=10, max_wait=60.0),
            "background": Workload(max_concurrent=6, max_wait=300.0),
        },
    )


async def test_seed_example_background_never_holds_more_than_six() -> None:
    limiter = seed_limiter()
    active = peak = 0
    release = anyio.Event()

    async def background() -> None:
        nonlocal active, peak
        async with limiter.slot(workload="background"):
            active += 1
            peak = max(peak, active)
            await release.wait()
            active -= 1

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(background)
            await anyio.wait_all_tasks_blocked()
            stats = await limiter.stats()
            # No interactive request waits, yet the two reserved slots stay idle.
            assert (stats.active, stats.queued) == (6, 4)
            assert stats.workloads["background"].active == 6
            assert stats.workloads["interactive"].active == 0
            assert active == 6

            # Two interactive requests start at once, even with background work queued.
            first = await limiter.acquire(now_or_never("interactive"))
            second = await limiter.acquire(now_or_never("interactive"))
            assert (await limiter.stats()).active == 8
            with pytest.raises(ConcurrencyTimeoutError):
                await limiter.acquire(now_or_never("interactive"))
            for lease in (first, second):
                await limiter.release(lease)
            # Releasing the interactive slots gives background nothing: it is at its ceiling.
            await anyio.wait_all_tasks_blocked()
            stats = await limiter.stats()
            assert (stats.active, stats.queued) == (6, 4)
            release.set()
    assert peak == 6
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)


async def test_seed_example_interactive_goes_first_and_nothing_is_preempted() -> None:
    limiter = seed_limiter()
    background = [await limiter.acquire(now_or_never("background")) for _ in range(6)]
    interactive = [await limiter.acquire(now_or_never("interactive")) for _ in range(2)]
    # Background waiters arrive first; the interactive ones arrive later but have priority.
    order = await grant_order(
        limiter,
        held=[background[0], interactive[0], background[1]],
        arrivals=[("bg1", "background"), ("bg2", "background"), ("in1", "interactive")],
    )
    # The first freed slot (a background one) goes to the interactive waiter; the next frees
    # go to background in arrival order.
    assert order == ["in1", "bg1", "bg2"]
    # No running request was interrupted: the leases held throughout are all still valid.
    for lease in (*background[2:], interactive[1]):
        assert await limiter.renew(lease) is not None


async def test_seed_example_interactive_can_use_shared_slots() -> None:
    limiter = seed_limiter()
    leases = [await limiter.acquire(now_or_never("interactive")) for _ in range(8)]
    assert (await limiter.stats()).workloads["interactive"].active == 8
    with pytest.raises(ConcurrencyTimeoutError):
        await limiter.acquire(now_or_never("background"))
    for lease in leases:
        await limiter.release(lease)


@on_mock_clock()
async def test_seed_example_max_waits() -> None:
    # Leases taken directly are not renewed: make them outlive the longest wait.
    limiter = seed_limiter(lease_ttl=10_000.0)
    for _ in range(6):
        await limiter.acquire(now_or_never("background"))
    for _ in range(2):
        await limiter.acquire(now_or_never("interactive"))
    timed_out: list[tuple[str, float]] = []

    async def wait(workload: str) -> None:
        start = anyio.current_time()
        with pytest.raises(ConcurrencyTimeoutError):
            async with limiter.slot(workload=workload):
                pytest.fail("the body must not run")
        timed_out.append((workload, anyio.current_time() - start))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, "background")
        tg.start_soon(wait, "interactive")
    assert [workload for workload, _ in timed_out] == ["interactive", "background"]
    assert timed_out[0][1] >= 60.0
    assert timed_out[1][1] >= 300.0
    assert (await limiter.stats()).queued == 0


# -- allocation rules ---------------------------------------------------------------------


async def test_unused_reservations_stay_idle() -> None:
    limiter = MemoryLimiter(
        max_concurrent=4, workloads={"reserved": Workload(reserved=2), "open": Workload()}
    )
    held = [await limiter.acquire(now_or_never("open")) for _ in range(2)]
    with pytest.raises(ConcurrencyTimeoutError):
        await limiter.acquire(now_or_never("open"))

    granted: list[Lease] = []

    async def open_waiter() -> None:
        granted.append(await limiter.acquire(req("open")))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(open_waiter)
            await anyio.wait_all_tasks_blocked()
            stats = await limiter.stats()
            assert (stats.active, stats.queued) == (2, 3)
            assert granted == []
            # The reserved workload still starts at once, twice.
            reserved = [await limiter.acquire(now_or_never("reserved")) for _ in range(2)]
            # Freeing the reserved slots never lends them to the waiting workload.
            for lease in reserved:
                await limiter.release(lease)
            await anyio.wait_all_tasks_blocked()
            assert granted == []
            assert (await limiter.stats()).active == 2
            tg.cancel_scope.cancel()
    for lease in held:
        await limiter.release(lease)


async def test_a_workload_at_its_ceiling_does_not_block_another() -> None:
    limiter = MemoryLimiter(
        max_concurrent=3,
        workloads={
            "capped": Workload(max_concurrent=1, priority=10),
            "other": Workload(),
        },
    )
    capped = await limiter.acquire(now_or_never("capped"))
    others = [await limiter.acquire(now_or_never("other")) for _ in range(2)]
    order = await grant_order(
        limiter,
        held=[others[0]],
        arrivals=[("capped1", "capped"), ("other1", "other")],
    )
    # The higher-priority workload waited first, but it is at its ceiling: the freed slot
    # goes to the other workload, and capped1 only starts once capped frees its own slot.
    assert order[0] == "other1"
    assert "capped1" not in order

    capped_waiter_done = anyio.Event()

    async def capped_waiter() -> None:
        lease = await limiter.acquire(req("capped"))
        await limiter.release(lease)
        capped_waiter_done.set()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(capped_waiter)
            await anyio.wait_all_tasks_blocked()
            # A new request of the other workload is granted at once, beside the queued
            # higher-priority waiter.
            extra = await limiter.acquire(now_or_never("other"))
            await limiter.release(extra)
            assert not capped_waiter_done.is_set()
            await limiter.release(capped)
    await limiter.release(others[1])


async def test_priority_among_workloads_with_room() -> None:
    limiter = MemoryLimiter(
        max_concurrent=1, workloads={"low": Workload(), "high": Workload(priority=5)}
    )
    held = await limiter.acquire(now_or_never("low"))
    order = await grant_order(
        limiter,
        held=[held],
        arrivals=[("low1", "low"), ("high1", "high"), ("low2", "low"), ("high2", "high")],
    )
    assert order == ["high1", "high2", "low1", "low2"]


async def test_equal_priority_goes_to_the_longest_wait_across_workloads() -> None:
    limiter = MemoryLimiter(max_concurrent=1, workloads={"a": Workload(), "b": Workload()})
    held = await limiter.acquire(now_or_never("a"))
    order = await grant_order(
        limiter,
        held=[held],
        arrivals=[("b1", "b"), ("a1", "a"), ("a2", "a"), ("b2", "b"), ("a3", "a")],
    )
    assert order == ["b1", "a1", "a2", "b2", "a3"]


async def test_arrival_order_within_a_workload() -> None:
    limiter = MemoryLimiter(max_concurrent=2)
    held = [await limiter.acquire(now_or_never()) for _ in range(2)]
    names = [f"w{i}" for i in range(8)]
    order = await grant_order(limiter, held=held, arrivals=[(n, "default") for n in names])
    assert order == names


# -- queue bounds and waits -----------------------------------------------------------------


async def test_max_queued_refuses_at_once_with_queue_full() -> None:
    limiter = MemoryLimiter(name="bounded", max_concurrent=1, max_queued=2)
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)
    held = await limiter.acquire(now_or_never())
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(2):
                    tg.start_soon(limiter.acquire, req())
                await anyio.wait_all_tasks_blocked()
                assert (await limiter.stats()).queued == 2
                # The slot is still held and nothing else can free one: this returns only
                # because the request is refused without waiting.
                with pytest.raises(ConcurrencyQueueFullError) as caught:
                    async with limiter.slot():
                        pytest.fail("the body must not run")
                assert (await limiter.stats()).queued == 2
                tg.cancel_scope.cancel()
    finally:
        unsubscribe()
    assert caught.value.limiter == "bounded"
    assert caught.value.workload == "default"
    assert caught.value.request_id is not None
    full = [e for e in events if e.kind == "queue-full"]
    assert len(full) == 1
    assert full[0].request_id == caught.value.request_id
    assert full[0].wait_time >= 0
    assert (await limiter.stats()).queued == 0
    await limiter.release(held)


async def test_max_queued_zero_refuses_every_waiter_but_grants_free_slots() -> None:
    limiter = MemoryLimiter(max_concurrent=1, max_queued=0)
    held = await limiter.acquire(now_or_never())
    with pytest.raises(ConcurrencyQueueFullError):
        async with limiter.slot():
            pytest.fail("the body must not run")
    await limiter.release(held)
    async with limiter.slot() as slot:
        assert slot.lease is not None


async def test_max_wait_zero_fails_fast_when_full_and_succeeds_when_free() -> None:
    limiter = MemoryLimiter(max_concurrent=1, workloads={"default": Workload(max_wait=0)})
    held = await limiter.acquire(now_or_never())
    # Nothing frees the held slot meanwhile: this returns only because it fails at once.
    with pytest.raises(ConcurrencyTimeoutError) as caught:
        async with limiter.slot():
            pytest.fail("the body must not run")
    assert isinstance(caught.value, TimeoutError)
    assert (await limiter.stats()).queued == 0
    await limiter.release(held)
    async with limiter.slot() as again:
        assert again.lease is not None
    assert (await limiter.stats()).active == 0


@on_mock_clock()
async def test_max_wait_timeout_raises_and_leaves_the_queue() -> None:
    limiter = MemoryLimiter(max_concurrent=1, workloads={"default": Workload(max_wait=5.0)})
    held = await limiter.acquire(now_or_never())
    start = anyio.current_time()
    with pytest.raises(ConcurrencyTimeoutError) as caught:
        async with limiter.slot():
            pytest.fail("the body must not run")
    assert isinstance(caught.value, TimeoutError)
    assert anyio.current_time() - start >= 5.0
    assert (await limiter.stats()).queued == 0
    # The timed-out request is not granted the slot later on.
    await limiter.release(held)
    assert (await limiter.stats()).active == 0


@on_real_asyncio()
async def test_max_wait_timeout_on_a_real_clock() -> None:
    limiter = MemoryLimiter(max_concurrent=1, workloads={"default": Workload(max_wait=0.05)})
    held = await limiter.acquire(now_or_never())
    with anyio.fail_after(30), pytest.raises(ConcurrencyTimeoutError):
        await limiter.acquire(req())
    assert (await limiter.stats()).queued == 0
    await limiter.release(held)
    assert (await limiter.stats()).active == 0


# -- leases ---------------------------------------------------------------------------------


async def test_lease_ids_are_never_reused() -> None:
    limiters = [MemoryLimiter(max_concurrent=3), MemoryLimiter(max_concurrent=3)]
    seen: set[str] = set()
    for _ in range(200):
        for limiter in limiters:
            leases = [await limiter.acquire(now_or_never()) for _ in range(3)]
            for lease in leases:
                assert lease.lease_id not in seen
                seen.add(lease.lease_id)
                await limiter.release(lease)
    assert len(seen) == 1200


@on_mock_clock()
async def test_an_unrenewed_lease_expires_and_its_slot_goes_to_the_next_waiter() -> None:
    limiter = MemoryLimiter(max_concurrent=1, lease_ttl=10.0)
    stale = await limiter.acquire(req())
    assert stale.expires_at == anyio.current_time() + 10.0
    granted: list[tuple[float, Lease]] = []

    async def waiter() -> None:
        lease = await limiter.acquire(req())
        granted.append((anyio.current_time(), lease))

    with anyio.fail_after(1000):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert granted == []
            await anyio.sleep(5.0)
            # Renewed before it expired: the holder keeps it.
            renewed = await limiter.renew(stale)
            assert renewed is not None
            assert renewed.expires_at == anyio.current_time() + 10.0
            assert granted == []
    assert renewed is not None
    # Both waiters got the slot in turn, each after the lease before it expired.
    assert len(granted) == 2
    assert granted[0][0] >= renewed.expires_at
    assert granted[1][0] >= granted[0][1].expires_at
    assert stale.lease_id != granted[0][1].lease_id
    assert await limiter.renew(stale) is None
    # Releasing the expired lease frees nothing that another request now holds.
    await limiter.release(stale)
    await anyio.sleep(1.0)
    assert (await limiter.stats()).active == 1


@on_mock_clock()
async def test_expiry_still_wakes_a_waiter_after_earlier_waiters_leave() -> None:
    limiter = MemoryLimiter(
        max_concurrent=1,
        lease_ttl=10.0,
        workloads={"gone": Workload(), "short": Workload(max_wait=2.0), "long": Workload()},
        default_workload="long",
    )
    await limiter.acquire(req("long"))  # never renewed: expires at 10
    start = anyio.current_time()
    granted: list[float] = []
    cancelled = anyio.CancelScope()

    async def cancelled_waiter() -> None:
        with cancelled:
            await limiter.acquire(req("gone"))

    async def impatient() -> None:
        with pytest.raises(ConcurrencyTimeoutError):
            await limiter.acquire(req("short"))

    async def patient() -> None:
        await limiter.acquire(req("long"))
        granted.append(anyio.current_time() - start)

    # The first waiter is cancelled and the second times out, both before the lease
    # expires; the last one must still be woken when it does.
    with anyio.fail_after(1000):
        async with anyio.create_task_group() as tg:
            for task in (cancelled_waiter, impatient, patient):
                tg.start_soon(task)
                await anyio.wait_all_tasks_blocked()
            await anyio.sleep(1.0)
            cancelled.cancel()
    assert len(granted) == 1
    assert granted[0] >= 10.0
    assert (await limiter.stats()).queued == 0


@on_mock_clock()
async def test_expiry_is_noticed_while_an_unservable_workload_waits() -> None:
    # Reservations take every slot, so "open" can never be served (a valid setting).
    limiter = MemoryLimiter(
        max_concurrent=1,
        lease_ttl=10.0,
        workloads={"reserved": Workload(reserved=1), "open": Workload()},
    )
    granted = anyio.Event()

    async def reserved_waiter() -> None:
        await limiter.acquire(req("reserved"))
        granted.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(limiter.acquire, req("open"))  # waits while no lease exists
        await anyio.wait_all_tasks_blocked()
        await limiter.acquire(req("reserved"))  # never renewed: expires at 10
        tg.start_soon(reserved_waiter)
        # (No stats() call meanwhile: it would sweep the expired lease itself.)
        with anyio.move_on_after(1000.0):
            await granted.wait()
        tg.cancel_scope.cancel()
    assert granted.is_set()


@on_real_asyncio()
async def test_an_unrenewed_lease_expires_on_a_real_clock() -> None:
    limiter = MemoryLimiter(max_concurrent=1, lease_ttl=0.05)
    stale = await limiter.acquire(req())
    with anyio.fail_after(30):
        fresh = await limiter.acquire(req())
    assert fresh.lease_id != stale.lease_id
    assert await limiter.renew(stale) is None
    await limiter.release(fresh)


async def test_renew_and_release_are_idempotent() -> None:
    limiter = MemoryLimiter(max_concurrent=1)
    first = await limiter.acquire(now_or_never())
    assert await limiter.renew(first) is not None
    assert await limiter.renew(first) is not None
    await limiter.release(first)
    await limiter.release(first)
    assert await limiter.renew(first) is None
    second = await limiter.acquire(now_or_never())
    # A repeated release of the old lease must not free the slot the new lease holds.
    await limiter.release(first)
    assert (await limiter.stats()).active == 1
    with pytest.raises(ConcurrencyTimeoutError):
        await limiter.acquire(now_or_never())
    assert await limiter.renew(second) is not None
    await limiter.release(second)
    assert (await limiter.stats()).active == 0


@on_mock_clock()
async def test_renew_returns_none_once_the_lease_expired() -> None:
    limiter = MemoryLimiter(max_concurrent=1, lease_ttl=3.0)
    lease = await limiter.acquire(req())
    await anyio.sleep(3.5)
    assert await limiter.renew(lease) is None
    assert (await limiter.stats()).active == 0


# -- construction and representation ---------------------------------------------------------

MODULE_LIMITER: MemoryLimiter[str] = MemoryLimiter(name="module-level", max_concurrent=2)


async def test_a_limiter_built_at_module_level_works_on_every_backend() -> None:
    active = peak = 0

    async def body() -> None:
        nonlocal active, peak
        async with MODULE_LIMITER.slot():
            active += 1
            peak = max(peak, active)
            for _ in range(3):
                await anyio.lowlevel.checkpoint()
            active -= 1

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(body)
    assert peak == 2
    stats = await MODULE_LIMITER.stats()
    assert (stats.active, stats.queued) == (0, 0)


async def test_repr_is_readable() -> None:
    limiter = seed_limiter()
    assert repr(limiter) == (
        "<slotwise.MemoryLimiter 'claude' 0/8 active, 0 queued (interactive 0/8, background 0/6)>"
    )
    for _ in range(6):
        await limiter.acquire(now_or_never("background"))
    for _ in range(2):
        await limiter.acquire(now_or_never("interactive"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(limiter.acquire, req("background"))
        await anyio.wait_all_tasks_blocked()
        text = repr(limiter)
        tg.cancel_scope.cancel()
    assert text.startswith("<slotwise.MemoryLimiter 'claude' 8/8 active, 1 queued (")
    assert "interactive 2/8" in text
    assert "background 6/6" in text
    assert text.endswith(">")


# -- many waiters ---------------------------------------------------------------------------


async def test_cancelling_ten_thousand_waiters_in_random_order() -> None:
    limiter = MemoryLimiter(max_concurrent=1)
    held = await limiter.acquire(now_or_never())
    count = 10_000
    scopes = [anyio.CancelScope() for _ in range(count)]
    granted = 0

    async def waiter(scope: anyio.CancelScope) -> None:
        nonlocal granted
        with scope:
            await limiter.acquire(req())
            granted += 1

    rng = random.Random(2)
    order = list(range(count))
    rng.shuffle(order)
    async with anyio.create_task_group() as tg:
        for scope in scopes:
            tg.start_soon(waiter, scope)
        await anyio.wait_all_tasks_blocked()
        assert (await limiter.stats()).queued == count
        for start in range(0, count, 1000):
            for index in order[start : start + 1000]:
                scopes[index].cancel()
            await anyio.wait_all_tasks_blocked()
            assert (await limiter.stats()).queued == count - start - 1000
    assert granted == 0
    stats = await limiter.stats()
    assert (stats.active, stats.queued) == (1, 0)
    await limiter.release(held)
    fresh = await limiter.acquire(now_or_never())
    await limiter.release(fresh)


@on_mock_clock()
async def test_a_stale_expiry_entry_does_not_send_a_free_slot_down_the_waiting_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A renewed and then released lease leaves entries in the expiry heap that no lease
    # owns; once their time passes, a free slot is still taken at once, not submitted to
    # the queue (which would sweep them first).
    limiter = MemoryLimiter(max_concurrent=2, lease_ttl=10.0)
    lease = await limiter.acquire(req())
    await anyio.sleep(6.0)
    assert await limiter.renew(lease) is not None
    await anyio.sleep(2.0)
    await limiter.release(lease)
    await anyio.sleep(3.0)  # past the first entry's time (10) and before the second (16)
    submitted: list[str] = []
    take = MemoryLimiter._take

    def spy(self: MemoryLimiter, workload: str, *args: object, **kwargs: object) -> object:
        submitted.append(workload)
        return take(self, workload, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(MemoryLimiter, "_take", spy)
    async with limiter.slot() as slot:
        assert slot.lease is not None
        # The stale entries are gone; the heap's only entry is the new lease's.
        assert limiter._state._expiries == [(slot.lease.expires_at, slot.lease.lease_id)]
    assert submitted == []
    assert (await limiter.stats()).active == 0
