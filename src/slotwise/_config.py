"""Workload settings and the validation shared by every built-in limiter."""

import math
from collections.abc import Mapping
from typing import Any

import attrs

from ._core.rates import BucketRule, bucket_key
from ._core.rules import Rules, WorkloadRule
from ._errors import ConcurrencyConfigError, ConcurrencyTimeoutError

__all__ = (
    "DEFAULT_LEASE_TTL",
    "DEFAULT_WORKLOAD",
    "MAX_UNITS",
    "Adaptive",
    "Rate",
    "Settings",
    "Workload",
    "build_settings",
    "resolve_workload",
    "seconds",
    "token_count",
    "wait_timeout",
)

DEFAULT_WORKLOAD = "default"
DEFAULT_LEASE_TTL = 30.0
# The largest count of requests or tokens (a rate's capacity, a request's tokens) that a
# float holds exactly: rate buckets keep their levels as floats.
MAX_UNITS = 2**53


@attrs.frozen(kw_only=True)
class Rate:
    """A rate limit: at most `requests` requests and `tokens` tokens per `per` seconds.

    Each is a token bucket that starts full and refills continuously (`requests / per` a
    second), as providers document their own limits: a burst of up to `requests` may start
    at once, then requests go at the refill rate. On a limiter it is the provider account's
    RPM and TPM; on a workload it is a ceiling inside the limiter's.

    Attributes:
        requests: Requests per `per` seconds (at most 2**53); None: no request limit.
        tokens: Tokens per `per` seconds, at most 2**53 (the estimates given to
            `slot(tokens=...)`, corrected by `Slot.used_tokens()`); None: no token limit.
        per: The period, in seconds (60: per minute).
        latency: Seconds a granted request may take to reach the provider. The provider
            counts a request when it arrives, and while its bucket is full it loses the
            refill of that time, which slotwise's bucket, charged at the grant, does not:
            so each bucket grants only while the refill of `latency` seconds would be left
            (`requests / per * latency` requests). A request then never reaches the provider
            before the provider's own bucket holds it, and the pace is unchanged: a request
            that waits for a bucket waits `latency` seconds longer. 0 (the default) keeps
            nothing back; for a remote provider, the time a request takes to get there,
            its connection's setup included (such as 0.5).

    Example:
        ```python
        Rate(requests=50, tokens=40_000)  # 50 RPM and 40k TPM
        Rate(requests=50, tokens=40_000, latency=0.5)  # the same, never early at the provider
        ```
    """

    requests: int | None = None
    tokens: int | None = None
    per: float = 60.0
    latency: float = 0.0


@attrs.frozen(kw_only=True)
class Adaptive:
    """An effective limit that follows the provider's pushback (AIMD).

    On pushback (`Slot.throttled()`, or a 429, 529 or 503 seen by `slotwise.httpx`) the
    effective `max_concurrent` is multiplied by `backoff` (at most once per round trip: a
    burst of refusals of requests already in flight counts once); after as many successful
    requests as the effective limit (one round trip), it climbs by one slot. A success counts
    only if at least half the limit was occupied when it ended (held, or reserved and unused):
    a limit that the rate buckets or the demand keep from being reached says nothing of the
    room above it. Nor does it climb more than one slot above what the provider has been
    seen to take: a climb needs the success of a request granted with the limit full (since
    the last decrease), so only one slot at a time is tried above it. It stays between
    `min_concurrent` and the limiter's `max_concurrent`, and shrinking never revokes a held
    slot: new grants wait until fewer are active than the new limit.

    Attributes:
        min_concurrent: The lowest effective limit; it must cover the reservations (the
            shared capacity shrinks first).
        backoff: The factor applied on pushback, between 0 and 1.
        slow_start: Start at `min_concurrent` rather than at `max_concurrent`, and climb by
            one slot on every success of a request granted with the limit full (about one
            slot a round trip) until the first pushback, then as above: for a
            `max_concurrent` that may be above what the provider takes, so that no more
            than `min_concurrent` requests reach it before it has answered any, and finding
            its limit costs about one refused request.
    """

    min_concurrent: int
    backoff: float = 0.5
    slow_start: bool = False


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
        max_queued: Requests of this workload that may wait; the next one fails at once with
            `ConcurrencyQueueFullError`, so a flood of one workload cannot fill the queue
            another needs. None: only the limiter's `max_queued` applies.
        rate: A rate limit of this workload, inside the limiter's (a ceiling, like its
            `max_concurrent`).

    Example:
        ```python
        Workload(reserved=2, priority=10, max_wait=60.0)
        ```
    """

    max_concurrent: int | None = None
    reserved: int = 0
    priority: int = 0
    max_wait: float | None = None
    max_queued: int | None = None
    rate: Rate | None = None


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
    rate: Rate | None = None
    adaptive: Adaptive | None = None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(setting: str, value: object) -> int:
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise ConcurrencyConfigError(f"{setting} must be a positive integer, got {value!r}")
    return value  # type: ignore[return-value]


def _shown(value: int) -> str:
    try:
        return repr(value)
    except ValueError:  # more digits than Python converts (sys.set_int_max_str_digits)
        return f"an integer of {value.bit_length()} bits"


def token_count(
    setting: str,
    value: object,
    error: type[Exception] = ConcurrencyConfigError,
    *,
    optional: bool = False,
) -> int:
    """Validate a count of tokens: a non-negative integer, at most `MAX_UNITS`; ``error``
    naming ``setting`` and the value when it is not one (``optional``: None was allowed)."""
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        allowed = "None or a non-negative integer" if optional else "a non-negative integer"
        raise error(f"{setting} must be {allowed}, got {value!r}")
    if value > MAX_UNITS:  # type: ignore[operator]
        raise error(
            f"{setting} must be at most 2**53 ({MAX_UNITS}), got {_shown(value)}"  # type: ignore[arg-type]
        )
    return value  # type: ignore[return-value]


def retry_after_seconds(value: object) -> float | None:
    """Validate a provider's `retry_after` (seconds, or None for a backoff); ValueError when
    it is negative, not finite or not a number (an endless pause would stop the limiter)."""
    if value is not None and (
        not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < math.inf
    ):
        raise ValueError(f"retry_after must be None or seconds (>= 0), got {value!r}")
    return value


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


def _rate(setting: str, rate: object) -> dict[str, BucketRule]:
    """Validate a `Rate`; its bucket rules by kind."""
    if not isinstance(rate, Rate):
        raise ConcurrencyConfigError(f"{setting} must be a slotwise.Rate, got {rate!r}")
    per = seconds(f"{setting}.per", rate.per, finite=True)
    latency = seconds(f"{setting}.latency", rate.latency, allow_zero=True, finite=True)
    rules: dict[str, BucketRule] = {}
    for kind in ("requests", "tokens"):
        value = getattr(rate, kind)
        if value is not None:
            capacity = _positive_int(f"{setting}.{kind}", value)
            if capacity > MAX_UNITS:
                raise ConcurrencyConfigError(
                    f"{setting}.{kind} must be at most 2**53 ({MAX_UNITS}), got {_shown(capacity)}"
                )
            reserve = capacity / per * latency
            rules[kind] = BucketRule(kind=kind, capacity=capacity, per=per, reserve=reserve)
    if not rules:
        raise ConcurrencyConfigError(f"{setting} limits nothing: give requests, tokens or both")
    return rules


def build_settings(
    *,
    name: Any,
    max_concurrent: Any,
    max_queued: Any,
    lease_ttl: Any,
    workloads: Any,
    default_workload: Any,
    rate: Any = None,
    adaptive: Any = None,
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
    buckets: dict[str, BucketRule] = {}
    limiter_rate = {} if rate is None else _rate("rate", rate)
    buckets.update(limiter_rate)
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
        if workload.max_queued is not None and (
            not _is_int(workload.max_queued) or workload.max_queued < 0
        ):
            raise ConcurrencyConfigError(
                f"{where}.max_queued must be None or a non-negative integer, "
                f"got {workload.max_queued!r}"
            )
        if workload.rate is not None:
            for kind, bucket in _rate(f"{where}.rate", workload.rate).items():
                above = limiter_rate.get(kind)
                if above is not None and bucket.per_second > above.per_second:
                    raise ConcurrencyConfigError(
                        f"{where}.rate allows {bucket.capacity} {kind} per {bucket.per:g}s, "
                        f"more than the limiter's rate ({above.capacity} per {above.per:g}s)"
                    )
                buckets[bucket_key(wname, kind)] = bucket
        checked[wname] = workload
        rules[wname] = WorkloadRule(
            ceiling=ceiling,
            reserved=reserved,
            priority=workload.priority,
            max_queued=workload.max_queued,
        )
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
    if adaptive is not None:
        if not isinstance(adaptive, Adaptive):
            raise ConcurrencyConfigError(f"adaptive must be a slotwise.Adaptive, got {adaptive!r}")
        floor = _positive_int("adaptive.min_concurrent", adaptive.min_concurrent)
        if floor > max_concurrent:
            raise ConcurrencyConfigError(
                f"adaptive.min_concurrent ({floor}) is above max_concurrent ({max_concurrent})"
            )
        if floor < total_reserved:
            raise ConcurrencyConfigError(
                f"adaptive.min_concurrent ({floor}) must cover the reservations "
                f"({total_reserved} slots): the shared capacity shrinks first"
            )
        backoff = adaptive.backoff
        if not isinstance(backoff, int | float) or isinstance(backoff, bool) or not 0 < backoff < 1:
            raise ConcurrencyConfigError(
                f"adaptive.backoff must be a number between 0 and 1, got {backoff!r}"
            )
        if not isinstance(adaptive.slow_start, bool):
            raise ConcurrencyConfigError(
                f"adaptive.slow_start must be True or False, got {adaptive.slow_start!r}"
            )
    return Settings(
        name=name,
        max_concurrent=max_concurrent,
        max_queued=max_queued,
        lease_ttl=lease_ttl,
        workloads=checked,
        default_workload=default_workload,
        rules=Rules(max_concurrent=max_concurrent, workloads=rules, buckets=buckets),
        rate=rate,
        adaptive=adaptive,
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
    return ConcurrencyTimeoutError(
        f"no slot within {waited:.3f}s: its deadline passed (a run's budget, or a timeout)"
    )
