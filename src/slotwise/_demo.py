"""``python -m slotwise demo``: a simulated fleet of agents shares one MemoryLimiter.

Everything is offline. Interactive chats and background jobs run agents; an agent's tools
may start child agents (child runs of ``slotwise.run``). Every provider request holds one
slot, and a simulated provider answers with a lognormal time to first token plus a
lognormal streaming time. Time runs :data:`SPEEDUP` times faster than real time, so the
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
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO, TypeAlias

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

__all__ = ("SPEEDUP", "DemoResult", "main", "run_demo")

SPEEDUP = 40.0
"""Simulated seconds per second of the demo."""

MAX_CONCURRENT = 8
MAX_QUEUED = 200
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
        "background": Workload(max_concurrent=6, max_wait=_scaled(300.0)),
    }


# -- the trace: what the fleet will do, drawn once and replayed against every limiter ------


@attrs.frozen
class Call:
    """One provider request, streaming included (demo seconds)."""

    ttft: float
    stream: float


@attrs.frozen
class Tool:
    """A tool call: ``duration`` of work, or a child agent that runs ``child``."""

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
    """Draw the sessions of a demo of ``seconds`` from ``seed``."""
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
        Variant(key="example", title="the example workloads", workloads=example),
        Variant(
            key="priority-only",
            title="no reservation, priority kept",
            workloads={
                "interactive": Workload(priority=10, max_wait=interactive.max_wait),
                "background": Workload(max_wait=background.max_wait),
            },
        ),
        Variant(
            key="one-queue",
            title="no reservation, one first-come queue",
            workloads={
                "interactive": Workload(max_wait=interactive.max_wait),
                "background": Workload(max_wait=background.max_wait),
            },
        ),
    )


def _by_workload() -> dict[str, int]:
    return dict.fromkeys(WORKLOADS, 0)


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
    # (when, workload, wait, timed out) for the picture
    wait_points: list[tuple[float, str, float, bool]] = attrs.field(factory=list)

    def on_event(self, event: ConcurrencyEvent) -> None:
        workload = event.workload or ""
        if workload not in self.peak:
            return
        if isinstance(event, AcquiredEvent):
            self.waits[workload].append(event.wait_time)
            self.wait_points.append(
                (anyio.current_time() - self.started, workload, event.wait_time, False)
            )
        elif isinstance(event, TimedOutEvent):
            self.timeouts[workload] += 1
            self.waits[workload].append(event.wait_time)
            self.wait_points.append(
                (anyio.current_time() - self.started, workload, event.wait_time, True)
            )
        elif isinstance(event, QueueFullEvent):
            self.queue_full[workload] += 1
        elif isinstance(event, WaitCancelledEvent) or (
            isinstance(event, ReleasedEvent) and event.outcome == "cancelled"
        ):
            self.cut_off[workload] += 1

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
    """The nearest-rank ``q`` quantile, or None for no values."""
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
    wait_points: tuple[tuple[float, str, float, bool], ...]

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
        wait_points=tuple(fleet.wait_points),
    )


# -- the live view ----------------------------------------------------------------------------


def fmt_seconds(value: float | None) -> str:
    """``12 ms`` or ``1.25 s``; ``-`` for nothing measured."""
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1.0 else f"{value:.2f} s"


class LiveView:
    """The example limiter's workloads, redrawn in place on a terminal, else printed as lines."""

    def __init__(self, out: TextIO, fleets: Sequence[Fleet], seconds: float) -> None:
        self.out = out
        self.fleets = fleets
        self.seconds = seconds
        self.tty = out.isatty()
        self.drawn = 0

    async def draw(self, elapsed: float) -> None:
        main = self.fleets[0]
        stats = await main.limiter.stats()
        clock = f"t={elapsed:5.1f}/{self.seconds:g} s"
        if not self.tty:
            parts = []
            for name in WORKLOADS:
                w = stats.workloads[name]
                part = (
                    f"{name} {w.active}/{w.max_concurrent} active, {w.queued} queued, "
                    f"p95 wait {fmt_seconds(quantile(main.waits[name], 0.95))}"
                )
                lost = main.timeouts[name] + main.budget_outs[name]
                part += f", {lost} timed out" if lost else ""
                full = main.queue_full[name]
                part += f", {full} refused" if full else ""
                parts.append(part)
            self.out.write(f"[{clock}] " + " | ".join(parts) + "\n")
            self.out.flush()
            return
        lines = [
            f"{clock}  limiter {main.limiter.name!r}: {stats.active}/{stats.max_concurrent} "
            f"active, {stats.queued}/{MAX_QUEUED} queued"
        ]
        for name in WORKLOADS:
            w = stats.workloads[name]
            waits = main.waits[name]
            ceiling = w.max_concurrent or stats.max_concurrent or 0
            bar = "#" * w.active + "." * (ceiling - w.active)
            lines.append(
                f"  {name:<11} {w.active}/{ceiling} [{bar:<8}] queued {w.queued:>3}  "
                f"wait p50 {fmt_seconds(quantile(waits, 0.5)):>7} "
                f"p95 {fmt_seconds(quantile(waits, 0.95)):>7}  "
                f"timeouts {main.timeouts[name] + main.budget_outs[name]:>3}  "
                f"queue full {main.queue_full[name]:>3}"
            )
        for fleet in self.fleets[1:]:
            waits = fleet.waits["interactive"]
            lost = fleet.timeouts["interactive"] + fleet.budget_outs["interactive"]
            lines.append(
                f"  same load, {fleet.variant.title}: interactive p95 wait "
                f"{fmt_seconds(quantile(waits, 0.95))}, {lost} timed out, "
                f"{fleet.queue_full['interactive']} refused"
            )
        # A wrapped line would break the redraw: cut lines to the terminal's width.
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
        out: Where the live view goes; default: ``sys.stdout``.
        configs: The configurations to play (default: :func:`variants`); the limits
            checked are theirs.
        make_limiter: Builds each configuration's limiter (default: a ``MemoryLimiter``
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


def summary(result: DemoResult) -> str:
    """The table and the sentences printed at the end."""
    main = result.fleets[0]
    rows = [
        (
            "workload",
            "served",
            "max in flight",
            "reserved",
            "p50 wait",
            "p95 wait",
            "timeouts",
            "queue full",
            "cut off",
        ),
    ]
    for name, w in main.workloads.items():
        rows.append(
            (
                name,
                str(w.served),
                f"{w.peak}/{w.limit} {'ok' if w.held else 'EXCEEDED'}",
                str(w.reserved),
                fmt_seconds(quantile(w.waits, 0.5)),
                fmt_seconds(quantile(w.waits, 0.95)),
                str(w.timeouts + w.budget_outs),
                str(w.queue_full),
                str(w.cut_off),
            )
        )
    held_total = main.peak_total <= main.max_concurrent
    rows.append(
        (
            "all",
            str(sum(w.served for w in main.workloads.values())),
            f"{main.peak_total}/{main.max_concurrent} {'ok' if held_total else 'EXCEEDED'}",
            str(sum(w.reserved for w in main.workloads.values())),
            "",
            "",
            str(sum(w.timeouts + w.budget_outs for w in main.workloads.values())),
            str(sum(w.queue_full for w in main.workloads.values())),
            str(sum(w.cut_off for w in main.workloads.values())),
        )
    )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = [
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines = [
        "",
        f"Summary ({result.seconds:g} s, seed {result.seed}, limiter 'claude'):",
        *table,
        "(waits count the requests that timed out; cut off: waiting or in flight when the "
        "fleet was cancelled at the end)",
        "",
    ]
    background = main.workloads["background"]
    if main.held:
        lines.append(
            f"Limits held: at most {main.peak_total} of {main.max_concurrent} requests were in "
            f"flight at the provider, and background at most {background.peak} of its "
            f"{background.limit}; every slot came back when the fleet was cancelled."
        )
    else:
        lines.append(
            f"LIMIT EXCEEDED: {main.peak_total} in flight for a limit of {main.max_concurrent}; "
            + ", ".join(f"{n} {w.peak}/{w.limit}" for n, w in main.workloads.items())
            + f"; left over: {main.leftover_active} active, {main.leftover_queued} queued."
        )
    lines.append(bought(result))
    for fleet in result.fleets[1:]:
        if not fleet.held:
            lines.append(f"LIMIT EXCEEDED in the replay with {fleet.title}.")
    return "\n".join(lines)


def at_once(w: WorkloadResult) -> str:
    """The share of a workload's requests that got a slot without waiting."""
    asked = len(w.waits) + w.queue_full
    started = sum(1 for wait in w.waits if wait < 0.001)
    return f"{started / asked:.0%}" if asked else "-"


def bought(result: DemoResult) -> str:
    """The sentences that say what the reservation bought the interactive workload."""
    main = result.fleets[0]
    interactive = main.workloads["interactive"]

    def said(w: WorkloadResult) -> str:
        return (
            f"{at_once(w)} started at once, p95 wait {fmt_seconds(quantile(w.waits, 0.95))}, "
            f"{w.timeouts + w.budget_outs} timed out, {w.queue_full} refused"
        )

    background = quantile(main.workloads["background"].waits, 0.95)
    text = (
        f"What the reservation bought: on the {interactive.reserved} slots background work "
        f"cannot take, interactive requests had {said(interactive)} (background p95 wait "
        f"{fmt_seconds(background)})."
    )
    replays = result.fleets[1:]
    if replays:
        others = "; ".join(f"{f.title}: {said(f.workloads['interactive'])}" for f in replays)
        text += (
            f" The same load, replayed at the same time on {main.max_concurrent} slots "
            f"without the reservation (background work may take them all), gave "
            f"interactive requests: {others}."
        )
    if any(f.workloads["interactive"].queue_full for f in result.fleets):
        text += (
            " Refused means the queue was full: max_queued counts every workload's waiters, "
            "and a reservation keeps slots, not places in the queue."
        )
    return text


# -- the picture ------------------------------------------------------------------------------


def plot_available() -> bool:
    """Whether matplotlib is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def plot(result: DemoResult, path: str) -> None:
    """Write the example limiter's timeline, and the interactive waits of every replay, as a PNG."""
    from matplotlib.figure import Figure  # type: ignore[import-not-found, unused-ignore]

    colors = {"interactive": "tab:orange", "background": "tab:blue"}
    main = result.fleets[0]
    samples = result.samples
    t = [s.t for s in samples]
    stack = ("background", "interactive")  # background at the bottom, to show its ceiling
    fig = Figure(figsize=(10, 8.5), layout="constrained")
    active, queued, waits = fig.subplots(3, 1, sharex=True)
    fig.suptitle(
        f"slotwise demo: one MemoryLimiter, {main.max_concurrent} slots, "
        f"{result.seconds:g} s, seed {result.seed}"
    )
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
    active.set_title("example workloads: interactive reserved 2, priority 10; background ceiling 6")
    active.legend(loc="upper left", fontsize="small", ncols=4)
    for w in WORKLOADS:
        queued.step(
            t, [s.queued[w] for s in samples], where="post", color=colors[w], label=f"{w} queued"
        )
    queued.axhline(MAX_QUEUED, color="black", linestyle="--", linewidth=1, label="max_queued")
    queued.set_ylim(0, MAX_QUEUED * 1.25)
    queued.set_ylabel("waiting requests")
    queued.legend(loc="upper left", fontsize="small", ncols=3)
    looks = {"example": ("o", "black"), "priority-only": ("s", "tab:purple")}
    for fleet in result.fleets:
        marker, color = looks.get(fleet.key, ("^", "tab:red"))
        figures = fleet.workloads["interactive"]
        lost = figures.timeouts + figures.budget_outs
        for timed_out in (False, True):
            points = [
                (at, wait)
                for at, w, wait, out in fleet.wait_points
                if w == "interactive" and out is timed_out
            ]
            if timed_out and not points:
                continue
            waits.scatter(
                [p[0] for p in points],
                [p[1] for p in points],
                s=40 if timed_out else 12,
                marker="X" if timed_out else marker,
                color=color,
                label=(
                    f"{fleet.title}: timed out"
                    if timed_out
                    else f"{fleet.title} ({lost} timed out, {figures.queue_full} refused)"
                ),
            )
    waits.set_yscale("symlog", linthresh=0.01)
    waits.set_ylim(0, 1000)  # room for the legend above the points
    waits.set_ylabel("wait (s)")
    waits.set_title("interactive waits, same load on each limiter")
    waits.set_xlabel("demo time (s)")
    waits.legend(loc="upper left", fontsize="small")
    fig.savefig(path, dpi=100)


# -- the command ------------------------------------------------------------------------------


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
            "--plot needs matplotlib, which is not installed: "
            "pip install 'slotwise[plot]' (or pip install matplotlib)",
            file=sys.stderr,
        )
        return 2
    if plot_path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(plot_path))):
        print(f"--plot: the folder of {plot_path} does not exist", file=sys.stderr)
        return 2
    settings = example_workloads()
    out.write(
        f"slotwise demo: chats and background agents (tools start child runs) share one "
        f"MemoryLimiter: {MAX_CONCURRENT} slots, max_queued {MAX_QUEUED}.\n"
        f"  interactive: reserved 2, priority 10, max_wait {fmt_seconds(settings['interactive'].max_wait)}\n"
        f"  background:  max_concurrent 6, max_wait {fmt_seconds(settings['background'].max_wait)}\n"
        f"The provider is simulated (lognormal time to first token plus streaming) and time "
        f"runs {SPEEDUP:g}x faster: {seconds:g} s here are {seconds * SPEEDUP / 60:g} minutes "
        f"of traffic, and the example's waits (60 s, 300 s) are scaled alike. A batch of "
        f"{BATCH_SIZE} background jobs arrives at {seconds * BATCH_AT:g} s.\n\n"
    )
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
