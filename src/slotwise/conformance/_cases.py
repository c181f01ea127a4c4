"""The duties of a limiter, one probe each.

Each case builds the limiters it needs through the user's factory, drives them through the
protocol, and fails with a message that starts with its duty. Every lease a probe holds is
counted (see ``_harness.Subject.hold``), so an over-grant fails whichever case provokes it.
Waits are bounded by generous timeouts; "must not happen" checks watch a quiet window, which
can only let a slow bug pass, never fail a correct limiter.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import attrs
from anyio.lowlevel import checkpoint

from .._config import Rate, Workload
from .._errors import (
    ConcurrencyConfigError,
    ConcurrencyLeaseLostError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
)
from .._protocol import AcquireRequest
from .._runtime.dispatch import subscribe
from .._runtime.lifecycle import acquire as runtime_acquire
from .._runtime.lifecycle import slot as runtime_slot
from .._runtime.loop import trio_running
from ._harness import Harness, Probe, Subject

__all__ = ("CASES", "CaseSpec")

Body = Callable[[Harness], Awaitable[None]]


@attrs.frozen(kw_only=True)
class CaseSpec:
    name: str
    duty: str
    requires: frozenset[str]
    body: Body


CASES: list[CaseSpec] = []


def _case(name: str, duty: str, *requires: str) -> Callable[[Body], Body]:
    def register(body: Body) -> Body:
        CASES.append(CaseSpec(name=name, duty=duty, requires=frozenset(requires), body=body))
        return body

    return register


async def _checkpoints(count: int) -> None:
    for _ in range(count):
        await checkpoint()


# -- allocation ---------------------------------------------------------------------------


@_case(
    "atomic_allocation",
    "atomic allocation (many tasks acquiring at once never hold more than max_concurrent slots)",
)
async def _atomic_allocation(h: Harness) -> None:
    subject = await h.limiter(max_concurrent=3)
    rng = random.Random(20260)
    schedule = [[rng.randrange(4) for _ in range(4)] for _ in range(12)]

    async def worker(holds: list[int]) -> None:
        for hold in holds:
            lease = await subject.acquire()
            await _checkpoints(hold)
            await subject.release(lease)

    with anyio.move_on_after(h.timing.within * 4) as scope:
        async with anyio.create_task_group() as tg:
            for holds in schedule:
                tg.start_soon(worker, holds)
    if scope.cancelled_caught:
        h.fail("12 tasks taking 4 short slots each with max_concurrent=3 did not finish")
    await h.capacity(subject, after="many tasks acquired and released at once")


# -- leases -------------------------------------------------------------------------------


@_case(
    "lease_expiry",
    "leases expire (a lease not renewed within lease_ttl of its grant or last renewal ends "
    "and its slot returns)",
)
async def _lease_expiry(h: Harness) -> None:
    ttl = h.timing.lease_ttl
    subject = await h.limiter(max_concurrent=1, lease_ttl=ttl)
    holder = await h.take(subject, what="a free slot was not granted")
    waiter = h.start(subject, label="waiter")
    holder.abandon()  # the holder stops renewing, as a crashed process would
    await waiter.granted(
        f"a lease not renewed for lease_ttl={ttl:g}s kept its slot: the waiting request "
        "never got it",
        within=ttl + h.timing.within,
    )
    # Renewed several times in a row, then left alone: each renewal extends the lease to
    # lease_ttl after it, not for good, nor lease_ttl beyond the expiry it had: renewals
    # that add up keep the slot for twice as long as the case waits.
    renewals = 2 * math.ceil(h.timing.within / ttl)
    for _ in range(renewals):
        if await subject.renew(waiter.lease) is None:
            h.fail("renew returned None for a lease granted a moment before")
    late = h.start(subject, label="late")
    waiter.abandon()
    await late.granted(
        f"a lease renewed {renewals} times in a row and then no more kept its slot for more "
        f"than lease_ttl={ttl:g}s after the last renewal: the waiting request never got it",
        within=ttl + h.timing.within,
    )
    late.abandon()
    await anyio.sleep(ttl)
    await h.take(
        subject,
        what=f"a lease not renewed for lease_ttl={ttl:g}s kept its slot: a new request "
        "never got it",
    )


@_case(
    "lease_renewal",
    "renewal keeps a lease (renew extends a held lease by lease_ttl and returns it)",
)
async def _lease_renewal(h: Harness) -> None:
    ttl = h.timing.lease_ttl * 5 / 3
    subject = await h.limiter(max_concurrent=1, lease_ttl=ttl)
    holder = await h.take(subject, what="a free slot was not granted")
    waiter = h.start(subject, label="waiter")
    until = anyio.current_time() + 2 * ttl
    while anyio.current_time() < until:
        if await subject.renew(holder.lease) is None:
            h.fail(
                f"renew returned None for a held lease renewed every {ttl / 10:g}s "
                f"with lease_ttl={ttl:g}s"
            )
        if waiter.lease is not None:
            h.fail(
                f"a lease renewed every {ttl / 10:g}s (lease_ttl={ttl:g}s) lost its slot "
                "to a waiting request"
            )
        await anyio.sleep(ttl / 10)
    await holder.release()
    await waiter.granted("the slot of a released lease did not go to the waiting request")
    await waiter.release()


@_case(
    "lease_lifetime",
    "a lease lasts lease_ttl (neither a grant nor a renewal ends sooner than lease_ttl after it)",
)
async def _lease_lifetime(h: Harness) -> None:
    ttl = h.timing.lease_ttl
    subject = await h.limiter(max_concurrent=1, lease_ttl=ttl)
    # A lease must still be held when renewed 0.6 x lease_ttl after its grant, then after
    # that renewal. A renewal answered more than lease_ttl after the grant (or the last
    # renewal) was sent proves nothing (the machine was too slow): try again.
    for _ in range(3):
        since = anyio.current_time()  # the grant comes later: the lease lives past since+ttl
        probe = await h.take(subject, what="a free slot was not granted")
        lease, checked = probe.lease, 0
        for after in ("its grant", "its renewal"):
            await anyio.sleep(0.6 * ttl)
            sent = anyio.current_time()
            renewed = await subject.renew(lease)
            answered = anyio.current_time()
            if renewed is None:
                if answered < since + ttl:
                    h.fail(
                        f"a lease was gone {answered - since:.3f}s after {after}, with "
                        f"lease_ttl={ttl:g}s: renew returned None"
                    )
                break
            lease, since, checked = renewed, sent, checked + 1
        probe.lease = lease
        await probe.release()
        if checked == 2:
            return


@_case(
    "idempotent_renew_release",
    "renew and release are idempotent (repeating them changes nothing)",
)
async def _idempotent(h: Harness) -> None:
    subject = await h.limiter(max_concurrent=2)
    first = await h.take(subject, what="a free slot was not granted")
    second = await h.take(subject, what="a second free slot was not granted")
    lease = first.lease
    for attempt in ("first", "second"):
        if await subject.renew(lease) is None:
            h.fail(f"the {attempt} of two renewals of a held lease returned None")
    await first.release()
    try:
        await subject.limiter.release(lease)
    except Exception as exc:
        h.fail(f"releasing a lease a second time raised {exc!r}")
    try:
        await subject.limiter.release(subject.lease("conformance-never-issued"))
    except Exception as exc:
        h.fail(f"releasing a lease the limiter never issued raised {exc!r}")
    third = await h.take(subject, what="the slot of a released lease was not granted again")
    fourth = h.start(subject, label="fourth")
    await fourth.waits(
        "after one lease was released twice, a slot beyond max_concurrent=2 was granted: "
        "the second release freed another holder's slot"
    )
    await subject.limiter.release(lease)
    await fourth.waits(
        "releasing a lease again while its slot had a new holder freed that holder's slot"
    )
    await second.release()
    await fourth.granted("the slot of a released lease did not go to the waiting request")
    await third.release()
    await fourth.release()
    await h.capacity(subject, after="repeated renewals and releases")


@_case(
    "renew_after_loss",
    "a lost lease stays lost (renew returns None, and release frees nothing, for a lease no "
    "longer held: released, expired or never issued)",
)
async def _renew_after_loss(h: Harness) -> None:
    ttl = h.timing.lease_ttl
    subject = await h.limiter(max_concurrent=1, lease_ttl=ttl)
    first = await h.take(subject, what="a free slot was not granted")
    lease = first.lease
    await first.release()
    if await subject.renew(lease) is not None:
        h.fail("renew of a released lease returned a lease")
    second = await h.take(subject, what="the slot of a released lease was not granted again")
    if await subject.renew(lease) is not None:
        h.fail("renew of a released lease returned a lease once its slot had a new holder")
    expired = second.abandon()
    await anyio.sleep(1.5 * ttl)  # nobody waits: nothing else touches the limiter
    if await subject.renew(expired) is not None:
        h.fail(
            f"renew of a lease left unrenewed for 1.5 x lease_ttl={ttl:g}s, with nobody "
            "waiting for its slot, returned a lease: the expired lease was revived"
        )
    holder = await h.take(subject, what=f"a lease not renewed for lease_ttl={ttl:g}s kept its slot")
    if await subject.renew(expired) is not None:
        h.fail("renew of an expired lease (its slot already given to another) returned a lease")
    await subject.limiter.release(expired)
    intruder = h.start(subject, label="intruder")
    await intruder.waits(
        "releasing a lease that had expired, whose slot had gone to another request, freed "
        "that request's slot: a slot beyond max_concurrent=1 was granted"
    )
    if await subject.renew(subject.lease("conformance-never-issued")) is not None:
        h.fail("renew of a lease the limiter never issued returned a lease")
    await holder.release()
    await intruder.granted("the slot of a released lease did not go to the waiting request")
    await intruder.release()


@_case("lease_ids_unique", "lease ids are never reused")
async def _lease_ids_unique(h: Harness) -> None:
    ttl = h.timing.lease_ttl
    subject = await h.limiter(max_concurrent=2, lease_ttl=ttl)
    for _ in range(10):
        probe = await h.take(subject, what="a free slot was not granted")
        await probe.release()

    async def worker() -> None:
        for _ in range(3):
            lease = await subject.acquire()
            await checkpoint()
            await subject.release(lease)

    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(worker)
    holder = await h.take(subject, what="a free slot was not granted")
    holder.abandon()
    await anyio.sleep(ttl)
    after_expiry = await h.take(
        subject, what="a slot whose lease expired was not granted", within=h.timing.within + ttl
    )
    await after_expiry.release()
    ids = subject.lease_ids
    reused = sorted({lease_id for lease_id in ids if ids.count(lease_id) > 1})
    if reused:
        h.fail(f"{len(ids)} grants used only {len(set(ids))} distinct lease ids: {reused[:5]}")
    # Grants in one instant: four requests started in one tick, then four waiters granted
    # together when those four leases expire together (one sweep, one transaction).
    burst = await h.limiter(max_concurrent=4, lease_ttl=ttl)
    holders = [h.start(burst, label=f"burst{index}") for index in range(4)]
    for probe in holders:
        await probe.granted("a free slot was not granted")
    waiters = [h.start(burst, label=f"next{index}") for index in range(4)]
    await h.queued(burst, len(waiters))
    for probe in holders:
        probe.abandon()
    for probe in waiters:
        await probe.granted(
            f"a lease not renewed for lease_ttl={ttl:g}s kept its slot",
            within=ttl + h.timing.within,
        )
    same = burst.lease_ids
    if len(set(same)) < len(same):
        h.fail(
            f"{len(same)} leases granted in the same instants (four in one tick, four as "
            f"the first four expired together) had only {len(set(same))} distinct ids"
        )
    for probe in waiters:
        await probe.release()
    again = await h.limiter(**subject.limits)
    probe = await h.take(again, what="a limiter created again could not grant a slot")
    if probe.lease.lease_id in ids:
        h.fail(
            f"a limiter created again with the same settings (as after a restart) issued "
            f"lease id {probe.lease.lease_id!r} again"
        )
    await probe.release()


# -- cancellation -------------------------------------------------------------------------


@_case(
    "cancel_at_every_await",
    "acquire is safe to cancel (cancelled at any await point, it leaks no slot)",
)
async def _cancel_at_every_await(h: Harness) -> None:
    subject = await h.limiter(max_concurrent=2)
    # Uncontended: the fast path, cancelled after k checkpoints or a short real delay (a
    # backend doing I/O has await points that checkpoints alone do not reach).
    delays: list[int | float] = [0, 1, 2, 3, 4, 6, 10, 0.0005, 0.002, 0.005, 0.01, 0.02, 0.05]
    for delay in delays:
        probe = h.start(subject)
        if isinstance(delay, int):
            when = f"{delay} checkpoints"
            await _checkpoints(delay)
        else:
            when = f"{delay}s"
            await anyio.sleep(delay)
        probe.cancel()
        await probe.ends(f"an acquire cancelled after {when} did not end")
        await probe.release()
        await h.capacity(subject, after=f"an uncontended acquire was cancelled after {when}")
    # Contended: every slot held; the waiter is cancelled after k checkpoints while a
    # holder releases after j, so the cancellation lands before, at and after the grant.
    # At the same step both orders are tried: a cancellation delivered just before the slot
    # is handed over reaches the waiter only after it was granted. The last rows wait until
    # the waiter is queued (k=None), so that moment is certain whatever the scheduler does.
    steps = (0, 1, 2, 3, 5)
    grid: list[tuple[int | None, int, bool]] = [
        (k, j, first)
        for k in steps
        for j in steps
        for first in (False, True)
        if k == j or not first
    ]
    grid += [(None, 0, False), (None, 0, True)]
    for k, j, cancel_first in grid:
        held = [await h.take(subject, what="a free slot was not granted") for _ in range(2)]
        waiter = h.start(subject, label="waiter")
        if k is None:
            await h.queued(subject, 1)
        when = "once queued" if k is None else f"after {k} checkpoints"
        for step in range(max(k or 0, j) + 1):
            if step == (k or 0) and cancel_first:
                waiter.cancel()
            if step == j:
                await held[0].release()
            if step == (k or 0) and not cancel_first:
                waiter.cancel()
            await checkpoint()
        await waiter.ends(f"a waiting acquire cancelled {when} did not end")
        await waiter.release()
        await held[1].release()
        await h.capacity(
            subject,
            after=f"a waiter was cancelled {when} while a holder released after {j} "
            "checkpoints" + (" (cancelled first)" if cancel_first else ""),
        )


@_case(
    "cancel_woken_waiter",
    "acquire is safe to cancel (a waiter cancelled as it is woken passes the slot on: no "
    "lost wake-up, CPython gh-90155)",
)
async def _cancel_woken_waiter(h: Harness) -> None:
    subject = await h.limiter(max_concurrent=1)
    for others in (0, 1):
        for release_first in (True, False):
            for _ in range(2):
                holder = await h.take(subject, what="a free slot was not granted")
                woken = h.start(subject, label="woken")
                await h.queued(subject, 1)
                later = []
                if others:
                    later.append(h.start(subject, label="next"))
                    await h.queued(subject, 2)
                if release_first:
                    await holder.release()
                    woken.cancel()
                else:
                    woken.cancel()
                    await holder.release()
                order = "released then cancelled" if release_first else "cancelled then released"
                await woken.ends(f"the waiter {order} did not end")
                # An acquire that won before the cancellation landed keeps its slot: legal.
                await woken.release()
                for probe in later:
                    await probe.granted(
                        f"the only woken waiter was cancelled ({order}) and the next waiter "
                        "never got the free slot: the wake-up was lost"
                    )
                    await probe.release()
                for _ in range(3):
                    probe = await h.take(
                        subject,
                        what=f"after the only woken waiter was cancelled ({order}), a later "
                        "acquire got no slot: the wake-up was lost",
                    )
                    await probe.release()


@_case(
    "cancel_after_grant",
    "acquire is safe to cancel (a slot granted as its waiter is cancelled goes back, and a "
    "slot handed to a waiter is never granted twice, anyio#1170)",
)
async def _cancel_after_grant(h: Harness) -> None:
    subject = await h.limiter(max_concurrent=1)
    # A newcomer's acquire starts `lead` checkpoints before the holder releases (or just
    # after, when None), so that for some lead its check for room runs while the slot is
    # on its way to the waiter: the window in which anyio#1170 granted the slot twice.
    for cancel_after in (None, 0, 1):
        for lead in (None, 0, 1, 2, 3):
            for _ in range(2):
                holder = await h.take(subject, what="a free slot was not granted")
                woken = h.start(subject, label="woken")
                await h.queued(subject, 1)
                gate = anyio.Event()
                newcomer = h.start(subject, label="newcomer", gate=gate)
                if lead is not None:
                    gate.set()
                    await _checkpoints(lead)
                await holder.release()
                if lead is None:
                    gate.set()
                if cancel_after is not None:
                    await _checkpoints(cancel_after)
                    woken.cancel()
                what = (
                    "a slot was released to a waiter as a new acquire arrived"
                    if cancel_after is None
                    else f"a waiter was cancelled {cancel_after} checkpoints after the slot "
                    "was released to it, as a new acquire arrived"
                )
                await h.settle([woken, newcomer], what=what)
                await h.capacity(subject, after=what)


@_case(
    "cancel_renew",
    "renew is safe to cancel (a renewal cancelled at any await point leaves the lease held, "
    "and the next renewal succeeds)",
)
async def _cancel_renew(h: Harness) -> None:
    subject = await h.limiter(max_concurrent=1)
    holder = await h.take(subject, what="a free slot was not granted")
    # The runtime cancels a renewal that takes too long, and a renewal may be cut short by
    # the caller's own cancellation: after either, the lease is still held.
    delays: list[int | float] = [0, 1, 2, 3, 5, 0.0005, 0.002, 0.01, 0.05]
    for delay in delays:
        when = f"{delay} checkpoints" if isinstance(delay, int) else f"{delay}s"
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(subject.renew, holder.lease)
                if isinstance(delay, int):
                    await _checkpoints(delay)
                else:
                    await anyio.sleep(delay)
                scope.cancel()
        renewed = await subject.renew(holder.lease)
        if renewed is None:
            h.fail(
                f"after a renewal was cancelled {when} into it, renewing the same held lease "
                "returned None: the cancelled renewal lost the lease"
            )
        holder.lease = renewed
    intruder = h.start(subject, label="intruder")
    await intruder.waits("after renewals were cancelled, a slot still held was granted again")
    await holder.release()
    await intruder.granted("the slot of a released lease did not go to the waiting request")
    await intruder.release()


@_case(
    "stalled_hand_off",
    "no lease is handed out expired (a slot handed to a waiter that resumes only after the "
    "lease's lease_ttl, as when the event loop stalls, is not returned as held)",
)
async def _stalled_hand_off(h: Harness) -> None:
    ttl = h.timing.lease_ttl
    subject = await h.limiter(max_concurrent=1, lease_ttl=ttl)
    holder = await h.take(subject, what="a free slot was not granted")
    waiter = h.start(subject, label="waiter")
    await h.queued(subject, 1)
    await holder.release()  # the slot may be handed to the waiter now...
    h.stall(2 * ttl)  # ...which resumes only after the loop stalled for 2 x lease_ttl
    await waiter.granted(
        "after the event loop stalled, the waiting request never got the free slot",
        within=ttl + h.timing.within,
    )
    if await subject.renew(waiter.lease) is None:
        h.fail(
            "acquire returned a lease that had already expired: the event loop stalled for "
            f"2 x lease_ttl={ttl:g}s between the release that freed the slot and the waiting "
            "request resuming, and renewing the lease acquire then returned gave None"
        )
    await waiter.release()
    await h.capacity(subject, after="a slot was handed over across a stalled event loop")


# -- queue bounds -------------------------------------------------------------------------


@_case(
    "queue_full",
    "queue full (beyond max_queued waiting requests, acquire fails at once with "
    "ConcurrencyQueueFullError)",
    "max_queued",
)
async def _queue_full(h: Harness) -> None:
    subject = await h.limiter(max_concurrent=1, max_queued=2)
    holder = await h.take(subject, what="a free slot was not granted")
    waiters = [h.start(subject, label="w1")]
    await h.queued(subject, 1)
    waiters.append(h.start(subject, label="w2"))
    await h.queued(subject, 2)
    extra = h.start(subject, label="w3")
    await extra.ends("a request beyond max_queued=2 waited instead of failing at once")
    if not isinstance(extra.error, ConcurrencyQueueFullError):
        h.fail(
            "a request beyond max_queued=2 ended with "
            f"{extra.error or extra.lease!r}, not ConcurrencyQueueFullError",
            cause=extra.error,
        )
    waiters[0].cancel()
    await waiters[0].ends("a cancelled waiter did not end")
    replacement = h.start(subject, label="w4")
    await replacement.waits("a request was granted a slot that another held")
    await holder.release()
    await h.settle([waiters[1], replacement], what="the queued requests were not served")

    empty = await h.limiter(max_concurrent=1, max_queued=0)
    holder = await h.take(empty, what="with max_queued=0, a free slot was not granted")
    refused = h.start(empty)
    await refused.ends("with max_queued=0 and no free slot, a request waited")
    if not isinstance(refused.error, ConcurrencyQueueFullError):
        h.fail(
            f"with max_queued=0 and no free slot, a request ended with "
            f"{refused.error or refused.lease!r}, not ConcurrencyQueueFullError",
            cause=refused.error,
        )
    await holder.release()


@_case(
    "workload_max_queued",
    "a workload's max_queued bounds its own queue (beyond it, that workload's requests fail "
    "at once with ConcurrencyQueueFullError, while other workloads still queue)",
    "workloads",
    "workload_max_queued",
)
async def _workload_max_queued(h: Harness) -> None:
    subject = await h.limiter(
        max_concurrent=1,
        workloads={"flood": Workload(max_queued=2), "interactive": Workload()},
        default_workload="flood",
    )
    holder = await h.take(subject, "flood", what="a free slot was not granted")
    flood = []
    for index in range(2):
        flood.append(h.start(subject, "flood", label=f"flood{index + 1}"))
        await h.queued(subject, index + 1)
    extra = h.start(subject, "flood", label="flood3")
    await extra.ends(
        "a request beyond workload 'flood''s max_queued=2 waited instead of failing at once"
    )
    if not isinstance(extra.error, ConcurrencyQueueFullError):
        h.fail(
            "a request beyond workload 'flood''s max_queued=2 ended with "
            f"{extra.error or extra.lease!r}, not ConcurrencyQueueFullError",
            cause=extra.error,
        )
    interactive = [h.start(subject, "interactive", label=f"interactive{i + 1}") for i in range(3)]
    refused = (
        "a request of workload 'interactive', which has no max_queued, did not queue while "
        "'flood' had its 2 requests waiting (flood's bound was applied to it)"
    )
    await interactive[-1].waits(refused)
    for probe in interactive[:-1]:  # they had the same quiet window
        if probe.done.is_set():
            await probe.waits(refused)
    flood[0].cancel()
    await flood[0].ends("a cancelled waiter did not end")
    replacement = h.start(subject, "flood", label="flood4")
    await replacement.waits(
        "a request of workload 'flood' did not queue after one of its 2 waiters left "
        "(max_queued=2): the request that left still counted"
    )
    await holder.release()
    await h.settle(
        [flood[1], replacement, *interactive], what="the queued requests were not served"
    )


@_case(
    "max_wait",
    "max_wait (a request waits at most its workload's max_wait, then fails with "
    "ConcurrencyTimeoutError and leaves the queue)",
    "max_wait",
)
async def _max_wait(h: Harness) -> None:
    max_wait = 2 * h.timing.quiet
    subject = await h.limiter(max_concurrent=1, workloads={"default": Workload(max_wait=max_wait)})
    holder = await h.take(subject, what="a free slot was not granted")
    # Two requests, the second arriving 0.75 x max_wait after the first: each may wait
    # max_wait from its own arrival (at least half of it, to leave room for a slow machine).
    waiters: list[tuple[Probe, float, str]] = []
    for label, arrival in (("first", "first"), ("second", f"{0.75 * max_wait:g}s later")):
        if waiters:
            await anyio.sleep(0.75 * max_wait)
        waiters.append((h.start(subject, label=label), anyio.current_time(), arrival))
    for waiter, started, arrival in waiters:
        await waiter.ends(
            f"a request with max_wait={max_wait:g}s kept waiting",
            within=max_wait + h.timing.within,
        )
        waited = anyio.current_time() - started
        if not isinstance(waiter.error, ConcurrencyTimeoutError):
            h.fail(
                f"a request past max_wait={max_wait:g}s ended with "
                f"{waiter.error or waiter.lease!r}, not ConcurrencyTimeoutError",
                cause=waiter.error,
            )
        if waited < max_wait / 2:
            h.fail(
                f"a request with max_wait={max_wait:g}s that arrived {arrival} gave up after "
                f"only {waited:.3f}s of its own wait"
            )
    await holder.release()
    again = await h.take(
        subject,
        what="after a request timed out, the freed slot did not go to a new request (the "
        "timed-out request kept its place in the queue)",
    )
    patient = h.start(subject, label="patient")
    await h.queued(subject, 1)
    await again.release()
    await patient.granted("a slot freed within max_wait did not go to the waiting request")
    await patient.release()

    fail_fast = await h.limiter(max_concurrent=1, workloads={"default": Workload(max_wait=0)})
    holder = await h.take(fail_fast, what="with max_wait=0, a free slot was not granted")
    refused = h.start(fail_fast)
    await refused.ends("with max_wait=0 and no free slot, a request waited")
    if not isinstance(refused.error, ConcurrencyTimeoutError):
        h.fail(
            "with max_wait=0 and no free slot, a request ended with "
            f"{refused.error or refused.lease!r}, not ConcurrencyTimeoutError",
            cause=refused.error,
        )
    await holder.release()


@_case(
    "deadline",
    "deadline (a request stops waiting at AcquireRequest.deadline with ConcurrencyTimeoutError)",
    "deadline",
)
async def _deadline(h: Harness) -> None:
    subject = await h.limiter(max_concurrent=1)
    budget = 2 * h.timing.quiet
    past = anyio.current_time() - 1.0
    holder = h.start(subject, deadline=past)
    await holder.granted("a request whose deadline had passed did not take a free slot")
    started = anyio.current_time()
    waiter = h.start(subject, deadline=started + budget, label="waiter")
    await waiter.ends(
        f"a request with a deadline {budget:g}s away kept waiting past it",
        within=budget + h.timing.within,
    )
    waited = anyio.current_time() - started
    if not isinstance(waiter.error, ConcurrencyTimeoutError):
        h.fail(
            "a request past its deadline ended with "
            f"{waiter.error or waiter.lease!r}, not ConcurrencyTimeoutError",
            cause=waiter.error,
        )
    if waited < budget / 2:
        h.fail(f"a request with a deadline {budget:g}s away gave up after {waited:.3f}s")
    late = h.start(subject, deadline=past, label="late")
    await late.ends("a request whose deadline had passed waited for a slot")
    if not isinstance(late.error, ConcurrencyTimeoutError):
        h.fail(
            "a request whose deadline had passed, with no free slot, ended with "
            f"{late.error or late.lease!r}, not ConcurrencyTimeoutError",
            cause=late.error,
        )
    await holder.release()
    await h.capacity(subject, after="requests timed out at their deadline")


# -- order --------------------------------------------------------------------------------


_ROUNDS = 10  # a race that gets the order right by chance in one round rarely does in ten


async def _queue_in_order(h: Harness, subject: Subject, workloads: list[str]) -> list[Probe]:
    probes = []
    for index, workload in enumerate(workloads):
        probes.append(h.start(subject, workload, label=f"{workload}{index + 1}"))
        await h.queued(subject, index + 1)
    return probes


@_case(
    "arrival_order",
    "arrival order (within a workload, waiting requests are served first come, first served, "
    "even when they arrive together)",
)
async def _arrival_order(h: Harness) -> None:
    subject = await h.limiter(max_concurrent=1)
    holder = await h.take(subject, what="a free slot was not granted")
    probes = await _queue_in_order(h, subject, ["default"] * 5)
    order = await _serve(h, subject, holder, probes)
    expected = [probe.label for probe in probes]
    if order != expected:
        h.fail(f"requests queued as {expected} were served as {order}")
    # Requests arriving in the same tick: their order is the order their acquire calls
    # began (on trio, tasks started together begin in no set order, so it is read there).
    # A limiter that lets them race to its queue may get the order right by chance (trio
    # runs each batch of tasks forwards or backwards at random), hence several rounds.
    for round_ in range(_ROUNDS):
        holder = await h.take(subject, what="a free slot was not granted")
        together = [h.start(subject, label=f"r{round_ + 1}.{index + 1}") for index in range(5)]
        await h.queued(subject, len(together))
        labels = {probe.label for probe in together}
        arrived = [label for label in subject.arrivals if label in labels]
        order = await _serve(h, subject, holder, together)
        if order != arrived:
            h.fail(
                f"requests that arrived together, calling acquire in the order {arrived}, "
                f"were served as {order}"
            )


async def _serve(h: Harness, subject: Subject, holder: Probe, probes: list[Probe]) -> list[str]:
    """Release ``holder``, then each probe as it is granted; return the grant order."""
    labels = {probe.label: probe for probe in probes}
    order: list[str] = []
    current = holder
    for _ in probes:
        await current.release()
        with anyio.move_on_after(h.timing.within):
            while not any(p.lease is not None for p in labels.values()):
                await subject.next_grant.wait()
        granted = [p for p in labels.values() if p.lease is not None]
        if not granted:
            h.fail(f"after a release, no waiting request was granted (served so far: {order})")
        current = granted[0]
        del labels[current.label]
        order.append(current.label)
    await current.release()
    return order


@_case(
    "priority",
    "priority (when a slot frees, the highest-priority workload with room is served first; "
    "priority never interrupts a running request)",
    "workloads",
    "priority",
)
async def _priority(h: Harness) -> None:
    subject = await h.limiter(
        max_concurrent=1,
        workloads={"low": Workload(priority=0), "high": Workload(priority=10)},
        default_workload="low",
    )
    holder = await h.take(subject, "low", what="a free slot was not granted")
    probes = await _queue_in_order(h, subject, ["low", "low", "high", "high"])
    if await subject.renew(holder.lease) is None:
        h.fail("a running low-priority lease was taken away when high-priority requests queued")
    order = await _serve(h, subject, holder, probes)
    if order != ["high3", "high4", "low1", "low2"]:
        h.fail(
            "with low1, low2, then high3, high4 (priority 10) queued, requests were served "
            f"as {order}, not high3, high4, low1, low2"
        )


@_case(
    "longest_wait_tie_break",
    "longest-wait tie-break (among workloads of equal priority with room, the request that "
    "has waited longest is served first)",
    "workloads",
)
async def _tie_break(h: Harness) -> None:
    subject = await h.limiter(
        max_concurrent=1, workloads={"x": Workload(), "y": Workload()}, default_workload="x"
    )
    holder = await h.take(subject, "x", what="a free slot was not granted")
    probes = await _queue_in_order(h, subject, ["y", "x", "x", "y", "x"])
    order = await _serve(h, subject, holder, probes)
    expected = [probe.label for probe in probes]
    if order != expected:
        h.fail(
            f"requests of two equal-priority workloads queued as {expected} were served as {order}"
        )


@_case(
    "ceiling_isolation",
    "a ceiling never blocks another workload (a workload at its own max_concurrent leaves "
    "free slots to the others, and never exceeds its ceiling)",
    "workloads",
)
async def _ceiling_isolation(h: Harness) -> None:
    subject = await h.limiter(
        max_concurrent=3,
        workloads={"capped": Workload(max_concurrent=1), "open": Workload()},
        default_workload="open",
    )
    capped = await h.take(subject, "capped", what="a free slot was not granted")
    blocked = h.start(subject, "capped", label="capped2")
    await h.queued(subject, 1)
    first = await h.take(
        subject,
        "open",
        what="a request of workload 'open' waited behind 'capped', which was only at its own "
        "ceiling",
    )
    second = await h.take(subject, "open", what="the last free slot was not granted to 'open'")
    await first.release()
    third = await h.take(
        subject,
        "open",
        what="a freed slot stayed idle while 'open' waited, because 'capped' (at its ceiling) "
        "had waited longer",
    )
    await capped.release()
    await blocked.granted("a slot freed under the ceiling did not go to the waiting request")
    for probe in (blocked, second, third):
        await probe.release()

    async def worker(workload: str, holds: list[int]) -> None:
        for hold in holds:
            lease = await subject.acquire(workload)
            await _checkpoints(hold)
            await subject.release(lease)

    rng = random.Random(11)
    with anyio.move_on_after(h.timing.within * 4) as scope:
        async with anyio.create_task_group() as tg:
            for index in range(10):
                holds = [rng.randrange(4) for _ in range(3)]
                tg.start_soon(worker, "capped" if index % 2 else "open", holds)
    if scope.cancelled_caught:
        h.fail("tasks of a capped and an open workload taking short slots did not finish")


@_case(
    "strict_reservations",
    "strict reservations (reserved slots stay idle rather than being lent to another workload)",
    "workloads",
    "reservations",
)
async def _strict_reservations(h: Harness) -> None:
    subject = await h.limiter(
        max_concurrent=3,
        workloads={"reserved": Workload(reserved=1), "other": Workload()},
        default_workload="other",
    )
    others = [await h.take(subject, "other", what="a shared slot was not granted") for _ in "ab"]
    third = h.start(subject, "other", label="other3")
    await third.waits(
        "workload 'other' took the slot reserved for 'reserved' while it was idle "
        "(reserved=1 of max_concurrent=3)"
    )
    reserved = await h.take(
        subject, "reserved", what="the reserved slot was not available to its own workload"
    )
    second_reserved = h.start(subject, "reserved", label="reserved2")
    await second_reserved.waits("workload 'reserved' got a slot beyond the limiter's capacity")
    await reserved.release()
    await second_reserved.granted("the reserved slot did not go back to its own workload")
    await third.waits(
        "a freed reserved slot went to workload 'other' (reserved=1 of max_concurrent=3)"
    )
    await others[0].release()
    await third.granted("a freed shared slot did not go to the waiting request")
    for probe in (others[1], second_reserved, third):
        await probe.release()

    # However long the reserved workload stays idle (here past the limiter's lease_ttl,
    # which a reservation must not be mistaken for), its slot is never lent.
    ttl = h.timing.lease_ttl
    idle = await h.limiter(
        max_concurrent=3,
        lease_ttl=ttl,
        workloads={"reserved": Workload(reserved=1), "other": Workload()},
        default_workload="other",
    )
    used = await h.take(idle, "reserved", what="the reserved slot was not granted")
    await used.release()
    await anyio.sleep(2 * ttl)
    others = [await h.take(idle, "other", what="a shared slot was not granted") for _ in "ab"]
    third = h.start(idle, "other", label="other3")
    await third.waits(
        "workload 'other' took the slot reserved for 'reserved' after 'reserved' had been "
        f"idle for 2 x lease_ttl={ttl:g}s (reserved=1 of max_concurrent=3)"
    )
    for probe in others:
        await probe.release()
    await third.granted("a freed shared slot did not go to the waiting request")
    await third.release()


# -- stats and settings -------------------------------------------------------------------


@_case(
    "stats_consistent",
    "stats are consistent with grants (active and queued, in total and per workload)",
    "stats",
)
async def _stats_consistent(h: Harness) -> None:
    several = h.supports("workloads")
    names = ["a", "b"] if several else ["default"]
    limits: dict[str, Any] = {"max_concurrent": 2}
    if several:
        limits.update(workloads={"a": Workload(), "b": Workload()}, default_workload="a")
    subject = await h.limiter(**limits)
    if not callable(getattr(subject.limiter, "stats", None)):
        h.fail("the limiter has no stats(); declare skip={'stats': ...} if it offers none")

    async def expect(
        subject: Subject, active: dict[str, int], queued: dict[str, int], when: str
    ) -> None:
        names = list(active)
        want = (sum(active.values()), sum(queued.values()), active, queued)
        seen: Any = None
        with anyio.move_on_after(h.timing.within):
            while True:
                stats = await subject.limiter.stats()
                per = getattr(stats, "workloads", {}) or {}
                seen = (
                    stats.active,
                    stats.queued,
                    {name: per[name].active if name in per else None for name in names},
                    {name: per[name].queued if name in per else None for name in names},
                )
                if seen == want:
                    return
                await anyio.sleep(0.005)
        h.fail(
            f"{when}: stats() said active={seen[0]} {seen[2]}, queued={seen[1]} {seen[3]}; "
            f"expected active={want[0]} {want[2]}, queued={want[1]} {want[3]}"
        )

    zero = dict.fromkeys(names, 0)
    await expect(subject, zero, zero, "before any request")
    a1 = await h.take(subject, names[0], what="a free slot was not granted")
    b1 = await h.take(subject, names[-1], what="a free slot was not granted")
    held = {**zero, names[0]: 1}
    held[names[-1]] += 1
    await expect(subject, held, zero, "with two slots held")
    a2 = h.start(subject, names[0], label="a2")
    await expect(
        subject, held, {**zero, names[0]: 1}, "with two slots held and one request waiting"
    )
    await b1.release()
    await a2.granted("a released slot did not go to the waiting request")
    await expect(
        subject, {**zero, names[0]: 2}, zero, "after a release handed a slot to the waiter"
    )
    b2 = h.start(subject, names[-1], label="b2")
    await expect(subject, {**zero, names[0]: 2}, {**zero, names[-1]: 1}, "with a request waiting")
    b2.cancel()
    await b2.ends("a cancelled waiter did not end")
    await b2.release()
    await expect(subject, {**zero, names[0]: 2}, zero, "after the only waiter was cancelled")
    await a1.release()
    await a2.release()
    await expect(subject, zero, zero, "after every slot was released")

    ttl = h.timing.lease_ttl
    expiring = await h.limiter(max_concurrent=1, lease_ttl=ttl)
    zero = {"default": 0}
    probe = await h.take(expiring, what="a free slot was not granted")
    probe.abandon()
    await anyio.sleep(ttl)
    await expect(
        expiring, zero, zero, f"after the only lease went unrenewed past lease_ttl={ttl:g}s"
    )


@_case(
    "invalid_limits",
    "invalid limits are rejected (ConcurrencyConfigError naming the setting)",
)
async def _invalid_limits(h: Harness) -> None:
    for value in (0, -1, 2.5):
        await h.rejects(
            {"max_concurrent": value},
            setting="max_concurrent",
            why="a non-positive or non-integer max_concurrent",
        )
    for value in (0, -1.0):
        await h.rejects(
            {"max_concurrent": 2, "lease_ttl": value},
            setting="lease_ttl",
            why="a lease_ttl that is not positive",
        )
    await h.rejects({"max_concurrent": 2, "name": ""}, setting="name", why="an empty name")
    if h.supports("max_queued"):
        await h.rejects(
            {"max_concurrent": 2, "max_queued": -1},
            setting="max_queued",
            why="a negative max_queued",
        )
    if h.supports("max_wait"):
        await h.rejects(
            {"max_concurrent": 2, "workloads": {"default": Workload(max_wait=-1.0)}},
            setting="max_wait",
            why="a negative max_wait",
        )
    if h.supports("workload_max_queued"):
        await h.rejects(
            {"max_concurrent": 2, "workloads": {"default": Workload(max_queued=-1)}},
            setting="max_queued",
            why="a negative workload max_queued",
        )
    if h.supports("rates"):
        await h.rejects(
            {"max_concurrent": 2, "rate": Rate(requests=0)},
            setting="rate",
            why="a rate of 0 requests",
        )
        await h.rejects(
            {"max_concurrent": 2, "rate": Rate(tokens=100, per=0)},
            setting="per",
            why="a rate over 0 seconds",
        )
        if h.supports("workloads"):
            await h.rejects(
                {
                    "max_concurrent": 2,
                    "rate": Rate(requests=10),
                    "workloads": {"default": Workload(rate=Rate(requests=20))},
                },
                setting="rate",
                why="a workload rate above the limiter's",
            )


@_case(
    "invalid_workloads",
    "invalid workloads are rejected (ConcurrencyConfigError naming the setting)",
    "workloads",
)
async def _invalid_workloads(h: Harness) -> None:
    await h.rejects(
        {"max_concurrent": 2, "workloads": {"a": Workload(max_concurrent=3)}},
        setting="max_concurrent",
        why="a workload ceiling above the limiter's max_concurrent",
    )
    await h.rejects(
        {"max_concurrent": 2, "workloads": {"a": Workload(max_concurrent=0)}},
        setting="max_concurrent",
        why="a workload ceiling of 0",
    )
    await h.rejects(
        {
            "max_concurrent": 2,
            "workloads": {"a": Workload(), "b": Workload()},
            "default_workload": "missing",
        },
        setting="default_workload",
        why="a default_workload that is not one of the workloads",
    )
    if h.supports("reservations"):
        await h.rejects(
            {
                "max_concurrent": 2,
                "workloads": {"a": Workload(reserved=2), "b": Workload(reserved=1)},
            },
            setting="reserve",
            why="reservations that sum past max_concurrent",
        )
        await h.rejects(
            {"max_concurrent": 4, "workloads": {"a": Workload(max_concurrent=1, reserved=2)}},
            setting="reserved",
            why="a reservation above its workload's ceiling",
        )


@_case(
    "unknown_workload",
    "unknown workloads are refused (a request naming a workload the limiter does not have "
    "fails at once with ConcurrencyConfigError)",
    "workloads",
)
async def _unknown_workload(h: Harness) -> None:
    workloads = {"a": Workload(), "b": Workload()}
    subject = await h.limiter(max_concurrent=2, workloads=workloads, default_workload="a")
    undefaulted = await h.limiter(max_concurrent=2, workloads=workloads)
    for limiter, name, what in (
        (subject.limiter, "missing", "an unknown workload name"),
        (undefaulted.limiter, None, "no workload name, with several and no default"),
    ):
        validate = getattr(limiter, "validate_workload", None)
        if validate is not None:
            try:
                resolved = validate(name)
            except ConcurrencyConfigError:
                continue
            except Exception as exc:
                h.fail(
                    f"validate_workload({name!r}) ({what}) raised {exc!r}, not "
                    "ConcurrencyConfigError",
                    cause=exc,
                )
            h.fail(
                f"validate_workload({name!r}) accepted {what} as {resolved!r}; it must raise "
                "ConcurrencyConfigError"
            )
    request = AcquireRequest(workload="missing", request_id="conformance-unknown")
    outcome: Any = None
    with anyio.move_on_after(h.timing.within):
        try:
            outcome = await subject.limiter.acquire(request)
        except Exception as exc:
            outcome = exc
    if isinstance(outcome, ConcurrencyConfigError):
        return
    if outcome is None:
        h.fail("a request for the unknown workload 'missing' waited instead of failing at once")
    if isinstance(outcome, Exception):
        h.fail(
            f"a request for the unknown workload 'missing' raised {outcome!r}, not "
            "ConcurrencyConfigError",
            cause=outcome,
        )
    await subject.limiter.release(outcome)
    h.fail(
        "a request for the unknown workload 'missing' was granted a slot (a lease for "
        f"{getattr(outcome, 'workload', None)!r}); it must raise ConcurrencyConfigError"
    )


@_case(
    "blocked_storage",
    "acquire keeps its deadline and cancellation while its storage is blocked (a request "
    "whose storage does not answer still ends at its deadline, and at once when cancelled)",
    "deadline",
    "block_storage",
)
async def _blocked_storage(h: Harness) -> None:
    subject = await h.limiter(max_concurrent=1)
    holder = await h.take(subject, what="a free slot was not granted")
    budget = 2 * h.timing.quiet
    async with h.block_storage(subject):
        started = anyio.current_time()
        timed = h.start(subject, deadline=started + budget, label="timed")
        cancelled = h.start(subject, label="cancelled")
        await anyio.sleep(h.timing.quiet)
        cancelled.cancel()
        await cancelled.ends("an acquire cancelled while the storage was blocked did not end")
        await timed.ends(
            f"a request with a deadline {budget:g}s away kept waiting past it while the "
            "storage was blocked",
            within=budget + h.timing.within,
        )
        if not isinstance(timed.error, ConcurrencyTimeoutError):
            h.fail(
                "a request past its deadline while the storage was blocked ended with "
                f"{timed.error or timed.lease!r}, not ConcurrencyTimeoutError",
                cause=timed.error,
            )
    await holder.release()
    await h.capacity(subject, after="requests ended while the storage was blocked")


# -- the runtime ----------------------------------------------------------------------------


class _FirstRenewalFails:
    """The limiter under test as the runtime sees it (its protocol and ``lease_ttl``, no
    fast paths), with its first renewal interrupted: by ``asyncio.CancelledError`` on
    asyncio, as when a driver's future is cancelled under it, and by an ordinary error on
    trio, whose ``Cancelled`` cannot be raised by hand."""

    def __init__(self, limiter: Any) -> None:
        self.limiter = limiter
        self.name = limiter.name
        if hasattr(limiter, "lease_ttl"):
            self.lease_ttl = limiter.lease_ttl
        self.renewals = 0

    def validate_workload(self, workload: str | None) -> str:
        validate = getattr(self.limiter, "validate_workload", None)
        return str(validate(workload)) if validate is not None else workload or "default"

    async def acquire(self, request: AcquireRequest) -> Any:
        return await self.limiter.acquire(request)

    async def renew(self, lease: Any) -> Any:
        self.renewals += 1
        if self.renewals == 1:
            if trio_running():
                raise RuntimeError("the first renewal fails")
            raise asyncio.CancelledError("the first renewal is cancelled under the runtime")
        return await self.limiter.renew(lease)

    async def release(self, lease: Any) -> None:
        await self.limiter.release(lease)


@_case(
    "slot_lifecycle",
    "the limiter backs slotwise.slot (a slot taken through the runtime holds a lease, keeps "
    "it renewed, even after a renewal fails, and gives it back)",
)
async def _slot_lifecycle(h: Harness) -> None:
    ttl = h.timing.lease_ttl
    subject = await h.limiter(max_concurrent=1, lease_ttl=ttl)
    interrupted = _FirstRenewalFails(subject.limiter)
    kinds: list[str] = []
    unsubscribe = subscribe(lambda event: kinds.append(event.kind), interrupted)
    held_for = f"a slot held through slotwise.slot for 2 x lease_ttl={ttl:g}s"
    why = (
        "(the runtime renews a lease every third of the limiter's lease_ttl attribute, "
        "30s when it has none, and retries a renewal that raised: its first renewal raised "
        f"{'RuntimeError' if trio_running() else 'CancelledError'})"
    )
    try:
        async with runtime_slot(limiter=interrupted) as held:
            if not isinstance(held.lease_id, str):
                h.fail(f"slotwise.slot held {held!r}, without a lease id")
            other = h.start(subject, label="other")
            with anyio.move_on_after(2 * ttl):
                await other.done.wait()
            if other.lease is not None:
                h.fail(f"{held_for} lost its slot to another request {why}")
    except ConcurrencyLeaseLostError:
        h.fail(f"{held_for} lost its lease {why}")
    finally:
        unsubscribe()
    if "renewal-failed" not in kinds:
        h.fail(f"a renewal that raised was not reported as renewal-failed (events: {kinds})")
    await other.granted("the slot released by slotwise.slot did not go to the waiting request")
    await other.release()
    handle = await runtime_acquire(limiter=subject.limiter)

    async def release_elsewhere() -> None:
        await handle.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(release_elsewhere)
    await h.capacity(subject, after="a slot was released by another task")


# -- rates ----------------------------------------------------------------------------------

# Clocks of one machine may disagree by this much (the limiter's and the event loop's).
_SLACK = 1e-3


def _rate_held(h: Harness, probes: list[Probe], capacity: int, per: float, what: str) -> None:
    """Fail if the grants of ``probes`` exceed, in some window, what a bucket of ``capacity``
    requests per ``per`` seconds allows: its capacity plus what refilled in the window.

    A probe's grant happened between its call (``sent``) and its return (``seen``), so the
    grants of the probes called at or after ``s`` and returned by ``t`` all fall in [s, t]:
    counting those can only undercount, never fail a correct limiter on a slow machine.
    """
    granted = [p for p in probes if p.sent is not None and p.seen is not None]
    for first in granted:
        start = first.sent
        assert start is not None
        for last in granted:
            end = last.seen
            assert end is not None
            if end < start:
                continue
            inside = [p for p in granted if p.sent >= start and p.seen <= end]  # type: ignore[operator]
            allowed = capacity + math.floor((end - start + _SLACK) * capacity / per)
            if len(inside) > allowed:
                h.fail(
                    f"{what}, {len(inside)} requests were granted within {end - start:.3f}s "
                    f"(from the call of {first.label} to the grant of {last.label}), more than "
                    f"a bucket of {capacity} per {per:g}s allows then ({allowed})"
                )


@_case(
    "rate_window",
    "rate limits hold in every window (a request bucket, the limiter's or a workload's, never "
    "grants more than its capacity plus what refilled, and a request waiting for it is woken "
    "when it refills)",
    "rates",
)
async def _rate_window(h: Harness) -> None:
    unit = h.timing.quiet  # the time the buckets below take to refill one request
    per = 3 * unit
    rate = f"rate=Rate(requests=3, per={per:g})"
    subject = await h.limiter(max_concurrent=8, rate=Rate(requests=3, per=per))
    burst = [h.start(subject, label=f"burst{index + 1}") for index in range(3)]
    for probe in burst:
        await probe.granted(f"with {rate}, a first burst of 3 requests was not granted at once")
    for probe in burst:
        await probe.release()
    late = h.start(subject, label="late")
    await late.granted(
        f"with {rate}, a request waiting for the empty bucket to refill was never woken",
        within=unit + h.timing.within,
    )
    await late.release()
    _rate_held(h, [*burst, late], 3, per, f"with {rate}")
    # Left alone for longer than it takes to refill, the bucket holds its capacity, no more;
    # meanwhile, a workload's own bucket.
    idle_until = anyio.current_time() + per + unit
    if h.supports("workloads"):
        limited = f"Workload(rate=Rate(requests=2, per={2 * unit:g}))"
        scoped = await h.limiter(
            max_concurrent=8,
            workloads={
                "limited": Workload(rate=Rate(requests=2, per=2 * unit)),
                "free": Workload(),
            },
            default_workload="free",
        )
        held = [h.start(scoped, "limited", label=f"limited{index + 1}") for index in range(4)]
        free = [h.start(scoped, "free", label=f"free{index + 1}") for index in range(3)]
        for probe in free:
            await probe.granted(
                f"a request of workload 'free' waited while workload 'limited' ({limited}) "
                "waited for its own bucket"
            )
        for probe in held:
            await probe.granted(
                f"a request of workload 'limited' ({limited}) waiting for its bucket to refill "
                "was never woken",
                within=2 * unit + h.timing.within,
            )
        _rate_held(h, held, 2, 2 * unit, f"in workload 'limited' ({limited})")
        for probe in (*held, *free):
            await probe.release()
    await anyio.sleep_until(idle_until)
    again = [h.start(subject, label=f"again{index + 1}") for index in range(4)]
    for probe in again[:3]:
        await probe.granted(
            f"with {rate}, a burst of 3 requests after the bucket refilled was not granted at once"
        )
    await again[3].granted(
        f"with {rate}, a request waiting for the bucket to refill was never woken",
        within=unit + h.timing.within,
    )
    _rate_held(h, [*burst, late, *again], 3, per, f"with {rate}, idle for {per + unit:g}s")
    for probe in again:
        await probe.release()


@_case(
    "rate_tokens",
    "tokens are charged (a request's tokens are taken from the token buckets when it is "
    "granted and corrected by Slot.used_tokens(), while held or after release; a request "
    "larger than a bucket fails at once with ConcurrencyConfigError)",
    "rates",
)
async def _rate_tokens(h: Harness) -> None:
    # The bucket refills so slowly that within the case only what is charged and refunded
    # counts.
    slow = 1000 * h.timing.within
    rate = f"rate=Rate(tokens=100, per={slow:g})"
    subject = await h.limiter(max_concurrent=8, rate=Rate(tokens=100, per=slow))
    charge = h.member(subject, "charge_tokens", "rates")
    # Through the runtime, as users take slots: an estimate of 60 tokens.
    first = await runtime_acquire(limiter=subject.limiter, tokens=60)
    subject.hold(first.lease, "default", label="first")
    second = h.start(subject, tokens=60, label="second")
    await second.waits(
        f"with {rate}, a request of 60 tokens was granted while a slot with an estimate of "
        "60 tokens was held: the estimate was not charged at grant"
    )
    first.used_tokens(20)  # 40 refunded: 80 left
    await second.granted(
        "Slot.used_tokens(20) after an estimate of 60 did not refund 40 tokens: a request "
        "of 60 waiting with 40 tokens left never got them"
    )
    # 20 left. A correction after release counts too (a stream's usage comes at its end).
    subject.forget(first.lease)
    await first.release()
    first.used_tokens(60)  # 40 more: -20 left
    third = h.start(subject, tokens=1, label="third")
    await third.waits(
        "Slot.used_tokens(60) after the slot was released (an estimate of 60 corrected to "
        "20 while held) did not charge the 40 tokens more: a request of 1 token was granted"
    )
    first.used_tokens(0)  # 60 refunded: 40 left
    await third.granted(
        "Slot.used_tokens(0) refunded 60 tokens, but a request of 1 token waiting for them "
        "never got one"
    )
    # charge_tokens for a lease held through the protocol: 39 left, 39 charged.
    charge(subject.limiter, second.lease, 39)
    fourth = h.start(subject, tokens=1, label="fourth")
    await fourth.waits(
        "charge_tokens(lease, 39) with 39 tokens left did not charge them: a request of 1 "
        "token was granted"
    )
    charge(subject.limiter, second.lease, -1)
    await fourth.granted(
        "charge_tokens(lease, -1) refunded a token, but a request of 1 token waiting for it "
        "never got it"
    )
    for probe in (second, third, fourth):
        await probe.release()
    huge = h.start(subject, tokens=101, label="huge")
    await huge.ends(
        f"a request of 101 tokens, more than {rate} can ever hold, waited instead of failing "
        "at once"
    )
    if not isinstance(huge.error, ConcurrencyConfigError):
        await huge.release()
        h.fail(
            f"a request of 101 tokens, more than {rate} can ever hold, ended with "
            f"{huge.error or 'a lease'!r}, not ConcurrencyConfigError",
            cause=huge.error,
        )
    if h.supports("workloads"):
        small = f"Workload(rate=Rate(tokens=50, per={slow:g}))"
        scoped = await h.limiter(
            max_concurrent=2,
            rate=Rate(tokens=100, per=slow),
            workloads={"small": Workload(rate=Rate(tokens=50, per=slow)), "other": Workload()},
            default_workload="other",
        )
        big = h.start(scoped, "small", tokens=60, label="big")
        await big.ends(
            f"a request of 60 tokens in workload 'small' ({small}) waited instead of "
            "failing at once"
        )
        if not isinstance(big.error, ConcurrencyConfigError):
            await big.release()
            h.fail(
                f"a request of 60 tokens in workload 'small' ({small}) ended with "
                f"{big.error or 'a lease'!r}, not ConcurrencyConfigError",
                cause=big.error,
            )
        other = await h.take(
            scoped,
            "other",
            tokens=60,
            what=f"a request of 60 tokens in workload 'other' was not granted ({rate})",
        )
        await other.release()


@_case(
    "rate_order",
    "requests waiting for a rate keep their order (when a bucket refills, the request the "
    "allocation rules put first gets it: higher priority first, then arrival; no request "
    "behind it takes the tokens it waits for, however few it needs)",
    "rates",
)
async def _rate_order(h: Harness) -> None:
    per = 2 * h.timing.quiet
    rate = f"rate=Rate(tokens=100, per={per:g})"
    # One slot: the requests are granted one at a time, so their order is plain to see.
    subject = await h.limiter(max_concurrent=1, rate=Rate(tokens=100, per=per))
    holder = await h.take(subject, tokens=100, what="a free slot was not granted")
    big = h.start(subject, tokens=100, label="big")
    await h.queued(subject, 1)
    small = h.start(subject, tokens=10, label="small")
    await h.queued(subject, 2)
    order = await _serve(h, subject, holder, [big, small])
    if order != ["big", "small"]:
        h.fail(
            f"with {rate} and one slot, a request of 100 tokens then one of 10, queued while "
            f"the bucket was empty, were served as {order}: the later, smaller request took "
            "tokens the first was waiting for"
        )
    if not (h.supports("workloads") and h.supports("priority")):
        return
    ranked = await h.limiter(
        max_concurrent=1,
        rate=Rate(tokens=100, per=per),
        workloads={"low": Workload(priority=0), "high": Workload(priority=10)},
        default_workload="low",
    )
    holder = await h.take(ranked, "low", tokens=100, what="a free slot was not granted")
    probes = []
    for index, (workload, tokens) in enumerate((("low", 10), ("low", 10), ("high", 100))):
        probes.append(h.start(ranked, workload, tokens=tokens, label=f"{workload}{index + 1}"))
        await h.queued(ranked, index + 1)
    order = await _serve(h, ranked, holder, probes)
    if order != ["high3", "low1", "low2"]:
        h.fail(
            f"with {rate} and one slot, low1 and low2 (10 tokens each), then high3 (priority "
            f"10, 100 tokens), queued while the bucket was empty, were served as {order}, "
            "not high3, low1, low2: a lower-priority request took tokens high3 was waiting for"
        )


# -- pushback -------------------------------------------------------------------------------


@_case(
    "pause",
    "a pause holds every new grant (after Slot.throttled() or throttle(), no slot is granted "
    "until the time given; held slots stay held, waiting requests keep their places, and "
    "their deadlines and max_wait keep running)",
    "pushback",
)
async def _pause(h: Harness) -> None:
    await _pause_keeps_clocks(h)
    pause = 4 * h.timing.quiet
    subject = await h.limiter(max_concurrent=2)
    holder = await h.take(subject, what="a free slot was not granted")
    # Through the runtime, as slotwise.httpx does on a 429.
    refused = await runtime_acquire(limiter=subject.limiter)
    subject.hold(refused.lease, "default", label="refused")
    paused_at = anyio.current_time()
    refused.throttled(retry_after=pause)
    ends = paused_at + pause - _SLACK  # no grant before this

    def during(probe: Probe) -> None:
        if probe.seen is not None and probe.seen < ends:
            h.fail(
                f"{probe.label} was granted {probe.seen - paused_at:.3f}s after "
                f"Slot.throttled(retry_after={pause:g}): during the pause"
            )

    if await subject.renew(holder.lease) is None:
        h.fail("a held lease was gone after Slot.throttled(): renew returned None")
    waiting = [h.start(subject, label="first")]
    await h.queued(subject, 1)
    subject.forget(refused.lease)
    await refused.release()  # a slot frees during the pause
    with anyio.move_on_after(h.timing.quiet):
        await waiting[0].done.wait()
    during(waiting[0])
    for index, label in enumerate(("second", "third")):
        waiting.append(h.start(subject, label=label))
        await h.queued(subject, index + 2)
    with anyio.move_on_at(paused_at + pause + h.timing.within):
        while not any(probe.lease is not None for probe in waiting):
            await subject.next_grant.wait()
    granted = [probe for probe in waiting if probe.lease is not None]
    if not granted:
        h.fail(
            f"no waiting request got the free slot when a pause of {pause:g}s "
            "(Slot.throttled(retry_after=...)) ended"
        )
    during(granted[0])
    first, *later = waiting
    if granted[0] is not first:
        h.fail(
            f"first, second and third queued during a pause; when it ended, {granted[0].label} "
            "got the free slot before first"
        )
    order = await _serve(h, subject, first, later)
    if order != ["second", "third"]:
        h.fail(f"first, second and third queued during a pause were served as first, {order}")
    await holder.release()


async def _pause_keeps_clocks(h: Harness) -> None:
    """During a pause longer than the case: a free slot is not taken, and requests still
    end at their deadline and their max_wait."""
    long = 10 * h.timing.within
    budget = 2 * h.timing.quiet
    limits: dict[str, Any] = {"max_concurrent": 2}
    if h.supports("max_wait"):
        limits["workloads"] = {"default": Workload(max_wait=budget)}
    paused = await h.limiter(**limits)
    throttle = h.member(paused, "throttle", "pushback")
    holder = await h.take(paused, what="a free slot was not granted")
    throttle(paused.limiter, holder.lease, long)
    started = anyio.current_time()
    idle = h.start(paused, label="idle")
    await idle.waits(
        f"a request that found a free slot was granted during a pause (throttle(lease, {long:g}))"
    )
    timed = (
        h.start(paused, deadline=started + budget, label="timed")
        if h.supports("deadline")
        else None
    )
    for probe, bound in ((idle, "max_wait"), (timed, "deadline")):
        if probe is None or not h.supports(bound):
            continue
        await probe.ends(
            f"a request with a {bound} of {budget:g}s, waiting during a pause of {long:g}s, "
            f"kept waiting past its {bound}: the pause stopped its clock",
            within=budget + h.timing.within,
        )
        waited = anyio.current_time() - started
        if not isinstance(probe.error, ConcurrencyTimeoutError):
            h.fail(
                f"a request past its {bound} during a pause ended with "
                f"{probe.error or probe.lease!r}, not ConcurrencyTimeoutError",
                cause=probe.error,
            )
        if waited < budget / 2:
            h.fail(
                f"a request with a {bound} of {budget:g}s gave up after {waited:.3f}s "
                "during a pause"
            )


@_case(
    "set_limits",
    "set_limits() applies new limits at once (shrinking never revokes a held slot: new grants "
    "wait until fewer are held than the new limit; growing serves the waiting requests; an "
    "invalid change raises ConcurrencyConfigError and changes nothing)",
    "pushback",
)
async def _set_limits(h: Harness) -> None:
    subject = await h.limiter(max_concurrent=3)
    set_limits = h.member(subject, "set_limits", "pushback")
    held = [await h.take(subject, what="a free slot was not granted") for _ in range(3)]
    waiter = h.start(subject, label="waiter")
    await h.queued(subject, 1)
    await set_limits(subject.limiter, max_concurrent=1)
    subject.max_concurrent = 1  # from now on, a grant with a slot held is an over-grant
    for probe in held:
        if await subject.renew(probe.lease) is None:
            h.fail(
                "set_limits(max_concurrent=1) with 3 slots held revoked one: renew returned "
                "None for it"
            )
    for index, probe in enumerate(held[:2]):
        await probe.release()
        await waiter.waits(
            f"after set_limits(max_concurrent=1), a request was granted with {2 - index} "
            "slots still held"
        )
    await held[2].release()
    await waiter.granted(
        "after set_limits(max_concurrent=1), the waiting request did not get the slot freed "
        "when no other was held"
    )
    second = h.start(subject, label="second")
    await h.queued(subject, 1)
    subject.max_concurrent = 3  # before the call: it may grant before it returns
    await set_limits(subject.limiter, max_concurrent=3)
    await second.granted(
        "set_limits(max_concurrent=3) raised the limit from 1, but the waiting request did "
        "not get one of the new slots"
    )
    third = await h.take(
        subject, what="after set_limits(max_concurrent=3), a third slot was not granted"
    )
    fourth = h.start(subject, label="fourth")
    await h.queued(subject, 1)
    # All or nothing: a valid limit beside an invalid one is not applied either.
    invalid: dict[str, Any] = {"max_concurrent": 0}
    setting = "max_concurrent"
    if h.supports("max_queued"):
        invalid, setting = {"max_concurrent": 4, "max_queued": -1}, "max_queued"
    shown = ", ".join(f"{key}={value!r}" for key, value in invalid.items())
    try:
        await set_limits(subject.limiter, **invalid)
    except ConcurrencyConfigError as exc:
        if setting not in str(exc):
            h.fail(
                f"set_limits({shown}) was rejected, but the message does not name the "
                f"setting {setting!r}: {exc}"
            )
    except Exception as exc:
        h.fail(f"set_limits({shown}) raised {exc!r}, not ConcurrencyConfigError", cause=exc)
    else:
        h.fail(f"set_limits({shown}) was accepted; it must raise ConcurrencyConfigError")
    await fourth.waits(
        f"set_limits({shown}) raised, but max_concurrent changed: a fourth slot was granted "
        "with max_concurrent=3"
    )
    await h.settle([waiter, second, third, fourth], what="the queued request was not served")
