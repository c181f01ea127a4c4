"""OpenTelemetry metrics and spans, built from slotwise's events.

::

    import slotwise.opentelemetry

    uninstrument = slotwise.opentelemetry.instrument()          # every limiter
    slotwise.opentelemetry.instrument(limiter=claude)           # or one

Only ``opentelemetry-api`` is used: nothing is recorded until the application installs an
OpenTelemetry SDK. The metrics follow the OpenTelemetry database connection-pool conventions
(``db.client.connection.*``), with a slot in place of a connection; the reference lists them
(docs/reference/metrics.md). A span is recorded only for a request that waited for its slot.
Metric attributes are the limiter's and the workload's names (and a state, an outcome or an
error type); span attributes add the request's and run's ids. Never a prompt, a header, a body
or an error message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import SpanKind, Status, StatusCode

from . import __version__
from ._events import ConcurrencyEvent
from ._runtime.dispatch import subscribe

__all__ = ("instrument",)

LIMITER = "slotwise.limiter"
WORKLOAD = "slotwise.workload"
STATE = "slotwise.slot.state"
OUTCOME = "slotwise.outcome"
OPERATION = "slotwise.operation"
ERROR_TYPE = "error.type"
RECLAIMED_SOURCE = "slotwise.reclaimed.source"

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_HOLD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# The kinds that end a wait, and what a span calls them.
_WAIT_ENDS = {
    "acquired": "acquired",
    "timed-out": "timed-out",
    "queue-full": "queue-full",
    "wait-cancelled": "cancelled",
    "limiter-error": "limiter-error",
    "config-error": "config-error",
}
_WAIT_FAILURES = {"timed-out", "queue-full", "limiter-error", "config-error"}


def instrument(
    limiter: Any = None,
    meter_provider: metrics.MeterProvider | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    *,
    span_min_wait: float = 0.001,
) -> Callable[[], None]:
    """Record slotwise's metrics and wait spans with OpenTelemetry.

    Call it once per limiter, or once with no limiter for every limiter in the process.

    Args:
        limiter: The limiter to observe; None: every limiter. ``slotwise.slot.limit`` is only
            reported for a limiter named here.
        meter_provider: Default: the global one.
        tracer_provider: Default: the global one.
        span_min_wait: A request that waited at least this many seconds for its slot gets a
            ``slotwise.wait`` span; a slot granted at once does not. The default (1 ms) is
            above the bookkeeping of an immediate grant in memory.

    Returns:
        A function that stops recording; calling it twice is harmless.

    Example:
        >>> from opentelemetry.sdk.metrics import MeterProvider
        >>> uninstrument = slotwise.opentelemetry.instrument(meter_provider=MeterProvider())
    """
    recorder = _Recorder(limiter, meter_provider, tracer_provider, span_min_wait)
    unsubscribe = subscribe(recorder.record, limiter)

    def uninstrument() -> None:
        recorder.closed = True
        unsubscribe()

    return uninstrument


def _error_type(error: str) -> str:
    # Events describe an error as "TypeName: message"; only the type is low-cardinality and
    # free of whatever the message might quote.
    return error.partition(":")[0].strip() or "Exception"


class _Recorder:
    def __init__(
        self,
        limiter: Any,
        meter_provider: metrics.MeterProvider | None,
        tracer_provider: trace.TracerProvider | None,
        span_min_wait: float,
    ) -> None:
        self.closed = False
        self._limiter = limiter
        self._span_min_wait = span_min_wait
        meter = metrics.get_meter("slotwise", __version__, meter_provider)
        self._tracer = trace.get_tracer("slotwise", __version__, tracer_provider)
        # Requests waiting and slots held, so that each is counted down exactly once with the
        # attributes it was counted up with.
        self._waiting: dict[str | None, dict[str, str]] = {}
        self._holding: dict[str, dict[str, str]] = {}
        self._count = meter.create_up_down_counter(
            "slotwise.slot.count",
            unit="{slot}",
            description="Slots held (state=active) and requests waiting for one (state=queued).",
        )
        self._wait_time = meter.create_histogram(
            "slotwise.slot.wait_time",
            unit="s",
            description="How long requests waited before they got their slot.",
            explicit_bucket_boundaries_advisory=_WAIT_BUCKETS,
        )
        self._hold_time = meter.create_histogram(
            "slotwise.slot.hold_time",
            unit="s",
            description="How long slots were held, from grant to release.",
            explicit_bucket_boundaries_advisory=_HOLD_BUCKETS,
        )
        self._timeouts = meter.create_counter(
            "slotwise.slot.timeouts",
            unit="{request}",
            description="Requests that gave up waiting: max_wait or the run's budget ran out.",
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
        if limiter is not None:
            meter.create_observable_up_down_counter(
                "slotwise.slot.limit",
                callbacks=[self._observe_limit],
                unit="{slot}",
                description="The limiter's max_concurrent.",
            )
            meter.create_observable_up_down_counter(
                "slotwise.workload.limit",
                callbacks=[self._observe_workload_limits],
                unit="{slot}",
                description="Each workload's ceiling (its max_concurrent, else the limiter's).",
            )
            meter.create_observable_up_down_counter(
                "slotwise.workload.reserved",
                callbacks=[self._observe_reservations],
                unit="{slot}",
                description="Slots reserved for each workload.",
            )

    # -- events ---------------------------------------------------------------------------

    def record(self, event: ConcurrencyEvent) -> None:
        if self.closed:
            return
        attrs = {LIMITER: event.limiter, WORKLOAD: event.workload or ""}
        kind = event.kind
        if kind == "wait-started":
            self._waiting[event.request_id] = attrs
            self._count.add(1, {**attrs, STATE: "queued"})
            return
        if kind in _WAIT_ENDS:
            self._end_wait(event, attrs)
        if event.kind == "acquired":
            self._holding[event.lease_id] = attrs
            self._count.add(1, {**attrs, STATE: "active"})
            self._wait_time.record(event.wait_time, attrs)
        elif event.kind == "timed-out":
            self._timeouts.add(1, attrs)
        elif event.kind == "queue-full":
            self._rejections.add(1, attrs)
        elif event.kind == "limiter-error":
            self._errors.add(
                1, {**attrs, OPERATION: "acquire", ERROR_TYPE: _error_type(event.error)}
            )
        elif event.kind == "renewal-failed":
            self._errors.add(1, {**attrs, OPERATION: "renew", ERROR_TYPE: _error_type(event.error)})
        elif event.kind == "lease-lost":
            self._leases_lost.add(1, attrs)
        elif event.kind == "reclaimed":
            self._reclaimed.add(1, {**attrs, RECLAIMED_SOURCE: event.source})
        elif event.kind == "released":
            self._end_hold(event.lease_id)
            self._hold_time.record(event.hold_time, {**attrs, OUTCOME: event.outcome})
        elif event.kind == "release-failed":
            self._end_hold(event.lease_id)
            self._errors.add(
                1, {**attrs, OPERATION: "release", ERROR_TYPE: _error_type(event.error)}
            )

    def _end_wait(self, event: ConcurrencyEvent, attrs: dict[str, str]) -> None:
        started = self._waiting.pop(event.request_id, None)
        if started is not None:
            self._count.add(-1, {**started, STATE: "queued"})
        waited = getattr(event, "wait_time", None)
        if waited is None or waited < self._span_min_wait:
            return
        outcome = _WAIT_ENDS[event.kind]
        span_attrs: dict[str, str] = {**attrs, "slotwise.wait.outcome": outcome}
        for key, value in (
            ("slotwise.request.id", event.request_id),
            ("slotwise.run.id", event.run_id),
            ("slotwise.run.root_id", event.root_run_id),
            ("slotwise.run.parent_id", event.parent_run_id),
            ("slotwise.lease.id", getattr(event, "lease_id", None)),
        ):
            if value is not None:
                span_attrs[key] = value
        end = int(event.timestamp * 1e9)
        span = self._tracer.start_span(
            "slotwise.wait",
            kind=SpanKind.INTERNAL,
            attributes=span_attrs,
            start_time=end - int(waited * 1e9),
        )
        if event.kind in _WAIT_FAILURES:
            error = getattr(event, "error", None)
            span.set_attribute(ERROR_TYPE, _error_type(error) if error else event.kind)
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=end)

    def _end_hold(self, lease_id: str) -> None:
        held = self._holding.pop(lease_id, None)
        if held is not None:
            self._count.add(-1, {**held, STATE: "active"})

    # -- the limiter's settings -----------------------------------------------------------

    def _workloads(self) -> Mapping[str, Any]:
        workloads = getattr(self._limiter, "workloads", None)
        return workloads if isinstance(workloads, Mapping) else {}

    def _observe_limit(self, options: CallbackOptions) -> Iterable[Observation]:
        limit = getattr(self._limiter, "max_concurrent", None)
        if self.closed or not isinstance(limit, int):
            return []
        return [Observation(limit, {LIMITER: str(self._limiter.name)})]

    def _observe_workload_limits(self, options: CallbackOptions) -> Iterable[Observation]:
        limit = getattr(self._limiter, "max_concurrent", None)
        if self.closed or not isinstance(limit, int):
            return []
        name = str(self._limiter.name)
        observations = []
        for workload, settings in self._workloads().items():
            ceiling = getattr(settings, "max_concurrent", None)
            value = ceiling if isinstance(ceiling, int) else limit
            observations.append(Observation(value, {LIMITER: name, WORKLOAD: str(workload)}))
        return observations

    def _observe_reservations(self, options: CallbackOptions) -> Iterable[Observation]:
        if self.closed:
            return []
        name = str(getattr(self._limiter, "name", ""))
        return [
            Observation(
                int(getattr(settings, "reserved", 0) or 0), {LIMITER: name, WORKLOAD: str(w)}
            )
            for w, settings in self._workloads().items()
        ]
