"""The real openai and anthropic SDKs, through slotwise.httpx, against the fake provider.

openai is tested with an httpx2 client and with a legacy httpx client; anthropic takes only
httpx2 clients. Every test runs on asyncio and trio; on trio the SDKs' own unfinished async
generators are reported as ResourceWarnings, which these tests accept (see ``closes_early``).
"""

from __future__ import annotations

import gc
import pickle
from typing import Any

import anyio
import pytest

import slotwise.httpx
from slotwise import AcquireRequest, Lease, MemoryLimiter, Workload

from ._helpers import Holders, closes_early, wait_until
from .conftest import FakeProvider

pytestmark = [pytest.mark.anyio, closes_early]

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

KEY = "sk-test-secret-key-0123456789"


class Sdk:
    """One SDK client over one HTTP stack, with the two calls the tests make."""

    def __init__(
        self,
        name: str,
        stack: str,
        url: str,
        limiter: Any,
        *,
        http: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        """``http`` holds keywords for ``slotwise.httpx.client()``, ``options`` the SDK's."""
        self.name = name
        http_client = slotwise.httpx.client(limiter=limiter, stack=stack, **(http or {}))  # type: ignore[call-overload]
        self.error = openai.OpenAIError if name == "openai" else anthropic.AnthropicError
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


class FailingLimiter:
    """A custom limiter whose storage is down: every acquire fails."""

    name = "failing"

    def __init__(self) -> None:
        self.acquires = 0

    async def acquire(self, request: AcquireRequest) -> Lease:
        self.acquires += 1
        raise ConnectionRefusedError("the limiter's database is down")

    async def renew(self, lease: Lease) -> Lease | None:
        return lease

    async def release(self, lease: Lease) -> None:
        pass


@pytest.mark.parametrize("failure", ["timeout", "queue-full", "limiter-error"])
async def test_a_slot_error_fails_the_call_once_promptly_as_slotwises_own(
    provider: FakeProvider, sdk_stack: tuple[str, str], failure: str
) -> None:
    """Neither SDK wraps nor retries slotwise's errors: with the SDKs' default two retries,
    a slot timeout would otherwise wait three times, plus the backoff sleeps between."""
    limiter: Any
    if failure == "limiter-error":
        limiter = FailingLimiter()
    else:
        limiter = MemoryLimiter(
            name="provider",
            max_concurrent=1,
            max_queued=0 if failure == "queue-full" else None,
            workloads={"default": Workload(max_wait=0.1)},
        )
    holders = Holders(limiter)
    sdk = Sdk(*sdk_stack, provider.url, limiter, max_retries=2)
    held = None if failure == "limiter-error" else await slotwise.acquire(limiter=limiter)
    expected = {
        "timeout": slotwise.ConcurrencyTimeoutError,
        "queue-full": slotwise.ConcurrencyQueueFullError,
        "limiter-error": slotwise.ConcurrencyLimiterError,
    }[failure]
    started = anyio.current_time()
    with pytest.raises(expected) as caught:
        await sdk.call()
    elapsed = anyio.current_time() - started
    if held is not None:
        await held.release()
    error = caught.value
    # One attempt, one wait: a retry would add the SDK's backoff (at least 0.375 s) and a wait,
    # two retries about 1.5 s.
    kind = {"timeout": "timed-out", "queue-full": "queue-full"}.get(failure, "limiter-error")
    assert len(holders.kinds(kind)) == 1
    assert len(holders.kinds("wait-started")) == 1 + (held is not None)
    assert elapsed < 1.0
    assert provider.requests == 0
    # The SDK's own catch-all catches it too; slotwise's fields and cause are intact.
    assert isinstance(error, sdk.error)
    assert error.limiter == limiter.name
    if failure == "limiter-error":
        assert limiter.acquires == 1
        assert isinstance(error.__cause__, ConnectionRefusedError)
    # It pickles as slotwise's plain class (the other side may not have the SDK).
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is expected
    assert (str(copy), copy.workload) == (str(error), error.workload)
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


async def abandon_a_stream(sdk: Sdk) -> None:
    """Read one event of a long stream, then leave it unclosed: only the SDK's own reference
    cycles keep it (and its slot) alive when this returns."""
    stream = await sdk.call(stream=True, headers={"x-fake-chunks": "1000", "x-fake-delay": "0.01"})
    async for _ in stream:
        break


async def test_an_abandoned_stream_gives_its_slot_back_within_the_idle_bound(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    """Without any garbage collection. openai's stream forms reference cycles, which only the
    cyclic collector frees (and an idle loop rarely triggers it): the idle bound gives its slot
    back. anthropic's closes itself when its generator is dropped, at once on asyncio; on trio,
    whose finalizer keeps a dropped generator alive until a collection, the bound does."""
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="provider", max_concurrent=1, workloads={"default": Workload(max_wait=5.0)}
    )
    holders = Holders(limiter)
    sdk = Sdk(*sdk_stack, provider.url, limiter, http={"idle_timeout": 0.5})
    gc.disable()
    try:
        await abandon_a_stream(sdk)
        started = anyio.current_time()
        assert sdk.text(await sdk.call()) == "ok"
        waited = anyio.current_time() - started
    finally:
        gc.enable()
    assert (await limiter.stats()).active == 0
    assert [e.outcome for e in holders.released()] == ["cancelled", "completed"]
    ended = [e.kind for e in holders.kinds("reclaimed", "released")]
    if sdk.name == "openai" or ended[0] == "reclaimed":
        assert ended == ["reclaimed", "released", "released"]
        assert 0.4 <= waited < 4.0  # the bound, not the collector: no sooner than 0.5 s idle
    else:
        assert ended == ["released", "released"]
        assert waited < 0.4
    # The abandoned body was closed: the server saw the client go.
    await wait_until(lambda: provider.disconnects >= 1)
    await sdk.aclose()
    gc.collect()


async def test_a_slow_reader_keeps_its_stream_within_the_idle_bound(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=1)
    holders = Holders(limiter)
    sdk = Sdk(*sdk_stack, provider.url, limiter, http={"idle_timeout": 1.0})
    stream = await sdk.call(stream=True, headers={"x-fake-chunks": "2", "x-fake-delay": "0.01"})
    events = 0
    async with stream:
        async for _ in stream:
            events += 1
            await anyio.sleep(0.25)  # work between events, well within the bound
    assert events >= 2
    assert not holders.kinds("reclaimed")
    assert [e.outcome for e in holders.released()] == ["completed"]
    await sdk.aclose()


async def test_a_429_before_a_stream_is_a_failed_attempt(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    """The SDK closes the 429 unread before it retries; the attempt failed all the same, as
    the same 429 on a plain call does."""
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=1)
    holders = Holders(limiter)
    sdk = Sdk(*sdk_stack, provider.url, limiter, max_retries=1)
    stream = await sdk.call(stream=True, headers={"x-fake-429": "1"})
    async with stream:
        async for _ in stream:
            pass
    assert provider.rate_limited == 1
    assert [e.outcome for e in holders.released()] == ["failed", "completed"]
    await sdk.aclose()


async def test_a_redirect_is_followed_one_slot_per_hop(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    """``client()`` follows redirects, as the SDKs' own clients do."""
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=1)
    holders = Holders(limiter)
    sdk = Sdk(*sdk_stack, f"{provider.url}/redirect", limiter)
    assert sdk.text(await sdk.call()) == "ok"
    assert provider.redirects == 1
    assert [e.kind for e in holders.kinds("acquired", "released")] == ["acquired", "released"] * 2
    assert [e.outcome for e in holders.released()] == ["completed", "completed"]
    await sdk.aclose()


async def test_a_call_waiting_for_a_pool_connection_holds_no_slot(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    """Four calls through a one-connection pool hold one slot, not four: another client
    sharing the limiter is served meanwhile instead of waiting with the server idle."""
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="provider",
        max_concurrent=4,
        workloads={"narrow": Workload(), "other": Workload(max_wait=0)},
        default_workload="narrow",
    )
    holders = Holders(limiter)
    module = pytest.importorskip(sdk_stack[1])
    narrow = Sdk(
        *sdk_stack, provider.url, limiter, http={"limits": module.Limits(max_connections=1)}
    )
    other = Sdk(*sdk_stack, provider.url, limiter, http={"workload": "other"})

    async def slow_call() -> None:
        await narrow.call(headers={"x-fake-delay": "0.3"})

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(slow_call)
        await wait_until(lambda: provider.active == 1)
        await anyio.sleep(0.1)  # the other three calls reach the pool
        assert (await limiter.stats()).active <= 1
        assert other.text(await other.call()) == "ok"  # max_wait=0: a free slot or an error
    assert provider.requests == 5
    assert holders.max_held <= 2
    await narrow.aclose()
    await other.aclose()
