"""Point-in-time counts returned by ``await limiter.stats()``."""

from collections.abc import Mapping

import attrs

__all__ = ("BucketStats", "LimiterStats", "WorkloadStats")


@attrs.frozen(kw_only=True)
class WorkloadStats:
    """One workload's counts.

    Attributes:
        active: Slots held now.
        queued: Requests waiting now.
        max_concurrent: The workload's ceiling, or None when the limiter does not say.
        reserved: Slots reserved for it.
    """

    active: int
    queued: int
    max_concurrent: int | None = None
    reserved: int = 0


@attrs.frozen(kw_only=True)
class BucketStats:
    """One rate bucket's level.

    Attributes:
        level: Units left now (requests or tokens); below zero when corrected token counts
            overspent it, which later grants wait out.
        capacity: Units it holds when full.
        per: Seconds to refill from empty.
    """

    level: float
    capacity: int
    per: float


@attrs.frozen(kw_only=True)
class LimiterStats:
    """A limiter's counts, in total and per workload, and its rate and pushback state.

    Attributes:
        active: Slots held now.
        queued: Requests waiting now.
        max_concurrent: The configured limit, or None when the limiter does not say.
        workloads: Each workload's counts (a workload removed by `set_limits()` stays here
            while its slots are held).
        effective_max_concurrent: The limit in force now: lower than `max_concurrent` while
            an adaptive limit has backed off.
        paused_until: While the provider's pushback pauses new grants, when the pause ends
            (seconds since the epoch); else None.
        buckets: Each rate bucket's level, by name (`"requests"`, `"tokens"`, and
            `"<workload>.requests"` / `"<workload>.tokens"`).

    Example:
        ```python
        stats = await claude.stats()
        print(stats.active, stats.workloads["interactive"].queued)  # 6 0
        ```
    """

    active: int
    queued: int
    max_concurrent: int | None = None
    workloads: Mapping[str, WorkloadStats] = attrs.field(factory=dict)
    effective_max_concurrent: int | None = None
    paused_until: float | None = None
    buckets: Mapping[str, BucketStats] = attrs.field(factory=dict)
