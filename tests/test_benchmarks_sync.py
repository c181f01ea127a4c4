"""The `sync` section of the benchmark command runs at a tiny size and prints its rows.

Only the shape of the output is checked (no timing): the uncontended cycle and the hand-off
at every size, for `sync_slot()` and `threading.Semaphore`, each with a figure and a ratio.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_sync_section_prints_every_row() -> None:
    result = subprocess.run(
        [sys.executable, "-W", "error", "-m", "benchmarks", "--tiny", "--only", "sync"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    block = result.stdout.split("## sync:", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in block.strip().splitlines()[1:] if line.strip()]
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[2:]]
    assert {(row[1], row[2], row[4]) for row in rows} == {
        (peer, n, unit)
        for peer in ("slotwise.MemoryLimiter", "threading.Semaphore")
        for n, unit in (("50", "us/cycle"), ("10", "grants/s"), ("20", "grants/s"))
    }
    for row in rows:
        assert row[0] == "threads"
        assert float(row[3].replace(",", "")) > 0
        assert re.fullmatch(r"[0-9.,]+x", row[5]), row
