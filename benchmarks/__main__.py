"""``python -m benchmarks``: slotwise beside its peers, in one run, with ratios and targets.

Options:
    --tiny             a few iterations of everything: proves the benchmarks run, measures
                       nothing worth reading.
    --only NAME        run one section (repeatable): uncontended, hand-off, cancellation,
                       memory, allocation, tools, sync.
    --backend NAME     asyncio, trio or all. By default the uncontended cycle runs on both
                       and the other sections on asyncio, whose asyncio.Semaphore they compare
                       with; ``all`` runs every section on both.

Two benchmarks run on their own: ``python -m benchmarks.rates`` (429s, capacity used and
latency against a fake provider with RPM, TPM and concurrency limits; minutes, not seconds)
and ``python benchmarks/postgres_load.py`` (PostgresLimiter under load).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence

import attrs

from . import allocation, cancellation, handoff, memory, sync, tools, uncontended
from ._harness import ANYIO, FULL, SLOTWISE, TINY, Row, Size, cpu_model, format_table
from .memory import BARE

MEMORY_OVER_PARKED = 800  # bytes a waiting request may add to a task that waits anyway

SECTIONS: dict[str, Callable[[Size, list[str]], list[Row]]] = {
    "uncontended": uncontended.run,
    "hand-off": handoff.run,
    "cancellation": cancellation.run,
    "memory": memory.run,
    "allocation": allocation.run,
    "tools": tools.run,
    "sync": sync.run,
}
TITLES = {
    "uncontended": "Uncontended slot cycle: `async with` enter+exit, limit 8, never full "
    "(lower is better)",
    "hand-off": f"Contended hand-off: N waiters behind a full limit of {handoff.LIMIT} "
    "(higher grants/s is better)",
    "cancellation": "Cancelling half of N queued waiters in random order (lower is better)",
    "memory": "Memory per waiting request, tracemalloc (lower is better)",
    "allocation": "Allocation throughput, 4 workloads with reservations and priorities, "
    f"limit {allocation.LIMIT} (higher is better)",
    "tools": f"One batch of {tools.CALLS:,} tool calls that return at once, over {tools.POOLS} "
    f"pools, cost per call (lower is better; goal: within {tools.GOAL:g}x)",
    "sync": "Threads: `with limiter.sync_slot()` uncontended, limit 8 (lower us/cycle is better), "
    f"and the hand-off between N threads behind a full limit of {sync.LIMIT} (higher grants/s "
    f"is better), against {sync.SEMAPHORE} doing the same",
}


def with_ratios(rows: list[Row]) -> list[Row]:
    """Set each row's ratio: the group's reference figure (slotwise's, or the group's first
    row) divided by the row's."""
    references: dict[str, Row] = {}
    for row in rows:
        if row.group not in references or row.peer == SLOTWISE:
            references[row.group] = row
    return [
        attrs.evolve(row, ratio=references[row.group].value / row.value if row.value else None)
        for row in rows
    ]


@attrs.frozen(kw_only=True)
class Verdict:
    target: str
    measured: str
    met: bool


def _find(rows: list[Row], section: str, backend: str, peer: str, n: int | None = None) -> Row:
    for row in rows:
        if (row.section, row.backend, row.peer) == (section, backend, peer) and n in (None, row.n):
            return row
    raise LookupError((section, backend, peer, n))


def verdicts(rows: list[Row]) -> list[Verdict]:
    """Check the targets against the figures of this run."""
    out: list[Verdict] = []
    backends = sorted({row.backend for row in rows if row.section != "allocation"})
    for backend in backends:
        by = [row for row in rows if row.backend == backend]
        if any(row.section == "uncontended" for row in by):
            ratio = (
                _find(by, "uncontended", backend, SLOTWISE).value
                / _find(by, "uncontended", backend, ANYIO).value
            )
            out.append(
                Verdict(
                    target=f"uncontended cycle <= 1.0x anyio.CapacityLimiter's time [{backend}]",
                    measured=f"{ratio:.2f}x",
                    met=ratio <= 1.0,
                )
            )
        sizes = sorted({row.n for row in by if row.section == "hand-off"})
        if sizes:
            ratios = [
                _find(by, "hand-off", backend, SLOTWISE, n).value
                / _find(by, "hand-off", backend, ANYIO, n).value
                for n in sizes
            ]
            out.append(
                Verdict(
                    target=f"hand-off >= 1.0x anyio.CapacityLimiter's grants/s at every N "
                    f"[{backend}]",
                    measured=", ".join(
                        f"{r:.2f}x at {n:,}" for r, n in zip(ratios, sizes, strict=True)
                    ),
                    met=min(ratios) >= 1.0,
                )
            )
            costs = [1.0 / _find(by, "hand-off", backend, SLOTWISE, n).value for n in sizes]
            spread = max(costs) / min(costs)
            out.append(
                Verdict(
                    target=f"hand-off cost per grant within 2x from {sizes[0]:,} to "
                    f"{sizes[-1]:,} waiters [{backend}]",
                    measured=f"max/min {spread:.2f}x",
                    met=spread <= 2.0,
                )
            )
        anyio_cancels = [row for row in by if row.section == "cancellation" and row.peer == ANYIO]
        if anyio_cancels:
            ratios = [
                _find(by, "cancellation", backend, SLOTWISE, row.n).value / row.value
                for row in anyio_cancels
            ]
            out.append(
                Verdict(
                    target=f"cancellation <= 1.0x anyio.CapacityLimiter's cost per cancel "
                    f"at every N [{backend}]",
                    measured=", ".join(
                        f"{r:.2f}x at {row.n:,}"
                        for r, row in zip(ratios, anyio_cancels, strict=True)
                    ),
                    met=max(ratios) <= 1.0,
                )
            )
        if any(row.section == "memory" for row in by):
            mine = _find(by, "memory", backend, SLOTWISE).value
            bare = _find(by, "memory", backend, BARE).value
            out.append(
                Verdict(
                    target=f"memory per waiter <= {MEMORY_OVER_PARKED} bytes over a task "
                    f"parked on an Event [{backend}]",
                    measured=f"{mine - bare:,.0f} bytes ({mine:,.0f} in all)",
                    met=mine - bare <= MEMORY_OVER_PARKED,
                )
            )
    return out


def _backends(section: str, choice: str | None) -> list[str]:
    if choice == "all":
        return ["asyncio", "trio"]
    if choice is not None:
        return [choice]
    return ["asyncio", "trio"] if section == "uncontended" else ["asyncio"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmarks and print their tables, then the targets."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Measure slotwise beside its peers, in one run, with ratios and targets.",
        epilog="On their own: python -m benchmarks.rates (429s and capacity used against a "
        "fake provider with RPM, TPM and concurrency limits, about 7 minutes), "
        "python -m benchmarks.floor (the least a limiter with slotwise's duties costs, beside "
        "anyio, about 1 minute) and python benchmarks/postgres_load.py (PostgresLimiter under "
        "load).",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument(
        "--only",
        action="append",
        choices=list(SECTIONS),
        metavar="NAME",
        help=f"run only this section (repeatable): {', '.join(SECTIONS)}",
    )
    parser.add_argument(
        "--backend",
        choices=["asyncio", "trio", "all"],
        default=None,
        help="event loop(s); default: uncontended on both, the rest on asyncio",
    )
    args = parser.parse_args(argv)
    size = TINY if args.tiny else FULL
    chosen = args.only or list(SECTIONS)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"slotwise benchmarks: Python {platform.python_version()} on {cpu_model()}, "
        f"{os.cpu_count()} CPUs, load average {load:.2f}"
    )
    print(
        f"command: python -m benchmarks {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()
        + f"  (best of {size.repeats}+ repetitions; process CPU time; garbage collector off "
        "while timing)"
    )
    started = time.perf_counter()
    rows: list[Row] = []
    for name in [name for name in SECTIONS if name in chosen]:
        section_rows = with_ratios(SECTIONS[name](size, _backends(name, args.backend)))
        rows += section_rows
        print(f"\n## {name}: {TITLES[name]}\n")
        print(format_table(section_rows))
        sys.stdout.flush()
    print("\n## targets (ratios measured in this run)\n")
    for verdict in verdicts(rows):
        print(f"{'MET   ' if verdict.met else 'MISSED'}  {verdict.target}: {verdict.measured}")
    print(f"\ntotal time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
