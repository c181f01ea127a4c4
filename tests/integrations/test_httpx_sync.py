"""slotwise.httpx with sync clients: the real sync openai and anthropic SDKs and plain httpx2 and
httpx clients, in plain threads, against the fake provider.

These tests have no event loop of their own (the sync clients refuse to block one), so they
are plain tests: they start threads, and event loops in threads where they mix sync and async
clients. Every thread is joined under a timeout, so a hang fails the test instead of stalling
the suite. Limits are counted at the server.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import anyio
import pytest

import slotwise
import slotwise.httpx
from slotwise import ConcurrencyEvent, MemoryLimiter, Workload

from ._helpers import Holders
from .conftest import FakeProvider

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

KEY = "sk-test-secret-key-0123456789"
STACKS = ["httpx2", "httpx"]
SDKS = [("openai", "httpx2"), ("openai", "httpx"), ("anthropic", "httpx2")]
# The outcome of a stream read to its end. openai's sync stream stops reading at its `[DONE]`
# event and closes the response before the body's last bytes (its async stream reads them):
# to slotwise, a response closed before its end.
STREAM_END = {"openai": "cancelled", "anthropic": "completed"}


class ThreadHolders(Holders):
    """`Holders`, counting events that arrive from any thread."""

    def __init__(self, limiter: Any) -> None:
        self._lock = threading.Lock()
        self.threads: list[str] = []
        super().__init__(limiter)

    def _on_event(self, event: ConcurrencyEvent) -> None:
        with self._lock:
            self.threads.append(threading.current_thread().name)
            super()._on_event(event)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll until ``condition`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.005)


def in_threads(count: int, work: Callable[[int], None], timeout: float = 60.0) -> None:
    """Run ``work(i)`` in ``count`` threads at once; re-raise the first error; fail on a hang."""
    errors: list[BaseException] = []

    def main(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(i,), name=f"worker-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    if errors:
        raise errors[0]


def active(limiter: MemoryLimiter[Any]) -> int:
    return anyio.run(limiter.stats).active


@contextmanager
def held_elsewhere(limiter: MemoryLimiter[Any]) -> Iterator[None]:
    """The limiter's only slot, held by another thread for the duration of the block."""
    got, done = threading.Event(), threading.Event()

    def hold() -> None:
        with limiter.sync_slot():
            got.set()
            done.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    assert got.wait(10)
    try:
        yield
    finally:
        done.set()
        thread.join(10)


class SyncSdk:
    """One sync SDK client over one HTTP stack, with the two calls the tests make."""

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
        """``http`` holds keywords for ``slotwise.httpx.sync_client()``, ``options`` the SDK's."""
        self.name = name
        http_client = slotwise.httpx.sync_client(limiter=limiter, stack=stack, **(http or {}))  # type: ignore[call-overload]
        sdk, cls, path = {
            "openai": (openai, "OpenAI", "/v1"),
            "anthropic": (anthropic, "Anthropic", ""),
        }[name]
        self.error = openai.OpenAIError if name == "openai" else anthropic.AnthropicError
        self.client = getattr(sdk, cls)(
            api_key=KEY, base_url=url + path, http_client=http_client, **options
        )
        if name == "openai":
            self._create = partial(self.client.chat.completions.create, model="fake")
        else:
            self._create = partial(self.client.messages.create, model="fake", max_tokens=16)

    def call(self, *, stream: bool = False, headers: dict[str, str] | None = None) -> Any:
        messages = [{"role": "user", "content": "tell me a secret"}]
        return self._create(messages=messages, stream=stream, extra_headers=headers)

    @staticmethod
    def text(result: Any) -> str:
        if hasattr(result, "choices"):
            return str(result.choices[0].message.content)
        return str(result.content[0].text)

    def close(self) -> None:
        self.client.close()


@pytest.fixture(params=SDKS, ids=["-".join(p) for p in SDKS])
def sdk_stack(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param  # type: ignore[no-any-return]


# -- the real sync SDKs ---------------------------------------------------------------------


def test_twelve_threads_through_one_client_never_exceed_the_limit(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=4)
    holders = ThreadHolders(limiter)
    sdk = SyncSdk(*sdk_stack, provider.url, limiter)
    texts: list[str] = []

    def work(i: int) -> None:
        headers = {"x-fake-delay": "0.05", "x-fake-end-at-once": "1"}
        for j in range(3):
            if (i + j) % 2:
                texts.append(sdk.text(sdk.call(headers=headers)))
            else:
                with sdk.call(stream=True, headers=headers) as stream:
                    for _ in stream:
                        pass
                texts.append("streamed")

    in_threads(12, work)
    sdk.close()
    assert len(texts) == 36
    assert provider.requests == 36
    # Counted at the server. (Not from the events: a slot handed to a waiting thread may be
    # announced there before its releaser announces the release.)
    assert 2 <= provider.max_active <= 4
    assert len(holders.kinds("acquired")) == len(holders.kinds("released")) == 36
    assert {e.outcome for e in holders.released()} <= {"completed", STREAM_END[sdk.name]}
    assert active(limiter) == 0


@pytest.mark.parametrize("stack", STACKS)
def test_without_a_limiter_the_server_sees_twelve_threads_at_once(
    provider: FakeProvider, stack: str
) -> None:
    """The control for the test above: the server's counter does see threads' concurrency."""
    with slotwise.httpx.sync_client(stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]
        in_threads(12, lambda i: c.post("/raw", json={}, headers={"x-fake-delay": "0.5"}))
    assert provider.max_active > 4


def test_a_stream_holds_its_slot_until_it_ends(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=1)
    holders = ThreadHolders(limiter)
    sdk = SyncSdk(*sdk_stack, provider.url, limiter)
    events = 0
    for _ in sdk.call(stream=True, headers={"x-fake-chunks": "5"}):
        events += 1
        assert holders.held == 1
        assert not holders.kinds("released")
    assert events >= 5
    assert [e.outcome for e in holders.released()] == [STREAM_END[sdk.name]]
    assert active(limiter) == 0
    sdk.close()


@pytest.mark.parametrize("how", ["break", "close-from-another-thread"])
def test_a_stream_ended_early_gives_its_slot_back_at_once(
    provider: FakeProvider, sdk_stack: tuple[str, str], how: str
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="provider", max_concurrent=1, workloads={"default": Workload(max_wait=0)}
    )
    holders = ThreadHolders(limiter)
    sdk = SyncSdk(*sdk_stack, provider.url, limiter)
    stream = sdk.call(stream=True, headers={"x-fake-chunks": "1000", "x-fake-delay": "0.01"})
    if how == "break":
        with stream:
            for _ in stream:
                break
            assert holders.held == 1
        assert holders.threads[-1] == "MainThread"
    else:
        assert next(iter(stream)) is not None
        in_threads(1, lambda i: stream.close())
        assert holders.threads[-1] == "worker-0"  # released by the thread that closed it
    assert [e.outcome for e in holders.released()] == ["cancelled"]
    # max_wait=0: the only slot is free at once, or this raises.
    assert sdk.text(sdk.call()) == "ok"
    wait_for(lambda: provider.disconnects >= 1)  # the body was closed: the server saw it
    sdk.close()


def abandon_a_stream(sdk: SyncSdk) -> None:
    """Read one event of a long stream, then leave it unclosed: only the SDK's own reference
    cycles keep it (and its slot) alive when this returns."""
    stream = sdk.call(stream=True, headers={"x-fake-chunks": "1000", "x-fake-delay": "0.01"})
    for _ in stream:
        break


def test_an_abandoned_stream_gives_its_slot_back_within_the_idle_bound(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    """With the garbage collector off. openai's sync stream forms reference cycles, which only
    the cyclic collector frees: the reclaimer thread gives its slot back once the bound has
    passed. anthropic's closes itself as soon as its generator is dropped."""
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="provider", max_concurrent=1, workloads={"default": Workload(max_wait=5.0)}
    )
    holders = ThreadHolders(limiter)
    sdk = SyncSdk(*sdk_stack, provider.url, limiter, http={"idle_timeout": 0.5})
    gc.disable()
    try:
        abandon_a_stream(sdk)
        started = time.monotonic()
        assert sdk.text(sdk.call()) == "ok"
        waited = time.monotonic() - started
    finally:
        gc.enable()
    assert [e.outcome for e in holders.released()] == ["cancelled", "completed"]
    ended = [e.kind for e in holders.kinds("reclaimed", "released")]
    if sdk.name == "openai":
        assert ended == ["reclaimed", "released", "released"]
        assert 0.45 <= waited < 4.0  # the bound, not the collector: no sooner than 0.5 s idle
        reclaimed = holders.events.index(holders.kinds("reclaimed")[0])
        assert holders.threads[reclaimed] == "slotwise-httpx-reclaimer"
    else:
        assert ended == ["released", "released"]
        assert waited < 0.45
    assert active(limiter) == 0
    wait_for(lambda: provider.disconnects >= 1)  # the abandoned body was closed
    sdk.close()
    gc.collect()


def test_each_retry_of_a_429_takes_a_new_slot(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=1)
    holders = ThreadHolders(limiter)
    sdk = SyncSdk(*sdk_stack, provider.url, limiter, max_retries=3)
    assert sdk.text(sdk.call(headers={"x-fake-429": "2"})) == "ok"
    assert provider.rate_limited == 2
    kinds = [e.kind for e in holders.kinds("acquired", "released")]
    assert kinds == ["acquired", "released"] * 3
    assert [e.outcome for e in holders.released()] == ["failed", "failed", "completed"]
    sdk.close()


def test_a_429_before_a_stream_closed_unread_is_a_failed_attempt(
    provider: FakeProvider, sdk_stack: tuple[str, str]
) -> None:
    """The SDK closes the 429 unread before it retries: that attempt failed all the same."""
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=1)
    holders = ThreadHolders(limiter)
    sdk = SyncSdk(*sdk_stack, provider.url, limiter, max_retries=1)
    with sdk.call(stream=True, headers={"x-fake-429": "1"}) as stream:
        for _ in stream:
            pass
    assert provider.rate_limited == 1
    assert [e.outcome for e in holders.released()] == ["failed", STREAM_END[sdk.name]]
    sdk.close()


@pytest.mark.parametrize("failure", ["timeout", "queue-full"])
def test_a_slot_error_fails_the_call_once_promptly_as_slotwises_own(
    provider: FakeProvider, sdk_stack: tuple[str, str], failure: str
) -> None:
    """Neither sync SDK wraps nor retries slotwise's errors: with the SDKs' default two
    retries, a slot timeout would otherwise block the thread three times, plus backoffs."""
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="provider",
        max_concurrent=1,
        max_queued=0 if failure == "queue-full" else None,
        workloads={"default": Workload(max_wait=0.1)},
    )
    holders = ThreadHolders(limiter)
    sdk = SyncSdk(*sdk_stack, provider.url, limiter, max_retries=2)
    expected = {
        "timeout": slotwise.ConcurrencyTimeoutError,
        "queue-full": slotwise.ConcurrencyQueueFullError,
    }[failure]
    with held_elsewhere(limiter):
        started = time.monotonic()
        with pytest.raises(expected) as caught:
            sdk.call()
        elapsed = time.monotonic() - started
    error = caught.value
    # One attempt, one wait: a retry would add the SDK's backoff (at least 0.375 s) and a wait.
    assert len(holders.kinds({"timeout": "timed-out"}.get(failure, failure))) == 1
    assert len(holders.kinds("wait-started")) == 2  # the holder's and the call's
    assert elapsed < 1.0
    assert provider.requests == 0
    assert isinstance(error, sdk.error)
    assert error.limiter == "provider"
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is expected
    sdk.close()


def test_anthropic_refuses_a_legacy_httpx_sync_client() -> None:
    legacy = slotwise.httpx.sync_client(stack="httpx")
    with pytest.raises(TypeError, match="httpx2"):
        anthropic.Anthropic(api_key=KEY, http_client=legacy)
    legacy.close()


def test_the_sdks_own_sync_clients_wrapped(provider: FakeProvider) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="provider", max_concurrent=1)
    holders = ThreadHolders(limiter)
    oa = openai.OpenAI(
        api_key=KEY,
        base_url=f"{provider.url}/v1",
        http_client=slotwise.httpx.wrap(openai.DefaultHttpxClient(), limiter=limiter),
    )
    an = anthropic.Anthropic(
        api_key=KEY,
        base_url=provider.url,
        http_client=slotwise.httpx.wrap(anthropic.DefaultHttpxClient(), limiter=limiter),
    )
    messages = [{"role": "user", "content": "hi"}]
    completion = oa.chat.completions.create(model="fake", messages=messages)  # type: ignore[arg-type]
    assert completion.choices[0].message.content == "ok"
    texts = []
    with an.messages.stream(
        model="fake",
        max_tokens=16,
        messages=messages,  # type: ignore[arg-type]
        extra_headers={"x-fake-chunks": "3"},
    ) as stream:
        for text in stream.text_stream:
            texts.append(text)
            assert holders.held == 1
    assert texts == ["t0", "t1", "t2"]
    assert [e.outcome for e in holders.released()] == ["completed", "completed"]
    oa.close()
    an.close()


def test_sync_clients_in_threads_and_async_clients_on_loops_share_one_limit(
    provider: FakeProvider,
) -> None:
    """8 threads with the sync OpenAI client, an asyncio loop and a trio run (in threads of
    their own) with AsyncOpenAI and AsyncAnthropic, all on one MemoryLimiter of 4."""
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="provider",
        max_concurrent=4,
        workloads={"interactive": Workload(reserved=1, priority=10), "batch": Workload()},
        default_workload="batch",
    )
    holders = ThreadHolders(limiter)
    headers = {"x-fake-delay": "0.03"}
    messages = [{"role": "user", "content": "hi"}]
    sync = openai.OpenAI(
        api_key=KEY,
        base_url=f"{provider.url}/v1",
        http_client=slotwise.httpx.sync_client(limiter=limiter),
    )
    done: list[str] = []

    def sync_work(i: int) -> None:
        for _ in range(4):
            sync.chat.completions.create(model="fake", messages=messages, extra_headers=headers)  # type: ignore[arg-type]
            done.append("sync")

    async def loop_work(backend: str) -> None:
        http = slotwise.httpx.client(limiter=limiter, workload="interactive")
        if backend == "asyncio":
            client: Any = openai.AsyncOpenAI(
                api_key=KEY, base_url=f"{provider.url}/v1", http_client=http
            )

            async def call() -> None:
                await client.chat.completions.create(
                    model="fake", messages=messages, extra_headers=headers
                )
        else:
            client = anthropic.AsyncAnthropic(api_key=KEY, base_url=provider.url, http_client=http)

            async def call() -> None:
                await client.messages.create(
                    model="fake", max_tokens=4, messages=messages, extra_headers=headers
                )

        async def task() -> None:
            for _ in range(3):
                await call()
                done.append(backend)

        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(task)
        await client.close()

    def work(i: int) -> None:
        if i < 8:
            sync_work(i)
        else:
            anyio.run(loop_work, ["asyncio", "trio"][i - 8], backend=["asyncio", "trio"][i - 8])

    in_threads(10, work, timeout=120)
    sync.close()
    assert sorted(set(done)) == ["asyncio", "sync", "trio"]
    assert len(done) == provider.requests == 8 * 4 + 2 * 6 * 3
    assert 2 <= provider.max_active <= 4
    assert len(holders.released()) == provider.requests
    assert active(limiter) == 0


# -- plain sync httpx2 and httpx clients ----------------------------------------------------


@pytest.mark.parametrize("stack", STACKS)
def test_a_plain_request_holds_one_slot(provider: FakeProvider, stack: str) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=2)
    holders = ThreadHolders(limiter)
    with slotwise.httpx.sync_client(limiter=limiter, stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]
        assert c.post("/raw", json={}).json() == {"ok": True}
        assert active(limiter) == 0
    assert [e.kind for e in holders.events] == ["wait-started", "acquired", "released"]
    assert holders.released()[0].outcome == "completed"


@pytest.mark.parametrize("stack", STACKS)
def test_a_failed_request_gives_its_slot_back(stack: str) -> None:
    import socket

    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    holders = ThreadHolders(limiter)
    with socket.socket() as nobody:
        nobody.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{nobody.getsockname()[1]}"
        c = slotwise.httpx.sync_client(limiter=limiter, stack=stack, base_url=url)  # type: ignore[call-overload]
        with c, pytest.raises(Exception, match=r"(?i)connect|refused"):
            c.get("/")
    assert [e.outcome for e in holders.released()] == ["failed"]
    assert active(limiter) == 0


@pytest.mark.parametrize("stack", STACKS)
def test_an_error_response_is_failed_read_or_closed_unread(
    provider: FakeProvider, stack: str
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    holders = ThreadHolders(limiter)
    with slotwise.httpx.sync_client(limiter=limiter, stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]
        with c.stream("POST", "/raw", json={}, headers={"x-fake-429": "1"}) as response:
            assert response.status_code == 429
        assert c.post("/raw", json={}, headers={"x-fake-429": "1"}).status_code == 429
    assert [e.outcome for e in holders.released()] == ["failed", "failed"]


@pytest.mark.parametrize("stack", STACKS)
def test_an_abandoned_response_gets_its_slot_back_when_collected(
    provider: FakeProvider, stack: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With no idle bound: only the collector can tell. The finalizer, run in whatever thread
    collects, hands the response to the reclaimer thread, which closes it."""
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    holders = ThreadHolders(limiter)
    c = slotwise.httpx.sync_client(  # type: ignore[call-overload]
        limiter=limiter, stack=stack, base_url=provider.url, idle_timeout=None
    )
    with c:
        request = c.build_request(
            "POST",
            "/raw",
            json={"stream": True},
            headers={"x-fake-chunks": "1000", "x-fake-delay": "0.01"},
        )
        # Never read: a dropped iterator of the body would close the response itself.
        response = c.send(request, stream=True)
        assert holders.held == 1
        time.sleep(0.2)
        assert not holders.released()
        with caplog.at_level(logging.WARNING, logger="slotwise"):
            del response
            gc.collect()
            wait_for(lambda: bool(holders.released()))
        assert [e.outcome for e in holders.released()] == ["cancelled"]
        ended = holders.kinds("reclaimed", "released")
        assert [e.kind for e in ended] == ["reclaimed", "released"]
        assert ended[0].lease_id == ended[1].lease_id  # type: ignore[union-attr]
        assert any("garbage collected" in r.getMessage() for r in caplog.records)
        wait_for(lambda: provider.disconnects >= 1)  # the body was closed: the server saw it
        assert c.post("/raw", json={}).status_code == 200


@pytest.mark.parametrize("stack", STACKS)
def test_closing_the_client_gives_back_the_slots_of_open_responses(
    provider: FakeProvider, stack: str
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=2)
    holders = ThreadHolders(limiter)
    c = slotwise.httpx.sync_client(limiter=limiter, stack=stack, base_url=provider.url)  # type: ignore[call-overload]
    request = c.build_request(
        "POST", "/raw", json={"stream": True}, headers={"x-fake-chunks": "1000"}
    )
    response = c.send(request, stream=True)
    assert holders.held == 1
    c.close()
    assert [e.outcome for e in holders.released()] == ["cancelled"]
    response.close()
    assert len(holders.released()) == 1


@pytest.mark.parametrize("stack", STACKS)
def test_a_request_waits_for_a_pool_connection_without_a_slot(
    provider: FakeProvider, stack: str
) -> None:
    """The pool's timeout bounds that wait, as it bounds the pool's own."""
    module = pytest.importorskip(stack)
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=4)
    holders = ThreadHolders(limiter)
    c = slotwise.httpx.sync_client(  # type: ignore[call-overload]
        limiter=limiter,
        stack=stack,
        base_url=provider.url,
        limits=module.Limits(max_connections=1),
        timeout=module.Timeout(5.0, pool=0.2),
    )
    slow = threading.Thread(target=lambda: c.post("/raw", json={}, headers={"x-fake-delay": "1.0"}))
    with c:
        slow.start()
        wait_for(lambda: provider.active == 1)
        with pytest.raises(module.PoolTimeout):
            c.post("/raw", json={})
        assert active(limiter) == 1
        slow.join(10)
    assert len(holders.kinds("acquired")) == 1
    assert provider.requests == 1


def endless_body(module: Any, pauses: list[float]) -> Any:
    """A sync response body whose chunks come after ``pauses``, then never again (until it is
    closed)."""

    class Body(module.SyncByteStream):  # type: ignore[misc]
        def __init__(self) -> None:
            self.closed = threading.Event()

        def __iter__(self) -> Iterator[bytes]:
            for pause in pauses:
                time.sleep(pause)
                yield b"x"
            self.closed.wait(30)

        def close(self) -> None:
            self.closed.set()

    return Body()


@pytest.mark.parametrize("stack", STACKS)
def test_a_body_left_unread_gives_its_slot_back_after_the_idle_bound(stack: str) -> None:
    """With ``idle_timeout=1``: a body read every 0.6 s keeps its slot, and so does one whose
    next chunk takes the server 1.5 s to send (a read is in progress); left unread for 1 s, it
    is closed by the reclaimer thread and its slot given back, and reading it again raises
    ``ReadError``."""
    module = pytest.importorskip(stack)
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    holders = ThreadHolders(limiter)
    reclaimed_at: list[float] = []
    limiter.subscribe(
        lambda event: reclaimed_at.append(time.monotonic()) if event.kind == "reclaimed" else None
    )
    body = endless_body(module, [0, 0, 1.5])
    mock = module.MockTransport(
        lambda request: module.Response(200, stream=body if request.url.path == "/" else None)
    )
    transport = slotwise.httpx.transport(mock, limiter=limiter, idle_timeout=1.0)
    with module.Client(transport=transport, base_url="http://provider") as c:
        response = c.send(c.build_request("GET", "/"), stream=True)
        chunks = response.iter_raw()
        next(chunks)
        time.sleep(0.6)
        next(chunks)
        time.sleep(0.6)  # 1.2 s since the first read, 0.6 s since the last: held
        assert not holders.kinds("reclaimed")
        next(chunks)  # the server takes 1.5 s: never idle while a read waits
        last_read = time.monotonic()
        time.sleep(0.6)
        assert not holders.kinds("reclaimed")
        assert holders.held == 1
        wait_for(lambda: bool(holders.released()))
        assert 1.0 <= reclaimed_at[0] - last_read < 2.5
        assert [e.kind for e in holders.kinds("reclaimed", "released")] == ["reclaimed", "released"]
        assert holders.released()[0].outcome == "cancelled"
        assert body.closed.is_set()
        with pytest.raises(module.ReadError, match="idle_timeout"):
            next(chunks)
        response.close()
        assert c.get("/next").status_code == 200  # the only slot is free again
    assert len(holders.released()) == 2


@pytest.mark.parametrize("stack", STACKS)
def test_a_mock_transport_stays_both_sync_and_async(stack: str) -> None:
    module = pytest.importorskip(stack)
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    holders = ThreadHolders(limiter)
    mock = module.MockTransport(lambda request: module.Response(200, json={"mocked": True}))
    transport = slotwise.httpx.transport(mock, limiter=limiter)
    with module.Client(transport=transport, base_url="http://mock") as c:
        assert c.get("/").json() == {"mocked": True}

    async def main() -> None:
        async with module.AsyncClient(transport=transport, base_url="http://mock") as c:
            assert (await c.get("/")).json() == {"mocked": True}

    anyio.run(main)
    assert [e.outcome for e in holders.released()] == ["completed", "completed"]


@pytest.mark.parametrize("stack", STACKS)
def test_a_thread_started_from_a_run_uses_its_limiter_and_workload(
    provider: FakeProvider, stack: str
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="p",
        max_concurrent=2,
        workloads={"a": Workload(), "b": Workload()},
        default_workload="a",
    )
    holders = ThreadHolders(limiter)
    c = slotwise.httpx.sync_client(stack=stack, base_url=provider.url)  # type: ignore[call-overload]

    async def main() -> str:
        await anyio.to_thread.run_sync(lambda: c.post("/raw", json={}))  # outside a run
        assert holders.events == []
        async with slotwise.run(limiter=limiter, workload="b") as run:
            await anyio.to_thread.run_sync(lambda: c.post("/raw", json={}))
        return run.run_id

    run_id = anyio.run(main)
    c.close()
    assert [(e.workload, e.run_id) for e in holders.kinds("acquired")] == [("b", run_id)]


class AsyncOnlyLimiter:
    """A custom limiter that can only wait on an event loop."""

    name = "async-only"

    async def acquire(self, request: slotwise.AcquireRequest) -> slotwise.Lease:
        raise AssertionError("never used")

    async def renew(self, lease: slotwise.Lease) -> slotwise.Lease | None:
        return lease

    async def release(self, lease: slotwise.Lease) -> None:
        pass


def test_what_cannot_serve_a_sync_client_is_refused_clearly(provider: FakeProvider) -> None:
    import httpx2

    with pytest.raises(slotwise.ConcurrencyConfigError, match="block"):
        slotwise.httpx.sync_client(limiter=AsyncOnlyLimiter())
    with pytest.raises(slotwise.ConcurrencyConfigError, match="block"):
        slotwise.httpx.transport(httpx2.HTTPTransport(), limiter=AsyncOnlyLimiter())
    with pytest.raises(TypeError, match="Client"):
        slotwise.httpx.wrap(object())
    with pytest.raises(TypeError, match="BaseTransport"):
        slotwise.httpx.transport(object())
    # A sync client used inside a running event loop would block it: refused, nothing sent.
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    c = slotwise.httpx.sync_client(limiter=limiter, base_url=provider.url)

    async def main() -> None:
        with pytest.raises(slotwise.ConcurrencyConfigError, match="event loop"):
            c.post("/raw", json={})

    anyio.run(main)
    c.close()
    assert provider.requests == 0


def test_a_forked_child_reclaims_with_a_reclaimer_of_its_own() -> None:
    """The parent's reclaimer thread does not survive a fork: the child starts its own."""
    if not hasattr(os, "fork"):
        pytest.skip("no os.fork() on this platform")
    script = textwrap.dedent(
        """
        import os, sys, threading, httpx2, slotwise, slotwise.httpx

        limiter = slotwise.MemoryLimiter(name="p", max_concurrent=1)
        released = threading.Event()
        limiter.subscribe(lambda e: released.set() if e.kind == "released" else None)

        class Body(httpx2.SyncByteStream):
            def __iter__(self):
                yield b"x"
                threading.Event().wait(30)

        mock = httpx2.MockTransport(lambda request: httpx2.Response(200, stream=Body()))
        c = httpx2.Client(transport=slotwise.httpx.transport(
            mock, limiter=limiter, idle_timeout=0.2))

        def abandon():
            response = c.send(c.build_request("GET", "http://x/"), stream=True)
            chunks = response.iter_raw()
            next(chunks)
            return response, chunks

        kept = [abandon()]  # the parent's reclaimer starts, and takes the slot back
        assert released.wait(10)
        released.clear()
        pid = os.fork()
        if pid == 0:
            kept.append(abandon())
            os._exit(0 if released.wait(10) else 1)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_a_subscriber_that_raises_system_exit_does_not_stop_the_reclaims() -> None:
    """A subscriber raising SystemExit on `reclaimed`, in the reclaimer thread: that response's
    slot goes back all the same, and so do those of responses abandoned afterwards."""
    import httpx

    class Body(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            yield b"x"

    class Inner(httpx.BaseTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, stream=Body())

    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=2)
    quits = [True]

    def quit_once(event: ConcurrencyEvent) -> None:
        if event.kind == "reclaimed" and quits.pop():
            sys.exit("a subscriber quits")

    unsubscribe = slotwise.subscribe(quit_once, limiter)
    wrapped = slotwise.httpx.transport(Inner(), limiter=limiter, idle_timeout=None)
    try:
        with httpx.Client(transport=wrapped, base_url="http://test") as c:
            for _ in range(2):
                response = c.send(c.build_request("GET", "/"), stream=True)
                assert active(limiter) == 1
                del response
                gc.collect()
                wait_for(lambda: active(limiter) == 0)
    finally:
        unsubscribe()
