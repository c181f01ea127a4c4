"""Settings: every invalid setting the docs list fails when the limiter is created, with a
``ConcurrencyConfigError`` (also a ``ValueError``) whose message names the setting; the valid
edge cases are accepted; a request without a usable workload fails before it waits."""

from __future__ import annotations

import math
import re
from enum import StrEnum
from typing import Any

import anyio
import pytest

import slotwise
from slotwise import (
    AcquireRequest,
    ConcurrencyConfigError,
    ConcurrencyError,
    ConcurrencyEvent,
    MemoryLimiter,
    Workload,
)

INVALID: list[tuple[str, dict[str, Any], str]] = [
    # (id, keyword arguments, the setting the message must name)
    ("max_concurrent-zero", {"max_concurrent": 0}, "max_concurrent"),
    ("max_concurrent-negative", {"max_concurrent": -3}, "max_concurrent"),
    ("max_concurrent-float", {"max_concurrent": 2.5}, "max_concurrent"),
    ("max_concurrent-integral-float", {"max_concurrent": 4.0}, "max_concurrent"),
    ("max_concurrent-bool", {"max_concurrent": True}, "max_concurrent"),
    ("max_concurrent-str", {"max_concurrent": "8"}, "max_concurrent"),
    ("max_concurrent-none", {"max_concurrent": None}, "max_concurrent"),
    (
        "reservations-past-max_concurrent",
        {
            "max_concurrent": 4,
            "workloads": {"a": Workload(reserved=3), "b": Workload(reserved=2)},
        },
        "max_concurrent",
    ),
    (
        "reservation-above-ceiling",
        {"max_concurrent": 8, "workloads": {"a": Workload(max_concurrent=2, reserved=3)}},
        "workloads['a'].reserved",
    ),
    (
        "reservation-negative",
        {"max_concurrent": 8, "workloads": {"a": Workload(reserved=-1)}},
        "workloads['a'].reserved",
    ),
    (
        "reservation-float",
        {"max_concurrent": 8, "workloads": {"a": Workload(reserved=1.5)}},  # type: ignore[arg-type]
        "workloads['a'].reserved",
    ),
    (
        "ceiling-above-limiter",
        {"max_concurrent": 4, "workloads": {"a": Workload(max_concurrent=5)}},
        "workloads['a'].max_concurrent",
    ),
    (
        "ceiling-zero",
        {"max_concurrent": 4, "workloads": {"a": Workload(max_concurrent=0)}},
        "workloads['a'].max_concurrent",
    ),
    (
        "ceiling-bool",
        {"max_concurrent": 4, "workloads": {"a": Workload(max_concurrent=True)}},
        "workloads['a'].max_concurrent",
    ),
    (
        "priority-float",
        {"max_concurrent": 4, "workloads": {"a": Workload(priority=0.5)}},  # type: ignore[arg-type]
        "workloads['a'].priority",
    ),
    (
        "max_wait-negative",
        {"max_concurrent": 4, "workloads": {"a": Workload(max_wait=-1.0)}},
        "workloads['a'].max_wait",
    ),
    (
        "max_wait-nan",
        {"max_concurrent": 4, "workloads": {"a": Workload(max_wait=math.nan)}},
        "workloads['a'].max_wait",
    ),
    (
        "max_wait-str",
        {"max_concurrent": 4, "workloads": {"a": Workload(max_wait="1")}},  # type: ignore[arg-type]
        "workloads['a'].max_wait",
    ),
    (
        "default_workload-missing",
        {"max_concurrent": 4, "workloads": {"a": Workload()}, "default_workload": "b"},
        "default_workload",
    ),
    (
        "default_workload-missing-implicit-default",
        {"max_concurrent": 4, "default_workload": "interactive"},
        "default_workload",
    ),
    ("name-empty", {"max_concurrent": 4, "name": ""}, "name"),
    ("name-blank", {"max_concurrent": 4, "name": "   "}, "name"),
    ("name-not-str", {"max_concurrent": 4, "name": 7}, "name"),
    (
        "workload-name-empty",
        {"max_concurrent": 4, "workloads": {"": Workload()}},
        "workload names",
    ),
    ("max_queued-negative", {"max_concurrent": 4, "max_queued": -1}, "max_queued"),
    ("max_queued-float", {"max_concurrent": 4, "max_queued": 2.5}, "max_queued"),
    ("max_queued-bool", {"max_concurrent": 4, "max_queued": False}, "max_queued"),
    ("lease_ttl-zero", {"max_concurrent": 4, "lease_ttl": 0}, "lease_ttl"),
    ("lease_ttl-negative", {"max_concurrent": 4, "lease_ttl": -1.0}, "lease_ttl"),
    ("lease_ttl-inf", {"max_concurrent": 4, "lease_ttl": math.inf}, "lease_ttl"),
    ("lease_ttl-nan", {"max_concurrent": 4, "lease_ttl": math.nan}, "lease_ttl"),
    ("lease_ttl-str", {"max_concurrent": 4, "lease_ttl": "30"}, "lease_ttl"),
    (
        "workload-not-a-Workload",
        {"max_concurrent": 4, "workloads": {"a": {"reserved": 1}}},
        "workloads['a']",
    ),
    ("workloads-empty", {"max_concurrent": 4, "workloads": {}}, "workloads"),
    ("workloads-not-a-mapping", {"max_concurrent": 4, "workloads": ["a"]}, "workloads"),
]


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [pytest.param(kwargs, setting, id=id_) for id_, kwargs, setting in INVALID],
)
def test_an_invalid_setting_fails_at_creation_naming_it(
    kwargs: dict[str, Any], setting: str
) -> None:
    with pytest.raises(ConcurrencyConfigError, match=re.escape(setting)) as caught:
        MemoryLimiter(**kwargs)
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, ConcurrencyError)


def test_a_reservation_total_past_max_concurrent_says_so() -> None:
    with pytest.raises(ConcurrencyConfigError) as caught:
        MemoryLimiter(
            max_concurrent=4,
            workloads={"a": Workload(reserved=3), "b": Workload(reserved=2)},
        )
    message = str(caught.value)
    assert "reserve" in message
    assert "5" in message
    assert "4" in message


# -- valid edge cases ------------------------------------------------------------------------


def test_max_wait_zero_and_max_queued_zero_are_valid() -> None:
    limiter = MemoryLimiter(
        max_concurrent=1, max_queued=0, workloads={"default": Workload(max_wait=0)}
    )
    assert limiter.max_queued == 0
    assert limiter.workloads["default"].max_wait == 0


def test_every_slot_may_be_reserved() -> None:
    one = MemoryLimiter(max_concurrent=3, workloads={"only": Workload(reserved=3)})
    assert one.default_workload == "only"
    two = MemoryLimiter(
        max_concurrent=4,
        workloads={"a": Workload(reserved=2, max_concurrent=2), "b": Workload(reserved=2)},
        default_workload="b",
    )
    assert two.default_workload == "b"


def test_no_workloads_means_one_named_default() -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(max_concurrent=2)
    assert list(limiter.workloads) == ["default"]
    assert limiter.default_workload == "default"
    assert limiter.name == "default"


def test_the_default_workload_is_default_if_it_exists_or_the_only_one() -> None:
    several = MemoryLimiter(
        max_concurrent=2, workloads={"batch": Workload(), "default": Workload()}
    )
    assert several.default_workload == "default"
    only = MemoryLimiter(max_concurrent=2, workloads={"batch": Workload()})
    assert only.default_workload == "batch"
    none = MemoryLimiter(max_concurrent=2, workloads={"a": Workload(), "b": Workload()})
    assert none.default_workload is None


def test_a_limiter_can_be_built_outside_any_event_loop() -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="claude", max_concurrent=8, lease_ttl=0.5)
    assert limiter.lease_ttl == 0.5
    assert "claude" in repr(limiter)


class Kind(StrEnum):
    INTERACTIVE = "interactive"
    BACKGROUND = "background"


@pytest.mark.anyio
async def test_str_enum_keys_become_plain_names() -> None:
    limiter = MemoryLimiter(
        max_concurrent=8,
        workloads={Kind.INTERACTIVE: Workload(reserved=2), Kind.BACKGROUND: Workload()},
        default_workload=Kind.BACKGROUND,
    )
    assert [type(name) for name in limiter.workloads] == [str, str]
    assert type(limiter.default_workload) is str
    async with limiter.slot(workload=Kind.INTERACTIVE) as slot:
        assert type(slot.workload) is str
        assert slot.workload == "interactive"
        stats = await limiter.stats()
    assert list(stats.workloads) == ["interactive", "background"]
    assert all(type(name) is str for name in stats.workloads)
    assert stats.workloads["interactive"].active == 1


# -- requests without a usable workload ------------------------------------------------------


async def take_slot(entry: str, limiter: MemoryLimiter[str], workload: str | None) -> None:
    """Take a slot of ``limiter`` the way ``entry`` says; the body must never run."""
    if entry == "limiter.slot":
        async with limiter.slot(workload):
            pytest.fail("the body ran")
    elif entry == "slotwise.slot":
        async with slotwise.slot(workload, limiter=limiter):
            pytest.fail("the body ran")
    else:
        async with slotwise.run(limiter=limiter, workload=workload), slotwise.slot():
            pytest.fail("the body ran")


@pytest.mark.anyio
@pytest.mark.parametrize("entry", ["limiter.slot", "slotwise.slot", "slotwise.run"])
@pytest.mark.parametrize(
    ("workload", "named"),
    [(None, "several workloads and no default_workload"), ("typo", "unknown workload 'typo'")],
    ids=["no-workload", "unknown-workload"],
)
async def test_a_request_without_a_usable_workload_fails_before_it_waits(
    entry: str, workload: str | None, named: str
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="claude",
        max_concurrent=1,
        workloads={"interactive": Workload(), "background": Workload()},
    )
    events: list[ConcurrencyEvent] = []
    limiter.subscribe(events.append)
    # Every slot is taken: a request that waited would never return.
    held = await limiter.acquire(AcquireRequest(workload="background", request_id="holder"))
    try:
        with anyio.move_on_after(10) as guard:
            with pytest.raises(ConcurrencyConfigError, match=re.escape(named)) as caught:
                await take_slot(entry, limiter, workload)
        assert not guard.cancelled_caught, "the request waited instead of failing"
        assert caught.value.limiter == "claude"
        stats = await limiter.stats()
        assert stats.queued == 0
        assert stats.active == 1
        kinds = [event.kind for event in events]
        if entry == "slotwise.run" and workload is not None:
            assert kinds == []  # the run itself refuses the name; no slot was asked for
        else:
            assert kinds == ["config-error"]
    finally:
        await limiter.release(held)


def test_the_signatures_show_the_default_lease_ttl() -> None:
    """The reference shows the value (30.0), the runtime uses the constant: they agree."""
    import inspect

    from slotwise._config import DEFAULT_LEASE_TTL
    from slotwise.postgres import PostgresLimiter

    for cls in (MemoryLimiter, PostgresLimiter):
        default = inspect.signature(cls.__init__).parameters["lease_ttl"].default
        assert default == DEFAULT_LEASE_TTL, cls
