"""What the garbage collector runs, and the thread that does it instead.

The collector closes the coroutines and generators of requests that nobody will resume (an
event loop closed with a request pending, a generator holding a slot in a reference cycle),
and their ends run inside it: in whatever thread it runs in, wherever an allocation set it
off, which may be inside a limiter's lock or a subscriber's own, and those locks are not
reentrant. So an end that takes such a lock (a withdrawal, a release, `not_succeeded()`,
an event's delivery) looks at `thread` first, and when the collector runs in its own thread
it is posted (`later`) to one daemon worker, which does the posted work in order. The worker
is started beforehand (`start`, with the first limiter or subscription), never by the
collector: starting a thread takes locks of `threading` that the collector may have
interrupted too, while `SimpleQueue.put` is safe there.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Callable
from queue import SimpleQueue

__all__ = ("later", "start", "thread")

_logger = logging.getLogger("slotwise")
_ident = threading.get_ident

thread: int | None = None  # the thread the collector is collecting in; None: it is not
_inbox: SimpleQueue[tuple[Callable[..., object], tuple[object, ...]]] = SimpleQueue()
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()


def _follow(phase: str, info: dict[str, int]) -> None:
    global thread
    thread = _ident() if phase == "start" else None


gc.callbacks.append(_follow)


def later(fn: Callable[..., object], *args: object) -> None:
    """Have ``fn(*args)`` done by the worker thread, after what was posted before it."""
    _inbox.put((fn, args))


def start() -> None:
    """Start the worker thread, once per process."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = threading.Thread(target=_work, name="slotwise-collected", daemon=True)
            _worker.start()


def _work() -> None:
    while True:
        fn, args = _inbox.get()
        try:
            fn(*args)
        except BaseException:  # a bug, or a subscriber's exit: it must not stop the others
            _logger.exception("slotwise: ending a request that the collector closed failed")


def _start_afresh() -> None:
    # A forked child keeps none of the parent's threads, and maybe a lock held by one.
    global _inbox, _worker, _worker_lock
    started = _worker is not None
    _inbox, _worker, _worker_lock = SimpleQueue(), None, threading.Lock()
    if started:
        start()


os.register_at_fork(after_in_child=_start_afresh)
