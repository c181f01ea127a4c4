"""Event subscriptions: per limiter object, and process-wide."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from .._events import ConcurrencyEvent
from . import collector

__all__ = ("Callback", "emit", "subscribe", "wants")

Callback = Callable[[ConcurrencyEvent], object]

_logger = logging.getLogger("slotwise")


class _Subscription:
    """One ``subscribe`` call: removed by identity, so the same callback may be subscribed
    twice and each unsubscribe removes its own."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callback) -> None:
        self.callback = callback


_everywhere: list[_Subscription] = []
_by_limiter: weakref.WeakKeyDictionary[Any, list[_Subscription]] = weakref.WeakKeyDictionary()
# Limiters that cannot be weakly referenced (custom classes with __slots__ and no
# __weakref__) are kept by id, with the object itself to keep the id valid.
_by_id: dict[int, tuple[Any, list[_Subscription]]] = {}
# Subscriptions in force, everywhere: while there are none, no event is built.
_subscriptions = 0
_lock = threading.Lock()  # subscribe and unsubscribe may run in any thread


def _callbacks(limiter: Any) -> list[_Subscription] | None:
    try:
        return _by_limiter.get(limiter)
    except TypeError:
        entry = _by_id.get(id(limiter))
        return entry[1] if entry else None


def subscribe(callback: Callback, limiter: Any = None) -> Callable[[], None]:
    """Call ``callback`` with every event of ``limiter``, or of every limiter when None.

    Args:
        callback: Called with each event (a frozen object with a ``kind``), synchronously,
            in the task or thread that caused it (a request that the garbage collector
            ends: in slotwise's worker thread, after the collection). An exception it
            raises is logged and never reaches the slot.
        limiter: Any limiter object, built-in or custom; None for every limiter in the
            process.

    Raises:
        TypeError: ``callback`` is not callable.

    Returns:
        A function that removes the subscription; calling it twice is harmless.
    """
    if not callable(callback):
        raise TypeError(f"callback must be callable, got {callback!r}")
    collector.start()  # for the events of requests that the garbage collector ends
    global _subscriptions
    subscription = _Subscription(callback)
    with _lock:
        if limiter is None:
            target = _everywhere
        else:
            existing = _callbacks(limiter)
            if existing is None:
                existing = []
                try:
                    _by_limiter[limiter] = existing
                except TypeError:
                    _by_id[id(limiter)] = (limiter, existing)
            target = existing
        target.append(subscription)
        _subscriptions += 1

    def unsubscribe() -> None:
        global _subscriptions
        with _lock:
            if not any(entry is subscription for entry in target):
                return
            target[:] = [entry for entry in target if entry is not subscription]
            _subscriptions -= 1
            if limiter is not None and not target:
                try:
                    _by_limiter.pop(limiter, None)
                except TypeError:
                    _by_id.pop(id(limiter), None)

    return unsubscribe


def wants(limiter: Any) -> bool:
    """Whether anyone listens to ``limiter``: events are only built when this is true."""
    if not _subscriptions:
        return False
    return bool(_everywhere) or _callbacks(limiter) is not None


def emit(limiter: Any, event: ConcurrencyEvent, *, worker: bool = False) -> None:
    """Deliver ``event``; a callback that raises is logged and never reaches the slot (only
    ``KeyboardInterrupt`` and ``SystemExit`` go on). The event of a request that the garbage
    collector ends is delivered by `collector`'s worker thread (``worker``), after the
    collection, as a callback may take a lock that the collector interrupted; there nothing
    goes on, and every callback hears it."""
    if not worker and collector.thread is not None and collector.thread == threading.get_ident():
        collector.later(partial(emit, worker=True), limiter, event)
        return
    for entry in (*(_callbacks(limiter) or ()), *_everywhere):
        try:
            entry.callback(event)
        except BaseException as exc:
            if not worker and isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            _logger.exception(
                "slotwise event subscriber %r raised on %s", entry.callback, event.kind
            )
