"""`python -m slotwise demo`: a simulated fleet of agents shares one MemoryLimiter.

Everything is offline. Interactive chats and background jobs run agents; an agent's tools
may start child agents (child runs of `slotwise.run`). Every provider request holds one
slot, and a simulated provider answers with a lognormal time to first token plus a
lognormal streaming time. Time runs `SPEEDUP` times faster than real time, so the
example's waits are scaled by the same factor.

The same trace is replayed, at the same time, against two limiters without the
reservation, so the summary can say what the reservation bought the interactive workload.
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TextIO, TypeAlias

import anyio
import attrs

import slotwise

from ._config import Workload
from ._errors import ConcurrencyQueueFullError, ConcurrencyTimeoutError
from ._events import (
    AcquiredEvent,
    ConcurrencyEvent,
    QueueFullEvent,
    ReleasedEvent,
    TimedOutEvent,
    WaitCancelledEvent,
)
from .memory import MemoryLimiter

__all__ = ("SPEEDUP", "WIDTH", "DemoResult", "main", "run_demo")

SPEEDUP = 40.0
"""Simulated seconds per second of the demo."""

WIDTH = 78
"""The widest line the demos print: they fit an 80-column terminal."""

MAX_CONCURRENT = 8
MAX_QUEUED = 200
BACKGROUND_MAX_QUEUED = MAX_QUEUED - 20  # the rest of the queue stays open to interactive
WORKLOADS = ("interactive", "background")

# Arrivals per second of the demo, and the batch submitted at once part-way through.
CHAT_RATE = 2.5
JOB_RATE = 6.0
BATCH_SIZE = MAX_QUEUED + 40
BATCH_AT = 0.4  # fraction of the demo

INTERACTIVE_BUDGET = 120.0  # a chat turn's time budget, simulated seconds
BACKGROUND_BUDGET = 600.0  # a background job's


def _scaled(seconds: float) -> float:
    return seconds / SPEEDUP


def example_workloads() -> dict[str, Workload]:
    """The example workloads, with waits scaled to the demo's clock."""
    return {
        "interactive": Workload(reserved=2, priority=10, max_wait=_scaled(60.0)),
        "background": Workload(
            max_concurrent=6, max_wait=_scaled(300.0), max_queued=BACKGROUND_MAX_QUEUED
        ),
    }


# -- the trace: what the fleet will do, drawn once and replayed against every limiter ------


@attrs.frozen
class Call:
    """One provider request, streaming included (demo seconds)."""

    ttft: float
    stream: float


@attrs.frozen
class Tool:
    """A tool call: `duration` of work, or a child agent that runs `child`."""

    duration: float
    child: tuple[Step, ...] = ()


Step: TypeAlias = Call | Tool


@attrs.frozen
class Session:
    """A chat (turns separated by the user's think time) or a background job (one turn)."""

    start: float
    workload: str
    budget: float
    turns: tuple[tuple[float, tuple[Step, ...]], ...]


def _lognormal(rng: random.Random, median: float, sigma: float, cap: float) -> float:
    return min(cap, rng.lognormvariate(math.log(median), sigma))


def _call(rng: random.Random, workload: str) -> Call:
    # Simulated seconds: an interactive answer is short, a background one long.
    if workload == "interactive":
        ttft = _lognormal(rng, 0.6, 0.4, 10.0)
        tokens = _lognormal(rng, 180.0, 0.6, 2000.0)
    else:
        ttft = _lognormal(rng, 1.0, 0.5, 20.0)
        tokens = _lognormal(rng, 450.0, 0.7, 4000.0)
    return Call(ttft=_scaled(ttft), stream=_scaled(tokens / 65.0))


def _agent(rng: random.Random, workload: str, calls: int, child_odds: float) -> tuple[Step, ...]:
    steps: list[Step] = []
    for i in range(calls):
        if i:
            if rng.random() < child_odds:
                child = _agent(rng, workload, rng.randint(1, 2), 0.0)
                steps.append(Tool(duration=0.0, child=child))
            else:
                steps.append(Tool(duration=_scaled(rng.uniform(0.3, 4.0))))
        steps.append(_call(rng, workload))
    return tuple(steps)


def make_trace(seconds: float, seed: int) -> list[Session]:
    """Draw the sessions of a demo of `seconds` from `seed`."""
    rng = random.Random(seed)
    sessions: list[Session] = []
    t = rng.expovariate(CHAT_RATE)
    while t < seconds:
        turns = tuple(
            (
                _scaled(rng.uniform(5.0, 30.0)) if i else 0.0,
                _agent(rng, "interactive", 1 + (rng.random() < 0.4), 0.5),
            )
            for i in range(rng.randint(1, 4))
        )
        sessions.append(Session(t, "interactive", _scaled(INTERACTIVE_BUDGET), turns))
        t += rng.expovariate(CHAT_RATE)

    def job(start: float) -> Session:
        script = _agent(rng, "background", rng.randint(2, 4), 0.3)
        return Session(start, "background", _scaled(BACKGROUND_BUDGET), ((0.0, script),))

    t = rng.expovariate(JOB_RATE)
    while t < seconds:
        sessions.append(job(t))
        t += rng.expovariate(JOB_RATE)
    sessions.extend(job(seconds * BATCH_AT) for _ in range(BATCH_SIZE))
    sessions.sort(key=lambda s: s.start)
    return sessions


# -- one limiter under the trace ------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Variant:
    """A limiter configuration the trace is played against."""

    key: str
    title: str
    workloads: Mapping[str, Workload]


def variants() -> tuple[Variant, ...]:
    """The example limiter, then the same 8 slots without the reservation."""
    example = example_workloads()
    interactive, background = example["interactive"], example["background"]
    return (
        Variant(key="example", title="the example (2 reserved)", workloads=example),
        Variant(
            key="priority-only",
            title="no reservation, priority kept",
            workloads={
                "interactive": Workload(priority=10, max_wait=interactive.max_wait),
                "background": Workload(
                    max_wait=background.max_wait, max_queued=background.max_queued
                ),
            },
        ),
        Variant(
            key="one-queue",
            title="no reservation, one first-come queue",
            workloads={
                "interactive": Workload(max_wait=interactive.max_wait),
                "background": Workload(
                    max_wait=background.max_wait, max_queued=background.max_queued
                ),
            },
        ),
    )


def _by_workload() -> dict[str, int]:
    return dict.fromkeys(WORKLOADS, 0)


Outcome: TypeAlias = Literal["granted", "timed out", "refused"]


@attrs.frozen
class Point:
    """One request's answer: when (demo seconds), for which workload, after how long a wait."""

    at: float
    workload: str
    wait: float
    outcome: Outcome


@attrs.define(eq=False)
class Fleet:
    """The trace played against one limiter, and what the provider and events saw."""

    variant: Variant
    limiter: MemoryLimiter[str]
    started: float = 0.0
    in_flight: dict[str, int] = attrs.field(factory=_by_workload)
    peak: dict[str, int] = attrs.field(factory=_by_workload)
    peak_total: int = 0
    served: dict[str, int] = attrs.field(factory=_by_workload)
    # How long each request waited, granted or timed out (not those cut off at the end).
    waits: dict[str, list[float]] = attrs.field(factory=lambda: {w: [] for w in WORKLOADS})
    timeouts: dict[str, int] = attrs.field(factory=_by_workload)
    queue_full: dict[str, int] = attrs.field(factory=_by_workload)
    cut_off: dict[str, int] = attrs.field(factory=_by_workload)
    budget_outs: dict[str, int] = attrs.field(factory=_by_workload)
    # every request's answer, for the picture
    points: list[Point] = attrs.field(factory=list)

    def on_event(self, event: ConcurrencyEvent) -> None:
        workload = event.workload or ""
        if workload not in self.peak:
            return
        if isinstance(event, WaitCancelledEvent) or (
            isinstance(event, ReleasedEvent) and event.outcome == "cancelled"
        ):
            self.cut_off[workload] += 1
            return
        outcome: Outcome
        if isinstance(event, AcquiredEvent):
            outcome = "granted"
        elif isinstance(event, TimedOutEvent):
            self.timeouts[workload] += 1
            outcome = "timed out"
        elif isinstance(event, QueueFullEvent):
            self.queue_full[workload] += 1
            outcome = "refused"
        else:
            return
        if outcome != "refused":
            self.waits[workload].append(event.wait_time)
        at = anyio.current_time() - self.started
        self.points.append(Point(at=at, workload=workload, wait=event.wait_time, outcome=outcome))

    async def provide(self, workload: str, call: Call) -> None:
        """The simulated provider: counts what is in flight, then answers."""
        self.in_flight[workload] += 1
        self.peak[workload] = max(self.peak[workload], self.in_flight[workload])
        self.peak_total = max(self.peak_total, sum(self.in_flight.values()))
        try:
            await anyio.sleep(call.ttft)  # time to first token
            await anyio.sleep(call.stream)  # streaming the answer
        finally:
            self.in_flight[workload] -= 1
        self.served[workload] += 1

    async def agent(self, steps: Sequence[Step]) -> None:
        """An agent loop: a slot per provider request, none while a tool runs."""
        for step in steps:
            if isinstance(step, Call):
                async with slotwise.slot() as slot:
                    await self.provide(str(slot.workload), step)
            elif step.child:
                async with slotwise.run():  # the tool starts a child agent
                    await self.agent(step.child)
            else:
                await anyio.sleep(step.duration)

    async def session(self, session: Session) -> None:
        for think, steps in session.turns:
            await anyio.sleep(think)
            try:
                async with slotwise.run(
                    limiter=self.limiter, workload=session.workload, timeout=session.budget
                ):
                    await self.agent(steps)
            except (ConcurrencyTimeoutError, ConcurrencyQueueFullError):
                return  # counted from the events; the user gives up on this chat
            except TimeoutError:
                self.budget_outs[session.workload] += 1
                return


# -- results ----------------------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank `q` quantile, or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@attrs.frozen(kw_only=True)
class WorkloadResult:
    """One workload's figures in one fleet."""

    limit: int
    reserved: int
    peak: int
    served: int
    waits: tuple[float, ...]  # granted or timed out
    timeouts: int
    queue_full: int
    cut_off: int
    budget_outs: int

    @property
    def held(self) -> bool:
        return self.peak <= self.limit


@attrs.frozen(kw_only=True)
class FleetResult:
    """One limiter's figures."""

    key: str
    title: str
    max_concurrent: int
    peak_total: int
    workloads: Mapping[str, WorkloadResult]
    leftover_active: int
    leftover_queued: int
    points: tuple[Point, ...]

    @property
    def held(self) -> bool:
        """Every limit held, and every slot came back at the end."""
        return (
            self.peak_total <= self.max_concurrent
            and all(w.held for w in self.workloads.values())
            and self.leftover_active == 0
            and self.leftover_queued == 0
        )


@attrs.frozen(kw_only=True)
class Sample:
    """The example limiter's counts at one moment."""

    t: float
    active: Mapping[str, int]
    queued: Mapping[str, int]


@attrs.frozen(kw_only=True)
class DemoResult:
    """Everything the demo measured."""

    seconds: float
    seed: int
    fleets: tuple[FleetResult, ...]
    samples: tuple[Sample, ...]

    @property
    def held(self) -> bool:
        return all(fleet.held for fleet in self.fleets)


async def _result(fleet: Fleet) -> FleetResult:
    stats = await fleet.limiter.stats()
    return FleetResult(
        key=fleet.variant.key,
        title=fleet.variant.title,
        max_concurrent=MAX_CONCURRENT,
        peak_total=fleet.peak_total,
        workloads={
            w: WorkloadResult(
                limit=fleet.variant.workloads[w].max_concurrent or MAX_CONCURRENT,
                reserved=fleet.variant.workloads[w].reserved,
                peak=fleet.peak[w],
                served=fleet.served[w],
                waits=tuple(fleet.waits[w]),
                timeouts=fleet.timeouts[w],
                queue_full=fleet.queue_full[w],
                cut_off=fleet.cut_off[w],
                budget_outs=fleet.budget_outs[w],
            )
            for w in WORKLOADS
        },
        leftover_active=stats.active,
        leftover_queued=stats.queued,
        points=tuple(fleet.points),
    )


# -- the live view ----------------------------------------------------------------------------


def fmt_seconds(value: float | None) -> str:
    """A wait for people: `0 ms`, `12 ms`, `1.25 s`; `-` for nothing measured."""
    if value is None:
        return "-"
    ms = round(value * 1000)
    return f"{ms} ms" if ms < 1000 else f"{value:.2f} s"


def fmt_duration(seconds: float) -> str:
    """A length of time for people: `15 s`, `2.5 s`, `2 min 40 s`, `10 min`, `1 h 5 min`."""
    if round(seconds, 1) < 60:
        return f"{seconds:.1f}".removesuffix(".0") + " s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min" + (f" {rest} s" if rest else "")
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h" + (f" {minutes} min" if minutes else "")


def columns(rows: Iterable[Sequence[str]], widths: Sequence[int] | None = None) -> list[str]:
    """Rows of cells as lines: the first cell left-aligned, the others right-aligned, two
    spaces apart; each column as wide as `widths` says, else as its widest cell."""
    rows = list(rows)
    if widths is None:
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def bar(used: int, ceiling: int, width: int) -> str:
    """`##....`: the slots in use of a ceiling, padded to `width`."""
    return ("#" * used + "." * (ceiling - used)).ljust(width)


LIVE_HEADER = ("in use", "queued", "p50 wait", "p95 wait", "timed out", "refused")


class LiveView:
    """The limiters' workloads, redrawn in place on a terminal, else printed as a log."""

    def __init__(self, out: TextIO, fleets: Sequence[Fleet], seconds: float) -> None:
        self.out = out
        self.fleets = fleets
        self.seconds = seconds
        self.tty = out.isatty()
        self.drawn = 0

    async def row(self, label: str, fleet: Fleet, name: str) -> tuple[str, ...]:
        """A workload's live figures, as `LIVE_HEADER` names them; on a terminal, with a bar."""
        w = (await fleet.limiter.stats()).workloads[name]
        ceiling = fleet.variant.workloads[name].max_concurrent or MAX_CONCURRENT
        in_use = f"{w.active}/{ceiling}"
        if self.tty:
            in_use += " " + bar(w.active, ceiling, MAX_CONCURRENT)
        waits = fleet.waits[name]
        return (
            label,
            in_use,
            str(w.queued),
            fmt_seconds(quantile(waits, 0.5)),
            fmt_seconds(quantile(waits, 0.95)),
            str(fleet.timeouts[name] + fleet.budget_outs[name]),
            str(fleet.queue_full[name]),
        )

    async def draw(self, elapsed: float) -> None:
        main = self.fleets[0]
        if not self.tty:
            # A log: a row a workload each time, under a header printed once.
            rows: list[tuple[str, ...]] = []
            if not self.drawn:
                rows.append((f"{'time':>7}  workload", *LIVE_HEADER))
            for name in WORKLOADS:
                rows.append(await self.row(f"{elapsed:5.1f} s  {name}", main, name))
            widths = (20, 6, 6, 8, 8, 9, 7)
            self.out.write("".join(f"{line}\n" for line in columns(rows, widths)))
            self.drawn += 1
            self.out.flush()
            return
        stats = await main.limiter.stats()
        lines = [
            f"t={elapsed:4.1f} s of {fmt_duration(self.seconds)}   limiter {main.limiter.name!r}: "
            f"{stats.active}/{stats.max_concurrent} in use, {stats.queued}/{MAX_QUEUED} queued"
        ]
        header = ("", LIVE_HEADER[0].ljust(12), *LIVE_HEADER[1:])  # over the count, not the bar
        rows = [header] + [await self.row(name, main, name) for name in WORKLOADS]
        replays = [
            await self.row("  " + fleet.variant.key.replace("-", " "), fleet, "interactive")
            for fleet in self.fleets[1:]
        ]
        table = columns([*rows, *replays], (15, 12, 6, 8, 8, 9, 7))
        lines += table[: len(rows)]
        if replays:
            lines.append(
                f"Interactive, the same load on {MAX_CONCURRENT} slots without the reservation:"
            )
            lines += table[len(rows) :]
        # A wrapped line would break the redraw: cut lines to a narrower terminal's width.
        width = shutil.get_terminal_size().columns - 1
        if self.drawn:
            self.out.write(f"\x1b[{self.drawn}F")
        self.out.write("".join(f"\x1b[2K{line[:width]}\n" for line in lines))
        self.drawn = len(lines)
        self.out.flush()


# -- the run ----------------------------------------------------------------------------------


def _limiter(variant: Variant) -> MemoryLimiter[str]:
    return MemoryLimiter(
        name="claude",
        max_concurrent=MAX_CONCURRENT,
        max_queued=MAX_QUEUED,
        workloads=variant.workloads,
    )


async def run_demo(
    *,
    seconds: float = 15.0,
    seed: int = 1,
    compare: bool = True,
    out: TextIO | None = None,
    configs: Sequence[Variant] | None = None,
    make_limiter: Callable[[Variant], MemoryLimiter[str]] | None = None,
) -> DemoResult:
    """Play the trace against the example limiter (and the replays) and measure it.

    Args:
        seconds: How long the fleet runs; at the end it is cancelled.
        seed: Seeds the trace.
        compare: Replay the same trace against limiters without the reservation.
        out: Where the live view goes; default: `sys.stdout`.
        configs: The configurations to play (default: `variants()`); the limits
            checked are theirs.
        make_limiter: Builds each configuration's limiter (default: a `MemoryLimiter`
            with its workloads); tests pass a looser one to see a broken limit reported.
    """
    out = sys.stdout if out is None else out
    chosen = tuple(configs if configs is not None else variants())
    if not compare:
        chosen = chosen[:1]
    factory = make_limiter or _limiter
    fleets = [Fleet(variant=v, limiter=factory(v)) for v in chosen]
    unsubscribe = [f.limiter.subscribe(f.on_event) for f in fleets]
    trace = make_trace(seconds, seed)
    view = LiveView(out, fleets, seconds)
    samples: list[Sample] = []
    started = anyio.current_time()
    for fleet in fleets:
        fleet.started = started

    async def spawn(tg: anyio.abc.TaskGroup) -> None:
        for session in trace:
            await anyio.sleep(max(0.0, started + session.start - anyio.current_time()))
            for fleet in fleets:
                tg.start_soon(fleet.session, session)

    async def sample() -> None:
        while True:
            stats = await fleets[0].limiter.stats()
            samples.append(
                Sample(
                    t=anyio.current_time() - started,
                    active={w: stats.workloads[w].active for w in WORKLOADS},
                    queued={w: stats.workloads[w].queued for w in WORKLOADS},
                )
            )
            await anyio.sleep(0.05)

    async def show() -> None:
        interval = 0.1 if view.tty else 1.0
        while True:
            await anyio.sleep(interval)
            await view.draw(anyio.current_time() - started)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(spawn, tg)
            tg.start_soon(sample)
            tg.start_soon(show)
            await anyio.sleep(seconds)
            # The end: cancel the whole fleet. Waiting requests leave their queues, running
            # ones are cancelled, and every slot is released.
            tg.cancel_scope.cancel()
        await view.draw(anyio.current_time() - started)
        results = tuple([await _result(f) for f in fleets])
    finally:
        for stop in unsubscribe:
            stop()
    return DemoResult(seconds=seconds, seed=seed, fleets=results, samples=tuple(samples))


# -- the summary ------------------------------------------------------------------------------


def _fill(text: str) -> str:
    return textwrap.fill(text, WIDTH)


def summary(result: DemoResult) -> str:
    """The tables and the sentences printed at the end."""
    main = result.fleets[0]
    workloads = main.workloads.values()

    def in_flight(peak: int, limit: int) -> str:
        return f"{peak}/{limit}" + ("" if peak <= limit else " over")

    rows = [("", "served", "in flight", "p50 wait", "p95 wait", "timed out", "refused")]
    for name, w in main.workloads.items():
        rows.append(
            (
                name,
                str(w.served),
                in_flight(w.peak, w.limit),
                fmt_seconds(quantile(w.waits, 0.5)),
                fmt_seconds(quantile(w.waits, 0.95)),
                str(w.timeouts + w.budget_outs),
                str(w.queue_full),
            )
        )
    rows.append(
        (
            "all",
            str(sum(w.served for w in workloads)),
            in_flight(main.peak_total, main.max_concurrent),
            "",
            "",
            str(sum(w.timeouts + w.budget_outs for w in workloads)),
            str(sum(w.queue_full for w in workloads)),
        )
    )
    cut_off = sum(w.cut_off for w in workloads)
    background = main.workloads["background"]
    if main.held:
        verdict = (
            f"Limits held: at most {main.peak_total} of {main.max_concurrent} requests were in "
            f"flight at the provider, and background at most {background.peak} of its "
            f"{background.limit}. When the demo ended, {cut_off} requests were cut off "
            f"(waiting or in flight), and every slot came back."
        )
    else:
        verdict = (
            f"LIMIT EXCEEDED: {main.peak_total} in flight for a limit of {main.max_concurrent}; "
            + ", ".join(f"{n} {w.peak}/{w.limit}" for n, w in main.workloads.items())
            + f"; left over: {main.leftover_active} active, {main.leftover_queued} queued."
        )
    lines = [
        "",
        _fill(
            f"Summary: {fmt_duration(result.seconds)}, {fmt_duration(result.seconds * SPEEDUP)} "
            f"of traffic (seed {result.seed}), limiter 'claude':"
        ),
        "",
        *columns(rows),
        "",
        _fill(
            "In flight: the most requests at the provider at once, of the limit. The waits "
            "count the requests that timed out; refused: the queue was full."
        ),
        "",
        _fill(verdict),
        "",
        bought(result),
    ]
    for fleet in result.fleets[1:]:
        if not fleet.held:
            lines.append(_fill(f"LIMIT EXCEEDED in the replay with {fleet.title}."))
    return "\n".join(lines)


def at_once(w: WorkloadResult) -> str:
    """The share of a workload's requests that got a slot without waiting."""
    asked = len(w.waits) + w.queue_full
    started = sum(1 for wait in w.waits if wait < 0.001)
    return f"{started / asked:.0%}" if asked else "-"


def bought(result: DemoResult) -> str:
    """What the reservation bought the interactive workload: a table of the replays."""
    main = result.fleets[0]
    replays = result.fleets[1:]
    rows = [("", "at once", "p95 wait", "timed out", "refused")]
    for fleet in result.fleets:
        w = fleet.workloads["interactive"]
        rows.append(
            (
                fleet.title,
                at_once(w),
                fmt_seconds(quantile(w.waits, 0.95)),
                str(w.timeouts + w.budget_outs),
                str(w.queue_full),
            )
        )
    reserved = main.workloads["interactive"].reserved
    if replays:
        heading = (
            f"What the reservation bought: the same load, replayed at the same time on "
            f"{main.max_concurrent} slots without it (background work may then take them "
            f"all), gave interactive requests:"
        )
    else:
        heading = (
            f"What the reservation bought: on the {reserved} slots background work cannot "
            f"take, interactive requests had:"
        )
    notes = "At once: the share of requests that got a slot without waiting."
    if any(f.workloads["interactive"].queue_full for f in result.fleets):
        notes += (
            " Interactive requests were refused because the limiter's max_queued counts every "
            "workload's waiters, and a reservation keeps slots, not places in the queue."
        )
    elif any(f.workloads["background"].queue_full for f in result.fleets):
        notes += (
            f" Background requests past its own max_queued of {BACKGROUND_MAX_QUEUED} were "
            f"refused, which kept {MAX_QUEUED - BACKGROUND_MAX_QUEUED} places of the queue "
            "for interactive ones."
        )
    return "\n".join([_fill(heading), "", *columns(rows), "", _fill(notes)])


# -- the picture ------------------------------------------------------------------------------


def plot_available() -> bool:
    """Whether matplotlib is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def figure(result: DemoResult) -> Any:
    """The picture: the example limiter's slots and queues, then every limiter's
    interactive waits, each in a panel of its own on one scale."""
    from matplotlib.figure import Figure  # type: ignore[import-not-found, unused-ignore]

    colors = {"interactive": "tab:orange", "background": "tab:blue"}
    main = result.fleets[0]
    samples = result.samples
    t = [s.t for s in samples]
    replays = len(result.fleets) - 1
    fig = Figure(figsize=(10, 9 + 1.6 * replays), layout="constrained")
    axes = fig.subplots(
        3 + len(result.fleets),
        1,
        sharex=True,
        height_ratios=[3, 2, 1.2] + [1.5] * len(result.fleets),
    )
    active, queued, interactive_queued, *waits = axes
    fig.suptitle(
        f"slotwise demo: one MemoryLimiter, {main.max_concurrent} slots, "
        f"{fmt_duration(result.seconds)}, seed {result.seed}"
    )
    batch = result.seconds * BATCH_AT
    for ax in axes:
        ax.axvline(batch, color="grey", linestyle=":", linewidth=1)

    stack = ("background", "interactive")  # background at the bottom, to show its ceiling
    active.stackplot(
        t,
        *[[s.active[w] for s in samples] for w in stack],
        labels=[f"{w} active" for w in stack],
        colors=[colors[w] for w in stack],
        step="post",
        alpha=0.85,
    )
    background = main.workloads["background"]
    active.axhline(
        main.max_concurrent, color="black", linestyle="--", linewidth=1, label="max_concurrent"
    )
    active.axhline(
        background.limit, color="navy", linestyle=":", linewidth=1.5, label="background ceiling"
    )
    active.set_ylim(0, main.max_concurrent + 1.5)
    active.set_ylabel("slots in use")
    active.set_title(
        f"slots in use, {main.title}; a batch of {BATCH_SIZE} jobs arrives at the dotted line",
        loc="left",
        fontsize="medium",
    )
    active.legend(loc="upper left", fontsize="small", ncols=4)

    # Each workload's queue on its own scale; a refusal is a tick above it.
    for ax, name, top in (
        (queued, "background", MAX_QUEUED),
        (interactive_queued, "interactive", max(2, *(s.queued["interactive"] for s in samples))),
    ):
        depth = [s.queued[name] for s in samples]
        ax.fill_between(t, depth, step="post", color=colors[name], alpha=0.3, linewidth=0)
        ax.step(t, depth, where="post", color=colors[name], label=f"{name} queued")
        refused = [p.at for p in main.points if p.workload == name and p.outcome == "refused"]
        ax.plot(
            refused,
            [top * 1.15] * len(refused),
            linestyle="none",
            marker="|",
            markersize=8,
            color="tab:red",
            label=f"refused, queue full ({len(refused)})",
        )
        ax.set_ylim(-0.06 * top, top * 1.35)  # zero stands clear of the axis
        ax.set_ylabel("waiting")
    queued.axhline(
        MAX_QUEUED, color="black", linestyle="--", linewidth=1, label="max_queued (all workloads)"
    )
    queued.axhline(
        BACKGROUND_MAX_QUEUED,
        color="black",
        linestyle=":",
        linewidth=1,
        label="background's max_queued",
    )
    queued.legend(loc="center left", fontsize="small")
    interactive_queued.legend(loc="center left", fontsize="small", ncols=2)
    queued.set_title("background: requests waiting for a slot", loc="left", fontsize="medium")
    interactive_queued.set_title(
        "interactive: requests waiting for a slot (its own scale)", loc="left", fontsize="medium"
    )
    interactive_queued.yaxis.get_major_locator().set_params(integer=True)

    # Interactive waits, one panel a limiter on one scale: waits as dots, time-outs as
    # crosses, refusals as ticks in a row above.
    interactive = [[p for p in f.points if p.workload == "interactive"] for f in result.fleets]
    longest = max([0.1] + [p.wait for mine in interactive for p in mine])
    lane = longest * 8
    ticks = [0.0, *(10.0**k for k in range(-2, 3) if 10.0**k <= longest / 2), longest]
    for ax, fleet, mine in zip(waits, result.fleets, interactive, strict=True):
        for outcome, marker, size, color in (
            ("granted", "o", 12, colors["interactive"]),
            ("timed out", "X", 40, "tab:red"),
            ("refused", "|", 60, "tab:red"),
        ):
            points = [p for p in mine if p.outcome == outcome]
            ax.scatter(
                [p.at for p in points],
                [lane if outcome == "refused" else p.wait for p in points],
                s=size,
                marker=marker,
                color=color,
                label=outcome,
            )
        w = fleet.workloads["interactive"]
        ax.set_title(
            f"interactive waits, {fleet.title}: {at_once(w)} at once, p95 wait "
            f"{fmt_seconds(quantile(w.waits, 0.95))}, {w.timeouts + w.budget_outs} timed out, "
            f"{w.queue_full} refused",
            loc="left",
            fontsize="medium",
        )
        ax.set_yscale("symlog", linthresh=0.01)
        ax.set_ylim(-0.004, lane * 2)
        ax.set_yticks([*ticks, lane], labels=["0", *map(fmt_seconds, ticks[1:]), "refused"])
        ax.set_ylabel("wait")
    waits[0].legend(loc="center left", fontsize="small", ncols=3)
    waits[-1].set_xlabel("demo time (s)")
    return fig


def plot(result: DemoResult, path: str) -> None:
    """Write the picture of `figure()` as a PNG."""
    figure(result).savefig(path, dpi=100)


# -- the command ------------------------------------------------------------------------------


def intro(seconds: float) -> str:
    """What the demo is about to show, printed before it starts."""
    settings = example_workloads()
    interactive, background = settings["interactive"], settings["background"]

    def simulated(wait: float | None) -> str:
        return fmt_duration((wait or 0.0) * SPEEDUP)

    return "\n".join(
        [
            _fill(
                f"slotwise demo: chats and background agents, whose tools start child runs, "
                f"share one MemoryLimiter of {MAX_CONCURRENT} slots and a queue of at most "
                f"{MAX_QUEUED} requests:"
            ),
            f"  interactive  reserved {interactive.reserved}, priority {interactive.priority}, "
            f"max_wait {simulated(interactive.max_wait)}",
            f"  background   max_concurrent {background.max_concurrent}, "
            f"max_wait {simulated(background.max_wait)}, max_queued {background.max_queued}",
            _fill(
                f"The provider is simulated (a lognormal time to first token, then streaming). "
                f"Time runs {SPEEDUP:g} times faster: these {fmt_duration(seconds)} are "
                f"{fmt_duration(seconds * SPEEDUP)} of traffic, and every wait is scaled alike "
                f"(a max_wait of {simulated(interactive.max_wait)} lasts "
                f"{fmt_seconds(interactive.max_wait)}). A batch of {BATCH_SIZE} background jobs "
                f"arrives at {fmt_duration(seconds * BATCH_AT)}."
            ),
            "",
            "",
        ]
    )


def main(
    *,
    seconds: float = 15.0,
    seed: int = 1,
    plot_path: str | None = None,
    compare: bool = True,
    backend: str = "asyncio",
    out: TextIO | None = None,
) -> int:
    """Run the demo and print its summary; returns the exit code (1 if a limit broke)."""
    out = sys.stdout if out is None else out
    if plot_path is not None and not plot_available():
        print(
            "--plot needs matplotlib, which is not installed:\n"
            "    pip install 'slotwise[plot]'    (or: pip install matplotlib)",
            file=sys.stderr,
        )
        return 2
    if plot_path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(plot_path))):
        print(f"--plot: the folder of {plot_path} does not exist", file=sys.stderr)
        return 2
    out.write(intro(seconds))
    out.flush()
    result = anyio.run(
        lambda: run_demo(seconds=seconds, seed=seed, compare=compare, out=out), backend=backend
    )
    out.write(summary(result) + "\n")
    if plot_path is not None:
        plot(result, plot_path)
        out.write(f"Timeline written to {plot_path}\n")
    out.flush()
    return 0 if result.held else 1
