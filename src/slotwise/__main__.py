"""``python -m slotwise demo``: a short offline simulation of one limiter under load."""

from __future__ import annotations

import argparse
import sys

from ._demo import main as demo_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slotwise")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="simulate a fleet of agents sharing one limiter")
    demo.add_argument("--seconds", type=float, default=3.0, help="simulated load duration")
    args = parser.parse_args(argv)
    return demo_main(seconds=args.seconds)


if __name__ == "__main__":
    sys.exit(main())
