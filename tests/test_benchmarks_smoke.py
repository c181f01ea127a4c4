"""The benchmark command runs at a tiny size and prints every row, so it cannot rot.

Only the shape of the output is checked: which sections, peers and sizes appear, and that
every target gets a verdict. No timing is asserted (the figures of a tiny run mean nothing).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def output() -> str:
    result = subprocess.run(
        [sys.executable, "-W", "error", "-m", "benchmarks", "--tiny", "--backend", "all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def rows(output: str, section: str) -> list[list[str]]:
    """The table rows of one section, split on runs of two or more spaces."""
    block = output.split(f"## {section}:", 1)[1].split("\n## ", 1)[0]
    lines = block.strip().splitlines()[1:]  # past the title
    table = [line for line in lines if line.strip()]
    assert set(table[1]) <= {"-", " "}, table[:2]  # header, then the rule
    return [re.split(r"\s{2,}", line.strip()) for line in table[2:]]


def measured(output: str, section: str) -> set[tuple[str, str, str]]:
    return {(row[0], row[1], row[2]) for row in rows(output, section)}


def test_header_names_the_machine_and_the_command(output: str) -> None:
    assert output.startswith("slotwise benchmarks: Python ")
    assert "CPUs, load average" in output.splitlines()[0]
    assert "command: python -m benchmarks --tiny --backend all" in output


def test_uncontended_rows(output: str) -> None:
    expected = {
        ("asyncio", peer, "50")
        for peer in ("slotwise.MemoryLimiter", "anyio.CapacityLimiter", "asyncio.Semaphore")
    } | {
        ("trio", peer, "50")
        for peer in (
            "slotwise.MemoryLimiter",
            "anyio.CapacityLimiter",
            "trio.CapacityLimiter",
            "trio.Semaphore",
        )
    }
    assert measured(output, "uncontended") == expected


@pytest.mark.parametrize("section", ["hand-off", "cancellation"])
def test_queue_rows_at_every_size(output: str, section: str) -> None:
    sizes = {"hand-off": ("10", "20", "40", "80"), "cancellation": ("40", "100")}[section]
    expected = {
        (backend, peer, n)
        for n in sizes
        for backend, peers in (
            ("asyncio", ("slotwise.MemoryLimiter", "anyio.CapacityLimiter", "asyncio.Semaphore")),
            ("trio", ("slotwise.MemoryLimiter", "anyio.CapacityLimiter", "trio.Semaphore")),
        )
        for peer in peers
    }
    assert measured(output, section) == expected


def test_memory_rows(output: str) -> None:
    expected = {
        (backend, peer, "50")
        for backend, peers in (
            ("asyncio", ("anyio.CapacityLimiter", "asyncio.Semaphore")),
            ("trio", ("anyio.CapacityLimiter", "trio.Semaphore")),
        )
        for peer in ("task parked on an Event", "slotwise.MemoryLimiter", *peers)
    }
    assert measured(output, "memory") == expected
    for row in rows(output, "memory"):
        assert row[4] == "bytes/waiter"
        assert float(row[3].replace(",", "")) > 0


def test_allocation_rows(output: str) -> None:
    expected = {
        (backend, f"{path}, {label}", "100")
        for backend, path in (
            ("-", "core"),
            ("asyncio", "MemoryLimiter"),
            ("trio", "MemoryLimiter"),
        )
        for label in ("4 workloads", "1 workload")
    }
    assert measured(output, "allocation") == expected


def test_every_row_has_a_figure_and_a_ratio(output: str) -> None:
    for section in ("uncontended", "hand-off", "cancellation", "memory", "allocation"):
        for row in rows(output, section):
            figure, ratio = row[3], row[5]
            assert float(figure.replace(",", "")) != 0, row
            assert re.fullmatch(r"[0-9.,]+x", ratio), row


def test_every_target_gets_a_verdict(output: str) -> None:
    verdicts = output.split("## targets", 1)[1].strip().splitlines()[1:]
    verdicts = [line for line in verdicts if line.startswith(("MET", "MISSED"))]
    targets = [re.sub(r"^(MET|MISSED)\s+", "", line).split(":")[0] for line in verdicts]
    for backend in ("asyncio", "trio"):
        assert f"uncontended cycle <= 1.0x anyio.CapacityLimiter's time [{backend}]" in targets
        assert (
            f"hand-off >= 1.0x anyio.CapacityLimiter's grants/s at every N [{backend}]" in targets
        )
        assert f"hand-off cost per grant within 2x from 10 to 80 waiters [{backend}]" in targets
        assert (
            f"memory per waiter <= 800 bytes over a task parked on an Event [{backend}]" in targets
        )
        assert (
            f"cancellation <= 1.0x anyio.CapacityLimiter's cost per cancel at every N "
            f"[{backend}]" in targets
        )
    assert len(targets) == 10
