"""The how-to "Run a model's tool calls" runs as written: its ``python`` blocks form one program,
run against the fake provider (answering as a model that uses tools) on asyncio and trio, with
the real ``anthropic`` and ``openai`` clients and types. It prints what the page says it
prints, and it type-checks with ``mypy --strict``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from integrations.test_docs import program, source

from .conftest import FakeProvider

pytestmark = pytest.mark.anyio

PAGE = "how-to/tools.md"
CONSOLE = re.compile(r"^```console\n\$ python tool_calls.py\n(?P<out>.*?)^```$", re.M | re.S)


async def test_the_how_to_runs_and_prints_what_it_says(
    tool_model: FakeProvider,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", tool_model.url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("OPENAI_BASE_URL", f"{tool_model.url}/v1")
    module = program(PAGE)
    await module.main()
    page = (Path(__file__).parent.parent.parent / "docs" / PAGE).read_text(encoding="utf-8")
    match = CONSOLE.search(page)
    assert match is not None
    assert capsys.readouterr().out == match["out"]
    # Two requests per loop (tools asked, answer given); every slot given back.
    assert tool_model.requests == 6
    stats = await module.tools.limiter.stats()
    assert (stats.active, stats.queued) == (0, 0)


def test_the_how_to_type_checks(tmp_path: Path) -> None:
    path = tmp_path / "tool_calls.py"
    path.write_text(source(PAGE), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
