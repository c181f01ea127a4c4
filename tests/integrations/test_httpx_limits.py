"""The providers' own limits through slotwise.httpx: the `x-ratelimit-limit-*` and
`anthropic-ratelimit-*-limit` headers of every response cap the limiter's rate buckets (never
above the configured rate), on both HTTP stacks, on asyncio and trio."""

from __future__ import annotations

from typing import Any

import pytest

import slotwise
import slotwise.httpx
from slotwise import MemoryLimiter, Rate

from ._helpers import closes_early

pytestmark = [pytest.mark.anyio, closes_early]

STACKS = ["httpx2", "httpx"]
BODY = {"model": "m", "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}]}
USAGE = {"usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}}

OPENAI = {"x-ratelimit-limit-requests": "600", "x-ratelimit-limit-tokens": "100000"}
ANTHROPIC = {
    "anthropic-ratelimit-requests-limit": "600",
    "anthropic-ratelimit-tokens-limit": "16000",
    "anthropic-ratelimit-input-tokens-limit": "80000",
    "anthropic-ratelimit-output-tokens-limit": "20000",
}


def limiter() -> MemoryLimiter[str]:
    """Configured at twice the provider's limits."""
    return MemoryLimiter(
        name="provider", max_concurrent=4, rate=Rate(requests=1200, tokens=200_000, per=60.0)
    )


async def send(stack: str, limiter: MemoryLimiter[str], status: int, headers: Any) -> None:
    module = pytest.importorskip(stack)

    def handle(request: Any) -> Any:
        return module.Response(status, json=USAGE, headers=headers)

    client = slotwise.httpx.wrap(
        module.AsyncClient(transport=module.MockTransport(handle)), limiter=limiter
    )
    async with client:
        response = await client.post("http://p/v1/chat/completions", json=BODY)
        assert response.status_code == status


@pytest.mark.parametrize(
    ("headers", "tokens"), [(OPENAI, 100_000), (ANTHROPIC, 100_000)], ids=["openai", "anthropic"]
)
@pytest.mark.parametrize("status", [200, 429])
@pytest.mark.parametrize("stack", STACKS)
async def test_the_providers_limits_cap_the_buckets(
    stack: str, status: int, headers: dict[str, str], tokens: int
) -> None:
    subject = limiter()
    await send(stack, subject, status, headers)
    buckets = subject.stats_nowait().buckets
    assert buckets["requests"].capacity == 600
    assert buckets["tokens"].capacity == tokens
    assert buckets["tokens"].level <= tokens


@pytest.mark.parametrize("stack", STACKS)
async def test_a_limit_above_the_configured_rate_changes_nothing(stack: str) -> None:
    subject = limiter()
    await send(
        stack,
        subject,
        200,
        {"x-ratelimit-limit-requests": "10000", "x-ratelimit-limit-tokens": "2000000"},
    )
    buckets = subject.stats_nowait().buckets
    assert (buckets["requests"].capacity, buckets["tokens"].capacity) == (1200, 200_000)


@pytest.mark.parametrize("stack", STACKS)
async def test_a_malformed_limit_is_ignored_and_fails_nothing(stack: str) -> None:
    subject = limiter()
    await send(
        stack, subject, 200, {"x-ratelimit-limit-tokens": "lots", "x-ratelimit-limit-requests": "0"}
    )
    buckets = subject.stats_nowait().buckets
    assert (buckets["requests"].capacity, buckets["tokens"].capacity) == (1200, 200_000)


async def test_a_limiter_without_rates_is_not_told() -> None:
    subject = MemoryLimiter(name="plain", max_concurrent=2)
    await send("httpx", subject, 200, OPENAI)
    assert subject.stats_nowait().buckets == {}
