"""hang_watch.py: a test that hangs ends the run, saying where it waits."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

HANGS = """
import asyncio


async def waits_for_ever(event: asyncio.Event) -> None:
    await event.wait()


def test_hangs() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_task(waits_for_ever(asyncio.Event()))

    asyncio.run(main())


def test_never_reached() -> None:
    pass
"""


def run(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_case.py").write_text(textwrap.dedent(source))
    env = {**os.environ, "SLOTWISE_HANG_AFTER": "1", "PYTHONPATH": str(Path(__file__).parent)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "hang_watch", "-p", "no:cacheprovider", "-q"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_test_that_hangs_ends_the_run_saying_where_it_waits(tmp_path: Path) -> None:
    result = run(tmp_path, HANGS)
    assert result.returncode == 1, result.stderr
    assert "test_case.py::test_hangs still runs after 1 s: it hangs" in result.stderr
    assert "in test_hangs" in result.stderr  # the thread's stack
    # The waiting task's chain: its coroutine, then the one it awaits (Event.wait).
    lines = result.stderr.splitlines()
    at = [
        i
        for i, line in enumerate(lines)
        if re.fullmatch(r"\s+\S+test_case\.py:\d+ waits_for_ever", line)
    ]
    assert len(at) == 1, result.stderr
    assert re.fullmatch(r"\s+\S+locks\.py:\d+ wait", lines[at[0] + 1]), result.stderr
    assert "test_never_reached" not in result.stdout


def test_tests_that_end_in_time_are_left_alone(tmp_path: Path) -> None:
    result = run(tmp_path, "def test_quick() -> None:\n    pass\n")
    assert result.returncode == 0, result.stderr
    assert "hangs" not in result.stderr
