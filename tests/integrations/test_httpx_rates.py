"""Rates and pushback through slotwise.httpx: token estimates charged at the grant and
corrected by the usage in the response (JSON and streams, OpenAI and Anthropic shapes), the
providers' rate-limit headers lowering the buckets, and 429, 529 and 503 pausing the limiter;
then the real SDKs against a fake provider that enforces its limits.

Every test runs on asyncio and trio, with both HTTP stacks where it uses plain clients.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import anyio
import pytest

import slotwise
import slotwise.httpx
from slotwise import AcquiredEvent, MemoryLimiter, PausedEvent, Rate, Workload

from ._helpers import Holders, closes_early
from .conftest import FakeProvider

pytestmark = [pytest.mark.anyio, closes_early]

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

STACKS = ["httpx2", "httpx"]
KEY = "sk-test-secret-key-0123456789"
# Buckets that refill so slowly that, within a test, their levels are what was charged.
SLOW = 1e9
TPM = 1_000_000


def estimate(body: bytes) -> int:
    """What slotwise charges at the grant: the output cap plus the body's size over 4."""
    request = json.loads(body)
    cap = request.get("max_tokens") or request.get("max_completion_tokens") or 0
    return int(cap) + math.ceil(len(body) / 4)


def level(limiter: MemoryLimiter[Any], bucket: str = "tokens") -> float:
    return limiter.stats_nowait().buckets[bucket].level


def token_limiter(**options: Any) -> MemoryLimiter[str]:
    return MemoryLimiter(
        name="provider", max_concurrent=4, rate=Rate(tokens=TPM, per=SLOW), **options
    )


# (path, request body): one request of each shape, plain and streamed.
SHAPES = {
    "openai": (
        "/v1/chat/completions",
        {"model": "m", "max_tokens": 40, "messages": [{"role": "user", "content": "hi " * 50}]},
    ),
    "openai-stream": (
        "/v1/chat/completions",
        {
            "model": "m",
            "max_completion_tokens": 40,
            "messages": [{"role": "user", "content": "hi " * 50}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "anthropic": (
        "/v1/messages",
        {"model": "m", "max_tokens": 40, "messages": [{"role": "user", "content": "hi " * 50}]},
    ),
    "anthropic-stream": (
        "/v1/messages",
        {
            "model": "m",
            "max_tokens": 40,
            "messages": [{"role": "user", "content": "hi " * 50}],
            "stream": True,
        },
    ),
}


@pytest.mark.parametrize("gzipped", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("stack", STACKS)
async def test_the_estimate_is_charged_at_the_grant_and_the_usage_corrects_it(
    provider: FakeProvider, stack: str, shape: str, gzipped: bool
) -> None:
    limiter = token_limiter()
    path, request = SHAPES[shape]
    headers = {"x-fake-delay": "0.01", "x-fake-chunks": "5"}
    if gzipped:
        headers["x-fake-gzip"] = "1"
    async with slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]
        async with c.stream("POST", path, json=request, headers=headers) as response:
            # In flight: the estimate is charged.
            assert level(limiter) == pytest.approx(TPM - estimate(provider.bodies[-1]), abs=1)
            text = (await response.aread()).decode()
        assert ("data:" in text) == request.get("stream", False)  # decoded as the client reads
    _, used = provider.charged[-1]
    assert used < estimate(provider.bodies[-1])
    # Read to the end: the usage replaced the estimate.
    assert level(limiter) == pytest.approx(TPM - used, abs=1)


@pytest.mark.parametrize("stack", STACKS)
async def test_a_stream_without_a_usage_keeps_its_estimate(
    provider: FakeProvider, stack: str
) -> None:
    """An OpenAI stream that did not ask for `include_usage` says nothing of its usage."""
    limiter = token_limiter()
    path, request = SHAPES["openai-stream"]
    request = {k: v for k, v in request.items() if k != "stream_options"}
    client = slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url)  # type: ignore[call-overload]
    async with client, client.stream("POST", path, json=request) as response:
        await response.aread()
    assert level(limiter) == pytest.approx(TPM - estimate(provider.bodies[-1]), abs=1)


@pytest.mark.parametrize("stack", STACKS)
async def test_an_anthropic_stream_closed_before_its_usage_keeps_its_estimate(
    provider: FakeProvider, stack: str
) -> None:
    """Its `message_start` tells the input and one output token: not the request's usage."""
    limiter = token_limiter()
    path, request = SHAPES["anthropic-stream"]
    headers = {"x-fake-delay": "0.05", "x-fake-chunks": "100"}
    client = slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url)  # type: ignore[call-overload]
    async with client, client.stream("POST", path, json=request, headers=headers) as response:
        async for line in response.aiter_lines():
            if "content_block_delta" in line:
                break
    assert level(limiter) == pytest.approx(TPM - estimate(provider.bodies[-1]), abs=1)


@pytest.mark.parametrize("stack", STACKS)
async def test_an_estimate_never_exceeds_the_smallest_token_bucket(
    provider: FakeProvider, stack: str
) -> None:
    """A request whose estimate a bucket could never hold waits for a full bucket (rather
    than failing as too large), and its usage corrects the charge."""
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="provider",
        max_concurrent=4,
        rate=Rate(tokens=TPM, per=SLOW),
        workloads={"small": Workload(rate=Rate(tokens=100, per=SLOW))},
    )
    path, request = SHAPES["openai"]
    request = {**request, "max_tokens": 5000}
    client = slotwise.httpx.client(  # type: ignore[call-overload]
        limiter=limiter, workload="small", stack=stack, base_url=provider.url
    )
    async with client, client.stream("POST", path, json=request) as response:
        # In flight: charged what the smaller bucket holds.
        assert level(limiter, "small.tokens") == pytest.approx(0, abs=1)
        assert level(limiter) == pytest.approx(TPM - 100, abs=1)
        await response.aread()
    _, used = provider.charged[-1]
    assert level(limiter) == pytest.approx(TPM - used, abs=1)


@pytest.mark.parametrize("stack", STACKS)
async def test_without_a_token_rate_nothing_is_estimated_nor_read(
    provider: FakeProvider, stack: str
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="provider", max_concurrent=4, rate=Rate(requests=100, per=SLOW)
    )
    path, request = SHAPES["openai"]
    async with slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]
        response = await c.post(path, json=request)
        assert response.json()["usage"]["total_tokens"] > 0
    assert set(limiter.stats_nowait().buckets) == {"requests"}
    assert level(limiter, "requests") == pytest.approx(99, abs=0.01)


@pytest.mark.parametrize("stack", STACKS)
async def test_the_runs_limiter_and_workload_decide_the_estimate(
    provider: FakeProvider, stack: str
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="provider",
        max_concurrent=4,
        workloads={"rated": Workload(rate=Rate(tokens=TPM, per=SLOW)), "other": Workload()},
        default_workload="other",
    )
    path, request = SHAPES["anthropic"]
    async with slotwise.httpx.client(stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]
        async with slotwise.run(limiter=limiter, workload="rated"):
            await c.post(path, json=request)
        _, used = provider.charged[-1]
        assert level(limiter, "rated.tokens") == pytest.approx(TPM - used, abs=1)
        async with slotwise.run(limiter=limiter):  # "other" counts no tokens
            await c.post(path, json=request)
        assert level(limiter, "rated.tokens") == pytest.approx(TPM - used, abs=1)


# -- what the provider's headers say ----------------------------------------------------------


@pytest.mark.parametrize("shape", ["openai", "anthropic"])
@pytest.mark.parametrize("stack", STACKS)
async def test_the_providers_remaining_counts_lower_the_buckets(
    provider: FakeProvider, stack: str, shape: str
) -> None:
    """Another client used most of the account: its remaining counts, in either provider's
    headers, bring slotwise's buckets down to them."""
    provider.limit(requests=100, tokens=10_000, per=SLOW)
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="provider", max_concurrent=4, rate=Rate(requests=100, tokens=10_000, per=SLOW)
    )
    path, request = SHAPES[shape]
    async with slotwise.httpx.client(stack=stack, base_url=provider.url) as other:  # type: ignore[call-overload]
        for _ in range(5):
            await other.post(path, json=request)
    async with slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]
        await c.post(path, json=request)
    assert provider.request_bucket is not None
    assert provider.token_bucket is not None
    assert level(limiter, "requests") == pytest.approx(100 - 6, abs=0.01)
    # The provider counted this request's estimate in what it said was left; its usage then
    # corrected both sides alike.
    provider_tokens = provider.token_bucket.level
    assert provider_tokens < 10_000 - 5 * 20
    assert level(limiter) == pytest.approx(provider_tokens, abs=1)


PUSHBACK = [
    # (status, headers, seconds the limiter pauses)
    (429, {"retry-after": "7"}, 7.0),
    (429, {"retry-after-ms": "2500"}, 2.5),
    (429, {"retry-after": "2", "retry-after-ms": "4000"}, 4.0),
    (
        429,
        {
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "6s",
            "x-ratelimit-remaining-tokens": "900000",
            "x-ratelimit-reset-tokens": "6m0s",
        },
        6.0,
    ),
    (
        429,
        {
            "x-ratelimit-remaining-requests": "10",
            "x-ratelimit-reset-requests": "20ms",
            "x-ratelimit-remaining-tokens": "3",
            "x-ratelimit-reset-tokens": "1m30s",
        },
        90.0,
    ),
    (529, {"retry-after": "11"}, 11.0),
    (503, {"retry-after": "3"}, 3.0),
]


def pushback_handler(module: Any, status: int, headers: dict[str, str], anthropic: bool) -> Any:
    def handle(request: Any) -> Any:
        if anthropic:
            headers.update(
                {
                    "anthropic-ratelimit-output-tokens-remaining": "0",
                    "anthropic-ratelimit-output-tokens-reset": time.strftime(
                        "%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 20)
                    ),
                }
            )
        return module.Response(status, json={"error": "slow down"}, headers=headers)

    return handle


@pytest.mark.parametrize(("status", "headers", "pause"), PUSHBACK)
@pytest.mark.parametrize("stack", STACKS)
async def test_pushback_pauses_the_limiter_as_long_as_the_headers_say(
    stack: str, status: int, headers: dict[str, str], pause: float
) -> None:
    module = pytest.importorskip(stack)
    limiter = token_limiter()
    holders = Holders(limiter)
    transport = module.MockTransport(pushback_handler(module, status, dict(headers), False))
    client = slotwise.httpx.wrap(module.AsyncClient(transport=transport), limiter=limiter)
    async with client:
        before = time.time()
        response = await client.post("http://p/v1/chat/completions", json=SHAPES["openai"][1])
        assert response.status_code == status
    [paused] = [e for e in holders.events if isinstance(e, PausedEvent)]
    assert paused.reason == str(status)
    assert before + pause - 0.01 <= paused.until <= time.time() + pause + 0.01
    stats = limiter.stats_nowait()
    assert stats.paused_until == pytest.approx(paused.until, abs=0.01)
    # Refused: its estimate was refunded (unless the provider says fewer tokens are left).
    remaining = int(headers.get("x-ratelimit-remaining-tokens", TPM))
    assert level(limiter) == pytest.approx(min(TPM, remaining), abs=1)


@pytest.mark.parametrize("stack", STACKS)
async def test_anthropics_reset_times_pause_the_limiter(stack: str) -> None:
    module = pytest.importorskip(stack)
    limiter = token_limiter()
    holders = Holders(limiter)
    transport = module.MockTransport(pushback_handler(module, 429, {"retry-after": "5"}, True))
    async with slotwise.httpx.wrap(module.AsyncClient(transport=transport), limiter=limiter) as c:
        await c.post("http://p/v1/messages", json=SHAPES["anthropic"][1])
    [paused] = [e for e in holders.events if isinstance(e, PausedEvent)]
    # Its output tokens are exhausted until 20 s from now (a whole second, in RFC 3339).
    assert 18.9 <= paused.until - time.time() <= 20.1
    assert level(limiter) == pytest.approx(0, abs=1)


@pytest.mark.parametrize("status", [200, 400, 500, 502])
@pytest.mark.parametrize("stack", STACKS)
async def test_other_statuses_pause_nothing(stack: str, status: int) -> None:
    module = pytest.importorskip(stack)
    limiter = token_limiter()
    transport = module.MockTransport(lambda request: module.Response(status, json={}))
    async with slotwise.httpx.wrap(module.AsyncClient(transport=transport), limiter=limiter) as c:
        await c.post("http://p/v1/chat/completions", json=SHAPES["openai"][1])
    assert limiter.stats_nowait().paused_until is None


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"retry-after": "soon"},
        {"retry-after": "-3", "retry-after-ms": "NaN"},
        {"x-ratelimit-reset-tokens": "6 minutes", "x-ratelimit-remaining-tokens": "lots"},
        {"anthropic-ratelimit-tokens-reset": "tomorrow"},
    ],
)
@pytest.mark.parametrize("stack", STACKS)
async def test_a_429_that_says_nothing_readable_backs_off(
    stack: str, headers: dict[str, str]
) -> None:
    """The first backoff is a second, jittered by a quarter either way."""
    module = pytest.importorskip(stack)
    limiter = token_limiter()
    transport = module.MockTransport(lambda request: module.Response(429, headers=headers))
    async with slotwise.httpx.wrap(module.AsyncClient(transport=transport), limiter=limiter) as c:
        before = time.time()
        response = await c.post("http://p/v1/chat/completions", json=SHAPES["openai"][1])
        assert response.status_code == 429
    paused = limiter.stats_nowait().paused_until
    assert paused is not None
    assert before + 0.74 <= paused <= time.time() + 1.26


class RaisingLimiter:
    """A custom limiter whose pushback and bookkeeping fail."""

    name = "raising"
    rate = Rate(tokens=1000)

    def __init__(self) -> None:
        self.inner: MemoryLimiter[str] = MemoryLimiter(name="raising", max_concurrent=2)
        self.calls: list[str] = []

    async def acquire(self, request: slotwise.AcquireRequest) -> Any:
        return await self.inner.acquire(request)

    async def renew(self, lease: Any) -> Any:
        return await self.inner.renew(lease)

    async def release(self, lease: Any) -> None:
        await self.inner.release(lease)

    def throttle(self, lease: Any, retry_after: float | None) -> Any:
        self.calls.append("throttle")
        raise RuntimeError("the limiter's storage is down")

    def observe_remaining(self, lease: Any, kind: str, remaining: int) -> None:
        self.calls.append("observe")
        raise RuntimeError("the limiter's storage is down")

    def charge_tokens(self, lease: Any, tokens: int) -> None:
        self.calls.append("charge")
        raise RuntimeError("the limiter's storage is down")


@pytest.mark.parametrize("status", [200, 429])
@pytest.mark.parametrize("stack", STACKS)
async def test_a_limiter_that_fails_to_hear_the_provider_never_breaks_the_response(
    provider: FakeProvider, stack: str, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    provider.limit(requests=100, tokens=100_000, per=SLOW)
    limiter = RaisingLimiter()
    path, request = SHAPES["openai-stream"]
    headers = {"x-fake-429": "1" if status == 429 else "0"}
    client = slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url)  # type: ignore[call-overload]
    async with client, client.stream("POST", path, json=request, headers=headers) as response:
        body = await response.aread()
    assert response.status_code == status
    if status == 200:
        assert body.decode().endswith("data: [DONE]\n\n")
        assert limiter.calls == ["observe", "observe", "charge"]  # requests, tokens; usage
    else:
        assert limiter.calls == ["charge", "observe", "observe", "throttle"]
    assert "failed" in caplog.text
    assert limiter.inner.stats_nowait().active == 0


# -- the SDKs against a provider that enforces its limits -------------------------------------


class Sdk:
    """One SDK client over one HTTP stack, making calls of any size."""

    def __init__(self, name: str, stack: str, url: str, limiter: Any, **options: Any) -> None:
        self.name = name
        http_client = slotwise.httpx.client(limiter=limiter, stack=stack)  # type: ignore[call-overload]
        if name == "openai":
            self.client: Any = openai.AsyncOpenAI(
                api_key=KEY, base_url=f"{url}/v1", http_client=http_client, **options
            )
        else:
            self.client = anthropic.AsyncAnthropic(
                api_key=KEY, base_url=url, http_client=http_client, **options
            )

    async def call(
        self, prompt: str, max_tokens: int, *, stream: bool, headers: dict[str, str]
    ) -> str:
        """The text of the answer, read to its end."""
        messages = [{"role": "user", "content": prompt}]
        if self.name == "openai":
            options: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
            result = await self.client.chat.completions.create(
                model="fake",
                messages=messages,
                max_completion_tokens=max_tokens,
                stream=stream,
                extra_headers=headers,
                **options,
            )
            if not stream:
                return str(result.choices[0].message.content)
            texts = []
            async for chunk in result:
                texts += [c.delta.content or "" for c in chunk.choices]
            return "".join(texts)
        result = await self.client.messages.create(
            model="fake",
            max_tokens=max_tokens,
            messages=messages,
            stream=stream,
            extra_headers=headers,
        )
        if not stream:
            return str(result.content[0].text)
        texts = []
        async for event in result:
            if event.type == "content_block_delta":
                texts.append(event.delta.text)
        return "".join(texts)

    async def aclose(self) -> None:
        await self.client.close()


SDKS = [("openai", "httpx2"), ("openai", "httpx"), ("anthropic", "httpx2")]


@pytest.fixture(params=SDKS, ids=["-".join(p) for p in SDKS])
def sdk_stack(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param  # type: ignore[no-any-return]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_the_sdks_usage_corrects_the_estimate(
    provider: FakeProvider, sdk_stack: tuple[str, str], stream: bool
) -> None:
    limiter = token_limiter()
    sdk = Sdk(*sdk_stack, provider.url, limiter)
    text = await sdk.call("a question " * 40, 64, stream=stream, headers={"x-fake-chunks": "4"})
    assert text == ("t0t1t2t3" if stream else "ok")
    cost, used = provider.charged[-1]
    assert used < cost <= estimate(provider.bodies[-1])
    assert level(limiter) == pytest.approx(TPM - used, abs=1)
    await sdk.aclose()


async def run_calls(sdk: Sdk, calls: int, errors: list[BaseException]) -> None:
    """``calls`` calls at once, of varied sizes, half of them streamed."""

    async def one(i: int) -> None:
        prompt = "word " * (20 + (i * 37) % 300)
        headers = {"x-fake-delay": "0.05", "x-fake-chunks": str(3 + i % 4)}
        try:
            await sdk.call(prompt, 16 + (i * 53) % 180, stream=i % 2 == 1, headers=headers)
        except openai.RateLimitError as exc:
            errors.append(exc)
        except anthropic.RateLimitError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for i in range(calls):
            tg.start_soon(one, i)


CONCURRENCY, REQUESTS, TOKENS, PER = 4, 6, 1600, 1.0  # requests and tokens per PER seconds
# The longest a granted request may take to reach the provider: a request counts there only
# on its arrival, and the first calls of an SDK, which open its connections, take tenths of a
# second to arrive (more on a loaded machine).
LATENCY = 0.5
CALLS = 12


# The legacy httpx stack under openai is the same code as httpx2's here (both stacks are
# covered with plain clients above); two SDKs keep these slower tests short.
TWO_SDKS = pytest.mark.parametrize(
    "sdk_stack", [("openai", "httpx2"), ("anthropic", "httpx2")], ids="-".join
)


@TWO_SDKS
async def test_the_sdks_get_no_429_with_the_providers_limits_configured(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    """12 calls at once, against a provider whose requests, tokens and concurrency each
    bound the pace: none is refused, and both rates held calls back (the control below shows
    that the same calls, limited by concurrency alone, are refused)."""
    provider.limit(concurrency=CONCURRENCY, requests=REQUESTS, tokens=TOKENS, per=PER)
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="provider",
        max_concurrent=CONCURRENCY,
        rate=Rate(requests=REQUESTS, tokens=TOKENS, per=PER, latency=LATENCY),
        workloads={"default": Workload(max_wait=60.0)},
    )
    holders = Holders(limiter)
    sdk = Sdk(*sdk_stack, provider.url, limiter, max_retries=0)
    errors: list[BaseException] = []
    await run_calls(sdk, CALLS, errors)
    await sdk.aclose()
    assert errors == []
    assert provider.rate_limited == 0
    assert len(provider.charged) == CALLS
    assert 1 <= provider.max_active <= 4
    assert holders.max_held <= 4
    waited_for = {
        kind for e in holders.events if isinstance(e, AcquiredEvent) for kind in e.waited_for
    }
    assert {"requests", "tokens"} <= waited_for  # both rates held requests back


async def test_without_the_rates_the_same_calls_are_refused(provider: FakeProvider) -> None:
    """The control for the test above: a concurrency limit alone does not keep the pace."""
    provider.limit(concurrency=CONCURRENCY, requests=REQUESTS, tokens=TOKENS, per=PER)
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=CONCURRENCY)
    sdk = Sdk("openai", "httpx2", provider.url, limiter, max_retries=0)
    errors: list[BaseException] = []
    await run_calls(sdk, CALLS, errors)
    await sdk.aclose()
    assert provider.rate_limited > 0
    assert len(errors) == provider.rate_limited


@TWO_SDKS
async def test_after_a_429_no_request_reaches_the_provider_before_the_time_given(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    """Six tasks, four slots, a provider that takes three requests per 0.3 s: the fourth is
    refused at once while the first three are still being answered. Its ``retry-after``
    holds back every other task (they wait for slots), and the refused call's own retry,
    until that time."""
    provider.limit(requests=3, per=0.3)
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="provider", max_concurrent=4, workloads={"default": Workload(max_wait=60.0)}
    )
    holders = Holders(limiter)
    sdk = Sdk(*sdk_stack, provider.url, limiter, max_retries=8)
    texts: list[str] = []

    async def one(i: int) -> None:
        texts.append(await sdk.call("hi", 16, stream=i % 2 == 1, headers={"x-fake-delay": "0.2"}))

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(one, i)
    await sdk.aclose()
    assert len(texts) == 6
    assert provider.refusals
    refused_at, retry_after = provider.refusals[0]
    later = [t for t, _ in provider.arrivals if t > refused_at]
    assert later  # the others and the retry did come, after the pause
    assert min(later) >= refused_at + retry_after
    paused = [e for e in holders.events if isinstance(e, PausedEvent)]
    assert paused
    assert paused[0].reason == "429"
