"""The how-to on nested agent runs runs as written and prints what it says it prints.

The page's ``python`` blocks form one program: they are joined in order, executed as a module,
and its ``main()`` is awaited on asyncio and on trio; the output must equal the page's
``console`` block. The program is also type-checked with ``mypy --strict``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

import pytest

pytestmark = pytest.mark.anyio

PAGE = Path(__file__).parent.parent / "docs" / "how-to" / "nested-runs.md"
FENCE = re.compile(r"^```(?P<lang>\w+)[^\n]*\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(lang: str) -> list[str]:
    text = PAGE.read_text(encoding="utf-8")
    return [m["body"] for m in FENCE.finditer(text) if m["lang"] == lang]


def program() -> str:
    return "\n\n".join(blocks("python"))


def expected_output() -> str:
    [console] = blocks("console")
    command, _, output = console.partition("\n")
    assert command == "$ python nested_agents.py"
    return output


def load(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("nested_agents")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # dataclasses look it up
    code = compile(program(), str(PAGE), "exec")
    exec(code, module.__dict__)
    return module


def test_the_page_has_the_program_and_its_output() -> None:
    assert len(blocks("python")) >= 6
    assert "anyio.run(main" in program()
    assert expected_output().strip()


async def test_the_program_prints_what_the_page_shows(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    main = cast(Callable[[], Awaitable[None]], load(monkeypatch).main)
    await main()
    assert capsys.readouterr().out == expected_output()


def test_the_program_type_checks(tmp_path: Path) -> None:
    mypy_api = pytest.importorskip("mypy.api", reason="mypy is part of the test extra")
    source = tmp_path / "nested_agents.py"
    source.write_text(program(), encoding="utf-8")
    out, err, status = mypy_api.run(
        [
            "--strict",
            "--python-version=3.11",
            "--config-file=",
            f"--cache-dir={tmp_path / 'cache'}",
            "--no-error-summary",
            str(source),
        ]
    )
    assert status == 0, out + err


def test_the_program_is_lint_clean(tmp_path: Path) -> None:
    pytest.importorskip("ruff", reason="ruff is part of the test extra")
    source = tmp_path / "nested_agents.py"
    source.write_text(program(), encoding="utf-8")
    config = str(PAGE.parent.parent.parent / "pyproject.toml")
    for command in (["check"], ["format", "--diff"]):
        result = subprocess.run(
            [sys.executable, "-m", "ruff", *command, "--config", config, str(source)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
