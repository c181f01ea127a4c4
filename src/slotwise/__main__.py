"""``python -m slotwise demo``: a short offline simulation of one limiter under load."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


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
    args = parser.parse_args(argv)
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
