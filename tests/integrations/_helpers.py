"""What the integration tests share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

import slotwise
from slotwise import ConcurrencyEvent, ReleasedEvent

# httpx, httpx2 and the SDKs leave some of their async generators unfinished when a body is
# closed before its end (and the SDKs even when a stream ends: they break out of their SSE
# iterators). trio reports each one with a ResourceWarning when it is collected; asyncio
# finalizes them silently. The same happens without slotwise, so the tests that close streams
# accept exactly these warnings, and no others.
closes_early = pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. <async_generator object "
    r"(BoundAsyncStream|AsyncResponseStream|PoolByteStream|HTTP11ConnectionByteStream|"
    r"AsyncHTTP11Connection|Response|AsyncStream|SSEDecoder|SSEBytesDecoder)\.:"
    "pytest.PytestUnraisableExceptionWarning"
)


class Holders:
    """Counts the slots held at once, from the limiter's events."""

    def __init__(self, limiter: Any) -> None:
        self.events: list[ConcurrencyEvent] = []
        self.held = 0
        self.max_held = 0
        self.unsubscribe = slotwise.subscribe(self._on_event, limiter=limiter)

    def _on_event(self, event: ConcurrencyEvent) -> None:
        self.events.append(event)
        if event.kind == "acquired":
            self.held += 1
            self.max_held = max(self.max_held, self.held)
        elif event.kind == "released":
            self.held -= 1

    def kinds(self, *kinds: str) -> list[ConcurrencyEvent]:
        return [e for e in self.events if e.kind in kinds]

    def released(self) -> list[ReleasedEvent]:
        return [e for e in self.events if isinstance(e, ReleasedEvent)]


async def wait_until(condition: Callable[[], bool]) -> None:
    """Let other tasks (and other threads) run until ``condition`` holds (10 s at most)."""
    # Polling: the conditions read state that other threads (the server, the collector) change.
    with anyio.fail_after(10):
        while not condition():  # noqa: ASYNC110
            await anyio.sleep(0.005)
