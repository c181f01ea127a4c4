"""Limits learned from the provider (`Slot.provider_limits()`, the `x-ratelimit-limit-*`
headers) and the adaptive limit's slow start, on MemoryLimiter and in the pure core.

The rule under test: a learned limit caps a rate bucket's capacity and refill at the lesser of
the configured rate and the provider's (scaled from a minute to the bucket's period); each
statement replaces the one before, up or down, never above the configured rate; it lapses
`LEARNED_FOR` seconds after the provider last stated it.
"""

from __future__ import annotations

import math

import anyio
import pytest
from trio.testing import MockClock

import slotwise
import slotwise._core.rates as core_rates
from slotwise import Adaptive, ConcurrencyConfigError, MemoryLimiter, Rate
from slotwise._core.adaptive import Aimd
from slotwise._core.rates import LEARNED_FOR, Bank, BucketRule
from slotwise._core.rules import Rules, WorkloadRule
from slotwise._core.state import LimiterState

pytestmark = pytest.mark.anyio


def on_mock_clock() -> pytest.MarkDecorator:
    return pytest.mark.parametrize(
        "anyio_backend",
        [pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock")],
    )


def capacity(limiter: MemoryLimiter[str], kind: str) -> int:
    return limiter.stats_nowait().buckets[kind].capacity


def level(limiter: MemoryLimiter[str], kind: str) -> float:
    return limiter.stats_nowait().buckets[kind].level


def twice() -> MemoryLimiter[str]:
    """A limiter configured at twice a provider's 600 RPM and 100,000 TPM."""
    return MemoryLimiter(
        name="twice", max_concurrent=8, rate=Rate(requests=1200, tokens=200_000, per=60.0)
    )


# -- the learned limit ------------------------------------------------------------------------


async def test_a_learned_limit_lowers_the_capacity_and_what_the_bucket_holds() -> None:
    limiter = twice()
    async with limiter.slot(tokens=1_000) as slot:
        slot.provider_limits(requests=600, tokens=100_000)
        assert capacity(limiter, "requests") == 600
        assert capacity(limiter, "tokens") == 100_000
        # The bucket held 199,000: it holds no more than the provider's limit now.
        assert level(limiter, "tokens") <= 100_000


async def test_a_learned_limit_never_raises_the_capacity_above_the_configured_one() -> None:
    limiter = twice()
    async with limiter.slot() as slot:
        slot.provider_limits(requests=5_000, tokens=1_000_000)
        assert capacity(limiter, "requests") == 1200
        assert capacity(limiter, "tokens") == 200_000
        slot.provider_limits(tokens=100_000)
        assert capacity(limiter, "tokens") == 100_000
        # The provider raised its limit: followed, up to the configured one and no further.
        slot.provider_limits(tokens=150_000)
        assert capacity(limiter, "tokens") == 150_000
        slot.provider_limits(tokens=400_000)
        assert capacity(limiter, "tokens") == 200_000
        # A learned limit that rises does not fill the bucket: only the refill does.
        assert level(limiter, "tokens") <= 100_000 + 1


async def test_a_learned_limit_is_scaled_from_a_minute_to_the_buckets_period() -> None:
    limiter = MemoryLimiter(name="per-second", max_concurrent=4, rate=Rate(requests=20, per=1.0))
    async with limiter.slot() as slot:
        slot.provider_limits(requests=600)  # 600 a minute: 10 a second
        assert capacity(limiter, "requests") == 10


async def test_a_learned_limit_lapses_when_the_provider_stops_stating_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(core_rates, "LEARNED_FOR", 0.05)
    limiter = twice()
    async with limiter.slot() as slot:
        slot.provider_limits(tokens=100_000)
        assert capacity(limiter, "tokens") == 100_000
        await anyio.sleep(0.2)
    assert capacity(limiter, "tokens") == 200_000


async def test_limits_of_a_kind_without_a_bucket_and_without_a_limiter_are_ignored() -> None:
    limiter = MemoryLimiter(name="tokens-only", max_concurrent=2, rate=Rate(tokens=1_000))
    async with limiter.slot() as slot:
        slot.provider_limits(requests=10)  # no requests bucket: nothing to cap
        assert set(limiter.stats_nowait().buckets) == {"tokens"}
    plain = MemoryLimiter(name="plain", max_concurrent=2)
    async with plain.slot() as slot:
        slot.provider_limits(requests=10, tokens=10)  # no rate at all
        assert plain.stats_nowait().buckets == {}


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "600"])
async def test_a_limit_must_be_a_positive_integer(bad: object) -> None:
    limiter = twice()
    async with limiter.slot() as slot:
        with pytest.raises(ValueError, match="requests must be a positive integer"):
            slot.provider_limits(requests=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="tokens must be a positive integer"):
            slot.provider_limits(tokens=bad)  # type: ignore[arg-type]
    assert capacity(limiter, "requests") == 1200


@on_mock_clock()
async def test_the_learned_limit_paces_the_grants() -> None:
    # Configured at 120 a minute, the provider says 60: the bucket holds 60 (not the 119
    # left), then one request a second, not two.
    limiter = MemoryLimiter(name="pace", max_concurrent=4, rate=Rate(requests=120, per=60.0))
    async with limiter.slot() as slot:
        slot.provider_limits(requests=60)
    start = anyio.current_time()
    for _ in range(60 + 10):
        async with limiter.slot():
            pass
    assert anyio.current_time() - start == pytest.approx(10.0)


@on_mock_clock()
async def test_each_statement_of_the_limit_keeps_it_for_another_learned_for() -> None:
    limiter = twice()
    async with limiter.slot() as slot:
        slot.provider_limits(tokens=100_000)
    await anyio.sleep(LEARNED_FOR * 0.75)
    async with limiter.slot() as slot:
        slot.provider_limits(tokens=100_000)  # restated: it stands from here
    await anyio.sleep(LEARNED_FOR * 0.75)
    assert capacity(limiter, "tokens") == 100_000
    await anyio.sleep(LEARNED_FOR * 0.25)
    assert capacity(limiter, "tokens") == 200_000  # lapsed: the configured rate is back


@on_mock_clock()
async def test_set_limits_keeps_what_was_learned() -> None:
    limiter = twice()
    async with limiter.slot() as slot:
        slot.provider_limits(tokens=100_000)
    await limiter.set_limits(rate=Rate(requests=1200, tokens=300_000, per=60.0))
    assert capacity(limiter, "tokens") == 100_000
    await limiter.set_limits(rate=Rate(requests=1200, tokens=50_000, per=60.0))
    assert capacity(limiter, "tokens") == 50_000  # the configured one is lower now


def test_the_bank_learns_within_the_configured_capacity() -> None:
    bank = Bank({"tokens": BucketRule(kind="tokens", capacity=200, per=60.0)}, 0.0)
    bucket = bank.buckets["tokens"]
    assert bank.learn("tokens", 100, 0.0)
    assert (bucket.capacity, bucket.level, bucket.per_second) == (100, 100, 100 / 60)
    assert not bank.learn("tokens", 100, 1.0)  # the same: no change, but restated
    bucket.level = 0.0
    bank.refill(31.0)
    assert bucket.level == pytest.approx(50)  # refilled at the learned rate
    bank.refill(1_000.0)
    assert bucket.level == 100  # and never past the learned capacity
    assert bank.learn("tokens", 10_000, 1_000.0)
    assert bucket.capacity == 200
    assert not bank.learn("unknown", 5, 0.0)
    bank.learn("tokens", 20, 1_000.0)
    bank.refill(1_000.0 + LEARNED_FOR - 1)
    assert bucket.capacity == 20
    bank.refill(1_000.0 + LEARNED_FOR)
    assert bucket.capacity == 200
    assert bucket.learned == math.inf


def test_a_request_larger_than_the_learned_capacity_waits_for_a_full_bucket() -> None:
    # The provider may allow less than one request of the configured size: the request is not
    # refused for good (it fits the configured rate), it waits for the bucket to be full.
    bank = Bank({"tokens": BucketRule(kind="tokens", capacity=200, per=60.0)}, 0.0)
    bank.learn("tokens", 100, 0.0)
    bucket = bank.buckets["tokens"]
    bucket.level = 40.0
    assert not bucket.holds(150)
    assert bucket.wait(150) == pytest.approx(60 / 100 * 60)
    assert bank.oversized("default", {"tokens": 150}) is None


# -- slow start -------------------------------------------------------------------------------


async def _wave(limiter: MemoryLimiter, n: int) -> None:
    """``n`` slots taken at once (1, 2, ..., ``n`` occupied once each was granted), then
    released last first: ``n``, ``n - 1``, ..., 1 in use at the releases. A success counts
    only with at least half the limit in use, and climbs only if its slot was granted with the
    limit full: in slow start a wave at the limit climbs one slot, at its first release."""
    held = [await slotwise.acquire(limiter=limiter) for _ in range(n)]
    for slot in reversed(held):
        await slot.release()


def test_slow_start_climbs_on_each_success_that_found_the_limit_full() -> None:
    aimd = Aimd(floor=2, ceiling=32, backoff=0.5, limit=2, slow_start=True)
    # success(epoch granted in, slots occupied at its release, slots occupied once granted)
    assert aimd.success(0, 2, 1) is None  # granted with 1 of 2 occupied: 2 not tried yet
    assert aimd.success(0, 2, 2) == 3
    assert aimd.success(0, 3, 2) is None  # granted before the climb: 3 not tried
    assert [aimd.success(0, 3, 3), aimd.success(0, 4, 4), aimd.success(0, 5, 5)] == [4, 5, 6]
    assert aimd.proven == 5
    assert aimd.pushback(0) == 3
    assert not aimd.slow_start
    assert aimd.proven == 0  # what the provider took before it refused is void
    # From here on the additive climb: one slot per round trip (as many successes as the
    # limit), each of a request granted with the limit full.
    assert [aimd.success(1, 3, 3) for _ in range(3)] == [None, None, 4]
    assert [aimd.success(1, 4, 3) for _ in range(8)] == [None] * 8  # 4 never tried
    assert aimd.credit == 0.0
    assert [aimd.success(1, 4, 4) for _ in range(4)] == [None, None, None, 5]


def test_the_limit_never_climbs_two_slots_above_what_the_provider_took() -> None:
    # However many successes come back at once, of requests granted with at most `proven`
    # slots occupied, the limit goes one slot above it and waits for that slot's answer.
    aimd = Aimd(floor=2, ceiling=32, backoff=0.5, limit=16, slow_start=True, proven=16)
    assert [aimd.success(0, 17, 16) for _ in range(10)] == [17] + [None] * 9
    assert aimd.success(0, 17, 17) == 18
    # Granted in an epoch before the last decrease: neither a climb nor a proof.
    aimd.pushback(0)
    assert aimd.success(0, 9, 9) is None
    assert aimd.proven == 0


def test_a_success_with_less_than_half_the_limit_in_use_does_not_count() -> None:
    # A limit not reached (the buckets or the demand held the requests back) says nothing of
    # the room above it: neither slow start nor the additive climb moves on it.
    aimd = Aimd(floor=2, ceiling=32, backoff=0.5, limit=8, slow_start=True)
    assert [aimd.success(0, 3, 8) for _ in range(10)] == [None] * 10
    assert aimd.success(0, 4, 8) == 9
    aimd.pushback(0)  # 4, additive from here on
    assert [aimd.success(1, 1, 4) for _ in range(10)] == [None] * 10
    assert aimd.credit == 0.0
    assert [aimd.success(1, 2, 4) for _ in range(4)] == [None, None, None, 5]


async def test_an_adaptive_limit_in_slow_start_begins_at_min_concurrent() -> None:
    limiter = MemoryLimiter(
        name="slow", max_concurrent=16, adaptive=Adaptive(min_concurrent=2, slow_start=True)
    )
    assert limiter.stats_nowait().effective_max_concurrent == 2
    first = [limiter.slot(allow_nested=True) for _ in range(2)]
    for cm in first:
        await cm.__aenter__()
    third = anyio.Event()

    async def take() -> None:
        async with limiter.slot(allow_nested=True):
            third.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(take)
        await anyio.wait_all_tasks_blocked()
        assert not third.is_set()  # 2 before any answer
        # A success, but of a slot granted with 1 of 2 occupied: the limit was not tried.
        await first[0].__aexit__(None, None, None)
        assert limiter.stats_nowait().effective_max_concurrent == 2
        await third.wait()  # the slot it freed, granted with 2 of 2 occupied
    assert limiter.stats_nowait().effective_max_concurrent == 3  # its success climbs
    await first[1].__aexit__(None, None, None)  # 3 not tried yet (and 1 in use of 3)
    assert limiter.stats_nowait().effective_max_concurrent == 3

    async def busy() -> None:
        for _ in range(20):
            async with limiter.slot(allow_nested=True):
                await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:  # a demand of 32 at once
        for _ in range(32):
            tg.start_soon(busy)
    assert limiter.stats_nowait().effective_max_concurrent == 16  # never above the maximum


async def test_a_pushback_ends_slow_start() -> None:
    limiter = MemoryLimiter(
        name="slow", max_concurrent=16, adaptive=Adaptive(min_concurrent=2, slow_start=True)
    )
    # Each wave at the limit climbs one slot, at its first release.
    for limit in (2, 3, 4, 5):
        await _wave(limiter, limit)
    assert limiter.stats_nowait().effective_max_concurrent == 6
    async with limiter.slot() as slot:
        slot.throttled(retry_after=0.0)
    assert limiter.stats_nowait().effective_max_concurrent == 3
    # Additive now: 3 counted successes (granted with the limit full, released with at least
    # half of it in use) for a slot; a wave of 3 counts 2 (3 and 2 in use).
    await _wave(limiter, 3)
    assert limiter.stats_nowait().effective_max_concurrent == 3
    await _wave(limiter, 3)
    assert limiter.stats_nowait().effective_max_concurrent == 4


async def test_set_limits_does_not_end_a_slow_start() -> None:
    limiter = MemoryLimiter(
        name="slow", max_concurrent=16, adaptive=Adaptive(min_concurrent=2, slow_start=True)
    )
    await _wave(limiter, 2)
    await limiter.set_limits(max_concurrent=12)
    assert limiter.stats_nowait().effective_max_concurrent == 3
    await _wave(limiter, 3)  # its first release climbs at once (additive: a third of a slot)
    assert limiter.stats_nowait().effective_max_concurrent == 4


def test_slow_start_must_be_a_boolean() -> None:
    with pytest.raises(ConcurrencyConfigError, match=r"adaptive\.slow_start must be True or False"):
        MemoryLimiter(
            name="bad",
            max_concurrent=4,
            adaptive=Adaptive(min_concurrent=1, slow_start="yes"),  # type: ignore[arg-type]
        )


def _adaptive_state(rules: Rules, *, slow_start: bool) -> LimiterState:
    return LimiterState(
        rules, max_queued=None, lease_ttl=1e9, adaptive=(2, 0.5), slow_start=slow_start
    )


def _take(state: LimiterState, workload: str, n: int) -> list[str]:
    leases = [state.submit(workload, 0.0)[0].lease for _ in range(n)]
    return [lease.lease_id for lease in leases if lease is not None]


def test_a_reserved_slot_granted_over_a_lowered_limit_proves_only_the_limit() -> None:
    # 14 batch slots held, one refused: the limit falls to 8 while the 14 are still held. The
    # chat workload's reserved slot is still granted (a reservation is never lent); its
    # success must prove 8, not the 16 occupied, or the limit would climb back to 16 on
    # demand that never fills it.
    rules = Rules(
        max_concurrent=16,
        workloads={
            "chat": WorkloadRule(ceiling=16, reserved=2, priority=0),
            "batch": WorkloadRule(ceiling=16, reserved=0, priority=0),
        },
    )
    state = _adaptive_state(rules, slow_start=False)
    batch = _take(state, "batch", 14)
    assert len(batch) == 14
    state.throttle(batch[0], 0.0, 0.0, 0.0)
    assert state.rules.max_concurrent == 8
    chat = state.submit("chat", 0.0)[0].lease
    assert chat is not None
    assert chat.tried == 8
    state.release(chat.lease_id, 0.0)
    for lease_id in batch:
        state.not_succeeded(lease_id)
        state.release(lease_id, 0.0)
    assert state.aimd is not None
    assert state.aimd.proven == 8
    # Waves that leave one slot of the limit free: one climb, to 9, and no more.
    for _ in range(100):
        for lease_id in reversed(_take(state, "batch", state.rules.max_concurrent - 3)):
            state.release(lease_id, 0.0)
    assert state.rules.max_concurrent == 9


def test_a_grant_withdrawn_before_its_holder_resumed_is_no_success() -> None:
    # A waiter cancelled after its grant never sent its request: taking the slot back must
    # neither climb the limit nor count as proof of what the provider takes.
    rules = Rules(
        max_concurrent=16, workloads={"default": WorkloadRule(ceiling=16, reserved=0, priority=0)}
    )
    state = _adaptive_state(rules, slow_start=True)
    for _ in range(6):
        held = _take(state, "default", state.rules.max_concurrent)
        waiter, _ = state.submit("default", 0.0)
        assert waiter.lease is None
        for lease_id in held:
            state.not_succeeded(lease_id)
        assert state.release(held[0], 0.0) == [waiter]
        state.withdraw(waiter, 0.0)
        for lease_id in held[1:]:
            state.release(lease_id, 0.0)
    assert state.rules.max_concurrent == 2
    assert state.aimd is not None
    assert state.aimd.proven == 0
