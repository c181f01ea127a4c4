"""Workload settings and the validation shared by every built-in limiter."""

import math
from collections.abc import Mapping
from typing import Any

import attrs

from ._core.rules import Rules, WorkloadRule
from ._errors import ConcurrencyConfigError, ConcurrencyTimeoutError

__all__ = (
    "DEFAULT_LEASE_TTL",
    "DEFAULT_WORKLOAD",
    "Settings",
    "Workload",
    "build_settings",
    "resolve_workload",
    "seconds",
    "wait_timeout",
)

DEFAULT_WORKLOAD = "default"
DEFAULT_LEASE_TTL = 30.0


@attrs.frozen(kw_only=True)
class Workload:
    """One named share of a limiter's capacity.

    Attributes:
        max_concurrent: The workload's ceiling; None means the limiter's ``max_concurrent``.
        reserved: Slots only this workload can use, counted inside the limiter's
            ``max_concurrent``. Reservations are strict: unused reserved slots stay idle.
        priority: Among workloads with room, higher priority is served first. Priority never
            interrupts a running request.
        max_wait: The longest a request waits for a slot, in seconds; None waits as long as
            the run's budget allows; 0 fails fast when no slot is free.

    Example:
        >>> Workload(reserved=2, priority=10, max_wait=60.0)
        Workload(max_concurrent=None, reserved=2, priority=10, max_wait=60.0)
    """

    max_concurrent: int | None = None
    reserved: int = 0
    priority: int = 0
    max_wait: float | None = None


@attrs.frozen(kw_only=True)
class Settings:
    """A limiter's validated settings."""

    name: str
    max_concurrent: int
    max_queued: int | None
    lease_ttl: float
    workloads: Mapping[str, Workload]
    default_workload: str | None
    rules: Rules


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(setting: str, value: object) -> int:
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise ConcurrencyConfigError(f"{setting} must be a positive integer, got {value!r}")
    return value  # type: ignore[return-value]


def seconds(
    setting: str, value: object, *, allow_zero: bool = False, finite: bool = False
) -> float:
    """Validate a duration setting; ConcurrencyConfigError naming it when it is not one."""
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or math.isnan(value)
        or value < 0
        or (value == 0 and not allow_zero)
        or (finite and math.isinf(value))
    ):
        bound = "non-negative" if allow_zero else "positive"
        if finite:
            bound += ", finite"
        raise ConcurrencyConfigError(
            f"{setting} must be a {bound} number of seconds, got {value!r}"
        )
    return float(value)


def build_settings(
    *,
    name: Any,
    max_concurrent: Any,
    max_queued: Any,
    lease_ttl: Any,
    workloads: Any,
    default_workload: Any,
) -> Settings:
    """Validate a limiter's settings; raise ConcurrencyConfigError naming the bad setting."""
    if not isinstance(name, str) or not name.strip():
        raise ConcurrencyConfigError(f"name must be a non-empty string, got {name!r}")
    max_concurrent = _positive_int("max_concurrent", max_concurrent)
    if max_queued is not None and (not _is_int(max_queued) or max_queued < 0):
        raise ConcurrencyConfigError(
            f"max_queued must be None or a non-negative integer, got {max_queued!r}"
        )
    # A lease that never expires would keep a dead holder's slot forever.
    lease_ttl = seconds("lease_ttl", lease_ttl, finite=True)
    if workloads is None:
        workloads = {DEFAULT_WORKLOAD: Workload()}
    if not isinstance(workloads, Mapping) or not workloads:
        raise ConcurrencyConfigError(
            f"workloads must be a non-empty mapping of names to Workload, got {workloads!r}"
        )
    checked: dict[str, Workload] = {}
    rules: dict[str, WorkloadRule] = {}
    for key, workload in workloads.items():
        if not isinstance(key, str) or not key.strip():
            raise ConcurrencyConfigError(f"workload names must be non-empty strings, got {key!r}")
        wname = str(key)  # a StrEnum member becomes its plain value
        where = f"workloads[{wname!r}]"
        if not isinstance(workload, Workload):
            raise ConcurrencyConfigError(f"{where} must be a Workload, got {workload!r}")
        ceiling = max_concurrent
        if workload.max_concurrent is not None:
            ceiling = _positive_int(f"{where}.max_concurrent", workload.max_concurrent)
            if ceiling > max_concurrent:
                raise ConcurrencyConfigError(
                    f"{where}.max_concurrent ({ceiling}) is above the limiter's "
                    f"max_concurrent ({max_concurrent})"
                )
        reserved = workload.reserved
        if not _is_int(reserved) or reserved < 0:
            raise ConcurrencyConfigError(
                f"{where}.reserved must be a non-negative integer, got {reserved!r}"
            )
        if reserved > ceiling:
            raise ConcurrencyConfigError(
                f"{where}.reserved ({reserved}) is above its ceiling ({ceiling}): "
                "those reserved slots could never be used"
            )
        if not _is_int(workload.priority):
            raise ConcurrencyConfigError(
                f"{where}.priority must be an integer, got {workload.priority!r}"
            )
        if workload.max_wait is not None:
            seconds(f"{where}.max_wait", workload.max_wait, allow_zero=True)
        checked[wname] = workload
        rules[wname] = WorkloadRule(ceiling=ceiling, reserved=reserved, priority=workload.priority)
    total_reserved = sum(rule.reserved for rule in rules.values())
    if total_reserved > max_concurrent:
        raise ConcurrencyConfigError(
            f"workloads reserve {total_reserved} slots in all, more than max_concurrent "
            f"({max_concurrent})"
        )
    if default_workload is None:
        if DEFAULT_WORKLOAD in checked:
            default_workload = DEFAULT_WORKLOAD
        elif len(checked) == 1:
            default_workload = next(iter(checked))
    elif not isinstance(default_workload, str) or str(default_workload) not in checked:
        raise ConcurrencyConfigError(
            f"default_workload {default_workload!r} is not one of the workloads "
            f"({', '.join(map(repr, checked))})"
        )
    else:
        default_workload = str(default_workload)
    return Settings(
        name=name,
        max_concurrent=max_concurrent,
        max_queued=max_queued,
        lease_ttl=lease_ttl,
        workloads=checked,
        default_workload=default_workload,
        rules=Rules(max_concurrent=max_concurrent, workloads=rules),
    )


def resolve_workload(settings: Settings, workload: str | None) -> str:
    """The workload a request uses; ConcurrencyConfigError when it is missing or unknown."""
    if workload is None:
        if settings.default_workload is None:
            raise ConcurrencyConfigError(
                f"limiter {settings.name!r} has several workloads and no default_workload: "
                f"name one of {', '.join(map(repr, settings.workloads))}"
            )
        return settings.default_workload
    name = str(workload)
    if name not in settings.workloads:
        raise ConcurrencyConfigError(
            f"unknown workload {name!r}; limiter {settings.name!r} has "
            f"{', '.join(map(repr, settings.workloads))}"
        )
    return name


def wait_timeout(
    waited: float, max_wait: float | None, by_max_wait: bool
) -> ConcurrencyTimeoutError:
    """The error of a request that waited ``waited`` seconds without a slot: the same words
    from every built-in limiter."""
    if by_max_wait and max_wait is not None:
        return ConcurrencyTimeoutError(
            f"no slot within {waited:.3f}s: the workload's max_wait is {max_wait:g}s"
        )
    return ConcurrencyTimeoutError(f"no slot within {waited:.3f}s: the run's budget ended")
