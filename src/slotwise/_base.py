"""What every built-in limiter offers beside the Limiter protocol: its settings and
``subscribe()``. Each public limiter class defines its own ``slot()``, so that a type checker
names that class, not this base, in an error about a workload's name."""

import time
from collections.abc import Callable, Mapping
from typing import Generic, cast

from ._config import Rate, Settings, Workload, resolve_workload
from ._events import ConcurrencyEvent, LimitChangedEvent
from ._protocol import W
from ._runtime import dispatch
from ._stats import BucketStats, LimiterStats, WorkloadStats

__all__ = ("BuiltinLimiter",)


class BuiltinLimiter(Generic[W]):
    """The settings and the user's surface shared by MemoryLimiter and PostgresLimiter."""

    __slots__ = ("__weakref__", "_settings")

    _settings: Settings

    @property
    def name(self) -> str:
        """The limiter's name (every process using a shared limiter's name shares its slots)."""
        return self._settings.name

    @property
    def max_concurrent(self) -> int:
        """Slots in all."""
        return self._settings.max_concurrent

    @property
    def max_queued(self) -> int | None:
        """Waiting requests allowed; None: unbounded."""
        return self._settings.max_queued

    @property
    def lease_ttl(self) -> float:
        """Seconds a lease lives without renewal."""
        return self._settings.lease_ttl

    @property
    def rate(self) -> Rate | None:
        """The provider's rate limits this limiter keeps (requests and tokens per period),
        or None."""
        return self._settings.rate

    @property
    def workloads(self) -> Mapping[W, Workload]:
        """The workloads, by name."""
        return cast("Mapping[W, Workload]", self._settings.workloads)

    @property
    def default_workload(self) -> str | None:
        """The workload of requests that name none, or None when each must name one."""
        return self._settings.default_workload

    def validate_workload(self, workload: str | None) -> str:
        """Resolve a request's workload name (None: the default).

        Raises:
            ConcurrencyConfigError: unknown, or None with several workloads and no default.
        """
        settings = self._settings
        if workload is None:
            if settings.default_workload is not None:
                return settings.default_workload  # the common cases, without a call
        elif type(workload) is str and workload in settings.workloads:
            return workload
        return resolve_workload(settings, workload)

    def subscribe(self, callback: Callable[[ConcurrencyEvent], object]) -> Callable[[], None]:
        """Receive every event of this limiter; returns the function that unsubscribes."""
        return dispatch.subscribe(callback, self)

    def _stats(
        self,
        active: Mapping[str, int],
        queued: Mapping[str, int],
        *,
        effective: int | None = None,
        paused_until: float | None = None,
        buckets: Mapping[str, BucketStats] | None = None,
    ) -> LimiterStats:
        rules = self._settings.rules
        return LimiterStats(
            active=sum(active.values()),
            queued=sum(queued.values()),
            max_concurrent=rules.max_concurrent,
            workloads={
                name: WorkloadStats(
                    active=active.get(name, 0),
                    queued=queued.get(name, 0),
                    max_concurrent=rules.workloads[name].ceiling if name in rules.workloads else 0,
                    reserved=rules.workloads[name].reserved if name in rules.workloads else 0,
                )
                for name in {**rules.workloads, **active}
            },
            effective_max_concurrent=rules.max_concurrent if effective is None else effective,
            paused_until=paused_until,
            buckets=buckets or {},
        )

    def _limit_changed(self, old: int, new: int, reason: str) -> None:
        """Emit `limit-changed`: the limit in force went from `old` to `new`."""
        if dispatch._subscriptions and dispatch.wants(self):
            dispatch.emit(
                self,
                LimitChangedEvent(
                    timestamp=time.time(),
                    limiter=self.name,
                    workload=None,
                    run_id=None,
                    root_run_id=None,
                    parent_run_id=None,
                    request_id=None,
                    old=old,
                    new=new,
                    reason=reason,
                ),
            )
