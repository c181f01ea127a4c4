"""A worker process for the SDK tests across processes: ``python _sdk_worker.py '<json>'``.

It makes ``calls`` calls at once with one SDK (``sdk``: "openai" or "anthropic") through
`slotwise.httpx` and a `PostgresLimiter` that the other workers share (``rate``: its `Rate`,
or None for slots alone), against the fake provider at ``url``, with the SDK's own retries
off, so that every 429 reaches the caller. The calls vary in size, and half are streamed.
It prints a JSON summary: the calls answered and refused, and the rate buckets its requests
waited for.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import anthropic
import anyio
import openai

import slotwise
import slotwise.httpx
from slotwise import AcquiredEvent, ConcurrencyEvent, Rate, Workload
from slotwise.postgres import PostgresLimiter

KEY = "sk-test-secret-key-0123456789"


async def call(client: Any, sdk: str, prompt: str, max_tokens: int, stream: bool) -> None:
    """One call, its answer read to the end."""
    messages = [{"role": "user", "content": prompt}]
    headers = {"x-fake-delay": "0.05", "x-fake-chunks": str(3 + max_tokens % 4)}
    if sdk == "openai":
        options: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
        result = await client.chat.completions.create(
            model="fake",
            messages=messages,
            max_completion_tokens=max_tokens,
            stream=stream,
            extra_headers=headers,
            **options,
        )
    else:
        result = await client.messages.create(
            model="fake",
            max_tokens=max_tokens,
            messages=messages,
            stream=stream,
            extra_headers=headers,
        )
    if stream:
        async for _ in result:
            pass


async def main(spec: dict[str, Any]) -> None:
    sdk = spec["sdk"]
    limiter = PostgresLimiter(
        spec["dsn"],
        name="provider",
        schema=spec["schema"],
        ensure_schema=False,
        max_concurrent=spec["max_concurrent"],
        rate=Rate(**spec["rate"]) if spec["rate"] else None,
        workloads={"default": Workload(max_wait=120.0)},
        poll_interval=0.05,
    )
    waited_for: set[str] = set()

    def seen(event: ConcurrencyEvent) -> None:
        if isinstance(event, AcquiredEvent):
            waited_for.update(event.waited_for)

    slotwise.subscribe(seen, limiter=limiter)
    http_client = slotwise.httpx.client(limiter=limiter)
    if sdk == "openai":
        client: Any = openai.AsyncOpenAI(
            api_key=KEY, base_url=f"{spec['url']}/v1", http_client=http_client, max_retries=0
        )
    else:
        client = anthropic.AsyncAnthropic(
            api_key=KEY, base_url=spec["url"], http_client=http_client, max_retries=0
        )
    outcomes = {"answered": 0, "refused": 0}

    async def one(i: int) -> None:
        n = spec["seed"] * spec["calls"] + i
        try:
            await call(
                client, sdk, "word " * (20 + (n * 37) % 300), 16 + (n * 53) % 180, i % 2 == 1
            )
        except (openai.RateLimitError, anthropic.RateLimitError):
            outcomes["refused"] += 1
        else:
            outcomes["answered"] += 1

    async with limiter:
        async with anyio.create_task_group() as tg:
            for i in range(spec["calls"]):
                tg.start_soon(one, i)
        await client.close()
    print(json.dumps({**outcomes, "waited_for": sorted(waited_for)}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
