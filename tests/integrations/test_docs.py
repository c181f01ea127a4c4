"""The how-to pages on the SDKs and httpx run as written, against the fake provider.

Each page's ``python`` blocks form one program; it is executed as a module with the SDK's
environment variables pointing at the fake provider, and its ``main()`` is awaited on asyncio
and trio. What it prints is what the fake provider answers.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from ._helpers import closes_early
from .conftest import FakeProvider

pytestmark = [pytest.mark.anyio, closes_early]

DOCS = Path(__file__).parent.parent.parent / "docs"
FENCE = re.compile(r"^```python\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)


PAGES = ("how-to/openai.md", "how-to/anthropic.md", "how-to/httpx.md")


def source(page: str) -> str:
    text = (DOCS / page).read_text(encoding="utf-8")
    return "\n\n".join(m["body"] for m in FENCE.finditer(text))


def program(page: str) -> types.ModuleType:
    module = types.ModuleType(f"docs_{Path(page).stem}")
    exec(compile(source(page), page, "exec"), module.__dict__)
    return module


def assert_corrected(limiter: Any, provider: FakeProvider) -> None:
    """The page's metered call was charged its usage: the bucket is down by no more than
    that (it refills at the tier's pace meanwhile), though its estimate was larger."""
    cost, used = provider.charged[-1]
    assert used < cost
    bucket = limiter.stats_nowait().buckets["tokens"]
    assert bucket.capacity - used - 1 <= bucket.level <= bucket.capacity


async def test_openai_how_to(
    provider: FakeProvider, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("OPENAI_BASE_URL", f"{provider.url}/v1")
    module = program("how-to/openai.md")
    await module.main()
    assert capsys.readouterr().out.splitlines() == ["ok", "t0 t1 t2", "ok", "t0t1t2"]
    assert provider.requests == 4
    assert (await module.llm.stats()).active == 0
    assert_corrected(module.tier, provider)


async def test_anthropic_how_to(
    provider: FakeProvider, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", provider.url)
    module = program("how-to/anthropic.md")
    await module.main()
    assert capsys.readouterr().out.splitlines() == ["ok", "t0t1t2", "t0t1t2"]
    assert provider.requests == 3
    assert (await module.claude.stats()).active == 0
    assert_corrected(module.tier, provider)


async def test_httpx_how_to(provider: FakeProvider) -> None:
    module = program("how-to/httpx.md")
    for client in (module.client, module.wrapped, module.custom):
        async with client:
            response = await client.post(f"{provider.url}/raw", json={})
            assert response.json() == {"ok": True}
    assert provider.requests == 3
    assert (await module.provider.stats()).active == 0


def test_the_pages_type_check(tmp_path: Path) -> None:
    files = []
    for page in PAGES:
        path = tmp_path / f"docs_{Path(page).stem}.py"
        path.write_text(source(page), encoding="utf-8")
        files.append(str(path))
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", *files],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
