"""What every built-in limiter offers beside the Limiter protocol: its settings, ``slot()``
and ``subscribe()``."""

import time
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from ._config import Settings, Workload, resolve_workload
from ._events import ConcurrencyEvent, LimitChangedEvent
from ._runtime import dispatch
from ._runtime.lifecycle import SlotContext, SyncSlotContext, slot, sync_slot
from ._stats import BucketStats, LimiterStats, WorkloadStats

__all__ = ("BuiltinLimiter",)

W = TypeVar("W", bound=str)


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
    def workloads(self) -> Mapping[str, Workload]:
        """The workloads, by name."""
        return self._settings.workloads

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
        if workload is None and settings.default_workload is not None:
            return settings.default_workload  # the common case, without a call
        return resolve_workload(settings, workload)

    def slot(
        self, workload: W | None = None, *, tokens: int | None = None, allow_nested: bool = False
    ) -> SlotContext[W]:
        """`async with limiter.slot(workload=...)`: `slotwise.slot` with this limiter."""
        return slot(workload, limiter=self, tokens=tokens, allow_nested=allow_nested)

    def sync_slot(
        self,
        workload: W | None = None,
        *,
        timeout: float | None = None,
        tokens: int | None = None,
        allow_nested: bool = False,
    ) -> SyncSlotContext[W]:
        """`with limiter.sync_slot(workload=...)`: `slotwise.sync_slot` with this limiter,
        for code with no event loop (a thread, a sync SDK client)."""
        return sync_slot(
            workload, limiter=self, timeout=timeout, tokens=tokens, allow_nested=allow_nested
        )

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
