"""slotwise.opentelemetry against the OpenTelemetry SDK's in-memory reader and exporter.

The scenario runs on trio's MockClock (exact times) and on asyncio with short real durations.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import attrs
import pytest
import trio.testing
from opentelemetry.metrics import NoOpMeter, NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import slotwise
import slotwise.httpx
import slotwise.opentelemetry
from slotwise import Adaptive, ConcurrencyEvent, MemoryLimiter, Workload

from ._helpers import closes_early
from .conftest import FakeProvider

pytestmark = pytest.mark.anyio

MOCK_TRIO = pytest.param(
    ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}), id="trio-mockclock"
)
BACKENDS = [MOCK_TRIO, pytest.param("asyncio", id="asyncio")]
SHORT = {
    "pool": "slotwise.slot.pool.name",
    "state": "slotwise.slot.state",
    "workload": "slotwise.workload",
    "outcome": "slotwise.outcome",
    "operation": "slotwise.operation",
}


class Otel:
    """An SDK meter provider and tracer provider, recording in memory."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.cleanups: list[Callable[[], None]] = []

    def instrument(self, limiter: Any = None, **kwargs: Any) -> Callable[[], None]:
        uninstrument = slotwise.opentelemetry.instrument(
            limiter,
            meter_provider=self.meter_provider,
            tracer_provider=self.tracer_provider,
            **kwargs,
        )
        self.cleanups.append(uninstrument)
        return uninstrument

    def points(self) -> dict[str, list[Any]]:
        """Every data point, by metric name."""
        found: dict[str, list[Any]] = {}
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                assert scope.scope.name == "slotwise"
                for metric in scope.metrics:
                    found.setdefault(metric.name, []).extend(metric.data.data_points)
        return found

    def value(self, name: str, **attributes: str) -> Any:
        """The value (a sum, or a histogram's (count, sum)) of the point with these attributes.

        `pool`, `state`, `workload`, `outcome` and `operation` stand for slotwise's attribute
        names; any other key is an attribute name with its dots written as `__`.
        """
        wanted = {SHORT.get(k, k.replace("__", ".")): v for k, v in attributes.items()}
        matches = [p for p in self.points().get(name, []) if dict(p.attributes) == wanted]
        assert len(matches) <= 1
        if not matches:
            return None
        point = matches[0]
        return (point.count, point.sum) if hasattr(point, "count") else point.value

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def failures(self) -> list[ReadableSpan]:
        """The spans of failed waits (an immediate grant can take a span on a busy machine)."""
        return [s for s in self.spans() if s.status.status_code == StatusCode.ERROR]


@pytest.fixture
def otel() -> Iterator[Otel]:
    o = Otel()
    yield o
    for cleanup in o.cleanups:
        cleanup()
    o.meter_provider.shutdown()
    o.tracer_provider.shutdown()


@pytest.mark.parametrize("anyio_backend", BACKENDS)
async def test_metrics_and_spans_of_waits_timeouts_and_rejections(
    otel: Otel, anyio_backend_name: str
) -> None:
    # On the mock clock a unit is a second and times are exact; on asyncio they are real.
    unit = 1.0 if anyio_backend_name == "trio" else 0.05
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="claude",
        max_concurrent=1,
        max_queued=2,
        workloads={"default": Workload(), "fast": Workload(max_wait=2 * unit)},
    )
    # A's immediate grant stays under the threshold however busy the machine is.
    uninstrument = otel.instrument(limiter, span_min_wait=unit / 2)

    async def hold(workload: str, seconds: float) -> None:
        async with limiter.slot(workload=workload):
            await anyio.sleep(seconds)

    async def timed_out() -> None:
        with pytest.raises(slotwise.ConcurrencyTimeoutError):
            await hold("fast", 0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(hold, "default", 5 * unit)  # A: at once, holds 5
        await wait_for_stats(limiter, active=1)
        tg.start_soon(hold, "default", 1 * unit)  # B: waits 5, holds 1
        await wait_for_stats(limiter, queued=1)
        tg.start_soon(timed_out)  # C: gives up after 2
        await wait_for_stats(limiter, queued=2)
        with pytest.raises(slotwise.ConcurrencyQueueFullError):  # D: refused at once
            await hold("default", 0)

        assert (
            otel.value("slotwise.slot.count", pool="claude", workload="default", state="used") == 1
        )
        assert otel.value("slotwise.slot.count", pool="claude", state="idle") == 0
        assert otel.value("slotwise.slot.pending_requests", pool="claude", workload="default") == 1
        assert otel.value("slotwise.slot.pending_requests", pool="claude", workload="fast") == 1

    assert otel.value("slotwise.slot.count", pool="claude", workload="default", state="used") == 0
    assert otel.value("slotwise.slot.count", pool="claude", state="idle") == 1
    for workload in ("default", "fast"):
        assert otel.value("slotwise.slot.pending_requests", pool="claude", workload=workload) == 0
    assert otel.value("slotwise.slot.timeouts", pool="claude", workload="fast") == 1
    assert otel.value("slotwise.slot.rejections", pool="claude", workload="default") == 1
    assert otel.value("slotwise.slot.max", pool="claude") == 1
    assert otel.value("slotwise.workload.max", pool="claude", workload="fast") == 1
    assert otel.value("slotwise.workload.reserved", pool="claude", workload="default") == 0
    wait_count, wait_sum = otel.value("slotwise.slot.wait_time", pool="claude", workload="default")
    use_count, use_sum = otel.value(
        "slotwise.slot.use_time", pool="claude", workload="default", outcome="completed"
    )
    # A and B; C and D never got a slot.
    assert wait_count == 2
    assert use_count == 2
    if unit == 1.0:
        assert wait_sum == pytest.approx(5.0)
        assert use_sum == pytest.approx(6.0)
    else:
        assert wait_sum >= 5 * unit
        assert use_sum >= 6 * unit

    # Spans for the requests that waited, B (acquired) and C (timed out), and for D, refused.
    spans = sorted(otel.spans(), key=lambda s: str(attributes(s)["slotwise.wait.outcome"]))
    assert [s.name for s in spans] == ["slotwise.wait"] * 3
    acquired, refused, gave_up = spans
    assert attributes(acquired)["slotwise.wait.outcome"] == "acquired"
    assert attributes(acquired)["slotwise.workload"] == "default"
    assert attributes(acquired)["slotwise.slot.pool.name"] == "claude"
    assert attributes(acquired)["slotwise.lease.id"]
    assert "error.type" not in attributes(acquired)
    assert acquired.status.status_code == StatusCode.UNSET
    assert attributes(gave_up)["slotwise.wait.outcome"] == "timed-out"
    assert attributes(gave_up)["slotwise.workload"] == "fast"
    assert attributes(gave_up)["error.type"] == "slotwise.ConcurrencyTimeoutError"
    assert gave_up.status.status_code == StatusCode.ERROR
    assert attributes(refused)["slotwise.wait.outcome"] == "queue-full"
    assert attributes(refused)["error.type"] == "slotwise.ConcurrencyQueueFullError"
    assert refused.status.status_code == StatusCode.ERROR
    if unit == 1.0:
        assert duration(acquired) == pytest.approx(5.0, abs=1e-6)
        assert duration(gave_up) == pytest.approx(2.0, abs=1e-6)
        assert duration(refused) == 0

    # Nothing more is recorded once uninstrumented.
    uninstrument()
    uninstrument()
    await hold("default", 0)
    use = otel.value(
        "slotwise.slot.use_time", pool="claude", workload="default", outcome="completed"
    )
    assert use[0] == 2
    assert otel.value("slotwise.slot.max", pool="claude") is None
    assert otel.value("slotwise.slot.count", pool="claude", state="idle") is None


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def duration(span: ReadableSpan) -> float:
    assert span.start_time is not None
    assert span.end_time is not None
    return (span.end_time - span.start_time) / 1e9


async def wait_for_stats(limiter: MemoryLimiter[Any], *, active: int = 0, queued: int = 0) -> None:
    while True:
        stats = await limiter.stats()
        if stats.active >= active and stats.queued >= queued:
            return
        await anyio.lowlevel.checkpoint()


class LosingLimiter:
    """A custom limiter whose leases are gone at the first renewal."""

    name = "losing"
    lease_ttl = 0.3

    def __init__(self) -> None:
        self.inner: MemoryLimiter[str] = MemoryLimiter(name="losing", max_concurrent=1)

    async def acquire(self, request: slotwise.AcquireRequest) -> Any:
        return await self.inner.acquire(request)

    async def renew(self, lease: Any) -> None:
        return None

    async def release(self, lease: Any) -> None:
        await self.inner.release(lease)


class BrokenLimiter:
    """A custom limiter whose database is down; the error quotes a secret."""

    name = "broken"

    async def acquire(self, request: slotwise.AcquireRequest) -> Any:
        raise ConnectionError("could not connect with password=hunter2")

    async def renew(self, lease: Any) -> Any:
        raise AssertionError("never called")

    async def release(self, lease: Any) -> None:
        raise AssertionError("never called")


async def test_lost_leases_and_limiter_errors(otel: Otel) -> None:
    otel.instrument()
    losing = LosingLimiter()
    with pytest.raises(slotwise.ConcurrencyLeaseLostError):
        async with slotwise.slot(limiter=losing):
            await anyio.sleep(5)
    with pytest.raises(slotwise.ConcurrencyLimiterError):
        async with slotwise.slot(limiter=BrokenLimiter()):
            pass
    assert otel.value("slotwise.slot.leases_lost", pool="losing", workload="default") == 1
    assert otel.value("slotwise.slot.count", pool="losing", workload="default", state="used") == 0
    assert (
        otel.value(
            "slotwise.limiter.errors",
            pool="broken",
            workload="default",
            operation="acquire",
            error__type="ConnectionError",
        )
        == 1
    )
    (span,) = otel.failures()
    assert attributes(span)["slotwise.wait.outcome"] == "limiter-error"
    assert attributes(span)["error.type"] == "ConnectionError"
    assert "hunter2" not in everything_recorded(otel, [])
    # A limiter object named by nobody has no limit to report.
    assert "slotwise.slot.max" not in otel.points()
    assert otel.value("slotwise.slot.count", pool="losing", state="idle") is None


async def test_a_config_error_is_a_span_with_its_exception_class(otel: Otel) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="claude", max_concurrent=1)
    otel.instrument(limiter)
    with pytest.raises(slotwise.ConcurrencyConfigError):
        async with slotwise.slot(limiter=limiter, workload="typo"):
            pass
    (span,) = otel.failures()
    assert attributes(span)["slotwise.wait.outcome"] == "config-error"
    assert attributes(span)["error.type"] == "slotwise.ConcurrencyConfigError"
    assert span.status.status_code == StatusCode.ERROR


async def test_limiters_instrumented_one_by_one_each_report_their_limits(otel: Otel) -> None:
    a: MemoryLimiter[str] = MemoryLimiter(name="a", max_concurrent=1)
    b: MemoryLimiter[str] = MemoryLimiter(
        name="b",
        max_concurrent=3,
        workloads={"x": Workload(max_concurrent=2, reserved=1), "y": Workload()},
        default_workload="y",
    )
    otel.instrument(a)
    uninstrument_b = otel.instrument(b)
    async with b.slot(workload="x"):
        assert otel.value("slotwise.slot.max", pool="a") == 1
        assert otel.value("slotwise.slot.max", pool="b") == 3
        assert otel.value("slotwise.workload.max", pool="b", workload="x") == 2
        assert otel.value("slotwise.workload.max", pool="b", workload="y") == 3
        assert otel.value("slotwise.workload.reserved", pool="b", workload="x") == 1
        assert otel.value("slotwise.slot.count", pool="a", state="idle") == 1
        assert otel.value("slotwise.slot.count", pool="b", state="idle") == 2
        assert otel.value("slotwise.slot.count", pool="b", workload="x", state="used") == 1
    uninstrument_b()
    assert otel.value("slotwise.slot.max", pool="a") == 1
    assert otel.value("slotwise.slot.max", pool="b") is None
    assert otel.value("slotwise.slot.count", pool="b", workload="x", state="used") is None
    # The same provider, instrumented again, reports b again.
    otel.instrument(b)
    assert otel.value("slotwise.slot.max", pool="b") == 3


async def test_overlapping_instrument_calls_record_each_event_once(otel: Otel) -> None:
    a, other = (
        MemoryLimiter(name=name, max_concurrent=1, workloads={"default": Workload(max_wait=0)})
        for name in ("a", "other")
    )
    everything = otel.instrument()
    first = otel.instrument(a)
    second = otel.instrument(a)

    async def busy_then_refused(limiter: MemoryLimiter[str]) -> None:
        async with limiter.slot():
            with pytest.raises(slotwise.ConcurrencyTimeoutError):
                async with limiter.slot(allow_nested=True):
                    pass

    await busy_then_refused(a)
    await busy_then_refused(other)
    for pool in ("a", "other"):
        assert otel.value("slotwise.slot.wait_time", pool=pool, workload="default")[0] == 1
        assert otel.value("slotwise.slot.timeouts", pool=pool, workload="default") == 1
        assert otel.value("slotwise.slot.count", pool=pool, workload="default", state="used") == 0
        assert otel.value("slotwise.slot.pending_requests", pool=pool, workload="default") == 0
    assert otel.value("slotwise.slot.count", pool="a", state="idle") == 1
    assert len(otel.failures()) == 2  # the two refusals

    # Without the call for every limiter, a is still recorded once; the other is forgotten.
    everything()
    await busy_then_refused(a)
    await busy_then_refused(other)
    assert otel.value("slotwise.slot.wait_time", pool="a", workload="default")[0] == 2
    assert otel.value("slotwise.slot.timeouts", pool="a", workload="default") == 2
    assert otel.value("slotwise.slot.count", pool="other", workload="default", state="used") is None
    assert otel.value("slotwise.slot.timeouts", pool="other", workload="default") == 1
    assert len(otel.failures()) == 3

    first()
    await busy_then_refused(a)
    assert otel.value("slotwise.slot.timeouts", pool="a", workload="default") == 3
    second()
    await busy_then_refused(a)
    assert otel.value("slotwise.slot.timeouts", pool="a", workload="default") == 3
    assert otel.value("slotwise.slot.max", pool="a") is None
    assert len(otel.failures()) == 4


class Forwarding:
    """A custom limiter in front of a MemoryLimiter: it can pause and adapt, but cannot say
    its state outside an `await` (no `stats_nowait()`), so the events have to."""

    def __init__(self, inner: MemoryLimiter[str]) -> None:
        self.inner = inner
        self.name = inner.name
        self.max_concurrent = inner.max_concurrent

    async def acquire(self, request: slotwise.AcquireRequest) -> slotwise.Lease:
        return await self.inner.acquire(request)

    async def renew(self, lease: slotwise.SupportsLease) -> slotwise.Lease | None:
        return await self.inner.renew(lease)

    async def release(self, lease: slotwise.SupportsLease) -> None:
        await self.inner.release(lease)

    def throttle(
        self, lease: slotwise.SupportsLease | None, retry_after: float | None = None
    ) -> tuple[float, tuple[int, int] | None]:
        return self.inner.throttle(lease, retry_after)


@pytest.mark.parametrize("anyio_backend", BACKENDS)
@pytest.mark.parametrize("kind", ["memory", "custom"])
async def test_the_limit_in_force_and_the_pause_after_pushback(otel: Otel, kind: str) -> None:
    memory = MemoryLimiter(name="claude", max_concurrent=8, adaptive=Adaptive(min_concurrent=2))
    limiter: Any = memory if kind == "memory" else Forwarding(memory)
    otel.instrument(limiter)
    assert otel.value("slotwise.limiter.effective_max", pool="claude") == 8
    assert otel.value("slotwise.limiter.pause.remaining", pool="claude") == 0
    async with slotwise.slot(limiter=limiter) as slot:
        slot.throttled(retry_after=30.0, reason="429")
    assert otel.value("slotwise.limiter.effective_max", pool="claude") == 4
    assert otel.value("slotwise.slot.max", pool="claude") == 8  # the configured limit
    assert 25 < otel.value("slotwise.limiter.pause.remaining", pool="claude") <= 30
    assert otel.value("slotwise.limiter.pauses", pool="claude", slotwise__pause__reason="429") == 1


@pytest.mark.parametrize("anyio_backend", [MOCK_TRIO])
async def test_the_pause_ends_and_the_limit_set_by_hand_is_reported(otel: Otel) -> None:
    limiter = MemoryLimiter(name="claude", max_concurrent=8)
    otel.instrument(limiter)
    async with limiter.slot() as slot:
        slot.throttled(retry_after=10.0)
    assert (
        otel.value("slotwise.limiter.pauses", pool="claude", slotwise__pause__reason="throttled")
        == 1
    )
    await anyio.sleep(11.0)
    assert otel.value("slotwise.limiter.pause.remaining", pool="claude") == 0
    await limiter.set_limits(max_concurrent=3)
    assert otel.value("slotwise.limiter.effective_max", pool="claude") == 3
    assert otel.value("slotwise.slot.max", pool="claude") == 3


async def test_a_limiter_instrumented_after_its_pushback_reports_it(otel: Otel) -> None:
    """A MemoryLimiter says its state itself: the events before the call are not needed."""
    limiter = MemoryLimiter(name="claude", max_concurrent=8, adaptive=Adaptive(min_concurrent=2))
    async with limiter.slot() as slot:
        slot.throttled(retry_after=30.0)
    otel.instrument(limiter)
    assert otel.value("slotwise.limiter.effective_max", pool="claude") == 4
    assert otel.value("slotwise.limiter.pause.remaining", pool="claude") > 25


class RecordingMeter(NoOpMeter):
    """Notes the kind and unit of every instrument created."""

    def __init__(self) -> None:
        super().__init__("slotwise")
        self.created: dict[str, tuple[str, str]] = {}

    def create_counter(self, name: str, unit: str = "", description: str = "") -> Any:
        self.created[name] = ("Counter", unit)
        return super().create_counter(name, unit, description)

    def create_histogram(self, name: str, unit: str = "", description: str = "", **kw: Any) -> Any:
        self.created[name] = ("Histogram", unit)
        return super().create_histogram(name, unit, description, **kw)

    def create_observable_up_down_counter(
        self, name: str, callbacks: Any = None, unit: str = "", description: str = ""
    ) -> Any:
        self.created[name] = ("Asynchronous UpDownCounter", unit)
        return super().create_observable_up_down_counter(name, callbacks, unit, description)

    def create_observable_gauge(
        self, name: str, callbacks: Any = None, unit: str = "", description: str = ""
    ) -> Any:
        self.created[name] = ("Asynchronous Gauge", unit)
        return super().create_observable_gauge(name, callbacks, unit, description)


class RecordingMeterProvider(NoOpMeterProvider):
    def __init__(self) -> None:
        self.meter = RecordingMeter()

    def get_meter(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.meter


def test_the_reference_lists_every_metric_with_its_instrument_and_unit() -> None:
    provider = RecordingMeterProvider()
    uninstrument = slotwise.opentelemetry.instrument(meter_provider=provider)
    uninstrument()
    text = (Path(__file__).parents[2] / "docs" / "reference" / "metrics.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n##", 1)[0]
    rows = re.findall(r"^\| `(slotwise\.[^`]+)` \| ([^|]+) \| `([^`]*)` \|", section, re.M)
    documented = {name: (instrument, unit) for name, instrument, unit in rows}
    assert documented == provider.meter.created
    # The conventions' units.
    assert provider.meter.created["slotwise.slot.timeouts"] == ("Counter", "{timeout}")
    assert provider.meter.created["slotwise.slot.pending_requests"][1] == "{request}"


async def test_without_an_sdk_nothing_happens() -> None:
    """With the API's default (no-op) providers, instrumenting costs nothing and breaks nothing."""
    limiter: MemoryLimiter[str] = MemoryLimiter(name="quiet", max_concurrent=1)
    uninstrument = slotwise.opentelemetry.instrument(limiter)
    async with limiter.slot():
        pass
    uninstrument()


@closes_early
async def test_no_header_body_or_prompt_is_ever_recorded(
    otel: Otel, provider: FakeProvider
) -> None:
    openai = pytest.importorskip("openai")
    key = "sk-never-record-this-0123456789"
    prompt = "PROMPT-never-record-this"
    limiter: MemoryLimiter[str] = MemoryLimiter(name="claude", max_concurrent=1)
    events: list[ConcurrencyEvent] = []
    otel.cleanups.append(slotwise.subscribe(events.append))
    otel.instrument()
    client = openai.AsyncOpenAI(
        api_key=key,
        base_url=f"{provider.url}/v1",
        http_client=slotwise.httpx.client(limiter=limiter),
        default_headers={"x-custom": key},
        max_retries=2,
    )

    async def ask(stream: bool) -> None:
        result = await client.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": prompt}],
            stream=stream,
            extra_headers={"x-fake-delay": "0.05", "x-fake-429": "1"},
        )
        if stream:
            async for _ in result:
                pass

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(ask, i % 2 == 0)
    await client.close()

    # The secrets did travel: the server saw them.
    assert any(key in a for a in provider.authorizations)
    assert any(prompt.encode() in b for b in provider.bodies)
    # And slotwise saw the requests: events, metrics and at least one wait span.
    assert otel.points()["slotwise.slot.use_time"]
    assert otel.spans()
    recorded = everything_recorded(otel, events)
    assert key not in recorded
    assert prompt not in recorded
    assert "authorization" not in recorded.lower()


def everything_recorded(otel: Otel, events: list[ConcurrencyEvent]) -> str:
    parts = [repr(attrs.asdict(e)) for e in events]
    for name, points in otel.points().items():
        parts.append(name)
        parts.extend(repr(dict(p.attributes)) for p in points)
    for span in otel.spans():
        parts.append(span.to_json())
    return "\n".join(parts)
