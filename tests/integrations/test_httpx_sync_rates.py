"""Rates and pushback through slotwise.httpx's sync clients: the same estimates,
corrections, remaining counts and pauses as the async clients (tests/integrations/
test_httpx_rates.py), in plain threads; then the real sync SDKs against a fake provider that
enforces its limits.

Plain tests with no event loop of their own, as in test_httpx_sync.py.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

import slotwise.httpx
from slotwise import MemoryLimiter, PausedEvent, Rate, Workload

from ._helpers import Holders
from .conftest import FakeProvider
from .test_httpx_rates import (
    LATENCY,
    PUSHBACK,
    SHAPES,
    TPM,
    estimate,
    level,
    pushback_handler,
    token_limiter,
)
from .test_httpx_sync import KEY, in_threads

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

STACKS = ["httpx2", "httpx"]


@pytest.mark.parametrize("gzipped", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("stack", STACKS)
def test_the_estimate_is_charged_at_the_grant_and_the_usage_corrects_it(
    provider: FakeProvider, stack: str, shape: str, gzipped: bool
) -> None:
    limiter = token_limiter()
    path, request = SHAPES[shape]
    headers = {"x-fake-delay": "0.01", "x-fake-chunks": "5"}
    if gzipped:
        headers["x-fake-gzip"] = "1"
    client = slotwise.httpx.sync_client(limiter=limiter, stack=stack, base_url=provider.url)  # type: ignore[call-overload]
    with client, client.stream("POST", path, json=request, headers=headers) as response:
        assert level(limiter) == pytest.approx(TPM - estimate(provider.bodies[-1]), abs=1)
        response.read()
    _, used = provider.charged[-1]
    assert used < estimate(provider.bodies[-1])
    assert level(limiter) == pytest.approx(TPM - used, abs=1)


@pytest.mark.parametrize(("status", "headers", "pause"), PUSHBACK)
@pytest.mark.parametrize("stack", STACKS)
def test_pushback_pauses_the_limiter_as_long_as_the_headers_say(
    stack: str, status: int, headers: dict[str, str], pause: float
) -> None:
    module = pytest.importorskip(stack)
    limiter = token_limiter()
    holders = Holders(limiter)
    transport = module.MockTransport(pushback_handler(module, status, dict(headers), False))
    with slotwise.httpx.wrap(module.Client(transport=transport), limiter=limiter) as client:
        before = time.time()
        assert client.post("http://p/v1/messages", json=SHAPES["openai"][1]).status_code == status
    [paused] = [e for e in holders.events if isinstance(e, PausedEvent)]
    assert paused.reason == str(status)
    assert before + pause - 0.01 <= paused.until <= time.time() + pause + 0.01


class SyncSdk:
    """One sync SDK client over one HTTP stack, making calls of any size."""

    def __init__(self, name: str, stack: str, url: str, limiter: Any, **options: Any) -> None:
        self.name = name
        http_client = slotwise.httpx.sync_client(limiter=limiter, stack=stack)  # type: ignore[call-overload]
        if name == "openai":
            self.client: Any = openai.OpenAI(
                api_key=KEY, base_url=f"{url}/v1", http_client=http_client, **options
            )
        else:
            self.client = anthropic.Anthropic(
                api_key=KEY, base_url=url, http_client=http_client, **options
            )

    def call(self, prompt: str, max_tokens: int, *, stream: bool, headers: dict[str, str]) -> str:
        messages = [{"role": "user", "content": prompt}]
        if self.name == "openai":
            options: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
            result = self.client.chat.completions.create(
                model="fake",
                messages=messages,
                max_completion_tokens=max_tokens,
                stream=stream,
                extra_headers=headers,
                **options,
            )
            if not stream:
                return str(result.choices[0].message.content)
            return "".join(c.delta.content or "" for chunk in result for c in chunk.choices)
        result = self.client.messages.create(
            model="fake",
            max_tokens=max_tokens,
            messages=messages,
            stream=stream,
            extra_headers=headers,
        )
        if not stream:
            return str(result.content[0].text)
        return "".join(e.delta.text for e in result if e.type == "content_block_delta")

    def close(self) -> None:
        self.client.close()


SDKS = [("openai", "httpx2"), ("anthropic", "httpx2")]


@pytest.fixture(params=SDKS, ids=["-".join(p) for p in SDKS])
def sdk_stack(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param  # type: ignore[no-any-return]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_sync_sdks_usage_corrects_the_estimate(
    provider: FakeProvider, sdk_stack: tuple[str, str], stream: bool
) -> None:
    """openai's sync stream closes its response at ``[DONE]``, before the body's end: its
    usage event came before, and counts."""
    limiter = token_limiter()
    sdk = SyncSdk(*sdk_stack, provider.url, limiter)
    text = sdk.call("a question " * 40, 64, stream=stream, headers={"x-fake-chunks": "4"})
    sdk.close()
    assert text == ("t0t1t2t3" if stream else "ok")
    _, used = provider.charged[-1]
    assert level(limiter) == pytest.approx(TPM - used, abs=1)


def test_the_sync_sdks_in_threads_get_no_429_with_the_providers_limits_configured(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    provider.limit(concurrency=4, requests=6, tokens=1600, per=1.0)
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="provider",
        max_concurrent=4,
        rate=Rate(requests=6, tokens=1600, per=1.0, latency=LATENCY),
        workloads={"default": Workload(max_wait=60.0)},
    )
    sdk = SyncSdk(*sdk_stack, provider.url, limiter, max_retries=0)

    def one(i: int) -> None:
        prompt = "word " * (20 + (i * 37) % 300)
        headers = {"x-fake-delay": "0.05", "x-fake-chunks": str(3 + i % 4)}
        sdk.call(prompt, 16 + (i * 53) % 180, stream=i % 2 == 1, headers=headers)

    in_threads(12, one)
    sdk.close()
    assert provider.rate_limited == 0
    assert len(provider.charged) == 12
    assert 1 <= provider.max_active <= 4


def test_after_a_429_no_thread_reaches_the_provider_before_the_time_given(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    provider.limit(requests=3, per=0.3)
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="provider", max_concurrent=4, workloads={"default": Workload(max_wait=60.0)}
    )
    sdk = SyncSdk(*sdk_stack, provider.url, limiter, max_retries=8)

    def one(i: int) -> None:
        sdk.call("hi", 16, stream=i % 2 == 1, headers={"x-fake-delay": "0.2"})

    in_threads(6, one)
    sdk.close()
    assert provider.refusals
    refused_at, retry_after = provider.refusals[0]
    later = [t for t, _ in provider.arrivals if t > refused_at]
    assert later
    assert min(later) >= refused_at + retry_after
