"""``python -m slotwise``: ``demo`` simulates a limiter under load; ``status`` shows the
PostgresLimiters stored in a database."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _interval(text: str) -> float:
    value = _positive(text)
    if value < 0.1:
        raise argparse.ArgumentTypeError(f"must be at least 0.1 seconds, got {text}")
    return value


def _status_command(commands: Any) -> None:
    status = commands.add_parser(
        "status",
        help="show the PostgresLimiters stored in a database: limits, slots, queues, processes",
        description=(
            "A read-only view of PostgresLimiters, read from their tables: the stored limits, "
            "active and queued requests per workload, the oldest waiter, the leases that "
            "expire first, and each process's share. Needs slotwise[status]."
        ),
    )
    status.add_argument(
        "--dsn",
        required=True,
        help="a libpq conninfo or URI (postgresql://user@host/db); PG* variables apply",
    )
    status.add_argument("--name", help="one limiter (default: every limiter in the schema)")
    status.add_argument(
        "--schema", default="slotwise", help="the limiters' schema (default slotwise)"
    )
    status.add_argument(
        "--watch",
        nargs="?",
        type=_interval,
        const=2.0,
        metavar="SECONDS",
        help="refresh in place every SECONDS (default 2) until Ctrl-C",
    )
    status.add_argument(
        "--json",
        action="store_true",
        help="print a JSON document instead (one per line with --watch)",
    )


def _status(args: argparse.Namespace) -> int:
    try:
        from .postgres._status import main as status_main
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("psycopg"):
            raise
        print(
            f"slotwise status: needs {exc.name}: pip install 'slotwise[status]'",
            file=sys.stderr,
        )
        return 1
    try:
        return status_main(
            dsn=args.dsn,
            name=args.name,
            schema=args.schema,
            watch=args.watch,
            as_json=args.json,
            out=sys.stdout,
            err=sys.stderr,
        )
    except BrokenPipeError:  # the reader has read enough (`| head -1`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m slotwise")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    demo = commands.add_parser(
        "demo",
        help="simulate a fleet of agents sharing one limiter (offline, about 15 s)",
        description=(
            "Interactive chats and background jobs, whose tools start child agents, send "
            "requests to a simulated provider through one MemoryLimiter with the example "
            "workloads. Shows a live view, then a summary; exits with 1 if a limit was exceeded."
        ),
    )
    demo.add_argument(
        "what",
        nargs="?",
        choices=("fleet", "tools"),
        default="fleet",
        help="fleet (default): agents sharing one limiter; tools: a ToolBox's pools filling, "
        "with a fail-fast refusal (about 5 s)",
    )
    demo.add_argument(
        "--seconds", type=_positive, default=15.0, help="how long the fleet runs (default 15)"
    )
    demo.add_argument("--seed", type=int, default=1, help="seeds the simulated load (default 1)")
    demo.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG of the slots, queues and waits over time (needs slotwise[plot])",
    )
    demo.add_argument(
        "--no-compare",
        dest="compare",
        action="store_false",
        help="skip replaying the load against limiters without the reservation",
    )
    demo.add_argument(
        "--backend",
        choices=("asyncio", "trio"),
        default="asyncio",
        help="the event loop (trio must be installed)",
    )
    _status_command(commands)
    args = parser.parse_args(argv)
    if args.command == "status":
        return _status(args)
    if args.what == "tools":
        from ._demo_tools import main as tools_main

        return tools_main(backend=args.backend)

    from ._demo import main as demo_main

    return demo_main(
        seconds=args.seconds,
        seed=args.seed,
        plot_path=args.plot,
        compare=args.compare,
        backend=args.backend,
    )


if __name__ == "__main__":
    sys.exit(main())
