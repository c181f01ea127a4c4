"""`python -m slotwise demo tools`: two agents' tool calls share one ToolBox's pools.

Everything is offline: the tools sleep instead of calling anything. A chat agent and a batch
agent each send a few batches of tool calls (what a model's responses would ask for) to one
ToolBox, built once and shared. The view shows each pool filling up to its ceiling, the
calls waiting for it, and the global limit holding across pools; the payments pool fails
fast, so a refund asked for while another runs is refused at once, as a result the model can
read. The summary lists every call's result, and the most calls that ran at once, counted
inside the tools.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
from collections import Counter
from typing import Any, TextIO

import anyio
import attrs

import slotwise

from ._config import Workload
from ._demo import WIDTH, bar, columns
from ._events import ConcurrencyEvent
from .memory import MemoryLimiter
from .tools import (
    ToolBox,
    ToolCall,
    ToolFinishedEvent,
    ToolRejectedEvent,
    ToolResult,
    ToolStartedEvent,
)

__all__ = ("DemoResult", "main", "run_demo")

MAX_CONCURRENT = 4
POOLS: dict[str, Workload] = {
    "search": Workload(max_concurrent=1, max_wait=30.0),  # a search API: one at a time
    "customers": Workload(max_concurrent=2, max_wait=30.0),  # the CRM: two connections
    # One slot kept for payments, which never wait: a second one at once is refused.
    "payments": Workload(max_concurrent=1, reserved=1, max_wait=0),
    "default": Workload(max_wait=30.0),
}


def ceilings() -> dict[str, int]:
    """The most calls each pool can run at once: its own ceiling, else what the global limit
    leaves once the other pools' reserved slots are kept."""
    return {
        pool: w.max_concurrent
        or MAX_CONCURRENT - sum(o.reserved for name, o in POOLS.items() if name != pool)
        for pool, w in POOLS.items()
    }


# The agents' turns: (seconds after the agent's previous turn ended, the calls of one model
# response as (tool, arguments)). Times are seconds at speed 1.
TURNS: dict[str, list[tuple[float, list[tuple[str, dict[str, Any]]]]]] = {
    "chat": [
        (
            0.0,
            [
                ("search_docs", {"query": "refund policy"}),
                ("search_docs", {"query": "late delivery"}),
                ("search_docs", {"query": "store credit"}),
                ("lookup_customer", {"customer_id": "c-17"}),
                ("summarise", {"topic": "the customer's orders"}),
            ],
        ),
        (0.3, [("refund", {"order_id": "o-1138"}), ("lookup_customer", {"customer_id": "c-17"})]),
    ],
    "batch": [
        (
            0.4,
            [
                ("lookup_customer", {"customer_id": "c-21"}),
                ("lookup_customer", {"customer_id": "c-22"}),
                ("lookup_customer", {"customer_id": "c-23"}),
                ("refund", {"order_id": "o-2001"}),
                ("refund", {"order_id": "o-2002"}),
                ("summarise", {"topic": "overdue accounts"}),
                ("summarise", {"topic": "disputes"}),
            ],
        ),
        (
            0.1,
            [
                ("charge_card", {"customer_id": "c-21", "cents": 1200}),
                ("charge_card", {"customer_id": "c-22", "cents": 800}),
                ("export_report", {"month": "May"}),
                ("summarise", {"topic": "charges"}),
            ],
        ),
    ],
}


@attrs.define
class Board:
    """What the view shows: per pool, calls waiting, running, done and refused; the most that
    ran at once, counted inside the tools; the latest lines of the log."""

    waiting: Counter[str] = attrs.field(factory=Counter)
    running: Counter[str] = attrs.field(factory=Counter)
    inside: Counter[str] = attrs.field(factory=Counter)  # handlers running, as they count
    done: Counter[str] = attrs.field(factory=Counter)
    refused: Counter[str] = attrs.field(factory=Counter)
    peak: Counter[str] = attrs.field(factory=Counter)
    peak_total: int = 0
    log: list[str] = attrs.field(factory=list)


@attrs.frozen
class DemoResult:
    """What the demo did: each agent's calls and results, and the board at the end."""

    calls: dict[str, list[list[ToolCall]]]
    results: dict[str, list[list[ToolResult]]]
    board: Board
    pools: dict[str, int]  # each pool's ceiling
    pool_of: dict[str, str]  # each tool's pool

    @property
    def held(self) -> bool:
        """Whether no pool, and not all of them together, ever ran more than allowed."""
        return self.board.peak_total <= MAX_CONCURRENT and all(
            self.board.peak[pool] <= ceiling for pool, ceiling in self.pools.items()
        )


def make_toolbox(board: Board, speed: float) -> ToolBox[str]:
    """The shared ToolBox: its tools count themselves on the board while they run."""
    box = ToolBox(
        limiter=MemoryLimiter(name="tools", max_concurrent=MAX_CONCURRENT, workloads=POOLS),
        result_budget=2_000,
        max_calls_per_run=20,
    )

    def register(name: str, pool: str, seconds: float, **options: Any) -> None:
        async def handler(**arguments: Any) -> str:
            board.inside[pool] += 1
            board.peak[pool] = max(board.peak[pool], board.inside[pool])
            board.peak_total = max(board.peak_total, sum(board.inside.values()))
            try:
                await anyio.sleep(seconds / speed)
            finally:
                board.inside[pool] -= 1
            return f"{name} done: " + ", ".join(f"{k}={v}" for k, v in arguments.items())

        box.tool(name=name, pool=pool, **options)(handler)

    register("search_docs", "search", 0.8, timeout=5.0)
    register("lookup_customer", "customers", 0.6)
    register("refund", "payments", 1.2, writes=True)
    register("charge_card", "payments", 0.8, sequential=True, writes=True)
    register("summarise", "default", 0.5)
    register("export_report", "default", 9.0, timeout=1.0)  # always too slow: timed out
    return box


class View:
    """The pools, redrawn in place on a terminal; elsewhere, the log as it grows."""

    def __init__(self, out: TextIO, board: Board, started: float) -> None:
        self.out = out
        self.board = board
        self.started = started
        self.tty = out.isatty()
        self.drawn = 0
        self.printed = 0

    def draw(self) -> None:
        board = self.board
        if not self.tty:
            for line in board.log[self.printed :]:
                self.out.write(line + "\n")
            self.printed = len(board.log)
            self.out.flush()
            return
        elapsed = anyio.current_time() - self.started
        rows = [(f"t={elapsed:.1f} s", f"{'running':<8}", "waiting", "done", "refused")]
        for pool, ceiling in ceilings().items():
            running = board.running[pool]
            rows.append(
                (
                    f"  {pool}",
                    f"{running}/{ceiling} {bar(running, ceiling, MAX_CONCURRENT)}",
                    str(board.waiting[pool]),
                    str(board.done[pool]),
                    str(board.refused[pool]),
                )
            )
        total = sum(board.running.values())
        rows.append(
            (
                "  all pools",
                f"{total}/{MAX_CONCURRENT} {bar(total, MAX_CONCURRENT, MAX_CONCURRENT)}",
                "",
                "",
                "",
            )
        )
        lines = [*columns(rows, (11, 8, 7, 4, 7)), ""]
        lines += (board.log[-8:] + [""] * 8)[:8]
        width = shutil.get_terminal_size().columns - 1  # a narrower terminal: no wrapping
        if self.drawn:
            self.out.write(f"\x1b[{self.drawn}F")
        self.out.write("".join(f"\x1b[2K{line[:width]}\n" for line in lines))
        self.drawn = len(lines)
        self.out.flush()


async def run_demo(*, out: TextIO, speed: float = 1.0) -> DemoResult:
    """Run both agents against one shared ToolBox; draw the pools while they run."""
    board = Board()
    box = make_toolbox(board, speed)
    started = anyio.current_time()
    view = View(out, board, started)
    agents: dict[str, str] = {}  # run id -> agent

    def on_event(event: ConcurrencyEvent) -> None:
        if isinstance(event, ToolStartedEvent):
            board.waiting[event.workload or ""] -= 1
            board.running[event.workload or ""] += 1
            text = f"started, after waiting {event.wait_time * speed:.1f} s"
        elif isinstance(event, ToolFinishedEvent):
            board.running[event.workload or ""] -= 1
            board.done[event.workload or ""] += 1
            text = event.outcome
        elif isinstance(event, ToolRejectedEvent):
            board.waiting[event.workload or ""] -= 1
            board.refused[event.workload or ""] += 1
            text = f"REFUSED: {event.reason}"
        else:
            return
        at = (anyio.current_time() - started) * speed
        agent = agents.get(event.run_id or "", "?")
        board.log.append(f"{at:5.1f} s  {agent:<5} {event.tool:<15} {event.workload:<9} {text}")

    calls: dict[str, list[list[ToolCall]]] = {agent: [] for agent in TURNS}
    results: dict[str, list[list[ToolResult]]] = {agent: [] for agent in TURNS}

    async def agent(name: str) -> None:
        async with slotwise.run(run_id=f"{name}-agent") as run:
            agents[run.run_id] = name
            for turn, (pause, asked) in enumerate(TURNS[name], start=1):
                await anyio.sleep(pause / speed)
                batch = [
                    ToolCall(id=f"{name[0]}{turn}.{n}", name=tool, arguments=arguments)
                    for n, (tool, arguments) in enumerate(asked, start=1)
                ]
                for call in batch:
                    board.waiting[box.tools[call.name].pool] += 1
                calls[name].append(batch)
                results[name].append(await box.run(batch))

    async def redraw() -> None:
        while True:
            view.draw()
            await anyio.sleep(0.05)

    unsubscribe = box.limiter.subscribe(on_event)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(redraw)
            async with anyio.create_task_group() as fleet:
                for name in TURNS:
                    fleet.start_soon(agent, name)
            tg.cancel_scope.cancel()
        view.draw()
    finally:
        unsubscribe()
    pool_of = {name: tool.pool for name, tool in box.tools.items()}
    return DemoResult(calls=calls, results=results, board=board, pools=ceilings(), pool_of=pool_of)


def summary(result: DemoResult, speed: float = 1.0) -> str:
    """Every call's result, then whether the limits held."""
    lines = ["", "Results (what goes back to the model, call by call):", ""]
    lines.append(f"  {'call':<5} {'tool':<15} {'pool':<9} {'result':<17} {'waited':>6} {'ran':>6}")
    for agent in TURNS:
        for batch, batch_results in zip(result.calls[agent], result.results[agent], strict=True):
            for call, res in zip(batch, batch_results, strict=True):
                outcome: str = res.error or "done"
                if res.effect == "unknown":
                    outcome += " (effect?)"
                started = res.error is None or res.duration > 0
                ran = f"{res.duration * speed:.1f} s" if started else "-"
                lines.append(
                    f"  {call.id:<5} {call.name:<15} {result.pool_of[call.name]:<9} {outcome:<17} "
                    f"{res.wait_time * speed:>4.1f} s {ran:>6}"
                )
    board = result.board
    peaks = ", ".join(
        f"{pool} {board.peak[pool]}/{ceiling}" for pool, ceiling in result.pools.items()
    )
    lines += [
        "",
        f"Most calls running at once (counted inside the tools): {board.peak_total}/"
        f"{MAX_CONCURRENT} in all;",
        f"  {peaks}.",
        "Limits held." if result.held else "A LIMIT WAS EXCEEDED.",
        "",
        "A refused call never ran and is not retried; the model reads why.",
        "A call whose pool was full waited, holding no slot of the global limit.",
    ]
    return "\n".join(lines)


def main(*, backend: str = "asyncio", out: TextIO | None = None, speed: float = 1.0) -> int:
    """Run the demo and print its summary; returns the exit code (1 if a limit broke)."""
    out = sys.stdout if out is None else out
    pools = ", ".join(f"{pool} {ceiling}" for pool, ceiling in ceilings().items())
    paragraphs = (
        "slotwise demo tools: a chat agent and a batch agent send their tool calls to one "
        f"shared ToolBox, under a global limit of {MAX_CONCURRENT} calls at once and pools "
        f"(the workloads of its limiter) that run at most: {pools}.",
        "One slot is kept for payments, which never wait (max_wait=0): a payment asked for "
        "while another runs is refused at once. Each call holds one slot, admitted for its "
        "pool and the global limit together.",
    )
    out.write("\n".join(textwrap.fill(text, WIDTH) for text in paragraphs) + "\n\n")
    out.flush()
    result = anyio.run(lambda: run_demo(out=out, speed=speed), backend=backend)
    out.write(summary(result, speed) + "\n")
    out.flush()
    return 0 if result.held else 1
