"""Cheap access to the running event loop's clock and identity, for the hot path.

``anyio.current_time()`` looks the backend up on every call; a slot reads the clock several
times, so these helpers ask the running loop directly. They return exactly what anyio would:
``loop.time()`` on asyncio, ``trio.current_time()`` on trio (MockClock included).
"""

from __future__ import annotations

import asyncio
import sys

__all__ = ("checkpoint", "loop_identity", "now")


def _trio_running() -> bool:
    trio = sys.modules.get("trio")
    return trio is not None and bool(trio.lowlevel.in_trio_run())


def now() -> float:
    """The running loop's clock, as ``anyio.current_time()`` reads it."""
    if _trio_running():
        return float(sys.modules["trio"].current_time())
    return asyncio.get_running_loop().time()


def loop_identity() -> object:
    """An object that identifies the running event loop for as long as it runs."""
    if _trio_running():
        return sys.modules["trio"].lowlevel.current_trio_token()
    return asyncio.get_running_loop()


async def checkpoint() -> None:
    """Yield to the loop once, raising if the task is cancelled: ``anyio.lowlevel.checkpoint``."""
    if _trio_running():
        await sys.modules["trio"].lowlevel.checkpoint()
    else:
        await asyncio.sleep(0)
