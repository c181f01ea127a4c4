"""Rates, tokens and provider pushback on MemoryLimiter: requests and tokens per period in the
same decision as the slots, a pause that one refusal puts on every task, an adaptive limit,
limits changed at run time, and per-workload queue bounds.

Timing is checked exactly on trio's MockClock; a few tests also run on asyncio in real time.
"""

from __future__ import annotations

import math
import random
from typing import Any

import anyio
import pytest
from trio.testing import MockClock

import slotwise
from slotwise import (
    Adaptive,
    ConcurrencyConfigError,
    ConcurrencyEvent,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
    MemoryLimiter,
    Rate,
    Workload,
)
from slotwise._core.adaptive import backoff_delay
from slotwise._core.rates import Bucket, BucketRule
from slotwise._runtime.loop import AsyncioLoop, TrioLoop

pytestmark = pytest.mark.anyio


def on_mock_clock() -> pytest.MarkDecorator:
    return pytest.mark.parametrize(
        "anyio_backend",
        [pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock")],
    )


def now() -> float:
    return anyio.current_time()


# -- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": Rate(requests=0)}, "rate.requests must be a positive integer"),
        ({"rate": Rate(tokens=-5)}, "rate.tokens must be a positive integer"),
        ({"rate": Rate()}, "rate limits nothing"),
        ({"rate": Rate(requests=5, per=0)}, "rate.per must be a positive"),
        ({"rate": Rate(requests=5, per=float("inf"))}, "rate.per must be a positive, finite"),
        ({"rate": 50}, "rate must be a slotwise.Rate"),
        ({"rate": Rate(requests=5, latency=-1)}, "rate.latency must be a non-negative, finite"),
        ({"rate": Rate(requests=5, latency=float("inf"))}, "rate.latency must be a non-neg"),
        (
            {"workloads": {"a": Workload(rate=Rate(tokens=5, latency=float("nan")))}},
            r"workloads\['a'\].rate.latency must be",
        ),
        (
            {
                "rate": Rate(requests=10, per=60),
                "workloads": {"a": Workload(rate=Rate(requests=20, per=60))},
            },
            r"workloads\['a'\].rate allows 20 requests per 60s, more than the limiter's",
        ),
        (
            {"workloads": {"a": Workload(max_queued=-1)}},
            r"workloads\['a'\].max_queued must be None or a non-negative integer",
        ),
        ({"adaptive": Adaptive(min_concurrent=0)}, "adaptive.min_concurrent must be a positive"),
        ({"adaptive": Adaptive(min_concurrent=9)}, r"adaptive.min_concurrent \(9\) is above"),
        (
            {"adaptive": Adaptive(min_concurrent=1), "workloads": {"a": Workload(reserved=2)}},
            "must cover the reservations",
        ),
        ({"adaptive": Adaptive(min_concurrent=2, backoff=1.0)}, "adaptive.backoff must be"),
    ],
)
def test_invalid_rate_and_adaptive_settings_name_the_setting(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConcurrencyConfigError, match=message):
        MemoryLimiter(name="x", max_concurrent=8, **kwargs)


def test_a_workload_rate_at_the_limiters_pace_over_another_period_is_allowed() -> None:
    # 1 per second is 60 per minute: equal, not above.
    MemoryLimiter(
        max_concurrent=2,
        rate=Rate(requests=60, per=60),
        workloads={"a": Workload(rate=Rate(requests=1, per=1))},
    )


# -- requests per period ----------------------------------------------------------------------


@on_mock_clock()
async def test_a_burst_up_to_the_bucket_then_the_refill_rate() -> None:
    limiter = MemoryLimiter(name="rpm", max_concurrent=10, rate=Rate(requests=2, per=1.0))
    start = now()
    granted: list[float] = []

    async def request() -> None:
        async with limiter.slot():
            granted.append(now() - start)

    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(request)
    assert granted == [0.0, 0.0, 0.5, 1.0, 1.5, 2.0]


@on_mock_clock()
async def test_a_latency_reserve_delays_each_wait_by_the_latency_at_the_same_pace() -> None:
    """The refill of 0.25 s (half a request) stays in the bucket: the burst is one request
    shorter, and every later grant comes 0.25 s after it would have (see the test above)."""
    limiter = MemoryLimiter(
        name="rpm", max_concurrent=10, rate=Rate(requests=2, per=1.0, latency=0.25)
    )
    start = now()
    granted: list[float] = []

    async def request() -> None:
        async with limiter.slot():
            granted.append(now() - start)

    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(request)
    assert granted == pytest.approx([0.0, 0.25, 0.75, 1.25, 1.75, 2.25])


@on_mock_clock()
async def test_a_request_as_large_as_the_bucket_needs_it_full_whatever_the_reserve() -> None:
    limiter = MemoryLimiter(
        name="tpm", max_concurrent=10, rate=Rate(tokens=100, per=1.0, latency=0.5)
    )
    start = now()
    async with limiter.slot(tokens=100):
        assert now() == start
    async with limiter.slot(tokens=100):
        assert now() - start == pytest.approx(1.0)


def test_a_bucket_short_by_a_rounding_error_grants_at_once() -> None:
    """Refills are float sums: a level of 1.9999999999999 must grant 2 now, not ask for a
    wait of 1e-16 s that no float clock can add (on a mock clock: a waiter woken at the same
    instant for ever)."""
    rule = BucketRule(kind="tokens", capacity=1000, per=1.0)
    bucket = Bucket(rule=rule, level=1.999999999999904, updated=3.3545148639039803)
    assert bucket.holds(2)
    assert bucket.wait(2) == 0.0
    assert not Bucket(rule=rule, level=1.99, updated=0.0).holds(2)


class ProviderBucket:
    """A provider's own token bucket, which counts a request when it arrives."""

    def __init__(self, capacity: int, per: float, start: float) -> None:
        self.capacity, self.per = capacity, per
        self.level, self.updated = float(capacity), start

    def take(self, cost: int, at: float) -> bool:
        self.level = min(self.capacity, self.level + (at - self.updated) * self.capacity / self.per)
        self.updated = at
        fits = self.level >= cost - 1e-9
        self.level -= cost
        return fits


async def refusals_at_a_provider(latency: float, seed: int) -> int:
    """Requests of random sizes, in random bursts, each reaching the provider a random time
    (up to 0.2 s) after its grant: how many find the provider's bucket short."""
    rng = random.Random(seed)
    limiter = MemoryLimiter(
        name="p",
        max_concurrent=20,
        rate=Rate(requests=5, tokens=1000, per=1.0, latency=latency),
    )
    start = now()
    requests = ProviderBucket(5, 1.0, start)
    tokens = ProviderBucket(1000, 1.0, start)
    refused = 0

    async def request(cost: int, transit: float, hold: float) -> None:
        nonlocal refused
        async with limiter.slot(tokens=cost):
            await anyio.sleep(transit)
            if not (requests.take(1, now()) & tokens.take(cost, now())):
                refused += 1
            await anyio.sleep(hold)

    async with anyio.create_task_group() as tg:
        for _ in range(12):
            for _ in range(rng.randint(1, 8)):
                tg.start_soon(request, rng.randint(1, 600), rng.uniform(0, 0.2), rng.random())
            await anyio.sleep(rng.uniform(0, 3))
    return refused


@on_mock_clock()
@pytest.mark.parametrize("seed", range(8))
async def test_with_its_latency_reserved_no_request_reaches_the_provider_early(
    seed: int,
) -> None:
    assert await refusals_at_a_provider(latency=0.2, seed=seed) == 0


@on_mock_clock()
async def test_without_a_reserve_requests_granted_as_a_bucket_refills_arrive_early() -> None:
    """The control for the test above."""
    assert sum([await refusals_at_a_provider(latency=0.0, seed=seed) for seed in range(8)]) > 0


@on_mock_clock()
async def test_a_workload_rate_is_a_ceiling_inside_the_limiters() -> None:
    limiter = MemoryLimiter(
        name="rpm",
        max_concurrent=10,
        rate=Rate(requests=10, per=1.0),
        workloads={"slow": Workload(rate=Rate(requests=1, per=1.0)), "fast": Workload()},
    )
    start = now()
    times: dict[str, list[float]] = {"slow": [], "fast": []}

    async def request(workload: str) -> None:
        async with limiter.slot(workload):
            times[workload].append(now() - start)

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(request, "slow")
        for _ in range(3):
            tg.start_soon(request, "fast")
    assert times["slow"] == [0.0, 1.0, 2.0]
    # "slow" waiting for its own bucket holds up nobody else.
    assert times["fast"] == [0.0, 0.0, 0.0]


# -- tokens -----------------------------------------------------------------------------------


@on_mock_clock()
async def test_token_estimates_are_charged_and_corrected() -> None:
    limiter = MemoryLimiter(name="tpm", max_concurrent=10, rate=Rate(tokens=1000, per=10.0))
    start = now()
    async with limiter.slot(tokens=800) as first:
        assert limiter.stats_nowait().buckets["tokens"].level == pytest.approx(200)
        first.used_tokens(300)  # a smaller answer than feared: 500 come back
        assert limiter.stats_nowait().buckets["tokens"].level == pytest.approx(700)
    async with limiter.slot(tokens=700):
        assert now() - start == 0.0
    async with limiter.slot(tokens=500) as late:
        # Empty bucket: 500 tokens at 100 a second.
        assert now() - start == pytest.approx(5.0)
        late.used_tokens(900)  # more than estimated: the bucket goes below zero
    assert limiter.stats_nowait().buckets["tokens"].level == pytest.approx(-400)
    async with limiter.slot(tokens=100):
        assert now() - start == pytest.approx(10.0)


async def test_a_request_larger_than_a_bucket_fails_at_once() -> None:
    limiter = MemoryLimiter(
        name="tpm",
        max_concurrent=2,
        rate=Rate(tokens=1000),
        workloads={"small": Workload(rate=Rate(tokens=100)), "big": Workload()},
    )
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)
    try:
        with pytest.raises(ConcurrencyConfigError, match=r"a request of 1001 tokens can never"):
            async with limiter.slot("big", tokens=1001):
                pytest.fail("never granted")
        with pytest.raises(
            ConcurrencyConfigError, match=r"bucket 'small.tokens' holds at most 100"
        ):
            async with limiter.slot("small", tokens=101):
                pytest.fail("never granted")
    finally:
        unsubscribe()
    assert [e.kind for e in events].count("config-error") == 2
    assert limiter.stats_nowait().queued == 0


async def test_a_request_without_an_estimate_costs_no_tokens() -> None:
    limiter = MemoryLimiter(name="tpm", max_concurrent=4, rate=Rate(tokens=10))
    async with limiter.slot(), limiter.slot(allow_nested=True):
        assert limiter.stats_nowait().buckets["tokens"].level == 10


async def test_a_request_without_an_estimate_waits_for_no_token_bucket() -> None:
    """Not even for one spent below zero: a token rate paces only the requests that give an
    estimate (max_wait=0: a request that would wait fails at once)."""
    limiter = MemoryLimiter(
        name="tpm",
        max_concurrent=4,
        rate=Rate(tokens=10, per=60.0),
        workloads={"default": Workload(max_wait=0)},
    )
    async with limiter.slot(tokens=10) as slot:
        slot.used_tokens(30)
    # In real time: the bucket refills by a token every 6 s meanwhile.
    assert limiter.stats_nowait().buckets["tokens"].level == pytest.approx(-20, abs=0.01)
    async with limiter.slot():
        pass
    with pytest.raises(ConcurrencyTimeoutError):
        async with limiter.slot(tokens=1):
            pytest.fail("the bucket is 20 tokens below zero")


async def test_bad_token_counts_are_refused() -> None:
    limiter = MemoryLimiter(name="tpm", max_concurrent=4, rate=Rate(tokens=10))
    with pytest.raises(ConcurrencyConfigError, match="tokens must be None or a non-negative"):
        async with limiter.slot(tokens=-1):
            pass
    async with limiter.slot() as slot:
        with pytest.raises(ValueError, match="tokens must be a non-negative integer"):
            slot.used_tokens(-3)


# -- one decision: priority and buckets -------------------------------------------------------


@on_mock_clock()
async def test_no_lower_priority_request_overtakes_one_waiting_for_the_same_bucket() -> None:
    limiter = MemoryLimiter(
        name="tpm",
        max_concurrent=10,
        rate=Rate(tokens=1000, per=10.0),
        workloads={"interactive": Workload(priority=10), "background": Workload()},
    )
    order: list[str] = []

    async def request(workload: str, tokens: int) -> None:
        async with limiter.slot(workload, tokens=tokens, allow_nested=True):
            order.append(workload)

    async with (
        limiter.slot("background", tokens=900),  # leaves 100 tokens
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(request, "interactive", 500)  # waits 4 s for its 500
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(request, "background", 50)  # would fit now, but must not overtake
        await anyio.wait_all_tasks_blocked()
        assert order == []
    assert order == ["interactive", "background"]


@on_mock_clock()
async def test_a_waiter_is_woken_when_its_bucket_refills_and_says_so() -> None:
    limiter = MemoryLimiter(name="rpm", max_concurrent=5, rate=Rate(requests=1, per=3.0))
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)
    try:
        async with limiter.slot():
            pass
        start = now()
        async with limiter.slot():
            assert now() - start == pytest.approx(3.0)
    finally:
        unsubscribe()
    acquired = [e for e in events if e.kind == "acquired"]
    assert [e.waited_for for e in acquired] == [(), ("requests",)]


async def test_requests_waiting_for_a_refill_set_one_timer_between_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Twenty requests wait for an empty bucket: one of them (the clock watch of its thread)
    sets a timer for the refill, the others none; it grants whichever the refill is for."""
    timers: dict[object, float] = {}  # each task's latest wake-up time (inf: no timer)

    def spy(original: Any) -> Any:
        def park(self: Any, waker: Any, until: float) -> Any:
            timers[anyio.get_current_task().id] = until
            return original(self, waker, until)

        return park

    for loop_class in (AsyncioLoop, TrioLoop):
        monkeypatch.setattr(loop_class, "park", spy(loop_class.park))
    limiter = MemoryLimiter(name="rpm", max_concurrent=30, rate=Rate(requests=1, per=60.0))
    async with limiter.slot():
        pass  # the bucket is empty for a minute

    async def request() -> None:
        async with limiter.slot():
            pass

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(request)
        await anyio.wait_all_tasks_blocked()
        assert limiter.stats_nowait().queued == 20
        assert len(timers) == 20
        assert len([until for until in timers.values() if until != math.inf]) == 1
        tg.cancel_scope.cancel()


@on_mock_clock()
async def test_a_waiter_blocked_by_a_bucket_at_anothers_release_is_woken_at_the_refill() -> None:
    # It parked waiting for a slot; the release that frees one finds its bucket short, so
    # from then on it waits for the refill, which nobody's timer was set for.
    limiter = MemoryLimiter(name="tpm", max_concurrent=1, rate=Rate(tokens=1_000, per=10.0))
    granted: list[float] = []

    async def second() -> None:
        async with limiter.slot(tokens=900, allow_nested=True):  # started inside a slot
            granted.append(now())

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg, limiter.slot(tokens=900) as slot:
            tg.start_soon(second)
            await anyio.sleep(1.0)
            slot.used_tokens(900)
            # At 1 s the bucket holds 100 + 100 refilled: 700 more take 7 s.
    assert granted == [pytest.approx(8.0)]


@on_mock_clock()
async def test_a_waiter_freed_a_slot_then_short_of_tokens_is_woken_when_they_refill() -> None:
    # It waited for a slot first, with nothing to refill; the release that gave it room
    # leaves it waiting for its tokens, and the clock must now wake it at the refill.
    limiter = MemoryLimiter(name="tpm", max_concurrent=1, rate=Rate(tokens=100, per=10.0))
    holder = await slotwise.acquire(limiter=limiter, tokens=100)
    granted = anyio.Event()

    async def waiter() -> None:
        async with limiter.slot(tokens=100, allow_nested=True):
            granted.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        released_at = now()
        await holder.release()
        with anyio.fail_after(60):  # its lease would expire after 30 s: the wake-up then
            await granted.wait()
    assert now() - released_at == pytest.approx(10.0)


@on_mock_clock()
async def test_max_wait_ends_a_wait_for_a_bucket() -> None:
    limiter = MemoryLimiter(
        name="rpm",
        max_concurrent=5,
        rate=Rate(requests=1, per=60.0),
        workloads={"default": Workload(max_wait=2.0)},
    )
    async with limiter.slot():
        pass
    start = now()
    with pytest.raises(ConcurrencyTimeoutError):
        async with limiter.slot():
            pytest.fail("the bucket refills only in a minute")
    assert now() - start == pytest.approx(2.0)
    assert limiter.stats_nowait().queued == 0


# -- pushback ---------------------------------------------------------------------------------


@on_mock_clock()
async def test_one_refusal_pauses_every_new_grant_until_retry_after() -> None:
    limiter = MemoryLimiter(name="p", max_concurrent=3)  # one free slot: grants in turn
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)
    granted: list[tuple[str, float]] = []
    start = now()

    async def request(name: str) -> None:
        async with limiter.slot(allow_nested=True):
            granted.append((name, now() - start))

    try:
        async with limiter.slot() as held, limiter.slot(allow_nested=True) as refused:
            refused.throttled(retry_after=5.0, reason="429")
            assert limiter.stats_nowait().paused_until is not None
            async with anyio.create_task_group() as tg:
                for name in ("a", "b", "c"):
                    tg.start_soon(request, name)
                    await anyio.wait_all_tasks_blocked()
            assert not held.released  # held slots are untouched
    finally:
        unsubscribe()
    # Nothing was granted during the pause; then the waiters went in arrival order.
    assert granted == [("a", 5.0), ("b", 5.0), ("c", 5.0)]
    [paused] = [e for e in events if e.kind == "paused"]
    assert paused.reason == "429"
    assert paused.until == pytest.approx(paused.timestamp + 5.0, abs=0.01)
    assert limiter.stats_nowait().paused_until is None


@on_mock_clock()
async def test_a_waits_max_wait_keeps_running_during_a_pause() -> None:
    limiter = MemoryLimiter(
        name="p", max_concurrent=4, workloads={"default": Workload(max_wait=1.0)}
    )
    async with limiter.slot() as slot:
        slot.throttled(retry_after=10.0)
        start = now()
        with pytest.raises(ConcurrencyTimeoutError):
            async with limiter.slot(allow_nested=True):
                pytest.fail("paused")
        assert now() - start == pytest.approx(1.0)


@on_mock_clock()
async def test_without_retry_after_the_pause_backs_off_doubling_from_a_second() -> None:
    limiter = MemoryLimiter(name="p", max_concurrent=4)
    held = [limiter.slot(allow_nested=True) for _ in range(3)]
    slots = [await h.__aenter__() for h in held]
    # Three requests in flight refused together: one burst, a pause of about a second.
    start = now()
    for slot in slots:
        slot.throttled()
    async with limiter.slot(allow_nested=True) as first:
        assert 0.75 <= now() - start <= 1.25
        # Refused again, granted after that pause and with no success between them: 2 s.
        first.throttled()
    start = now()
    async with limiter.slot(allow_nested=True) as second:
        assert 1.5 <= now() - start <= 2.5
        second.throttled()
    start = now()
    async with limiter.slot(allow_nested=True):
        assert 3.0 <= now() - start <= 5.0
    for h in held:
        await h.__aexit__(None, None, None)
    # Successes reset the backoff: the next refusal pauses about a second again.
    async with limiter.slot() as slot:
        slot.throttled()
    start = now()
    async with limiter.slot():
        assert 0.75 <= now() - start <= 1.25


async def test_bad_retry_after_is_refused() -> None:
    limiter = MemoryLimiter(name="p", max_concurrent=1)
    async with limiter.slot() as slot:
        for bad in (-1.0, float("nan"), float("inf"), "5"):
            with pytest.raises(ValueError, match="retry_after must be None or seconds"):
                slot.throttled(retry_after=bad)  # type: ignore[arg-type]
            # The limiter's own throttle() too: an endless pause would stop it for good.
            with pytest.raises(ValueError, match="retry_after must be None or seconds"):
                limiter.throttle(slot.lease, bad)  # type: ignore[arg-type]
    assert limiter.stats_nowait().paused_until is None


def test_a_long_run_of_refusals_without_retry_after_backs_off_at_most_a_minute() -> None:
    # 2.0**1024 overflows a float: the 1,024th refusal in a row must not raise.
    assert backoff_delay(5_000, 1.0) == backoff_delay(10, 1.0) == 60.0


# -- the adaptive limit -----------------------------------------------------------------------


@on_mock_clock()
async def test_the_adaptive_limit_falls_on_pushback_and_climbs_on_success() -> None:
    limiter = MemoryLimiter(name="aimd", max_concurrent=8, adaptive=Adaptive(min_concurrent=2))
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)
    try:
        async with limiter.slot() as slot:
            slot.throttled(retry_after=0.0)
        assert limiter.stats_nowait().effective_max_concurrent == 4
        # A burst of refusals of requests in flight together counts once.
        held = [limiter.slot(allow_nested=True) for _ in range(3)]
        slots = [await h.__aenter__() for h in held]
        for s in slots:
            s.throttled(retry_after=0.0)
        for h in held:
            await h.__aexit__(None, None, None)
        assert limiter.stats_nowait().effective_max_concurrent == 2
        # Successes of slots granted with the limit full (or after one that was), with at
        # least half the limit in use at their release: one more slot per round trip (as
        # many counted successes as the limit). Waves at the limit, the last granted released
        # first: at a limit of 3, the release that leaves one in use does not count.
        for n in (2, 3, 3):
            held = [await slotwise.acquire(limiter=limiter) for _ in range(n)]
            for slot in reversed(held):
                await slot.release()
        assert limiter.stats_nowait().effective_max_concurrent == 4
        # Two slots at a time at a limit of 4: 4 is never tried, however many succeed.
        for _ in range(4 * 4):
            async with limiter.slot(), limiter.slot(allow_nested=True):
                pass
        assert limiter.stats_nowait().effective_max_concurrent == 4
        # One slot at a time, a quarter of the limit: says nothing of the room above it.
        for _ in range(4 * 4):
            async with limiter.slot():
                pass
        assert limiter.stats_nowait().effective_max_concurrent == 4
    finally:
        unsubscribe()
    changes = [(e.old, e.new, e.reason) for e in events if e.kind == "limit-changed"]
    assert changes == [
        (8, 4, "pushback"),
        (4, 2, "pushback"),
        (2, 3, "recovered"),
        (3, 4, "recovered"),
    ]


async def test_unused_reservations_count_as_occupied_for_the_climb() -> None:
    # A success counts with half the limit occupied: slots held, and reserved slots left
    # unused, which no other workload can take; so is the limit tried by a slot granted with
    # it occupied. Here the limit starts at the reservation: "batch" can take nothing until
    # it climbs on "chat"'s successes, though "chat" uses only 3 of its 8 slots.
    limiter = MemoryLimiter(
        name="reserved",
        max_concurrent=20,
        workloads={"batch": Workload(), "chat": Workload(reserved=8)},
        default_workload="batch",
        adaptive=Adaptive(min_concurrent=8, slow_start=True),
    )
    assert limiter.stats_nowait().effective_max_concurrent == 8
    held = [await slotwise.acquire("chat", limiter=limiter) for _ in range(3)]
    for slot in held:
        await slot.release()  # 8 occupied each time: 3, 2, 1 held and the rest reserved
    # The first climbs to 9; 9 is not tried by the others (granted with 8 occupied).
    assert limiter.stats_nowait().effective_max_concurrent == 9
    with anyio.fail_after(5):
        async with limiter.slot("batch"):
            assert limiter.stats_nowait().workloads["batch"].active == 1


@on_mock_clock()
async def test_cancelled_and_failed_requests_are_no_successes() -> None:
    # A cancelled or failed body says nothing of the provider's room: the adaptive limit does
    # not climb on it, nor does a backoff start again from a second.
    limiter = MemoryLimiter(
        name="aimd", max_concurrent=8, adaptive=Adaptive(min_concurrent=2, slow_start=True)
    )
    assert limiter.stats_nowait().effective_max_concurrent == 2
    with anyio.move_on_after(1):
        async with limiter.slot():
            await anyio.sleep(5)  # cancelled
    with pytest.raises(ValueError, match="the body failed"):
        async with limiter.slot():
            raise ValueError("the body failed")
    slot = await slotwise.acquire(limiter=limiter)
    await slot.release("failed")
    slot = await slotwise.acquire(limiter=limiter)
    slot.release_sync("cancelled")
    assert limiter.stats_nowait().effective_max_concurrent == 2
    async with limiter.slot(), limiter.slot(allow_nested=True):
        pass
    # A completed one, granted with the limit full, climbs.
    assert limiter.stats_nowait().effective_max_concurrent == 3

    # A refusal without a retry-after pauses about a second; with only a failure since,
    # the next one backs off to about two.
    async with limiter.slot() as refused:
        refused.throttled()
    with pytest.raises(ValueError, match="the body failed"):
        async with limiter.slot():
            raise ValueError("the body failed")
    async with limiter.slot() as refused:
        refused.throttled()
    start = now()
    async with limiter.slot():
        assert 1.5 <= now() - start <= 2.5


@on_mock_clock()
async def test_shrinking_never_revokes_a_held_slot() -> None:
    limiter = MemoryLimiter(name="aimd", max_concurrent=4, adaptive=Adaptive(min_concurrent=1))
    held = [limiter.slot(allow_nested=True) for _ in range(4)]
    slots = [await h.__aenter__() for h in held]
    slots[0].throttled(retry_after=0.0)
    assert limiter.stats_nowait().effective_max_concurrent == 2
    assert all(not s.released for s in slots)
    assert limiter.stats_nowait().active == 4
    got = anyio.Event()

    async def newcomer() -> None:
        async with limiter.slot(allow_nested=True):
            got.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(newcomer)
        for h in held[:2]:
            await h.__aexit__(None, None, None)
            await anyio.wait_all_tasks_blocked()
            assert not got.is_set()  # 3, then 2 active: not under the limit of 2
        await held[2].__aexit__(None, None, None)
        await anyio.wait_all_tasks_blocked()
        assert got.is_set()
    await held[3].__aexit__(None, None, None)


@on_mock_clock()
async def test_aimd_follows_a_provider_whose_capacity_drops_and_comes_back() -> None:
    # A provider that serves `capacity` requests at once and refuses the rest with a 429.
    limiter = MemoryLimiter(name="aimd", max_concurrent=16, adaptive=Adaptive(min_concurrent=2))
    capacity = 16
    in_flight = 0
    refusals: list[float] = []
    limits: list[tuple[float, int]] = []
    start = now()

    async def call() -> None:
        nonlocal in_flight
        async with limiter.slot() as slot:
            if in_flight >= capacity:
                refusals.append(now() - start)
                slot.throttled(retry_after=0.0, reason="429")
                return
            in_flight += 1
            try:
                await anyio.sleep(1.0)
            finally:
                in_flight -= 1

    async def client() -> None:
        while now() - start < 90:
            await call()

    async def provider() -> None:
        nonlocal capacity
        await anyio.sleep(30)
        capacity = 6
        await anyio.sleep(30)
        capacity = 16

    async def sample() -> None:
        while now() - start < 90:
            limits.append((now() - start, limiter.stats_nowait().effective_max_concurrent or 0))
            await anyio.sleep(1.0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(provider)
        tg.start_soon(sample)
        for _ in range(24):
            tg.start_soon(client)
    # While the capacity is 6: the limit comes down to it within a few round trips, and the
    # refusals stop (AIMD probes upward now and then: a few more are expected).
    dropped = [limit for t, limit in limits if 40 <= t < 60]
    assert max(dropped) <= 8
    assert len([t for t in refusals if 40 <= t < 60]) <= 6
    # Back at 16, the limit climbs back up.
    assert max(limit for t, limit in limits if t >= 75) >= 12


@on_mock_clock()
@pytest.mark.parametrize("seed", [7, 8, 9])
async def test_the_limit_never_climbs_two_slots_above_what_the_provider_took(seed: int) -> None:
    # A provider that takes 6 requests at once and refuses the next with a 429, in front of a
    # slow start from 2 toward 32. A success climbs only if its request was granted with the
    # limit full, so the limit goes at most one slot past what the provider took: the
    # successes that come back while that slot's request is refused cannot climb further.
    capacity = 6
    limiter = MemoryLimiter(
        name="aimd", max_concurrent=32, adaptive=Adaptive(min_concurrent=2, slow_start=True)
    )
    rng = random.Random(seed)
    in_flight = 0
    refusals: list[float] = []
    limits: list[int] = []
    start = now()

    def on_event(event: ConcurrencyEvent) -> None:
        if event.kind == "limit-changed":
            assert event.new is not None
            limits.append(event.new)

    async def client() -> None:
        nonlocal in_flight
        while now() - start < 60:
            async with limiter.slot() as slot:
                if in_flight >= capacity:
                    refusals.append(now() - start)
                    await anyio.sleep(0.2)  # the 429's way back
                    slot.throttled(retry_after=0.5, reason="429")
                    continue
                in_flight += 1
                try:
                    await anyio.sleep(rng.uniform(0.5, 1.5))
                finally:
                    in_flight -= 1

    unsubscribe = limiter.subscribe(on_event)
    try:
        async with anyio.create_task_group() as tg:
            for _ in range(24):
                tg.start_soon(client)
    finally:
        unsubscribe()
    assert max(limits) == capacity + 1  # it found the provider's limit, and went no higher
    # The first crossing costs one refusal, as does each later probe (additive, one slot a
    # round trip after a decrease): a handful a minute, not one per success in flight.
    first = [t for t in refusals if t < refusals[0] + 0.5]
    assert len(first) == 1
    assert len(refusals) <= 12


# -- set_limits -------------------------------------------------------------------------------


async def test_set_limits_applies_at_once_and_validates_like_the_constructor() -> None:
    limiter = MemoryLimiter(name="s", max_concurrent=2)
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)
    try:
        with pytest.raises(ConcurrencyConfigError, match="max_concurrent must be a positive"):
            await limiter.set_limits(max_concurrent=0)
        assert limiter.stats_nowait().max_concurrent == 2  # unchanged
        await limiter.set_limits(max_concurrent=3, rate=Rate(requests=100))
        stats = limiter.stats_nowait()
        assert stats.max_concurrent == 3
        assert stats.buckets["requests"].capacity == 100
        await limiter.set_limits(rate=None)
        assert limiter.stats_nowait().buckets == {}
    finally:
        unsubscribe()
    assert [(e.old, e.new, e.reason) for e in events if e.kind == "limit-changed"] == [
        (2, 3, "set_limits")
    ]


async def test_set_limits_keeps_held_slots_and_refuses_waiters_of_a_removed_workload() -> None:
    limiter = MemoryLimiter(
        name="s", max_concurrent=1, workloads={"old": Workload(), "kept": Workload()}
    )
    errors: list[BaseException] = []

    async def waits_for_old() -> None:
        try:
            async with limiter.slot("old", allow_nested=True):
                pytest.fail("its workload is gone")
        except ConcurrencyConfigError as exc:
            errors.append(exc)

    async with limiter.slot("old"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waits_for_old)
            await anyio.wait_all_tasks_blocked()
            await limiter.set_limits(workloads={"kept": Workload()})
        assert len(errors) == 1
        assert "removed" in str(errors[0])
        stats = limiter.stats_nowait()
        assert stats.workloads["old"].active == 1  # still counted, until released
        with anyio.move_on_after(0.1) as waited:
            async with limiter.slot("kept", allow_nested=True):
                pytest.fail("the old workload's slot still counts")
        assert waited.cancelled_caught
    async with limiter.slot("kept"):
        pass
    with pytest.raises(ConcurrencyConfigError, match="unknown workload 'old'"):
        async with limiter.slot("old"):
            pass


# -- per-workload queue bounds ----------------------------------------------------------------


async def test_a_workload_queue_bound_keeps_room_in_the_queue_for_others() -> None:
    limiter = MemoryLimiter(
        name="q",
        max_concurrent=1,
        max_queued=10,
        workloads={"background": Workload(max_queued=2), "interactive": Workload()},
    )
    holder = limiter.slot("background")
    await holder.__aenter__()
    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(_enter, limiter, "background")
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(ConcurrencyQueueFullError, match="workload 'background'"):
            async with limiter.slot("background", allow_nested=True):
                pass
        tg.start_soon(_enter, limiter, "interactive")
        await anyio.wait_all_tasks_blocked()
        assert limiter.stats_nowait().queued == 3
        await holder.__aexit__(None, None, None)
    assert limiter.stats_nowait().active == 0


async def _enter(limiter: MemoryLimiter[Any], workload: str) -> None:
    async with limiter.slot(workload, allow_nested=True):
        pass


# -- threads ----------------------------------------------------------------------------------


def test_sync_slots_take_tokens_too() -> None:
    limiter = MemoryLimiter(name="sync", max_concurrent=2, rate=Rate(tokens=100))
    with limiter.sync_slot(tokens=60) as slot:
        assert limiter.stats_nowait().buckets["tokens"].level == pytest.approx(40, abs=0.1)
        slot.used_tokens(10)
    assert limiter.stats_nowait().buckets["tokens"].level == pytest.approx(90, abs=0.1)
    with (
        pytest.raises(ConcurrencyTimeoutError),
        slotwise.sync_slot(limiter=limiter, tokens=95, timeout=0.05),
    ):
        pass


# -- what the provider says is left -----------------------------------------------------------


@on_mock_clock()
async def test_the_providers_remaining_count_lowers_a_bucket_never_raises_it() -> None:
    limiter = MemoryLimiter(name="obs", max_concurrent=5, rate=Rate(requests=10, per=10.0))
    async with limiter.slot() as slot:
        slot.provider_remaining(requests=2)  # the provider counted other clients too
        assert limiter.stats_nowait().buckets["requests"].level == pytest.approx(2)
        slot.provider_remaining(requests=8)  # more than slotwise thinks: ignored
        assert limiter.stats_nowait().buckets["requests"].level == pytest.approx(2)
    start = now()
    for _ in range(3):
        async with limiter.slot():
            pass
    assert now() - start == pytest.approx(1.0)  # two left, then one a second
