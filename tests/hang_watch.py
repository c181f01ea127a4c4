"""A pytest plugin: a test still running after ``SLOTWISE_HANG_AFTER`` seconds (default 600: no
test comes near it) has hung. Every thread's stack and every open asyncio loop's tasks, each
with the chain of coroutines it awaits, are written to stderr, and the run ends (exit status
1, the test's output lost) instead of waiting for the CI's own time limit with nothing to
show. (trio's tasks are not listed: the stack of the thread that runs trio is.)

tests/conftest.py enables it for the test suite; ``-p hang_watch`` anywhere else.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import os
import sys
import threading
import time
from typing import Any, TextIO

import pytest

HANG_AFTER = float(os.environ.get("SLOTWISE_HANG_AFTER", "600"))
_current: dict[str, Any] = {}  # the test running, and since when


def await_chain(task: asyncio.Task[Any]) -> list[str]:
    """Where ``task`` waits: each coroutine it awaits, innermost last."""
    chain = []
    awaited: Any = task.get_coro()
    while awaited is not None:
        frame = (
            getattr(awaited, "cr_frame", None)
            or getattr(awaited, "ag_frame", None)
            or getattr(awaited, "gi_frame", None)
        )
        if frame is None:
            chain.append(f"    awaits {awaited!r}")
            break
        chain.append(f"    {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        awaited = (
            getattr(awaited, "cr_await", None)
            or getattr(awaited, "ag_await", None)
            or getattr(awaited, "gi_yieldfrom", None)
        )
    return chain


def write_hang(test: str, out: TextIO) -> None:
    print(f"\n== {test} still runs after {HANG_AFTER:g} s: it hangs", file=out)
    out.flush()
    faulthandler.dump_traceback(file=out, all_threads=True)
    for loop in [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)]:
        if loop.is_closed():
            continue
        print(f"-- {loop!r}", file=out)
        for task in asyncio.all_tasks(loop):
            print(f"  {task!r}", file=out)
            print("\n".join(await_chain(task)), file=out)
    out.flush()


def _watch(out: TextIO) -> None:
    while True:
        time.sleep(min(5.0, HANG_AFTER / 4))
        test, since = _current.get("test"), _current.get("since", 0.0)
        if test is not None and time.monotonic() - since > HANG_AFTER:
            write_hang(test, out)
            os._exit(1)


def pytest_configure(config: pytest.Config) -> None:
    # The process's stderr as it is now: pytest captures file descriptor 2 during tests.
    out = os.fdopen(os.dup(sys.__stderr__.fileno() if sys.__stderr__ else 2), "w")
    threading.Thread(target=_watch, args=(out,), name="slotwise-hang-watch", daemon=True).start()


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _current.update(test=nodeid, since=time.monotonic())


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _current["test"] = None
