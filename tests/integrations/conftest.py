"""A fake LLM provider on a loopback port, for the SDK and HTTP client tests.

It serves the OpenAI chat completions and Anthropic messages endpoints, plain or streamed as
server-sent events, and a raw streaming endpoint. It counts the requests it is serving at
once: a request counts from its arrival until just before the last byte of its response is
sent, so a client can never have read a whole response while the server still counts it.

Request headers steer it:

- ``x-fake-delay``: seconds to wait before answering, and between streamed events;
- ``x-fake-chunks``: how many streamed events (default 3);
- ``x-fake-429``: answer 429 with ``Retry-After`` to the attempts whose
  ``x-stainless-retry-count`` is below this number.
- ``x-fake-end-at-once``: send the end of a stream right after its last event, without the
  pause (a real provider ends the body with its last event; a client that stops reading at
  that event, as openai's sync stream does at ``[DONE]``, then never closes a response that
  the server still counts).

- ``x-fake-gzip``: send the response body gzip-encoded (a stream flushed at each event).

A path that starts with ``/redirect`` is answered with a 307 to the same path without that
prefix (which keeps the method and the body).

Every answer carries a ``usage`` in the provider's shape: the input counts one token per 8
bytes of the request body (at least one), the output one per streamed event (``x-fake-chunks``,
at most the request's ``max_tokens``). An OpenAI stream ends with a usage chunk when the request
asks for it (``stream_options.include_usage``); an Anthropic stream has the input in
``message_start`` and the output in ``message_delta``.

``provider.limit(concurrency=, requests=, tokens=, per=)`` makes it enforce a provider
account's limits, as token buckets that start full and refill continuously: a request beyond
them is answered at once with a 429 and a ``retry-after`` saying when it would fit. A request
costs one request and, at its arrival, its output cap plus one token per 4 bytes of its body
(as the providers estimate); its usage replaces that when it ends. Every answer then carries
the rate-limit headers of its shape, as they were at its arrival (OpenAI's ``x-ratelimit-*``, Anthropic's
``anthropic-ratelimit-*``). ``provider.arrivals`` and ``provider.refusals`` record when
requests arrived and when each 429 was sent, with its ``retry-after``.

The server runs on its own event loop in a thread, so it serves asyncio and trio tests alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import math
import socket
import threading
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Bucket:
    """A provider's rate limit: ``capacity`` units per ``per`` seconds, refilling
    continuously, full at the start."""

    def __init__(self, capacity: int, per: float) -> None:
        self.capacity = capacity
        self.per = per
        self.level = float(capacity)
        self.updated = time.monotonic()

    def refill(self) -> None:
        now = time.monotonic()
        self.level = min(
            self.capacity, self.level + (now - self.updated) * self.capacity / self.per
        )
        self.updated = now

    def wait(self, cost: int) -> float:
        """Seconds until ``cost`` units fit (refilled already)."""
        return max(0.0, (cost - self.level) * self.per / self.capacity)

    def reset(self) -> float:
        """Seconds until it is full again."""
        return self.wait(self.capacity)


class FakeProvider:
    """The ASGI app, and what it saw."""

    def __init__(self) -> None:
        self.url = ""
        self.reset()

    def reset(self) -> None:
        self.active = 0
        self.max_active = 0
        self.requests = 0
        self.rate_limited = 0
        self.redirects = 0
        self.disconnects = 0
        self.authorizations: list[str] = []
        self.bodies: list[bytes] = []
        self.concurrency: int | None = None
        self.request_bucket: Bucket | None = None
        self.token_bucket: Bucket | None = None
        # (time.monotonic() at arrival, path); (time the 429 was sent, its retry-after).
        self.arrivals: list[tuple[float, str]] = []
        self.refusals: list[tuple[float, float]] = []
        # Each answered request's cost at its arrival (its output cap plus its size over 4)
        # and its usage, in the order they ended.
        self.charged: list[tuple[int, int]] = []

    def limit(
        self,
        *,
        concurrency: int | None = None,
        requests: int | None = None,
        tokens: int | None = None,
        per: float = 60.0,
    ) -> None:
        """Enforce these limits from now on (None: no such limit)."""
        self.concurrency = concurrency
        self.request_bucket = None if requests is None else Bucket(requests, per)
        self.token_bucket = None if tokens is None else Bucket(tokens, per)

    def _refuse(self, cost: int) -> float | None:
        """Admit a request costing ``cost`` tokens (charging it), or say how long until it
        would fit."""
        waits = []
        if self.concurrency is not None and self.active > self.concurrency:
            waits.append(0.05)
        for bucket, units in ((self.request_bucket, 1), (self.token_bucket, cost)):
            if bucket is not None:
                bucket.refill()
                if bucket.level < units:
                    waits.append(bucket.wait(units))
        if waits:
            return max(waits)
        for bucket, units in ((self.request_bucket, 1), (self.token_bucket, cost)):
            if bucket is not None:
                bucket.level -= units
        return None

    def _rate_headers(self, anthropic: bool) -> list[tuple[bytes, bytes]]:
        """The rate-limit headers of each limit, in the shape of the endpoint."""
        headers = []
        for name, bucket in (("requests", self.request_bucket), ("tokens", self.token_bucket)):
            if bucket is None:
                continue
            bucket.refill()
            left = str(max(0, math.floor(bucket.level)))
            # The providers state their limits a minute, whatever the bucket's period.
            limit = str(max(1, math.floor(bucket.capacity * 60 / bucket.per)))
            if anthropic:
                reset = datetime.now(UTC) + timedelta(seconds=bucket.reset())
                headers += [
                    (f"anthropic-ratelimit-{name}-limit", limit),
                    (f"anthropic-ratelimit-{name}-remaining", left),
                    (f"anthropic-ratelimit-{name}-reset", reset.isoformat()),
                ]
            else:
                headers += [
                    (f"x-ratelimit-limit-{name}", limit),
                    (f"x-ratelimit-remaining-{name}", left),
                    (f"x-ratelimit-reset-{name}", f"{math.ceil(bucket.reset() * 1000)}ms"),
                ]
        return [(k.encode(), v.encode()) for k, v in headers]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self.authorizations.append(headers.get("authorization", headers.get("x-api-key", "")))
        self.bodies.append(body)
        self.arrivals.append((time.monotonic(), scope["path"]))
        self.requests += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        counted = [True]

        def finish() -> None:
            if counted[0]:
                counted[0] = False
                self.active -= 1

        disconnected = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnects += 1
            disconnected.set()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self._answer(scope["path"], headers, body, send, finish, disconnected)
        finally:
            finish()
            watcher.cancel()

    async def _answer(
        self,
        path: str,
        headers: dict[str, str],
        body: bytes,
        send: Send,
        finish: Callable[[], None],
        disconnected: asyncio.Event,
    ) -> None:
        delay = float(headers.get("x-fake-delay", "0"))
        chunks = int(headers.get("x-fake-chunks", "3"))
        request = json.loads(body) if body else {}
        anthropic = path.endswith("/messages")
        limited = self.request_bucket or self.token_bucket or self.concurrency is not None
        cap = request.get("max_tokens") or request.get("max_completion_tokens") or 0
        cost = cap + math.ceil(len(body) / 4)
        rate_headers = []
        if limited:
            wait = self._refuse(cost)
            rate_headers = self._rate_headers(anthropic)  # at the admission, as providers do
            if wait is not None:
                await self._too_many(send, finish, wait, rate_headers)
                return
        output = min(chunks, cap) if cap else chunks
        used = max(1, len(body) // 8) + output
        charged = [False]

        def account(usage: int = used) -> None:
            """Its answer is complete: its usage replaces the estimate it was charged."""
            if not charged[0]:
                charged[0] = True
                self.charged.append((cost, usage))
                if self.token_bucket is not None:
                    self.token_bucket.refill()
                    self.token_bucket.level += cost - usage

        def settle(usage: int = used) -> None:
            """The request ends."""
            account(usage)
            finish()

        async def pause() -> bool:
            """Wait ``delay`` seconds; False if the client went away meanwhile."""
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(disconnected.wait(), delay)
            return not disconnected.is_set()

        if not await pause():
            return
        if path.startswith("/redirect/"):
            self.redirects += 1
            finish()
            location = path.removeprefix("/redirect").encode()
            await _respond(send, 307, {}, ((b"location", location),))
            return
        if int(headers.get("x-stainless-retry-count", "0")) < int(headers.get("x-fake-429", "0")):
            settle(0)
            await self._too_many(send, finish, 0.01, rate_headers)
            return
        prompt = used - output
        stream_usage = bool((request.get("stream_options") or {}).get("include_usage"))
        if path.endswith("/chat/completions"):
            events = [("", _openai_chunk(i, stream_usage)) for i in range(chunks)]
            if stream_usage:
                events.append(("", _openai_usage_chunk(prompt, output)))
            events.append(("", "[DONE]"))
            full: dict[str, Any] = {**_OPENAI_COMPLETION, "usage": _openai_usage(prompt, output)}
        elif anthropic:
            events = _anthropic_events(chunks, prompt, output)
            usage = {"input_tokens": prompt, "output_tokens": output}
            full = {**_ANTHROPIC_MESSAGE, "usage": usage}
        else:
            events = [("", json.dumps({"n": i})) for i in range(chunks)]
            full = {"ok": True}
        gzipped = headers.get("x-fake-gzip") == "1"
        if not request.get("stream"):
            settle()
            await _respond(send, 200, full, tuple(rate_headers), gzipped=gzipped)
            return
        extra = [(b"content-type", b"text/event-stream"), *rate_headers]
        if gzipped:
            extra.append((b"content-encoding", b"gzip"))
        encoder = zlib.compressobj(wbits=zlib.MAX_WBITS | 16) if gzipped else None

        def encode(data: bytes, last: bool = False) -> bytes:
            if encoder is None:
                return data
            return encoder.compress(data) + encoder.flush(
                zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH
            )

        await send({"type": "http.response.start", "status": 200, "headers": extra})
        end_at_once = headers.get("x-fake-end-at-once") == "1"
        for index, (event, data) in enumerate(events):
            line = ((f"event: {event}\n" if event else "") + f"data: {data}\n\n").encode()
            if end_at_once and index == len(events) - 1:
                settle()
                await send(
                    {"type": "http.response.body", "body": encode(line, True), "more_body": False}
                )
                return
            await send({"type": "http.response.body", "body": encode(line), "more_body": True})
            if index == len(events) - 1:
                account()  # the last event is out: a client may close the stream now
            if not await pause():
                return
        settle()
        await send({"type": "http.response.body", "body": encode(b"", True), "more_body": False})

    async def _too_many(
        self,
        send: Send,
        finish: Callable[[], None],
        wait: float,
        extra: list[tuple[bytes, bytes]],
    ) -> None:
        """Answer 429 at once, with a ``retry-after`` of ``wait`` seconds (rounded up to
        the millisecond)."""
        self.rate_limited += 1
        retry_after = math.ceil(wait * 1000) / 1000
        payload = {"error": {"type": "rate_limit_error", "message": "slow down"}}
        finish()
        self.refusals.append((time.monotonic(), retry_after))
        headers = ((b"retry-after", f"{retry_after:.3f}".encode()), *extra)
        await _respond(send, 429, payload, headers)


async def _respond(
    send: Send,
    status: int,
    payload: dict[str, Any],
    extra: tuple[tuple[bytes, bytes], ...] = (),
    *,
    gzipped: bool = False,
) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), *extra]
    if gzipped:
        body = gzip.compress(body)
        headers.append((b"content-encoding", b"gzip"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


_OPENAI_COMPLETION: dict[str, Any] = {
    "id": "chatcmpl-fake",
    "object": "chat.completion",
    "created": 0,
    "model": "fake",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "ok"},
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


def _openai_usage(prompt: int, output: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}


def _openai_chunk(i: int, with_usage: bool = False) -> str:
    chunk: dict[str, Any] = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "fake",
        "choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}],
    }
    if with_usage:
        chunk["usage"] = None
    return json.dumps(chunk)


def _openai_usage_chunk(prompt: int, output: int) -> str:
    return json.dumps(
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "fake",
            "choices": [],
            "usage": _openai_usage(prompt, output),
        }
    )


_ANTHROPIC_MESSAGE: dict[str, Any] = {
    "id": "msg_fake",
    "type": "message",
    "role": "assistant",
    "model": "fake",
    "content": [{"type": "text", "text": "ok"}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 1, "output_tokens": 1},
}


def _anthropic_events(chunks: int, prompt: int = 1, output: int = 1) -> list[tuple[str, str]]:
    start = {
        **_ANTHROPIC_MESSAGE,
        "content": [],
        "stop_reason": None,
        "usage": {"input_tokens": prompt, "output_tokens": 1},
    }
    events = [
        ("message_start", {"type": "message_start", "message": start}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        *(
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": f"t{i}"},
                },
            )
            for i in range(chunks)
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": output},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return [(name, json.dumps(data)) for name, data in events]


@pytest.fixture(scope="session")
def _provider_server() -> Iterator[FakeProvider]:
    app = FakeProvider()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_level="warning",
        loop="asyncio",
        http="h11",
        ws="none",
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        threading.Event().wait(0.01)
    else:
        raise RuntimeError("the fake provider did not start")
    app.url = f"http://127.0.0.1:{port}"
    yield app
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture
def provider(_provider_server: FakeProvider) -> Iterator[FakeProvider]:
    """The fake provider, its counters reset; ``provider.url`` is its base URL.

    After the test, every response must have ended: sent in full, or its client gone.
    """
    _provider_server.reset()
    yield _provider_server
    for _ in range(500):
        if _provider_server.active == 0:
            break
        threading.Event().wait(0.01)
    assert _provider_server.active == 0, "a response was still being served after the test"
