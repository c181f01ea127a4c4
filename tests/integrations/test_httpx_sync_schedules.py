"""Random schedules of requests through a sync client limited by slotwise.httpx, one thread
per request.

Each example sends requests from threads through an httpx2 `Client` whose mock transport
streams bodies slowly, and does something different with each response: reads it, closes it
early, closes it from another thread (after reading, or while another thread reads it),
abandons it (the finalizer hands it to the reclaimer thread), keeps it but never reads it
(the idle bound takes its slot back there), or lets sending fail. Throughout, the bodies being
served at once never outnumber the slots; at the end every slot has been given back exactly
once, and every body closed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slotwise.httpx
from slotwise import ConcurrencyEvent, MemoryLimiter

ACTIONS = (
    "read",
    "close-early",
    "close-from-another-thread",
    "close-while-another-thread-reads",
    "abandon",
    "leave-unread",
    "send-fails",
)
IDLE_TIMEOUT = 0.3


class Served:
    """The mock provider's side: how many bodies it is serving at once, from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0

    def start(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def end(self) -> None:
        with self.lock:
            self.now -= 1


class SlowBody(httpx2.SyncByteStream):
    """A body of ``chunks`` chunks, one per ``pause`` seconds, counted while it is served."""

    def __init__(self, served: Served, chunks: int, pause: float) -> None:
        self._served = served
        self._chunks = chunks
        self._pause = pause
        self._lock = threading.Lock()
        self._open = True

    def __iter__(self) -> Iterator[bytes]:
        for _ in range(self._chunks):
            time.sleep(self._pause)
            if not self._open:
                return
            yield b"x"
        self.close()

    def close(self) -> None:
        with self._lock:
            if not self._open:
                return
            self._open = False
        self._served.end()


request_plans = st.lists(
    st.tuples(
        st.sampled_from(ACTIONS),
        st.integers(min_value=0, max_value=4),  # chunks
        st.sampled_from([0.0, 0.001, 0.01]),  # pause between chunks, and before answering
        st.sampled_from([0.0, 0.002, 0.02]),  # when the request starts
    ),
    min_size=1,
    max_size=12,
)


def join_all(threads: list[threading.Thread], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a thread hung"


def run_schedule(limit: int, plan: list[tuple[str, int, float, float]]) -> None:
    served = Served()
    limiter: MemoryLimiter[str] = MemoryLimiter(name="schedule", max_concurrent=limit)
    events: list[ConcurrencyEvent] = []
    unsubscribe = limiter.subscribe(events.append)  # list.append is atomic

    def handler(request: httpx2.Request) -> httpx2.Response:
        pause = float(request.headers["x-pause"])
        served.start()
        time.sleep(pause)
        if request.headers["x-fail"] == "1":
            served.end()
            raise httpx2.ConnectError("refused", request=request)
        body = SlowBody(served, int(request.headers["x-chunks"]), pause)
        return httpx2.Response(200, stream=body)

    # Longer than any pause of a body that is being read: only a response left unread idles.
    transport = slotwise.httpx.transport(
        httpx2.MockTransport(handler), limiter=limiter, idle_timeout=IDLE_TIMEOUT
    )
    client = httpx2.Client(transport=transport, base_url="http://provider")
    unread: list[httpx2.Response] = []
    errors: list[BaseException] = []
    helpers: list[threading.Thread] = []

    def read(response: httpx2.Response) -> None:
        for _ in response.iter_raw():
            pass

    def helper(target: Any, *args: Any) -> threading.Thread:
        thread = threading.Thread(target=target, args=args)
        helpers.append(thread)
        thread.start()
        return thread

    def one(action: str, chunks: int, pause: float, start: float) -> None:
        try:
            time.sleep(start)
            headers = {
                "x-chunks": str(chunks),
                "x-pause": str(pause),
                "x-fail": "1" if action == "send-fails" else "0",
            }
            request = client.build_request("GET", "/", headers=headers)
            if action == "send-fails":
                try:
                    client.send(request, stream=True)
                except httpx2.ConnectError:
                    return
                raise AssertionError("sending should have failed")
            response = client.send(request, stream=True)
            if action == "read":
                response.read()
            elif action == "close-early":
                response.close()
            elif action == "close-from-another-thread":
                helper(response.close).join(10)
            elif action == "close-while-another-thread-reads":
                reader = helper(read, response)
                time.sleep(pause)
                response.close()
                reader.join(10)
            elif action == "abandon":
                del response, request  # the stream's finalizer runs at once, in this thread
            elif action == "leave-unread":
                unread.append(response)  # the idle bound takes its slot back
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=step) for step in plan]
    for thread in threads:
        thread.start()
    # A slot that never came back would leave requests waiting forever: fail instead.
    join_all(threads, 60)
    join_all(helpers, 10)
    assert not errors, errors
    assert served.most <= limit
    deadline = time.monotonic() + 10
    while anyio.run(limiter.stats).active:  # the reclaimer thread frees the last ones
        assert time.monotonic() < deadline, "a slot was never given back"
        time.sleep(0.005)
    assert served.now == 0  # reclaimed bodies were closed before their slots went back
    for response in unread:
        response.close()
    client.close()
    unsubscribe()
    reclaimed = [e.lease_id for e in events if e.kind == "reclaimed"]
    # Exactly the responses nobody closed: a closed one gives its slot back at once.
    assert len(reclaimed) == len(unread) + sum(step[0] == "abandon" for step in plan)
    acquired = [e.lease_id for e in events if e.kind == "acquired"]
    released = [e.lease_id for e in events if e.kind == "released"]
    assert sorted(acquired) == sorted(released)
    assert len(set(released)) == len(released)
    assert set(reclaimed) <= set(released)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(limit=st.integers(min_value=1, max_value=3), plan=request_plans)
def test_random_schedules_in_threads(limit: int, plan: list[Any]) -> None:
    run_schedule(limit, plan)
