"""Random schedules of requests through slotwise.httpx, with cancellations at awkward moments.

Each example sends requests through an httpx2 client whose mock transport streams bodies
slowly, and does something different with each response: reads it, closes it early in the
same task or from another one, abandons it to the garbage collector, keeps it but never reads
it (the idle bound takes its slot back), cancels the request while it waits or while it
reads, or lets sending fail. Throughout, the bodies being served at once
never outnumber the slots; at the end every slot has been given back exactly once.

The examples run on trio's MockClock (virtual time) and, fewer, on asyncio with real time.
"""

from __future__ import annotations

import gc
from typing import Any

import anyio
import httpx2
import pytest
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slotwise
import slotwise.httpx
from slotwise import ConcurrencyEvent, MemoryLimiter

from ._helpers import closes_early

ACTIONS = (
    "read",
    "close-early",
    "close-from-another-task",
    "abandon",
    "leave-unread",
    "cancel-while-waiting",
    "cancel-while-reading",
    "send-fails",
)


class Served:
    """The mock provider's side: how many bodies it is serving at once."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0

    def start(self) -> None:
        self.now += 1
        self.most = max(self.most, self.now)


class SlowBody(httpx2.AsyncByteStream):
    """A body of ``chunks`` chunks, one per ``pause`` seconds, counted while it is served."""

    def __init__(self, served: Served, chunks: int, pause: float) -> None:
        self._served = served
        self._left = chunks
        self._pause = pause
        self._open = True

    def __aiter__(self) -> SlowBody:
        return self

    async def __anext__(self) -> bytes:
        if self._left == 0:
            self._end()
            raise StopAsyncIteration
        await anyio.sleep(self._pause)
        self._left -= 1
        return b"x"

    async def aclose(self) -> None:
        self._end()

    def _end(self) -> None:
        if self._open:
            self._open = False
            self._served.now -= 1


request_plans = st.lists(
    st.tuples(
        st.sampled_from(ACTIONS),
        st.integers(min_value=0, max_value=4),  # chunks
        st.sampled_from([0.0, 0.001, 0.01]),  # pause between chunks, and before answering
        st.sampled_from([0.0, 0.002, 0.02]),  # when the request starts
    ),
    min_size=1,
    max_size=16,
)


async def run_schedule(limit: int, plan: list[tuple[str, int, float, float]], scale: float) -> None:
    served = Served()
    limiter: MemoryLimiter[str] = MemoryLimiter(name="schedule", max_concurrent=limit)
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)

    async def handler(request: httpx2.Request) -> httpx2.Response:
        pause = float(request.headers["x-pause"]) * scale
        served.start()
        try:
            await anyio.sleep(pause)
            if request.headers["x-fail"] == "1":
                raise httpx2.ConnectError("refused", request=request)
        except BaseException:
            served.now -= 1
            raise
        body = SlowBody(served, int(request.headers["x-chunks"]), pause)
        return httpx2.Response(200, stream=body)

    # Longer than any pause of a body that is being read: only a response left unread idles.
    transport = slotwise.httpx.transport(
        httpx2.MockTransport(handler), limiter=limiter, idle_timeout=2.0 * scale
    )
    client = httpx2.AsyncClient(transport=transport, base_url="http://provider")
    unread: list[httpx2.Response] = []

    async def one(action: str, chunks: int, pause: float, start: float) -> None:
        await anyio.sleep(start * scale)
        headers = {
            "x-chunks": str(chunks),
            "x-pause": str(pause),
            "x-fail": "1" if action == "send-fails" else "0",
        }
        request = client.build_request("GET", "/", headers=headers)
        if action == "cancel-while-waiting":
            with anyio.move_on_after(pause * scale):
                response = await client.send(request, stream=True)
                await response.aclose()
            return
        if action == "send-fails":
            with pytest.raises(httpx2.ConnectError):
                await client.send(request, stream=True)
            return
        response = await client.send(request, stream=True)
        if action == "read":
            await response.aread()
        elif action == "close-early":
            await response.aclose()
        elif action == "close-from-another-task":
            async with anyio.create_task_group() as tg:
                tg.start_soon(response.aclose)
        elif action == "cancel-while-reading":
            with anyio.move_on_after(pause * scale / 2):
                await response.aread()
            await response.aclose()
        elif action == "abandon":
            del response, request
            gc.collect()  # the slot comes back soon after, from the collector's finalizer
        elif action == "leave-unread":
            unread.append(response)  # the idle bound takes its slot back

    # A slot that never came back would leave requests waiting forever: fail instead.
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for step in plan:
                tg.start_soon(one, *step)

    assert served.most <= limit
    with anyio.fail_after(30):
        while (await limiter.stats()).active:  # noqa: ASYNC110  (the collector frees them)
            await anyio.sleep(0.001)
    assert served.now == 0  # reclaimed bodies were closed before their slots went back
    for response in unread:
        await response.aclose()
    await client.aclose()
    unsubscribe()
    reclaimed = [e.lease_id for e in events if e.kind == "reclaimed"]
    assert len(reclaimed) >= len(unread)
    acquired = [e.lease_id for e in events if e.kind == "acquired"]
    released = [e.lease_id for e in events if e.kind == "released"]
    assert sorted(acquired) == sorted(released)
    assert len(set(released)) == len(released)
    assert set(reclaimed) <= set(released)


@closes_early
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(limit=st.integers(min_value=1, max_value=3), plan=request_plans)
def test_random_schedules_on_a_mock_clock(limit: int, plan: list[Any]) -> None:
    anyio.run(
        run_schedule,
        limit,
        plan,
        1.0,
        backend="trio",
        backend_options={"clock": trio.testing.MockClock(autojump_threshold=0)},
    )


@closes_early
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(limit=st.integers(min_value=1, max_value=3), plan=request_plans)
def test_random_schedules_on_asyncio(limit: int, plan: list[Any]) -> None:
    anyio.run(run_schedule, limit, plan, 0.2, backend="asyncio")
