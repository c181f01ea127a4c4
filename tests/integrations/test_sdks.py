"""The real openai and anthropic SDKs, through slotwise.httpx, against the fake provider.

openai is tested with an httpx2 client and with a legacy httpx client; anthropic takes only
httpx2 clients. Every test runs on asyncio and trio; on trio the SDKs' own unfinished async
generators are reported as ResourceWarnings, which these tests accept (see ``closes_early``).
"""

from __future__ import annotations

import gc
from typing import Any

import anyio
import pytest

import slotwise.httpx
from slotwise import MemoryLimiter

from ._helpers import Holders, closes_early, wait_until
from .conftest import FakeProvider

pytestmark = [pytest.mark.anyio, closes_early]

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

KEY = "sk-test-secret-key-0123456789"


class Sdk:
    """One SDK client over one HTTP stack, with the two calls the tests make."""

    def __init__(self, name: str, stack: str, url: str, limiter: Any, **options: Any) -> None:
        self.name = name
        http_client = slotwise.httpx.client(limiter=limiter, stack=stack)  # type: ignore[call-overload]
        if name == "openai":
            self.client = openai.AsyncOpenAI(
                api_key=KEY, base_url=f"{url}/v1", http_client=http_client, **options
            )
        else:
            self.client = anthropic.AsyncAnthropic(
                api_key=KEY, base_url=url, http_client=http_client, **options
            )

    async def call(self, *, stream: bool = False, headers: dict[str, str] | None = None) -> Any:
        messages = [{"role": "user", "content": "tell me a secret"}]
        if self.name == "openai":
            return await self.client.chat.completions.create(
                model="fake", messages=messages, stream=stream, extra_headers=headers
            )
        return await self.client.messages.create(
            model="fake", max_tokens=16, messages=messages, stream=stream, extra_headers=headers
        )

    @staticmethod
    def text(result: Any) -> str:
        if hasattr(result, "choices"):
            return str(result.choices[0].message.content)
        return str(result.content[0].text)

    async def aclose(self) -> None:
        await self.client.close()


SDKS = [("openai", "httpx2"), ("openai", "httpx"), ("anthropic", "httpx2")]


@pytest.fixture(params=SDKS, ids=["-".join(p) for p in SDKS])
def sdk_stack(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param  # type: ignore[no-any-return]


async def test_fifty_concurrent_calls_never_exceed_the_limit(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=4)
    holders = Holders(limiter)
    sdk = Sdk(*sdk_stack, provider.url, limiter)
    texts: list[str] = []

    async def one(i: int) -> None:
        headers = {"x-fake-delay": "0.01"}
        if i % 2:
            texts.append(sdk.text(await sdk.call(headers=headers)))
        else:
            async for _ in await sdk.call(stream=True, headers=headers):
                pass
            texts.append("streamed")

    async with anyio.create_task_group() as tg:
        for i in range(50):
            tg.start_soon(one, i)
    await sdk.aclose()
    assert len(texts) == 50
    assert provider.requests == 50
    assert 1 <= provider.max_active <= 4
    assert holders.max_held <= 4
    assert len(holders.kinds("acquired")) == len(holders.kinds("released")) == 50
    assert (await limiter.stats()).active == 0


async def test_a_stream_holds_its_slot_until_it_ends(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=1)
    holders = Holders(limiter)
    sdk = Sdk(*sdk_stack, provider.url, limiter)
    stream = await sdk.call(stream=True, headers={"x-fake-chunks": "5"})
    events = 0
    async for _ in stream:
        events += 1
        assert (await limiter.stats()).active == 1
        assert not holders.kinds("released")
    assert events >= 5
    assert (await limiter.stats()).active == 0
    assert [e.outcome for e in holders.released()] == ["completed"]
    await sdk.aclose()


async def test_a_stream_closed_from_another_task_gives_its_slot_back(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=1)
    holders = Holders(limiter)
    sdk = Sdk(*sdk_stack, provider.url, limiter)
    stream = await sdk.call(stream=True, headers={"x-fake-chunks": "1000", "x-fake-delay": "0.01"})
    first = await stream.__anext__()
    assert first is not None
    assert (await limiter.stats()).active == 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(stream.close)
    assert (await limiter.stats()).active == 0
    assert [e.outcome for e in holders.released()] == ["cancelled"]
    # The only slot is free again for the next call.
    assert sdk.text(await sdk.call()) == "ok"
    await sdk.aclose()
    gc.collect()


async def test_an_abandoned_stream_gets_its_slot_back_after_gc(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=1)
    holders = Holders(limiter)
    sdk = Sdk(*sdk_stack, provider.url, limiter)
    stream = await sdk.call(stream=True, headers={"x-fake-chunks": "1000", "x-fake-delay": "0.01"})
    await stream.__anext__()
    assert (await limiter.stats()).active == 1
    del stream
    gc.collect()
    await wait_until(lambda: bool(holders.released()))
    assert (await limiter.stats()).active == 0
    assert sdk.text(await sdk.call()) == "ok"
    await sdk.aclose()
    gc.collect()


async def test_each_retry_of_a_429_takes_a_new_slot(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=1)
    holders = Holders(limiter)
    sdk = Sdk(*sdk_stack, provider.url, limiter, max_retries=3)
    result = await sdk.call(headers={"x-fake-429": "2"})
    assert sdk.text(result) == "ok"
    assert provider.rate_limited == 2
    assert provider.requests == 3
    # One slot per attempt, each given back before the SDK sleeps and retries.
    kinds = [e.kind for e in holders.kinds("acquired", "released")]
    assert kinds == ["acquired", "released"] * 3
    assert [e.outcome for e in holders.released()] == ["failed", "failed", "completed"]
    assert len({e.lease_id for e in holders.released()}) == 3
    await sdk.aclose()


async def test_a_429_that_is_not_retried_still_gives_its_slot_back(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=1)
    sdk = Sdk(*sdk_stack, provider.url, limiter, max_retries=0)
    with pytest.raises(Exception, match="429"):
        await sdk.call(headers={"x-fake-429": "1"})
    assert (await limiter.stats()).active == 0
    await sdk.aclose()


async def test_slot_errors_reach_the_caller(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    """openai passes slotwise's errors through unchanged; anthropic wraps every error of its
    HTTP client in APIConnectionError, retries it, and keeps slotwise's as the cause."""
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=1, max_queued=0)
    holders = Holders(limiter)
    sdk = Sdk(*sdk_stack, provider.url, limiter, max_retries=1)
    held = await slotwise.acquire(limiter=limiter)
    with pytest.raises(
        (slotwise.ConcurrencyQueueFullError, anthropic.APIConnectionError)
    ) as caught:
        await sdk.call()
    await held.release()
    if sdk.name == "openai":
        assert isinstance(caught.value, slotwise.ConcurrencyQueueFullError)
        assert len(holders.kinds("queue-full")) == 1
    else:
        assert isinstance(caught.value, anthropic.APIConnectionError)
        assert isinstance(caught.value.__cause__, slotwise.ConcurrencyQueueFullError)
        assert len(holders.kinds("queue-full")) == 2
    assert provider.requests == 0
    await sdk.aclose()


def test_anthropic_refuses_a_legacy_httpx_client() -> None:
    """Why the anthropic how-to says stack="httpx2" (the default)."""
    legacy = slotwise.httpx.client(stack="httpx")
    with pytest.raises(TypeError, match="httpx2"):
        anthropic.AsyncAnthropic(api_key=KEY, http_client=legacy)


async def test_anthropic_stream_helper_holds_its_slot_inside_the_block(
    provider: FakeProvider,
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=1)
    holders = Holders(limiter)
    client = anthropic.AsyncAnthropic(
        api_key=KEY,
        base_url=provider.url,
        http_client=slotwise.httpx.wrap(anthropic.DefaultAsyncHttpxClient(), limiter=limiter),
    )
    texts = []
    async with client.messages.stream(
        model="fake",
        max_tokens=16,
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"x-fake-chunks": "3"},
    ) as stream:
        async for text in stream.text_stream:
            texts.append(text)
            assert (await limiter.stats()).active == 1
    assert texts == ["t0", "t1", "t2"]
    assert (await limiter.stats()).active == 0
    assert [e.outcome for e in holders.released()] == ["completed"]
    await client.close()


async def test_openai_with_the_sdks_default_client_wrapped(provider: FakeProvider) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=1)
    holders = Holders(limiter)
    client = openai.AsyncOpenAI(
        api_key=KEY,
        base_url=f"{provider.url}/v1",
        http_client=slotwise.httpx.wrap(openai.DefaultAsyncHttpxClient(), limiter=limiter),
    )
    result = await client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}]
    )
    assert result.choices[0].message.content == "ok"
    assert len(holders.released()) == 1
    await client.close()
