"""Point-in-time counts returned by ``await limiter.stats()``."""

from collections.abc import Mapping

import attrs

__all__ = ("LimiterStats", "WorkloadStats")


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
class LimiterStats:
    """A limiter's counts, in total and per workload.

    Example:
        >>> stats = await claude.stats()  # doctest: +SKIP
        >>> stats.active, stats.workloads["interactive"].queued  # doctest: +SKIP
        (6, 0)
    """

    active: int
    queued: int
    max_concurrent: int | None = None
    workloads: Mapping[str, WorkloadStats] = attrs.field(factory=dict)
