"""The how-to on rates and pushback runs as written and prints what it says it prints.

The page's ``python`` blocks form one program on trio's virtual clock (its last line runs it):
it is executed as a module and its output must equal the page's ``console`` block. It is also
type-checked with ``mypy --strict``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

PAGE = Path(__file__).parent.parent / "docs" / "how-to" / "rates.md"
FENCE = re.compile(r"^```(?P<lang>\w+)[^\n]*\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(lang: str) -> list[str]:
    text = PAGE.read_text(encoding="utf-8")
    return [m["body"] for m in FENCE.finditer(text) if m["lang"] == lang]


def test_the_program_prints_what_the_page_shows(capsys: pytest.CaptureFixture[str]) -> None:
    module = types.ModuleType("rates_how_to")
    exec(compile("\n\n".join(blocks("python")), str(PAGE), "exec"), module.__dict__)
    [console] = blocks("console")
    command, _, expected = console.partition("\n")
    assert command == "$ python rates.py"
    assert capsys.readouterr().out == expected


def test_the_program_passes_mypy_strict(tmp_path: Path) -> None:
    program = tmp_path / "rates.py"
    program.write_text("\n\n".join(blocks("python")), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(program)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
