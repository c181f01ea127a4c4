"""The framework how-tos run as written, against the fake provider, and hold their limits there.

Each page's ``python`` blocks form one program, extracted and executed as the other how-to
pages are (``test_docs``). The tests point the SDKs at the fake provider through their
environment variables, slow its answers down (``x-fake-delay``, set on the page's HTTP client)
so that requests overlap, await the page's ``main()``, and check what the server counted: never
more requests in flight than the limiter's ``max_concurrent``, and that many reached, so the
limiter is what held the others back.

asyncio only: the async APIs of Pydantic AI, LangChain and the Agents SDK call asyncio
directly (`asyncio.gather`, the running loop), which trio refuses.

The pages are not type-checked here: a cold mypy run over these frameworks takes minutes.
They pass `mypy --strict` (LangChain's with the `pydantic.mypy` plugin, as its models need).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import anyio
import pytest

import slotwise
from slotwise import MemoryLimiter, Workload

from ._helpers import Holders, closes_early
from .conftest import FakeProvider
from .test_docs import program

pytestmark = [
    pytest.mark.anyio,
    closes_early,
    # A provider retiring the pages' model is news for the pages, not a fault of slotwise:
    # Pydantic AI warns on each request to a model its provider has deprecated.
    pytest.mark.filterwarnings("ignore::pydantic_ai.exceptions.DeprecatedModelWarning"),
]

DELAY = "0.2"  # seconds per answer: long enough for four requests to overlap on a busy machine
LIMIT = 4  # every limiter on the pages


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def openai_env(provider: FakeProvider, monkeypatch: pytest.MonkeyPatch) -> FakeProvider:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("OPENAI_BASE_URL", f"{provider.url}/v1")
    return provider


def workloads(holders: Holders) -> Counter[str | None]:
    return Counter(e.workload for e in holders.kinds("acquired"))


async def test_pydantic_ai_how_to(
    openai_env: FakeProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    module = program("how-to/pydantic-ai.md")
    module.http_client.headers["x-fake-delay"] = DELAY
    holders = Holders(module.llm)
    await module.main()
    assert capsys.readouterr().out.splitlines() == ["ok", "12 answers", "t0t1t2"]
    assert openai_env.requests == 14
    assert openai_env.max_active == LIMIT
    assert holders.max_held == LIMIT
    # The client names no limiter: each request took the run's limiter and workload.
    assert workloads(holders) == {"interactive": 2, "batch": 12}
    assert (await module.llm.stats()).active == 0
    holders.unsubscribe()


async def test_pydantic_ai_raises_slotwise_errors(openai_env: FakeProvider) -> None:
    module = program("how-to/pydantic-ai.md")
    module.http_client.headers["x-fake-delay"] = DELAY
    tight = MemoryLimiter(name="tight", max_concurrent=1, workloads={"now": Workload(max_wait=0)})
    outcomes: list[str] = []

    async def ask() -> None:
        async with slotwise.run(limiter=tight):
            try:
                await module.agent.run("Hello?")
                outcomes.append("answered")
            except slotwise.ConcurrencyTimeoutError:
                outcomes.append("no slot")

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask)
        tg.start_soon(ask)
    await module.http_client.aclose()
    assert sorted(outcomes) == ["answered", "no slot"]
    assert openai_env.requests == 1


async def test_langchain_how_to(
    openai_env: FakeProvider,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for variable in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", openai_env.url)
    module = program("how-to/langchain.md")
    module.http_client.headers["x-fake-delay"] = DELAY
    module.claude.default_headers = {"x-fake-delay": DELAY}
    gpt = Holders(module.openai_limit)
    claude = Holders(module.anthropic_limit)
    await module.main()
    assert capsys.readouterr().out.splitlines() == [
        "ok",
        "t0t1t2",
        "12 answers from GPT, 12 from Claude",
    ]
    assert openai_env.requests == 26
    # The two fan-outs run one after the other: the server saw each provider's limit reached.
    assert openai_env.max_active == LIMIT
    assert gpt.max_held == LIMIT
    assert claude.max_held == LIMIT
    assert workloads(gpt) == {"batch": 13, "interactive": 1}
    assert len(claude.released()) == 12
    for limiter in (module.openai_limit, module.anthropic_limit):
        assert (await limiter.stats()).active == 0
    # ChatAnthropic keeps one HTTP client per base URL for the whole process and never closes
    # it: close this one in its own event loop, or its sockets are reported at exit.
    from langchain_anthropic import _client_utils

    await module.claude._async_client.close()
    _client_utils._get_default_async_httpx_client.cache_clear()
    gpt.unsubscribe()
    claude.unsubscribe()


@pytest.fixture
def agents_sdk() -> Iterator[None]:
    """The Agents SDK, its traces never uploaded, on the API the fake provider serves.

    The page keeps the SDK's default, the Responses API; the fake provider serves Chat
    Completions, which goes through the same default client.
    """
    import agents

    agents.set_tracing_disabled(True)
    agents.set_default_openai_api("chat_completions")
    yield
    agents.set_default_openai_api("responses")


async def test_openai_agents_how_to(
    openai_env: FakeProvider, agents_sdk: None, capsys: pytest.CaptureFixture[str]
) -> None:
    module = program("how-to/openai-agents.md")
    module.http_client.headers["x-fake-delay"] = DELAY
    holders = Holders(module.llm)
    await module.main()
    assert capsys.readouterr().out.splitlines() == ["ok", "t0t1t2", "12 answers"]
    assert openai_env.requests == 14
    assert openai_env.max_active == LIMIT
    assert holders.max_held == LIMIT
    assert workloads(holders) == {"interactive": 2, "background": 12}
    assert (await module.llm.stats()).active == 0
    holders.unsubscribe()
