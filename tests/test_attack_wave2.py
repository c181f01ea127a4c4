"""MemoryLimiter under rates, pushback, changed limits and queue bounds: the moments where a
waiter leaves, a limit shrinks under a waiter, a refusal meets a grant, or the loop is
looked up while trio is half imported.

Waits are observed from the outside: tasks are started one at a time, each blocked before
the next, and `anyio.wait_all_tasks_blocked()` says when nothing more can happen without
time passing. Where time matters, tests run on asyncio in real time and on trio's
MockClock.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.machinery
import sys
import threading
import time
import types
from typing import Any

import anyio
import pytest
import trio
from trio.testing import MockClock

from slotwise import (
    AcquireRequest,
    ConcurrencyConfigError,
    ConcurrencyEvent,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
    ConfigErrorEvent,
    Lease,
    MemoryLimiter,
    Rate,
    Workload,
)
from slotwise._runtime import loop as loop_module

pytestmark = pytest.mark.anyio


def on_asyncio_and_mock_clock() -> pytest.MarkDecorator:
    """asyncio in real time, and trio on a virtual clock that jumps when every task sleeps."""
    return pytest.mark.parametrize(
        "anyio_backend",
        [
            "asyncio",
            pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock"),
        ],
    )


class Waiter:
    """A task that takes a slot, records that it got it (or its error), and holds the slot
    until told to leave."""

    def __init__(self, limiter: MemoryLimiter[str], workload: str, tokens: int = 0) -> None:
        self.limiter = limiter
        self.workload = workload
        self.tokens = tokens
        self.entered = False
        self.error: BaseException | None = None
        self.done = anyio.Event()
        self.scope = anyio.CancelScope()
        self.settled = anyio.Event()  # entered, or failed

    async def run(self) -> None:
        with self.scope:
            try:
                async with self.limiter.slot(self.workload, tokens=self.tokens or None):
                    self.entered = True
                    self.settled.set()
                    await self.done.wait()
            except Exception as exc:
                self.error = exc
                self.settled.set()


async def start(tg: Any, waiter: Waiter) -> Waiter:
    tg.start_soon(waiter.run)
    await anyio.wait_all_tasks_blocked()
    return waiter


def two_priorities(**limiter: Any) -> MemoryLimiter[str]:
    """A limiter with a token bucket that refills too slowly to matter during a test, and a
    high-priority workload whose head claims it when short."""
    return MemoryLimiter(
        name="tpm",
        max_concurrent=8,
        rate=Rate(tokens=100, per=3600.0),
        workloads={"hi": Workload(priority=10), "lo": Workload(), **limiter.pop("extra", {})},
        **limiter,
    )


# -- (a) a waiter that leaves the queue re-runs the allocation --------------------------------


async def test_a_cancelled_head_that_claimed_a_bucket_lets_those_behind_it_go() -> None:
    limiter = two_priorities()
    async with limiter.slot("lo", tokens=50):
        pass  # 50 tokens left, for an hour
    async with anyio.create_task_group() as tg:
        head = await start(tg, Waiter(limiter, "hi", tokens=80))  # short: claims "tokens"
        behind = await start(tg, Waiter(limiter, "lo", tokens=10))
        assert not head.entered
        assert not behind.entered  # behind the claim on "tokens"
        head.scope.cancel()
        await anyio.wait_all_tasks_blocked()
        assert behind.entered, "the head left, and nothing else is short: it must go now"
        behind.done.set()
    assert limiter.stats_nowait().queued == 0


@on_asyncio_and_mock_clock()
async def test_a_head_whose_max_wait_passes_lets_those_behind_it_go() -> None:
    limiter = MemoryLimiter(
        name="tpm",
        max_concurrent=8,
        rate=Rate(tokens=100, per=3600.0),
        workloads={"hi": Workload(priority=10, max_wait=0.2), "lo": Workload(max_wait=5.0)},
    )
    async with limiter.slot("lo", tokens=50):
        pass
    start_time = anyio.current_time()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            head = await start(tg, Waiter(limiter, "hi", tokens=80))
            behind = await start(tg, Waiter(limiter, "lo", tokens=10))
            await behind.settled.wait()
            assert isinstance(head.error, ConcurrencyTimeoutError)
            assert behind.error is None
            # Granted when the head timed out, not at the lo's max_wait or the hour's refill.
            assert anyio.current_time() - start_time < 4
            behind.done.set()


# -- (b) a bucket shrunk below a waiting request's cost -------------------------------------


@pytest.mark.parametrize("scope", ["limiter", "workload"])
async def test_set_limits_shrinking_a_bucket_below_a_waiting_request_fails_it(
    scope: str,
) -> None:
    rate = Rate(tokens=100, per=3600.0)
    limiter = MemoryLimiter(
        name="tpm",
        max_concurrent=8,
        rate=rate if scope == "limiter" else None,
        workloads={"a": Workload(rate=None if scope == "limiter" else rate)},
    )
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)
    try:
        async with limiter.slot("a", tokens=90):
            pass
        async with anyio.create_task_group() as tg:
            big = await start(tg, Waiter(limiter, "a", tokens=50))
            small = await start(tg, Waiter(limiter, "a", tokens=5))
            assert not big.entered
            assert not small.entered
            smaller = Rate(tokens=40, per=3600.0)
            if scope == "limiter":
                await limiter.set_limits(rate=smaller)
            else:
                await limiter.set_limits(workloads={"a": Workload(rate=smaller)})
            await anyio.wait_all_tasks_blocked()
            assert isinstance(big.error, ConcurrencyConfigError), big.error
            key = "tokens" if scope == "limiter" else "a.tokens"
            assert f"bucket {key!r} holds at most 40 tokens" in str(big.error)
            assert "a request of 50 tokens can never be granted" in str(big.error)
            assert big.error.request_id is not None
            assert big.error.workload == "a"
            # The 5-token request behind it fits the new bucket: it is not failed.
            assert small.error is None
            small.scope.cancel()
    finally:
        unsubscribe()
    assert [e.kind for e in events].count("config-error") == 1
    assert limiter.stats_nowait().queued == 0


# -- (c) a refusal after the submit's tick granted another waiter ------------------------------


async def test_a_queue_full_refusal_still_wakes_the_waiter_its_submit_granted() -> None:
    limiter = MemoryLimiter(
        name="rpm",
        max_concurrent=8,
        rate=Rate(requests=1, per=1.0),
        workloads={
            "hi": Workload(priority=10),
            "default": Workload(),
            "never-waits": Workload(max_queued=0),
        },
    )
    async with limiter.slot():
        pass  # the bucket is empty until a second from now
    async with anyio.create_task_group() as tg:
        watcher = await start(tg, Waiter(limiter, "default"))  # parked first: the clock watch
        granted = await start(tg, Waiter(limiter, "hi"))  # goes first at the refill
        # Block the loop past the refill, so that no timer rings before the next request:
        # its submit sees the refill first and grants `granted`.
        time.sleep(1.1)  # noqa: ASYNC251 - blocking the loop is the point
        with pytest.raises(ConcurrencyQueueFullError):
            async with limiter.slot("never-waits"):
                pytest.fail("the bucket is empty again: it would wait, and may not")
        await anyio.wait_all_tasks_blocked()
        assert granted.entered, "granted by the refused request's submit, but never woken"
        assert not watcher.entered
        granted.done.set()
        watcher.scope.cancel()


# -- (d) the queue bound counts only requests that must wait -----------------------------------


@pytest.mark.parametrize("bound", ["limiter", "workload"])
async def test_max_queued_zero_with_rates_grants_a_request_that_need_not_wait(bound: str) -> None:
    limiter = MemoryLimiter(
        name="rpm",
        max_concurrent=2,
        max_queued=0 if bound == "limiter" else None,
        rate=Rate(requests=10, per=60.0),
        workloads={"a": Workload(max_queued=0 if bound == "workload" else None)},
    )
    async with limiter.slot("a"), limiter.slot("a", allow_nested=True):
        assert limiter.stats_nowait().active == 2
        # A request that must wait (no slot is free) is still refused.
        with pytest.raises(ConcurrencyQueueFullError):
            async with limiter.slot("a", allow_nested=True):
                pytest.fail("no slot free: it would wait")
    assert limiter.stats_nowait().queued == 0


@on_asyncio_and_mock_clock()
async def test_max_queued_after_a_pause_grants_a_request_with_room_at_once() -> None:
    """A pause that has ended is kept while a request from before its end still waits (for
    a slot of its full workload): meanwhile a request of another workload with room goes at
    once, whatever the queue bound."""
    limiter = MemoryLimiter(
        name="paused",
        max_concurrent=4,
        max_queued=1,
        workloads={"full": Workload(max_concurrent=1), "free": Workload()},
    )
    async with anyio.create_task_group() as tg:
        holder = await start(tg, Waiter(limiter, "full"))
        assert holder.entered
        limiter.throttle(None, retry_after=0.05)
        waiting = await start(tg, Waiter(limiter, "full"))  # the one place in the queue
        await anyio.sleep(0.2)  # the pause ends; `waiting` still waits for its workload
        assert not waiting.entered
        async with limiter.slot("free"):
            pass
        waiting.scope.cancel()
        holder.done.set()


# -- (e) a workload removed while a request for it joins -------------------------------------


@pytest.mark.parametrize("case", ["idle", "holding", "rated"])
async def test_a_workload_removed_as_a_request_joins_fails_it_as_unknown(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """idle: the workload holds nothing and goes at once (the fast path); holding: it still
    holds a slot, so it stays as a workload that takes nothing more; rated: every request
    goes through the queue."""
    limiter = MemoryLimiter(
        name="shrinking",
        max_concurrent=4,
        workloads={"a": Workload(), "b": Workload()},
        rate=Rate(requests=100) if case == "rated" else None,
    )
    resolve = MemoryLimiter.validate_workload

    def resolve_then_remove(self: MemoryLimiter[str], workload: str | None) -> str:
        # The request resolved its workload; set_limits() in another thread removes it
        # before the request takes its slot.
        name = resolve(self, workload)
        removal = threading.Thread(
            target=asyncio.run, args=(limiter.set_limits(workloads={"a": Workload()}),)
        )
        removal.start()
        removal.join()
        return name

    async with contextlib.AsyncExitStack() as stack:
        if case == "holding":
            await stack.enter_async_context(limiter.slot("b"))
        events: list[ConcurrencyEvent] = []
        stack.callback(limiter.subscribe(events.append))
        with monkeypatch.context() as patch:
            patch.setattr(MemoryLimiter, "validate_workload", resolve_then_remove)
            with anyio.fail_after(10), pytest.raises(ConcurrencyConfigError) as raised:
                async with limiter.slot("b", allow_nested=True):
                    pytest.fail("its workload is gone")
        with pytest.raises(ConcurrencyConfigError) as unknown:
            async with limiter.slot("b", allow_nested=True):
                pytest.fail("its workload is gone")
        assert str(raised.value) == str(unknown.value)
        assert "unknown workload 'b'" in str(raised.value)
        assert raised.value.request_id is not None
        # Reported as a refusal of the slow path is: the wait it began, then the error.
        assert [e.kind for e in events][:2] == ["wait-started", "config-error"]
        assert limiter.stats_nowait().queued == 0
    assert limiter.stats_nowait().active == 0


# -- (f) the fast path reports its errors as the slow path does -------------------------------


def _take_in_another_run(limiter: MemoryLimiter[str], backend: str) -> BaseException | None:
    """Take a slot of ``limiter`` in a new event loop of ``backend`` in another thread."""
    result: list[BaseException | None] = []

    async def take() -> None:
        try:
            async with limiter.slot():
                result.append(None)
        except Exception as exc:
            result.append(exc)

    options = {"clock": MockClock()} if backend == "trio" else {}
    thread = threading.Thread(
        target=anyio.run, args=(take,), kwargs={"backend": backend, "backend_options": options}
    )
    thread.start()
    thread.join()
    return result[0]


@pytest.mark.parametrize(
    "anyio_backend",
    [
        "asyncio",
        pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock"),
    ],
)
async def test_a_fast_path_error_carries_the_request_and_is_reported(
    anyio_backend: Any,
) -> None:
    """A limiter in use on one clock refuses a request from a run on another one: the fast
    path's refusal is filled in and reported like any other."""
    limiter = MemoryLimiter(name="clocked", max_concurrent=4)
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)
    other = "asyncio" if isinstance(anyio_backend, tuple) else "trio"
    try:
        async with limiter.slot():
            error = await anyio.to_thread.run_sync(_take_in_another_run, limiter, other)
    finally:
        unsubscribe()
    assert isinstance(error, ConcurrencyConfigError), error
    assert "virtual clock" in str(error)
    assert error.request_id is not None
    assert error.limiter == "clocked"
    assert error.workload == "default"
    assert [e.kind for e in events if isinstance(e, ConfigErrorEvent)] == ["config-error"]


# -- (g) the running loop, with trio half imported in another thread --------------------------


def _half_imported(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    spec = importlib.machinery.ModuleSpec(name, None)
    spec._initializing = True  # type: ignore[attr-defined]  # what importlib sets meanwhile
    module.__spec__ = spec
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def test_the_loop_is_found_while_trio_is_half_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """trio's modules are in sys.modules from the moment their import starts: another thread
    importing trio must not break the loop lookup of this one (which runs no trio)."""
    monkeypatch.setitem(sys.modules, "trio", _half_imported("trio"))
    monkeypatch.setitem(sys.modules, "trio._core._run", _half_imported("trio._core._run"))
    monkeypatch.setattr(loop_module, "_trio_context", None)
    assert loop_module.current() is None

    async def inside() -> object:
        return loop_module.current()

    assert isinstance(asyncio.run(inside()), loop_module.AsyncioLoop)
    monkeypatch.undo()
    # Once trio's import has completed, its runs are found again.
    assert isinstance(trio.run(inside), loop_module.TrioLoop)
    assert isinstance(asyncio.run(inside()), loop_module.AsyncioLoop)


# -- (h) token counts and capacities a float holds exactly ------------------------------------


async def test_token_counts_beyond_exact_floats_are_refused_at_once() -> None:
    big = 2**53 + 1
    with pytest.raises(ConcurrencyConfigError, match=str(big)):
        MemoryLimiter(name="tpm", max_concurrent=1, rate=Rate(tokens=big))
    with pytest.raises(ConcurrencyConfigError, match=r"rate.tokens"):
        MemoryLimiter(name="tpm", max_concurrent=1, rate=Rate(tokens=10**400))
    limiter = MemoryLimiter(name="tpm", max_concurrent=2, rate=Rate(tokens=2**53))
    with pytest.raises(ConcurrencyConfigError, match=str(big)):
        async with limiter.slot(tokens=big):
            pytest.fail("too many tokens")
    async with limiter.slot(tokens=2**53):
        pass  # the largest count is fine


async def test_a_used_tokens_that_fails_leaves_the_estimate_as_it_was() -> None:
    limiter = MemoryLimiter(name="tpm", max_concurrent=2, rate=Rate(tokens=1000, per=3600.0))
    async with limiter.slot(tokens=100) as slot:
        assert round(limiter.stats_nowait().buckets["tokens"].level) == 900
        for bad in (10**400, 2**53 + 1):
            with pytest.raises(ValueError, match=str(bad)):
                slot.used_tokens(bad)
            assert round(limiter.stats_nowait().buckets["tokens"].level) == 900
        slot.used_tokens(300)  # 200 more than the estimate of 100
        assert round(limiter.stats_nowait().buckets["tokens"].level) == 700


# -- a claim on a limiter bucket lasts while that bucket is short ------------------------------


@on_asyncio_and_mock_clock()
async def test_a_claim_lifts_when_the_claimed_bucket_refills_not_when_the_head_can_go() -> None:
    """A head short of its workload's slow bucket and of the limiter's fast one claims the
    limiter's: a request of another workload behind it goes once the limiter's bucket holds
    the head's cost again (0.3 s), not when the head's own bucket does (6 s)."""
    limiter = MemoryLimiter(
        name="tpm",
        max_concurrent=8,
        rate=Rate(tokens=1000, per=6.0),
        workloads={"bg": Workload(rate=Rate(tokens=100, per=6.0)), "fg": Workload()},
    )
    async with limiter.slot("bg", tokens=100):
        pass  # bg's bucket is empty: 6 s to hold 100 again
    async with limiter.slot("fg", tokens=850):
        pass  # the limiter's holds 50: 0.3 s to hold 100
    start_time = anyio.current_time()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            head = await start(tg, Waiter(limiter, "bg", tokens=100))
            behind = await start(tg, Waiter(limiter, "fg", tokens=60))
            await behind.settled.wait()
            assert behind.error is None
            assert anyio.current_time() - start_time < 3
            assert not head.entered
            head.scope.cancel()
            behind.done.set()


# -- a grant made again after its lease ran out unused is charged once -------------------------


async def test_a_grant_made_again_after_its_lease_ran_out_is_charged_once() -> None:
    """An untethered grant (the Limiter protocol) whose lease runs out before its waiter
    resumes is made again: the request reaches the provider once, and is charged once."""
    limiter = MemoryLimiter(
        name="tpm", max_concurrent=1, lease_ttl=0.3, rate=Rate(tokens=1000, per=3600.0)
    )

    def request() -> AcquireRequest:
        return AcquireRequest(workload="default", request_id="r", tokens=100)

    first = await limiter.acquire(request())
    leases: list[Lease] = []

    async def wait() -> None:
        leases.append(await limiter.acquire(request()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.wait_all_tasks_blocked()
        await limiter.release(first)  # granted to the waiter, charged 100 tokens
        time.sleep(0.4)  # noqa: ASYNC251 - its loop stalls past lease_ttl before it resumes
    (lease,) = leases
    assert round(limiter.stats_nowait().buckets["tokens"].level) == 800
    await limiter.release(lease)
