"""The sync parts of the how-to pages on the SDKs and httpx run as written, against the fake
provider, in threads with no event loop (the async parts are run by ``test_docs``)."""

from __future__ import annotations

import threading

import anyio
import pytest

from .conftest import FakeProvider
from .test_docs import program


def test_openai_how_to_in_sync_code(
    provider: FakeProvider, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("OPENAI_BASE_URL", f"{provider.url}/v1")
    module = program("how-to/openai.md")
    module.sync_main()
    assert capsys.readouterr().out.splitlines() == ["ok", "t0 t1 t2"]
    assert provider.requests == 2
    assert anyio.run(module.llm.stats).active == 0


def test_anthropic_how_to_in_sync_code(
    provider: FakeProvider, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", provider.url)
    module = program("how-to/anthropic.md")
    module.sync_main()
    assert capsys.readouterr().out.splitlines() == ["ok", "t0t1t2"]
    assert provider.requests == 2
    assert anyio.run(module.claude.stats).active == 0


def test_httpx_how_to_in_sync_code(provider: FakeProvider) -> None:
    module = program("how-to/httpx.md")
    seen: list[str] = []
    module.provider.subscribe(lambda event: seen.append(threading.current_thread().name))
    url = f"{provider.url}/raw"
    with module.sync:
        assert module.statuses([url] * 12) == [200] * 12
    for client in (module.sync_wrapped, module.sync_custom):
        with client:
            assert client.post(f"{provider.url}/raw", json={}).json() == {"ok": True}
    assert provider.requests == 14
    assert provider.max_active <= 4
    assert len(set(seen)) > 2  # served from the pool's threads
    assert anyio.run(module.provider.stats).active == 0
