"""slotwise.httpx with plain httpx and httpx2 clients against the fake provider.

Every test runs on asyncio and trio, with both HTTP stacks.
"""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import trio
import trio.testing

import slotwise
import slotwise.httpx
from slotwise import ConcurrencyEvent, MemoryLimiter

from ._helpers import Holders, closes_early, wait_until
from .conftest import FakeProvider

pytestmark = pytest.mark.anyio

STACKS = ["httpx2", "httpx"]


@pytest.mark.parametrize("stack", STACKS)
async def test_a_plain_request_holds_one_slot(provider: FakeProvider, stack: str) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=2)
    holders = Holders(limiter)
    async with slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]
        response = await c.post("/raw", json={})
        assert response.json() == {"ok": True}
        assert (await limiter.stats()).active == 0
    assert [e.kind for e in holders.events] == ["wait-started", "acquired", "released"]
    assert holders.released()[0].outcome == "completed"


@pytest.mark.parametrize("stack", STACKS)
async def test_concurrent_requests_never_exceed_the_limit(
    provider: FakeProvider, stack: str
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=3)
    holders = Holders(limiter)
    async with slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]

        async def one(i: int) -> None:
            body = {"stream": i % 2 == 0}
            async with c.stream("POST", "/raw", json=body, headers={"x-fake-delay": "0.01"}) as r:
                async for _ in r.aiter_bytes():
                    pass

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(one, i)
    assert provider.requests == 20
    assert 1 <= provider.max_active <= 3
    assert holders.max_held <= 3
    assert len(holders.kinds("released")) == 20


@pytest.mark.parametrize("stack", STACKS)
async def test_without_a_limiter_the_server_sees_them_all_at_once(
    provider: FakeProvider, stack: str
) -> None:
    """The control for the test above: the server's counter does see concurrency."""
    async with slotwise.httpx.client(stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]

        async def one() -> None:
            await c.post("/raw", json={}, headers={"x-fake-delay": "0.3"})

        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(one)
    assert provider.max_active > 3


@pytest.mark.parametrize("stack", STACKS)
async def test_a_stream_holds_its_slot_until_read_to_the_end(
    provider: FakeProvider, stack: str
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    holders = Holders(limiter)
    async with slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]
        request = c.build_request(
            "POST", "/raw", json={"stream": True}, headers={"x-fake-chunks": "5"}
        )
        response = await c.send(request, stream=True)
        seen = 0
        async for _ in response.aiter_raw():
            seen += 1
            assert not holders.kinds("released")
            assert (await limiter.stats()).active == 1
        assert seen >= 1
        assert (await limiter.stats()).active == 0
        assert [e.outcome for e in holders.released()] == ["completed"]
        await response.aclose()
        assert len(holders.released()) == 1


@closes_early
@pytest.mark.parametrize("stack", STACKS)
async def test_a_stream_closed_by_another_task_gives_its_slot_back(
    provider: FakeProvider, stack: str
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    holders = Holders(limiter)
    async with slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]
        request = c.build_request(
            "POST", "/raw", json={"stream": True}, headers={"x-fake-chunks": "1000"}
        )
        response = await c.send(request, stream=True)
        chunks = response.aiter_raw()
        await chunks.__anext__()
        assert (await limiter.stats()).active == 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(response.aclose)
        assert (await limiter.stats()).active == 0
        assert [e.outcome for e in holders.released()] == ["cancelled"]
        await chunks.aclose()
        # The next request gets the only slot.
        assert (await c.post("/raw", json={})).status_code == 200
    await wait_until(lambda: provider.disconnects >= 1)


@closes_early
@pytest.mark.parametrize("stack", STACKS)
async def test_an_abandoned_response_gets_its_slot_back_when_collected(
    provider: FakeProvider, stack: str, caplog: pytest.LogCaptureFixture
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    holders = Holders(limiter)
    async with slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]
        request = c.build_request(
            "POST", "/raw", json={"stream": True}, headers={"x-fake-chunks": "1000"}
        )
        response = await c.send(request, stream=True)
        assert (await limiter.stats()).active == 1
        del response, request
        with caplog.at_level(logging.WARNING, logger="slotwise"):
            gc.collect()
            await wait_until(lambda: bool(holders.released()))
        assert [e.outcome for e in holders.released()] == ["cancelled"]
        ended = holders.kinds("reclaimed", "released")
        assert [e.kind for e in ended] == ["reclaimed", "released"]
        assert ended[0].source == "unclosed-response"  # type: ignore[union-attr]
        assert ended[0].lease_id == ended[1].lease_id  # type: ignore[union-attr]
        assert (await limiter.stats()).active == 0
        assert any("garbage collected" in r.getMessage() for r in caplog.records)
        # The abandoned body was closed too: the server saw the client go.
        await wait_until(lambda: provider.disconnects >= 1)
        assert (await c.post("/raw", json={})).status_code == 200


@closes_early
@pytest.mark.parametrize("stack", STACKS)
async def test_closing_the_client_gives_back_the_slots_of_open_responses(
    provider: FakeProvider, stack: str
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=2)
    c = slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url)  # type: ignore[call-overload]
    request = c.build_request(
        "POST", "/raw", json={"stream": True}, headers={"x-fake-chunks": "1000"}
    )
    response = await c.send(request, stream=True)
    assert (await limiter.stats()).active == 1
    await c.aclose()
    assert (await limiter.stats()).active == 0
    await response.aclose()


@pytest.mark.parametrize("stack", STACKS)
async def test_a_failed_request_gives_its_slot_back(stack: str) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    holders = Holders(limiter)
    with socket_nobody_listens() as url:
        async with slotwise.httpx.client(limiter=limiter, stack=stack, base_url=url) as c:  # type: ignore[call-overload]
            with pytest.raises(Exception, match=r"(?i)connect|refused"):
                await c.get("/")
    assert [e.outcome for e in holders.released()] == ["failed"]
    assert (await limiter.stats()).active == 0


@pytest.mark.parametrize("stack", STACKS)
async def test_a_request_cancelled_while_sent_gives_its_slot_back(
    provider: FakeProvider, stack: str
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    holders = Holders(limiter)
    async with slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]
        with anyio.move_on_after(0.2):
            await c.post("/raw", json={}, headers={"x-fake-delay": "30"})
        assert [e.outcome for e in holders.released()] == ["cancelled"]
        assert (await limiter.stats()).active == 0


@pytest.mark.parametrize("stack", STACKS)
async def test_a_transport_cancelled_inside_a_task_group_reports_a_cancellation(
    stack: str, anyio_backend_name: str
) -> None:
    """A trio nursery cancelled from outside raises a group made only of cancellations: that
    is a cancellation, not a failure (asyncio's task groups raise the cancellation itself)."""
    module = pytest.importorskip(stack)
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    holders = Holders(limiter)

    async def handler(request: Any) -> Any:
        if anyio_backend_name == "trio":
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)
                await trio.sleep_forever()
        else:
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.sleep_forever)
                await anyio.sleep_forever()
        raise AssertionError("never answers")

    transport = slotwise.httpx.transport(module.MockTransport(handler), limiter=limiter)
    async with module.AsyncClient(transport=transport, base_url="http://mock") as c:
        with anyio.move_on_after(0.05):
            await c.get("/")
    assert [e.outcome for e in holders.released()] == ["cancelled"]


@pytest.mark.parametrize("stack", STACKS)
async def test_a_full_queue_reaches_the_caller_unchanged(
    provider: FakeProvider, stack: str
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1, max_queued=0)
    async with slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]
        held = await slotwise.acquire(limiter=limiter)
        with pytest.raises(slotwise.ConcurrencyQueueFullError):
            await c.post("/raw", json={})
        await held.release()


@pytest.mark.parametrize("stack", STACKS)
async def test_the_current_runs_limiter_and_workload_are_used(
    provider: FakeProvider, stack: str
) -> None:
    limiter: MemoryLimiter[str] = MemoryLimiter(
        name="p",
        max_concurrent=2,
        workloads={"a": slotwise.Workload(), "b": slotwise.Workload()},
        default_workload="a",
    )
    holders = Holders(limiter)
    async with slotwise.httpx.client(stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]
        await c.post("/raw", json={})  # outside a run: not limited
        assert holders.events == []
        async with slotwise.run(limiter=limiter, workload="b") as run:
            await c.post("/raw", json={})
    acquired = holders.kinds("acquired")
    assert [(e.workload, e.run_id) for e in acquired] == [("b", run.run_id)]


@pytest.mark.parametrize("stack", STACKS)
async def test_wrap_keeps_the_clients_own_settings(provider: FakeProvider, stack: str) -> None:
    module = pytest.importorskip(stack)
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    holders = Holders(limiter)
    mounted = module.AsyncHTTPTransport()
    original = module.AsyncClient(
        base_url=provider.url, headers={"x-team": "a"}, mounts={"http://127.0.0.1": mounted}
    )
    c = slotwise.httpx.wrap(original, limiter=limiter, workload="default")
    assert c is original
    async with c:
        response = await c.post("/raw", json={})
    assert response.request.headers["x-team"] == "a"
    assert len(holders.kinds("released")) == 1


def test_wrap_and_transport_refuse_other_objects() -> None:
    with pytest.raises(TypeError, match="AsyncClient"):
        slotwise.httpx.wrap(object())
    with pytest.raises(TypeError, match="AsyncBaseTransport"):
        slotwise.httpx.transport(object())
    with pytest.raises(ValueError, match="stack"):
        slotwise.httpx.client(stack="requests")  # type: ignore[call-overload]


def test_import_slotwise_imports_no_http_stack() -> None:
    code = (
        "import sys, slotwise, slotwise.httpx, slotwise.opentelemetry; "
        "print(sorted(m for m in ('httpx', 'httpx2', 'openai', 'anthropic') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class socket_nobody_listens:
    """A loopback URL on which nothing listens."""

    def __enter__(self) -> str:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self._sock.close()


@pytest.mark.parametrize("stack", STACKS)
async def test_a_response_already_in_memory_gives_its_slot_back_at_once(stack: str) -> None:
    module = pytest.importorskip(stack)
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    holders = Holders(limiter)
    mock = module.MockTransport(lambda request: module.Response(200, json={"mocked": True}))
    async with module.AsyncClient(
        transport=slotwise.httpx.transport(mock, limiter=limiter), base_url="http://mock"
    ) as c:
        assert (await c.get("/")).json() == {"mocked": True}
        assert (await limiter.stats()).active == 0
        assert (await c.get("/")).json() == {"mocked": True}
    assert [e.outcome for e in holders.released()] == ["completed", "completed"]


@pytest.mark.parametrize("stack", STACKS)
async def test_an_error_response_closed_unread_is_failed(
    provider: FakeProvider, stack: str
) -> None:
    """As when its body is read: the attempt failed, however its body ends."""
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    holders = Holders(limiter)
    async with slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]
        async with c.stream("POST", "/raw", json={}, headers={"x-fake-429": "1"}) as response:
            assert response.status_code == 429
        assert (await c.post("/raw", json={}, headers={"x-fake-429": "1"})).status_code == 429
    assert [e.outcome for e in holders.released()] == ["failed", "failed"]


def test_a_missing_stack_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "httpx2", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'slotwise\[httpx\]'"):
        slotwise.httpx.client()
    monkeypatch.setitem(sys.modules, "httpx", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install httpx$"):
        slotwise.httpx.client(stack="httpx")


def test_idle_timeout_is_a_positive_number_of_seconds_or_none() -> None:
    import httpx2

    mock = httpx2.MockTransport(lambda request: httpx2.Response(200))
    for bad in (0, -1.0, float("nan"), "60", True):
        with pytest.raises(slotwise.ConcurrencyConfigError, match="idle_timeout"):
            slotwise.httpx.transport(mock, idle_timeout=bad)  # type: ignore[arg-type]
    slotwise.httpx.transport(mock, idle_timeout=None)


@pytest.mark.parametrize("stack", STACKS)
async def test_the_client_pools_and_redirects_as_the_sdks_do(
    provider: FakeProvider, stack: str
) -> None:
    """1000 connections (httpx's own default is 100) and redirects followed, as in the SDKs'
    `DefaultAsyncHttpxClient`: a limiter above 100 is not capped by the pool."""
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=150)
    holders = Holders(limiter)
    async with slotwise.httpx.client(limiter=limiter, stack=stack, base_url=provider.url) as c:  # type: ignore[call-overload]

        async def one() -> None:
            await c.post("/raw", json={}, headers={"x-fake-delay": "2.0"})

        async with anyio.create_task_group() as tg:
            for _ in range(150):
                tg.start_soon(one)
        assert provider.max_active > 100
        response = await c.post("/redirect/raw", json={})
        assert response.json() == {"ok": True}
    assert provider.redirects == 1
    assert len(holders.released()) == 152


@pytest.mark.parametrize("stack", STACKS)
async def test_a_request_waits_for_a_pool_connection_without_a_slot(
    provider: FakeProvider, stack: str
) -> None:
    """The pool's timeout bounds that wait, as it bounds the pool's own."""
    module = pytest.importorskip(stack)
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=4)
    holders = Holders(limiter)
    c = slotwise.httpx.client(  # type: ignore[call-overload]
        limiter=limiter,
        stack=stack,
        base_url=provider.url,
        limits=module.Limits(max_connections=1),
        timeout=module.Timeout(5.0, pool=0.2),
    )
    async with c, anyio.create_task_group() as tg:
        tg.start_soon(lambda: c.post("/raw", json={}, headers={"x-fake-delay": "1.0"}))
        await wait_until(lambda: provider.active == 1)
        with pytest.raises(module.PoolTimeout):
            await c.post("/raw", json={})
        assert (await limiter.stats()).active == 1
    assert len(holders.kinds("acquired")) == 1
    assert provider.requests == 1


@pytest.mark.parametrize("stack", STACKS)
async def test_a_client_wrapped_twice_takes_both_slots_once_a_connection_is_free(
    provider: FakeProvider, stack: str
) -> None:
    module = pytest.importorskip(stack)
    per_key: MemoryLimiter[str] = MemoryLimiter(name="key", max_concurrent=4)
    overall: MemoryLimiter[str] = MemoryLimiter(name="all", max_concurrent=4)
    holders = Holders(per_key), Holders(overall)
    c = module.AsyncClient(base_url=provider.url, limits=module.Limits(max_connections=1))
    slotwise.httpx.wrap(slotwise.httpx.wrap(c, limiter=per_key), limiter=overall)

    async def one() -> None:
        await c.post("/raw", json={}, headers={"x-fake-delay": "0.1"})

    async with c, anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(one)
    assert provider.requests == 3
    assert [h.max_held for h in holders] == [1, 1]
    assert [len(h.released()) for h in holders] == [3, 3]


def endless_body(module: Any, pauses: list[float]) -> Any:
    """A response body whose chunks come after ``pauses``, then never again."""

    class Body(module.AsyncByteStream):  # type: ignore[misc]
        closed = False

        async def __aiter__(self) -> AsyncIterator[bytes]:
            for pause in pauses:
                await anyio.sleep(pause)
                yield b"x"
            await anyio.sleep_forever()

        async def aclose(self) -> None:
            self.closed = True

    return Body()


async def idle_scenario(stack: str, scale: float) -> None:
    """With ``idle_timeout=10``: a body read every 6 keeps its slot, and so does one whose
    next chunk takes the server 15 to send (a read is in progress); left unread for 10, it
    is closed and its slot given back, and reading it again raises ``ReadError``."""
    module = pytest.importorskip(stack)
    limiter: MemoryLimiter[str] = MemoryLimiter(name="p", max_concurrent=1)
    holders = Holders(limiter)
    reclaimed_at: list[float] = []

    def on_event(event: ConcurrencyEvent) -> None:
        if event.kind == "reclaimed":
            reclaimed_at.append(anyio.current_time())

    limiter.subscribe(on_event)
    body = endless_body(module, [0, 0, 15 * scale])
    mock = module.MockTransport(
        lambda request: module.Response(200, stream=body if request.url.path == "/" else None)
    )
    transport = slotwise.httpx.transport(mock, limiter=limiter, idle_timeout=10 * scale)
    async with module.AsyncClient(transport=transport, base_url="http://provider") as c:
        response = await c.send(c.build_request("GET", "/"), stream=True)
        chunks = response.aiter_raw()
        await chunks.__anext__()
        await anyio.sleep(6 * scale)
        await chunks.__anext__()
        await anyio.sleep(6 * scale)  # 12 since the first read, 6 since the last: held
        assert not holders.kinds("reclaimed")
        await chunks.__anext__()  # the server takes 15: never idle while a read waits
        last_read = anyio.current_time()
        await anyio.sleep(7 * scale)
        assert not holders.kinds("reclaimed")
        assert (await limiter.stats()).active == 1
        await wait_until(lambda: bool(holders.released()))
        assert 10 * scale <= reclaimed_at[0] - last_read < 10 * scale + 0.5
        assert [e.kind for e in holders.kinds("reclaimed", "released")] == ["reclaimed", "released"]
        assert holders.released()[0].outcome == "cancelled"
        assert body.closed
        with pytest.raises(module.ReadError, match="idle_timeout"):
            await chunks.__anext__()
        await response.aclose()
        assert (await c.get("/next")).status_code == 200  # the only slot is free again
    assert len(holders.released()) == 2


@closes_early
@pytest.mark.parametrize("stack", STACKS)
def test_a_body_left_unread_gives_its_slot_back_after_the_idle_bound_on_a_mock_clock(
    stack: str,
) -> None:
    anyio.run(
        idle_scenario,
        stack,
        1.0,
        backend="trio",
        backend_options={"clock": trio.testing.MockClock(autojump_threshold=0)},
    )


@closes_early
@pytest.mark.parametrize("stack", STACKS)
def test_a_body_left_unread_gives_its_slot_back_after_the_idle_bound_on_asyncio(
    stack: str,
) -> None:
    anyio.run(idle_scenario, stack, 0.1, backend="asyncio")
