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

A path that starts with ``/redirect`` is answered with a 307 to the same path without that
prefix (which keeps the method and the body).

The server runs on its own event loop in a thread, so it serves asyncio and trio tests alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import pytest
import uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


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
            self.rate_limited += 1
            payload = {"error": {"type": "rate_limit_error", "message": "slow down"}}
            finish()
            await _respond(send, 429, payload, ((b"retry-after", b"0.01"),))
            return
        request = json.loads(body) if body else {}
        if path.endswith("/chat/completions"):
            events = [("", _openai_chunk(i)) for i in range(chunks)] + [("", "[DONE]")]
            full: dict[str, Any] = _OPENAI_COMPLETION
        elif path.endswith("/messages"):
            events = _anthropic_events(chunks)
            full = _ANTHROPIC_MESSAGE
        else:
            events = [("", json.dumps({"n": i})) for i in range(chunks)]
            full = {"ok": True}
        if not request.get("stream"):
            finish()
            await _respond(send, 200, full)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        end_at_once = headers.get("x-fake-end-at-once") == "1"
        for index, (event, data) in enumerate(events):
            line = (f"event: {event}\n" if event else "") + f"data: {data}\n\n"
            if end_at_once and index == len(events) - 1:
                finish()
                await send(
                    {"type": "http.response.body", "body": line.encode(), "more_body": False}
                )
                return
            await send({"type": "http.response.body", "body": line.encode(), "more_body": True})
            if not await pause():
                return
        finish()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _respond(
    send: Send, status: int, payload: dict[str, Any], extra: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), *extra]
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


def _openai_chunk(i: int) -> str:
    return json.dumps(
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "fake",
            "choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}],
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


def _anthropic_events(chunks: int) -> list[tuple[str, str]]:
    start = {**_ANTHROPIC_MESSAGE, "content": [], "stop_reason": None}
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
                "usage": {"output_tokens": chunks},
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
