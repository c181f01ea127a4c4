"""How-to pages written as one program run as written and print what they say they print.

Each page's ``python`` blocks form one program (its last line runs it: the threads page
starts threads with their own event loops, the rates page runs on trio's virtual clock): it is
executed as a module and its output must equal the page's ``console`` block. It is also
type-checked with ``mypy --strict``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

HOW_TO = Path(__file__).parent.parent / "docs" / "how-to"
PAGES = ["threads", "rates"]
FENCE = re.compile(r"^```(?P<lang>\w+)[^\n]*\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(page: str, lang: str) -> list[str]:
    text = (HOW_TO / f"{page}.md").read_text(encoding="utf-8")
    return [m["body"] for m in FENCE.finditer(text) if m["lang"] == lang]


@pytest.mark.parametrize("page", PAGES)
def test_the_program_prints_what_the_page_shows(
    page: str, capsys: pytest.CaptureFixture[str]
) -> None:
    module = types.ModuleType(f"{page}_how_to")
    program = "\n\n".join(blocks(page, "python"))
    exec(compile(program, str(HOW_TO / f"{page}.md"), "exec"), module.__dict__)
    [console] = blocks(page, "console")
    command, _, expected = console.partition("\n")
    assert command == f"$ python {page}.py"
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("page", PAGES)
def test_the_program_passes_mypy_strict(page: str, tmp_path: Path) -> None:
    program = tmp_path / f"{page}.py"
    program.write_text("\n\n".join(blocks(page, "python")), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(program)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
