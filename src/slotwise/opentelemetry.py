"""OpenTelemetry metrics and spans, built from slotwise's events.

```python
import slotwise.opentelemetry

uninstrument = slotwise.opentelemetry.instrument()          # every limiter
slotwise.opentelemetry.instrument(limiter=claude)           # or one, with its limits
```

Only `opentelemetry-api` is used: nothing is recorded until the application installs an
OpenTelemetry SDK. The metrics follow the OpenTelemetry conventions for database connection
pools (`db.client.connection.*`) with `slotwise.slot.*` in place of `db.client.connection.*`:
a slot for a connection, a limiter for a pool. The reference lists them
(docs/reference/metrics.md). A span is recorded for a request that waited for its slot, and
for every wait that failed. Metric attributes are the limiter's and the workload's names (and
a state, an outcome or an error type); span attributes add the request's and run's ids. Never
a prompt, a header, a body or an error message.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import SpanKind, Status, StatusCode

from . import __version__, _errors
from ._errors import ConcurrencyConfigError, ConcurrencyQueueFullError, ConcurrencyTimeoutError
from ._events import ConcurrencyEvent
from ._runtime.dispatch import subscribe

__all__ = ("instrument",)

POOL = "slotwise.slot.pool.name"
STATE = "slotwise.slot.state"
WORKLOAD = "slotwise.workload"
OUTCOME = "slotwise.outcome"
OPERATION = "slotwise.operation"
ERROR_TYPE = "error.type"
RECLAIMED_SOURCE = "slotwise.reclaimed.source"
PAUSE_REASON = "slotwise.pause.reason"

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_USE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def _qualified(cls: type[BaseException]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# The kinds that end a wait: what a span calls them, and the class of the exception the caller
# gets (None: no error; "limiter-error" reads it from the event).
_WAIT_ENDS: dict[str, tuple[str, str | None]] = {
    "acquired": ("acquired", None),
    "wait-cancelled": ("cancelled", None),
    "timed-out": ("timed-out", _qualified(ConcurrencyTimeoutError)),
    "queue-full": ("queue-full", _qualified(ConcurrencyQueueFullError)),
    "config-error": ("config-error", _qualified(ConcurrencyConfigError)),
    "limiter-error": ("limiter-error", ""),
}
# A limiter may raise slotwise's own errors; their canonical names are public ones.
_SLOTWISE_ERRORS = {name: _qualified(getattr(_errors, name)) for name in _errors.__all__}


def instrument(
    limiter: Any = None,
    meter_provider: metrics.MeterProvider | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    *,
    span_min_wait: float = 0.001,
) -> Callable[[], None]:
    """Record slotwise's metrics and wait spans with OpenTelemetry.

    Call it once for every limiter in the process, or once per limiter whose limits should be
    reported too; the calls combine. However many calls cover a limiter, each of its events
    is recorded once per meter provider and tracer provider.

    Args:
        limiter: The limiter to observe; None: every limiter. The limits
            (`slotwise.slot.max`, `slotwise.workload.*`) and the idle slots are reported only
            for the limiters named in a call.
        meter_provider: Default: the global one.
        tracer_provider: Default: the global one.
        span_min_wait: A request that waited at least this many seconds for its slot gets a
            `slotwise.wait` span; a slot granted at once does not. A wait that failed (a
            timeout, a full queue, a limiter error) always gets one. The default (1 ms) is
            above the bookkeeping of an immediate grant in memory. When several calls share a
            tracer provider, the smallest value applies.

    Returns:
        A function that stops this call's recording; calling it twice is harmless.

    Example:
        ```python
        from opentelemetry.sdk.metrics import MeterProvider

        uninstrument = slotwise.opentelemetry.instrument(
            limiter=claude, meter_provider=MeterProvider()
        )
        ```
    """
    registration = _Registration(limiter, span_min_wait)
    removers = [
        _meters(meter_provider or metrics.get_meter_provider()).add(registration),
        _tracers(tracer_provider or trace.get_tracer_provider()).add(registration),
    ]

    def uninstrument() -> None:
        for remove in removers:
            remove()

    return uninstrument


class _Registration:
    """One `instrument` call."""

    __slots__ = ("limiter", "span_min_wait")

    def __init__(self, limiter: Any, span_min_wait: float) -> None:
        self.limiter = limiter
        self.span_min_wait = span_min_wait


class _Recorder:
    """What one provider records for every `instrument` call that uses it.

    The calls share one set of instruments (a provider keeps the first instrument of a name
    and drops the callbacks of a second) and one set of subscriptions: a process-wide one
    while any call covers every limiter, else one per limiter named. Each event reaches
    `record` once.
    """

    def __init__(self) -> None:
        self.registrations: list[_Registration] = []
        self._everywhere: Callable[[], None] | None = None
        self._named: dict[int, Callable[[], None]] = {}

    def record(self, event: ConcurrencyEvent) -> None:
        raise NotImplementedError

    def forget(self) -> None:
        """Drop what was tracked for the limiters no call covers any more."""

    def add(self, registration: _Registration) -> Callable[[], None]:
        self.registrations.append(registration)
        self._subscribe()

        def remove() -> None:
            if any(r is registration for r in self.registrations):
                self.registrations = [r for r in self.registrations if r is not registration]
                self._subscribe()
                self.forget()

        return remove

    @property
    def everywhere(self) -> bool:
        return self._everywhere is not None

    def limiters(self) -> list[Any]:
        """The limiter objects named by the calls, each once."""
        found = {id(r.limiter): r.limiter for r in self.registrations if r.limiter is not None}
        return list(found.values())

    def covers(self, pool: str) -> bool:
        return self.everywhere or any(str(lim.name) == pool for lim in self.limiters())

    def _subscribe(self) -> None:
        if any(r.limiter is None for r in self.registrations):
            if self._everywhere is None:
                self._everywhere = subscribe(self.record)
        elif self._everywhere is not None:
            self._everywhere()
            self._everywhere = None
        named = {id(limiter): limiter for limiter in self.limiters()}
        for key in named.keys() - self._named.keys():
            self._named[key] = subscribe(self._record_named, named[key])
        for key in self._named.keys() - named.keys():
            self._named.pop(key)()

    def _record_named(self, event: ConcurrencyEvent) -> None:
        # The process-wide subscription delivers this event too.
        if self._everywhere is None:
            self.record(event)


_R = TypeVar("_R", bound=_Recorder)


class _PerProvider(Generic[_R]):
    """One recorder per provider, for as long as the provider lives."""

    def __init__(self, build: Callable[[Any], _R]) -> None:
        self._build = build
        self._recorders: weakref.WeakKeyDictionary[Any, _R] = weakref.WeakKeyDictionary()
        # Providers that cannot be weakly referenced are kept for good.
        self._pinned: dict[int, tuple[Any, _R]] = {}

    def __call__(self, provider: Any) -> _R:
        try:
            recorder = self._recorders.get(provider)
            if recorder is None:
                recorder = self._recorders[provider] = self._build(provider)
        except TypeError:
            if id(provider) not in self._pinned:
                self._pinned[id(provider)] = (provider, self._build(provider))
            recorder = self._pinned[id(provider)][1]
        return recorder


def _error_type(error: str) -> str:
    # Events describe an error as "TypeName: message"; only the type is low-cardinality and
    # free of whatever the message might quote.
    name = error.partition(":")[0].strip() or "Exception"
    return _SLOTWISE_ERRORS.get(name, name)


_Key = tuple[str, str]  # (pool, workload)


class _Metrics(_Recorder):
    def __init__(self, provider: metrics.MeterProvider) -> None:
        super().__init__()
        meter = metrics.get_meter("slotwise", __version__, provider)
        # Requests waiting and slots held, by pool and workload, and which key each request
        # and lease was counted under, so that each is counted down exactly once. Observed
        # from the SDK's export thread, changed by events: one lock.
        self._lock = threading.Lock()
        self._pending: Counter[_Key] = Counter()
        self._used: Counter[_Key] = Counter()
        self._waiting: dict[tuple[str, str | None], _Key] = {}
        self._holding: dict[tuple[str, str], _Key] = {}
        # What the events said of a limiter's pushback state, by pool, for a limiter that
        # cannot say it itself (no `stats_nowait()`): its limit in force, its pause's end.
        self._limits: dict[str, int] = {}
        self._paused_until: dict[str, float] = {}
        meter.create_observable_up_down_counter(
            "slotwise.slot.count",
            callbacks=[self._observe_count],
            unit="{slot}",
            description="Slots held (state=used, per workload) and free (state=idle).",
        )
        meter.create_observable_up_down_counter(
            "slotwise.slot.pending_requests",
            callbacks=[self._observe_pending],
            unit="{request}",
            description="Requests waiting for a slot.",
        )
        meter.create_observable_up_down_counter(
            "slotwise.slot.max",
            callbacks=[self._observe_settings(_limit)],
            unit="{slot}",
            description="The limiter's max_concurrent.",
        )
        meter.create_observable_up_down_counter(
            "slotwise.limiter.effective_max",
            callbacks=[self._observe_settings(self._effective_limit)],
            unit="{slot}",
            description="The limit in force: max_concurrent, or lower while an adaptive "
            "limit has backed off.",
        )
        meter.create_observable_gauge(
            "slotwise.limiter.pause.remaining",
            callbacks=[self._observe_settings(self._pause_remaining)],
            unit="s",
            description="Seconds until the pause after the provider's pushback ends; 0 when "
            "the limiter is not paused.",
        )
        meter.create_observable_up_down_counter(
            "slotwise.workload.max",
            callbacks=[self._observe_settings(_workload_limits)],
            unit="{slot}",
            description="Each workload's ceiling (its max_concurrent, else the limiter's).",
        )
        meter.create_observable_up_down_counter(
            "slotwise.workload.reserved",
            callbacks=[self._observe_settings(_reservations)],
            unit="{slot}",
            description="Slots reserved for each workload.",
        )
        self._timeouts = meter.create_counter(
            "slotwise.slot.timeouts",
            unit="{timeout}",
            description="Requests that gave up waiting: max_wait or the run's budget ran out.",
        )
        self._wait_time = meter.create_histogram(
            "slotwise.slot.wait_time",
            unit="s",
            description="How long requests waited before they got their slot.",
            explicit_bucket_boundaries_advisory=_WAIT_BUCKETS,
        )
        self._use_time = meter.create_histogram(
            "slotwise.slot.use_time",
            unit="s",
            description="How long slots were held, from grant to release.",
            explicit_bucket_boundaries_advisory=_USE_BUCKETS,
        )
        self._rejections = meter.create_counter(
            "slotwise.slot.rejections",
            unit="{request}",
            description="Requests refused at once because the queue was full.",
        )
        self._leases_lost = meter.create_counter(
            "slotwise.slot.leases_lost",
            unit="{slot}",
            description="Slots whose lease was lost while held; their bodies were cancelled.",
        )
        self._reclaimed = meter.create_counter(
            "slotwise.slot.reclaimed",
            unit="{slot}",
            description="Slots taken back from an abandoned holder (collected, or left unread).",
        )
        self._errors = meter.create_counter(
            "slotwise.limiter.errors",
            unit="{error}",
            description="Failures of the limiter itself, by operation and error type.",
        )
        self._pauses = meter.create_counter(
            "slotwise.limiter.pauses",
            unit="{pause}",
            description="Pauses of new grants after the provider pushed back (429, 529, 503).",
        )

    # -- events ---------------------------------------------------------------------------

    def record(self, event: ConcurrencyEvent) -> None:
        if not self.registrations:  # removed while this event was being delivered
            return
        key = (event.limiter, event.workload or "")
        attrs = {POOL: key[0], WORKLOAD: key[1]}
        match event.kind:
            case "wait-started":
                with self._lock:
                    self._waiting[event.limiter, event.request_id] = key
                    self._pending[key] += 1
            case "acquired":
                self._end_wait(event)
                with self._lock:
                    self._holding[event.limiter, event.lease_id] = key
                    self._used[key] += 1
                self._wait_time.record(event.wait_time, attrs)
            case "timed-out":
                self._end_wait(event)
                self._timeouts.add(1, attrs)
            case "queue-full":
                self._end_wait(event)
                self._rejections.add(1, attrs)
            case "limiter-error":
                self._end_wait(event)
                self._error(attrs, "acquire", event.error)
            case "wait-cancelled" | "config-error":
                self._end_wait(event)
            case "renewal-failed":
                self._error(attrs, "renew", event.error)
            case "lease-lost":
                self._leases_lost.add(1, attrs)
            case "reclaimed":
                self._reclaimed.add(1, {**attrs, RECLAIMED_SOURCE: event.source})
            case "released":
                self._end_use(event.limiter, event.lease_id)
                self._use_time.record(event.hold_time, {**attrs, OUTCOME: event.outcome})
            case "release-failed":
                self._end_use(event.limiter, event.lease_id)
                self._error(attrs, "release", event.error)
            case "paused":
                with self._lock:
                    until = self._paused_until.get(event.limiter, event.until)
                    self._paused_until[event.limiter] = max(until, event.until)
                self._pauses.add(1, {POOL: event.limiter, PAUSE_REASON: event.reason})
            case "limit-changed":
                with self._lock:
                    self._limits[event.limiter] = event.new

    def _error(self, attrs: dict[str, str], operation: str, error: str) -> None:
        self._errors.add(1, {**attrs, OPERATION: operation, ERROR_TYPE: _error_type(error)})

    def _end_wait(self, event: ConcurrencyEvent) -> None:
        with self._lock:
            key = self._waiting.pop((event.limiter, event.request_id), None)
            if key is not None:
                self._pending[key] -= 1

    def _end_use(self, pool: str, lease_id: str) -> None:
        with self._lock:
            key = self._holding.pop((pool, lease_id), None)
            if key is not None:
                self._used[key] -= 1

    def forget(self) -> None:
        tables: list[dict[Any, Any]] = [self._pending, self._used, self._waiting, self._holding]
        with self._lock:
            for table in tables:
                for entry in [k for k in table if not self.covers(k[0])]:
                    del table[entry]
            for pools in (self._limits, self._paused_until):
                for pool in [pool for pool in pools if not self.covers(pool)]:
                    del pools[pool]

    def _pushback(self, limiter: Any) -> tuple[int | None, float | None]:
        """A named limiter's limit in force and the end of its pause (seconds since the
        epoch, None: not paused): from its `stats_nowait()` when its class has one (it
        knows what happened before the call and in other processes), else from the events."""
        stats_nowait = getattr(type(limiter), "stats_nowait", None)
        if stats_nowait is not None:
            try:
                stats = stats_nowait(limiter)
                return stats.effective_max_concurrent, stats.paused_until
            except Exception:  # a limiter that cannot say now: what the events said
                pass
        pool = str(limiter.name)
        with self._lock:
            return self._limits.get(pool, _capacity(limiter)), self._paused_until.get(pool)

    def _effective_limit(self, limiter: Any) -> Iterable[tuple[float, dict[str, str]]]:
        limit, _ = self._pushback(limiter)
        return [] if limit is None else [(limit, {})]

    def _pause_remaining(self, limiter: Any) -> Iterable[tuple[float, dict[str, str]]]:
        _, until = self._pushback(limiter)
        return [(0.0 if until is None else max(0.0, until - time.time()), {})]

    # -- observations ---------------------------------------------------------------------

    def _observe_count(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            used = list(self._used.items())
        observations = [
            Observation(n, {POOL: pool, WORKLOAD: workload, STATE: "used"})
            for (pool, workload), n in used
        ]
        for limiter in self.limiters():
            limit = _capacity(limiter)
            if limit is not None:
                pool = str(limiter.name)
                busy = sum(n for (p, _), n in used if p == pool)
                observations.append(Observation(max(0, limit - busy), {POOL: pool, STATE: "idle"}))
        return observations

    def _observe_pending(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            pending = list(self._pending.items())
        return [Observation(n, {POOL: pool, WORKLOAD: w}) for (pool, w), n in pending]

    def _observe_settings(
        self, read: Callable[[Any], Iterable[tuple[float, dict[str, str]]]]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            return [
                Observation(value, {POOL: str(limiter.name), **attrs})
                for limiter in self.limiters()
                for value, attrs in read(limiter)
            ]

        return observe


# -- the settings of a limiter named in an `instrument` call --------------------------------
# Each reads what a limiter may declare (see `slotwise.Limiter`) and yields (value, attributes
# besides the pool's name). A setting it does not declare is not reported.


def _capacity(limiter: Any) -> int | None:
    """The number of slots the idle ones are counted against."""
    limit = getattr(limiter, "max_concurrent", None)
    return limit if isinstance(limit, int) else None


def _limit(limiter: Any) -> Iterable[tuple[int, dict[str, str]]]:
    limit = _capacity(limiter)
    return [] if limit is None else [(limit, {})]


def _workload_settings(limiter: Any) -> Mapping[str, Any]:
    workloads = getattr(limiter, "workloads", None)
    return workloads if isinstance(workloads, Mapping) else {}


def _workload_limits(limiter: Any) -> Iterable[tuple[int, dict[str, str]]]:
    limit = _capacity(limiter)
    if limit is None:
        return []
    return [
        (ceiling if isinstance(ceiling, int) else limit, {WORKLOAD: str(name)})
        for name, settings in _workload_settings(limiter).items()
        for ceiling in [getattr(settings, "max_concurrent", None)]
    ]


def _reservations(limiter: Any) -> Iterable[tuple[int, dict[str, str]]]:
    return [
        (int(getattr(settings, "reserved", 0) or 0), {WORKLOAD: str(name)})
        for name, settings in _workload_settings(limiter).items()
    ]


class _Spans(_Recorder):
    def __init__(self, provider: trace.TracerProvider) -> None:
        super().__init__()
        self._tracer = trace.get_tracer("slotwise", __version__, provider)

    def record(self, event: ConcurrencyEvent) -> None:
        end = _WAIT_ENDS.get(event.kind)
        threshold = min((r.span_min_wait for r in self.registrations), default=None)
        if end is None or threshold is None:
            return
        outcome, error_type = end
        waited: float = getattr(event, "wait_time", 0.0)  # a config error never waited
        if error_type is None and waited < threshold:
            return
        attributes: dict[str, str] = {
            POOL: event.limiter,
            WORKLOAD: event.workload or "",
            "slotwise.wait.outcome": outcome,
        }
        for key, value in (
            ("slotwise.request.id", event.request_id),
            ("slotwise.run.id", event.run_id),
            ("slotwise.run.root_id", event.root_run_id),
            ("slotwise.run.parent_id", event.parent_run_id),
            ("slotwise.lease.id", getattr(event, "lease_id", None)),
        ):
            if value is not None:
                attributes[key] = value
        if error_type is not None:
            attributes[ERROR_TYPE] = error_type or _error_type(getattr(event, "error", ""))
        end_ns = int(event.timestamp * 1e9)
        span = self._tracer.start_span(
            "slotwise.wait",
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=end_ns - int(waited * 1e9),
        )
        if error_type is not None:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=end_ns)


_meters = _PerProvider(_Metrics)
_tracers = _PerProvider(_Spans)
