"""The tool-call benchmark runs at a tiny size and prints its rows (no timing is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_tools_section_prints_both_rows_on_both_backends() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            "-m",
            "benchmarks",
            "--tiny",
            "--only=tools",
            "--backend=all",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "## tools: One batch of 1,000 tool calls that return at once, over 8 pools" in (
        result.stdout
    )
    lines = [line for line in result.stdout.splitlines() if "us/call" in line]
    assert len(lines) == 6
    assert "slotwise.tools.ToolBox" in lines[0]
    assert "goal <= 3x:" in lines[0]
    assert "limiter.slot() per call" in lines[1]
    assert "asyncio.gather + asyncio.Semaphore" in lines[2]
    assert "slotwise.tools.ToolBox" in lines[3]
    assert "limiter.slot() per call" in lines[4]
    assert "trio nursery + trio.Semaphore" in lines[5]
