"""The suite rejects broken limiters, each with the case aimed at its flaw.

Every broken limiter in ``broken.py`` must fail its case with a message that starts with the
case's duty and says what went wrong; the correct limiter each one was broken from
(SimpleLimiter, or MemoryLimiter itself) must pass the same case, so the failure is the flaw's.
MemoryLimiter passing every case is ``test_memory.py``.

Broken limiters mostly fail by a wait running out, so these tests run on asyncio with the
durations halved and on trio with a MockClock, where waiting costs nothing.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
import pytest
import trio.testing

from slotwise import MemoryLimiter
from slotwise.conformance import ConformanceCase, ConformanceFailure, conformance_cases

from . import broken

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio-mock-clock"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    if request.param == "asyncio":
        return "asyncio"
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


@attrs.frozen
class Flaw:
    create: broken.Factory
    case: str
    says: str  # a pattern the failure message matches: what the case saw
    control: broken.Factory


SIMPLE = broken.SimpleLimiter
SUPPORTS = ("workload_max_queued", "rates", "pushback")  # the limiters broken for them have them
FLAWS = {
    "over_grants": Flaw(broken.OverGrants, "atomic_allocation", "held at once", SIMPLE),
    "leaks_on_cancel": Flaw(broken.LeaksOnCancel, "cancel_at_every_await", "a slot leaked", SIMPLE),
    "loses_wakeups": Flaw(
        broken.LosesWakeups, "cancel_woken_waiter", "the wake-up was lost", SIMPLE
    ),
    "claims_after_wakeup": Flaw(
        broken.ClaimsAfterWakeup, "cancel_after_grant", "held at once", SIMPLE
    ),
    "renewal_does_not_extend": Flaw(
        broken.RenewalDoesNotExtend, "lease_renewal", "held at once|renew returned None", SIMPLE
    ),
    "serves_newest_first": Flaw(
        broken.ServesNewestFirst, "arrival_order", "were served as", SIMPLE
    ),
    "release_not_idempotent": Flaw(
        broken.ReleaseNotIdempotent, "idempotent_renew_release", "KeyError", SIMPLE
    ),
    "renews_any_lease": Flaw(
        broken.RenewsAnyLease, "renew_after_loss", "renew of a released lease", SIMPLE
    ),
    "never_expires": Flaw(broken.never_expires, "lease_expiry", "kept its slot", MemoryLimiter),
    "reuses_lease_ids": Flaw(
        broken.ReusesLeaseIds, "lease_ids_unique", "distinct lease ids", broken.Wrapped
    ),
    "ignores_priority": Flaw(
        broken.ignores_priority, "priority", "not high3, high4", MemoryLimiter
    ),
    "lends_reservations": Flaw(
        broken.lends_reservations, "strict_reservations", "reserved for", MemoryLimiter
    ),
    "serves_workloads_in_order": Flaw(
        broken.serves_workloads_in_order, "longest_wait_tie_break", "served as", MemoryLimiter
    ),
    "unbounded_queue": Flaw(
        broken.unbounded_queue, "queue_full", "waited instead of failing", MemoryLimiter
    ),
    "ignores_max_wait": Flaw(broken.ignores_max_wait, "max_wait", "kept waiting", MemoryLimiter),
    "ignores_deadline": Flaw(broken.IgnoresDeadline, "deadline", "past it", broken.Wrapped),
    "never_counts_queued": Flaw(
        broken.NeverCountsQueued, "stats_consistent", "queued=0", broken.Wrapped
    ),
    "accepts_invalid_limits": Flaw(
        broken.accepts_invalid_limits, "invalid_limits", "was accepted", MemoryLimiter
    ),
    "queues_batches_backwards": Flaw(
        broken.QueuesBatchesBackwards, "arrival_order", "arrived together", SIMPLE
    ),
    "hands_out_expired_leases": Flaw(
        broken.HandsOutExpiredLeases, "stalled_hand_off", "had already expired", SIMPLE
    ),
    "revives_expired_leases": Flaw(
        broken.RevivesExpiredLeases, "renew_after_loss", "was revived", SIMPLE
    ),
    "frees_expired_slots": Flaw(
        broken.FreesExpiredSlots, "renew_after_loss", "held at once", SIMPLE
    ),
    "renews_for_thirty_seconds": Flaw(
        broken.RenewsForThirtySeconds, "lease_expiry", "after the last renewal", SIMPLE
    ),
    "renews_from_old_expiry": Flaw(
        broken.RenewsFromOldExpiry, "lease_expiry", "after the last renewal", SIMPLE
    ),
    "expires_at_half_ttl": Flaw(broken.ExpiresAtHalfTtl, "lease_lifetime", "was gone", SIMPLE),
    "renew_loses_lease_on_cancel": Flaw(
        broken.RenewLosesLeaseOnCancel, "cancel_renew", "lost the lease", SIMPLE
    ),
    "hides_lease_ttl": Flaw(broken.HidesLeaseTtl, "slot_lifecycle", "lost its", SIMPLE),
    "cycle_time_lease_ids": Flaw(
        broken.CycleTimeLeaseIds, "lease_ids_unique", "distinct|held at once", SIMPLE
    ),
    "accepts_unknown_workloads": Flaw(
        broken.AcceptsUnknownWorkloads, "unknown_workload", "accepted an unknown", broken.Wrapped
    ),
    "max_wait_from_queue_head": Flaw(
        broken.MaxWaitFromQueueHead, "max_wait", "of its own wait", broken.Wrapped
    ),
    "lends_idle_reservations": Flaw(
        broken.LendsIdleReservations, "strict_reservations", "had been idle", broken.Wrapped
    ),
    "blocks_past_deadline": Flaw(
        broken.BlocksPastDeadline,
        "blocked_storage",
        "did not end|past it",
        broken.BlockableStorage,
    ),
    "ignores_workload_max_queued": Flaw(
        broken.ignores_workload_max_queued,
        "workload_max_queued",
        "waited instead of failing",
        MemoryLimiter,
    ),
    "overfills_buckets": Flaw(
        broken.OverfillsBuckets,
        "rate_window",
        # Caught where it first overfills: after the limiter's bucket sat idle, or, on a
        # slow machine, a workload's new bucket before its first grants.
        "more than a bucket of",
        broken.ChecksRatesFirst,
    ),
    "ignores_workload_rates": Flaw(
        broken.ignores_workload_rates, "rate_window", "in workload 'limited'", MemoryLimiter
    ),
    "ignores_token_estimates": Flaw(
        broken.IgnoresTokenEstimates, "rate_tokens", "not charged at grant", broken.Wrapped
    ),
    "charges_held_leases_only": Flaw(
        broken.ChargesHeldLeasesOnly, "rate_tokens", "after the slot was released", broken.Wrapped
    ),
    "checks_rates_first": Flaw(broken.ChecksRatesFirst, "rate_order", "not high3", MemoryLimiter),
    "ignores_pause": Flaw(broken.IgnoresPause, "pause", "during a pause", broken.Wrapped),
    "hands_on_during_pause": Flaw(
        broken.HandsOnDuringPause, "pause", "during the pause", broken.Wrapped
    ),
    "sleeps_through_pause": Flaw(
        broken.SleepsThroughPause, "pause", "the pause stopped its clock", broken.Wrapped
    ),
    "revokes_on_shrink": Flaw(broken.RevokesOnShrink, "set_limits", "revoked", broken.Wrapped),
    "applies_settings_in_turn": Flaw(
        broken.AppliesSettingsInTurn,
        "set_limits",
        "held at once with max_concurrent=3",
        broken.Wrapped,
    ),
}


def case_named(create: broken.Factory, name: str, anyio_backend: Any) -> ConformanceCase:
    # Halve the durations on the real clock; the mock clock makes waiting free anyway.
    scale = 0.5 if anyio_backend == "asyncio" else 1.0
    cases = conformance_cases(
        create, supports=SUPPORTS, time_scale=scale, block_storage=broken.block_storage
    )
    [case] = [c for c in cases if c.name == name]
    return case


@pytest.mark.parametrize("flaw", FLAWS.values(), ids=list(FLAWS))
async def test_broken_limiter_fails_the_case_aimed_at_it(flaw: Flaw, anyio_backend: Any) -> None:
    case = case_named(flaw.create, flaw.case, anyio_backend)
    with pytest.raises(ConformanceFailure) as failure:
        await case.run()
    message = str(failure.value)
    assert message.startswith(case.duty + ": ")
    assert re.search(flaw.says, message)


@pytest.mark.parametrize("flaw", FLAWS.values(), ids=list(FLAWS))
async def test_the_limiter_it_was_broken_from_passes(flaw: Flaw, anyio_backend: Any) -> None:
    await case_named(flaw.control, flaw.case, anyio_backend).run()


def test_every_duty_has_a_broken_limiter() -> None:
    aimed = {flaw.case for flaw in FLAWS.values()}
    untested = {case.name for case in conformance_cases(MemoryLimiter)} - aimed
    # A limiter breaking these needs a backend of its own, not a one-line flaw.
    assert untested == {"ceiling_isolation", "invalid_workloads"}
