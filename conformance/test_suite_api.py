"""The suite's own surface: factories, capability opt-outs, skips and failure reports."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import unittest
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from slotwise import AcquireRequest, Lease, MemoryLimiter
from slotwise.conformance import (
    CAPABILITIES,
    ConformanceCase,
    ConformanceFailure,
    conformance_cases,
)

from . import broken

pytestmark = pytest.mark.anyio


def case_named(name: str, create: Any, **options: Any) -> ConformanceCase:
    [case] = [c for c in conformance_cases(create, **options) if c.name == name]
    return case


ALL = ("workload_max_queued", "rates", "pushback")  # the capabilities declared with supports=


def test_cases_have_unique_names_duties_and_known_capabilities() -> None:
    cases = conformance_cases(MemoryLimiter, supports=ALL, block_storage=broken.block_storage)
    assert len({case.name for case in cases}) == len(cases)
    assert all(case.duty and case.skip_reason is None for case in cases)
    assert set().union(*(case.requires for case in cases)) == {*CAPABILITIES, "block_storage"}
    assert repr(cases[0]) == "<slotwise.conformance.ConformanceCase 'atomic_allocation'>"


@pytest.mark.parametrize("skip", [{"atomic_allocation"}, {"lease_expiry": "no"}, {"stat"}])
def test_only_capabilities_can_be_skipped(skip: Any) -> None:
    with pytest.raises(ValueError, match="every other duty is required"):
        conformance_cases(MemoryLimiter, skip=skip)


@pytest.mark.parametrize(
    ("supports", "skip", "says"),
    [
        (["rate"], (), "cannot declare 'rate'"),
        (["atomic_allocation"], (), "cannot declare 'atomic_allocation'"),
        (["rates"], {"rates": "no buckets"}, "'rates' is both in skip and in supports"),
    ],
)
def test_only_capabilities_can_be_declared_and_not_also_skipped(
    supports: Any, skip: Any, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        conformance_cases(MemoryLimiter, supports=supports, skip=skip)


def test_the_later_capabilities_run_only_when_declared() -> None:
    def skipped(**options: Any) -> set[str]:
        cases = conformance_cases(MemoryLimiter, block_storage=broken.block_storage, **options)
        return {case.name for case in cases if case.skip_reason is not None}

    assert skipped() == {
        "workload_max_queued",
        "rate_window",
        "rate_tokens",
        "rate_order",
        "pause",
        "set_limits",
    }
    assert skipped(supports="rates") == {"workload_max_queued", "pause", "set_limits"}
    assert skipped(supports=ALL) == set()
    # Skipping a capability the later cases also need skips them, declared or not.
    assert skipped(supports=ALL, skip=["workloads"]) == {
        case.name for case in conformance_cases(MemoryLimiter) if "workloads" in case.requires
    }


async def test_an_undeclared_capability_is_a_skip_that_says_how_to_declare_it() -> None:
    case = case_named("rate_window", MemoryLimiter)
    with pytest.raises(
        pytest.skip.Exception,
        match=r"'rates' support \(declare it with conformance_cases\(supports=\['rates'\]\)\)",
    ):
        await case.run()
    reason = case_named("rate_window", MemoryLimiter, skip={"rates": "no buckets"}).skip_reason
    assert reason == "the limiter declares no 'rates' support (no buckets)"


@pytest.mark.parametrize(
    ("name", "capability", "member"),
    [
        ("rate_tokens", "rates", "charge_tokens"),
        ("pause", "pushback", "throttle"),
        ("set_limits", "pushback", "set_limits"),
    ],
)
async def test_a_declared_capability_needs_its_methods_on_the_class(
    name: str, capability: str, member: str
) -> None:
    # ContextLimiter forwards acquire, renew and release only.
    case = case_named(
        name, lambda **limits: ContextLimiter(Opened(), **limits), supports=[capability]
    )
    with pytest.raises(ConformanceFailure, match=f"its class has no {member}\\(\\)"):
        await case.run()


def test_time_scale_must_be_positive() -> None:
    with pytest.raises(ValueError, match="time_scale"):
        conformance_cases(MemoryLimiter, time_scale=0)


def test_skipping_a_capability_skips_every_case_that_needs_it() -> None:
    cases = conformance_cases(MemoryLimiter, skip="workloads", supports=ALL)
    skipped = {case.name for case in cases if case.skip_reason is not None}
    assert skipped == {case.name for case in cases if "workloads" in case.requires} | {
        "blocked_storage"
    }
    assert "priority" in skipped
    assert "stats_consistent" not in skipped


async def test_a_skipped_case_is_reported_as_a_skip_with_its_reason() -> None:
    case = case_named("stats_consistent", MemoryLimiter, skip={"stats": "counts live elsewhere"})
    with pytest.raises(pytest.skip.Exception, match="'stats' support \\(counts live elsewhere\\)"):
        await case.run()


async def test_without_pytest_a_skip_is_unittest_skiptest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "pytest")
    case = case_named("queue_full", MemoryLimiter, skip=["max_queued"])
    with pytest.raises(unittest.SkipTest, match="max_queued"):
        await case.run()


class Opened:
    """Counts how often limiters were opened and closed."""

    def __init__(self) -> None:
        self.entered = 0
        self.exited = 0


class ContextLimiter:
    """A limiter that must be entered, as one owning a connection pool would."""

    def __init__(self, opened: Opened, **limits: Any) -> None:
        self._inner: MemoryLimiter[str] = MemoryLimiter(**limits)
        self._opened = opened
        self.name = self._inner.name
        self.lease_ttl = self._inner.lease_ttl
        self.open = False

    async def __aenter__(self) -> ContextLimiter:
        self._opened.entered += 1
        self.open = True
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._opened.exited += 1
        self.open = False

    async def acquire(self, request: AcquireRequest) -> Lease:
        assert self.open
        return await self._inner.acquire(request)

    async def renew(self, lease: Lease) -> Lease | None:
        return await self._inner.renew(lease)

    async def release(self, lease: Lease) -> None:
        await self._inner.release(lease)


@pytest.mark.parametrize("form", ["limiter", "awaitable", "context manager", "both", "task group"])
async def test_factories_may_be_async_and_clean_up(form: str) -> None:
    opened = Opened()

    async def awaitable(**limits: Any) -> MemoryLimiter[str]:
        return MemoryLimiter(**limits)

    @contextlib.asynccontextmanager
    async def context_manager(**limits: Any) -> AsyncIterator[MemoryLimiter[str]]:
        opened.entered += 1
        try:
            yield MemoryLimiter(**limits)
        finally:
            opened.exited += 1

    async def both(**limits: Any) -> ContextLimiter:
        return ContextLimiter(opened, **limits)

    @contextlib.asynccontextmanager
    async def with_task_group(**limits: Any) -> AsyncIterator[MemoryLimiter[str]]:
        # A limiter with background tasks: its task group is entered and exited in one task.
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.sleep_forever)
            async with context_manager(**limits) as limiter:
                yield limiter
            tg.cancel_scope.cancel()

    create = {
        "limiter": MemoryLimiter,
        "awaitable": awaitable,
        "context manager": context_manager,
        "both": both,
        "task group": with_task_group,
    }[form]
    await case_named("lease_ids_unique", create).run()  # builds three limiters
    assert opened.entered == opened.exited
    assert opened.entered == (0 if form in ("limiter", "awaitable") else 3)


async def test_without_block_storage_the_case_needing_it_is_skipped_with_the_reason() -> None:
    case = case_named("blocked_storage", MemoryLimiter)
    assert case.requires == {"deadline", "block_storage"}
    with pytest.raises(pytest.skip.Exception, match="no block_storage was given"):
        await case.run()
    given = case_named("blocked_storage", MemoryLimiter, block_storage=broken.block_storage)
    assert given.skip_reason is None


async def test_an_over_grant_a_probe_sees_is_reported_as_such() -> None:
    # One slot more than asked for: the first request that should queue is granted, and
    # the case must say so, not that stats() never showed it queued.
    def one_too_many(**limits: Any) -> MemoryLimiter[str]:
        return MemoryLimiter(**{**limits, "max_concurrent": limits["max_concurrent"] + 1})

    case = case_named("arrival_order", one_too_many)
    with anyio.fail_after(2):  # at once, not after a wait runs out
        with pytest.raises(ConformanceFailure) as failure:
            await case.run()
    assert str(failure.value) == (
        f"{case.duty}: 2 leases were held at once with max_concurrent=1 (held: {{'default': 2}})"
    )


async def test_a_factory_that_returns_no_limiter_fails_clearly() -> None:
    with pytest.raises(ConformanceFailure, match="which is not a limiter"):
        await case_named("arrival_order", lambda **limits: object()).run()


async def test_a_limiter_raising_unexpectedly_fails_the_case_with_the_cause() -> None:
    class Exploding(ContextLimiter):
        async def acquire(self, request: AcquireRequest) -> Lease:
            raise RuntimeError("boom")

    case = case_named("arrival_order", lambda **limits: Exploding(Opened(), **limits))
    with pytest.raises(ConformanceFailure, match="acquire raised RuntimeError") as failure:
        await case.run()
    assert str(failure.value).startswith(case.duty)
    assert isinstance(failure.value.__cause__, RuntimeError)


async def test_a_failing_case_still_closes_its_limiters() -> None:
    opened = Opened()

    @contextlib.asynccontextmanager
    async def create(**limits: Any) -> AsyncIterator[broken.OverGrants]:
        opened.entered += 1
        try:
            yield broken.OverGrants(**limits)
        finally:
            opened.exited += 1

    with pytest.raises(ConformanceFailure, match="held at once"):
        await case_named("atomic_allocation", create).run()
    assert opened.entered == opened.exited == 1


def test_importing_the_suite_needs_only_slotwise_and_anyio() -> None:
    code = (
        "import sys, slotwise.conformance; "
        "print(sorted(m for m in ('pytest', 'trio', 'hypothesis', 'psycopg') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_cases_come_only_from_conformance_cases() -> None:
    with pytest.raises(TypeError, match="conformance_cases"):
        ConformanceCase()
