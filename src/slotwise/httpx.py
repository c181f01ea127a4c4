"""One slot for every HTTP request an ``httpx`` or ``httpx2`` client sends.

The official ``openai`` and ``anthropic`` SDKs send every request, each retry included,
through the ``http_client`` they are given. Give them one from here and each attempt holds
a slot from the moment it is sent until its response body has been read to the end or
closed, streaming included, by whichever task closes it::

    from openai import AsyncOpenAI
    import slotwise.httpx

    openai = AsyncOpenAI(http_client=slotwise.httpx.client(limiter=claude, workload="interactive"))

A slot covers one attempt: the SDK's backoff sleeps between retries hold none. A response
that is never closed gives its slot back when it is garbage collected.

Both HTTP stacks are served: ``httpx2`` (what ``anthropic`` 2.x requires and ``openai`` 3.x
prefers) and the legacy ``httpx``. Neither is imported until it is used.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import weakref
from functools import cache
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import anyio

from ._events import Outcome, ReclaimedEvent
from ._runtime import dispatch
from ._runtime.lifecycle import Slot, acquire
from ._runtime.loop import Start, later

if TYPE_CHECKING:
    import httpx
    import httpx2

__all__ = ("client", "transport", "wrap")

T = TypeVar("T")

_logger = logging.getLogger("slotwise")
_STACKS = ("httpx2", "httpx")
# How long a reclaimed response gets to close its connection before the slot goes back anyway.
_CLOSE_TIMEOUT = 5.0


@overload
def client(
    *,
    limiter: Any = None,
    workload: str | None = None,
    stack: Literal["httpx2"] = "httpx2",
    **client_kwargs: Any,
) -> httpx2.AsyncClient: ...


@overload
def client(
    *,
    limiter: Any = None,
    workload: str | None = None,
    stack: Literal["httpx"],
    **client_kwargs: Any,
) -> httpx.AsyncClient: ...


def client(
    *,
    limiter: Any = None,
    workload: str | None = None,
    stack: Literal["httpx2", "httpx"] = "httpx2",
    **client_kwargs: Any,
) -> Any:
    """An ``AsyncClient`` whose every request holds a slot.

    Args:
        limiter: The limiter; default: the current run's at the time of each request
            (outside a run and with no limiter, requests are not limited).
        workload: The workload of every request; default: the current run's, else the
            limiter's default.
        stack: ``"httpx2"`` (for ``anthropic`` 2.x, and ``openai`` 3.x) or ``"httpx"`` (the
            legacy package, which ``openai`` 3.x still accepts).
        **client_kwargs: Passed to ``AsyncClient`` unchanged (``timeout``, ``limits``,
            ``proxy``, ``transport``, ``mounts``, ...). Proxies from the environment keep
            working: every transport the client builds is wrapped.

    Returns:
        A new ``httpx2.AsyncClient`` or ``httpx.AsyncClient``.

    Example:
        >>> from anthropic import AsyncAnthropic
        >>> anthropic = AsyncAnthropic(
        ...     http_client=slotwise.httpx.client(limiter=claude, workload="background")
        ... )
    """
    if stack not in _STACKS:
        raise ValueError(f"stack must be 'httpx2' or 'httpx', got {stack!r}")
    module = importlib.import_module(stack)
    return wrap(module.AsyncClient(**client_kwargs), limiter=limiter, workload=workload)


def wrap(client: T, *, limiter: Any = None, workload: str | None = None) -> T:
    """Make every request of an existing ``AsyncClient`` hold a slot, and return the client.

    Use it to keep a client built elsewhere, such as the SDK's own defaults:
    ``AsyncOpenAI(http_client=slotwise.httpx.wrap(openai.DefaultAsyncHttpxClient(), ...))``.
    Wrap a client before it sends its first request, and only once per limiter.

    Args:
        client: An ``httpx2.AsyncClient`` or ``httpx.AsyncClient``.
        limiter: As in :func:`client`.
        workload: As in :func:`client`.

    Returns:
        The same client.

    Raises:
        TypeError: ``client`` is not an ``AsyncClient`` of either stack.
    """
    module = _stack_of(client, "AsyncClient")
    if module is None or not hasattr(client, "_transport") or not hasattr(client, "_mounts"):
        raise TypeError(
            f"slotwise.httpx.wrap() takes an httpx2.AsyncClient or httpx.AsyncClient, "
            f"got {type(client).__name__}"
        )
    # The client routes each URL to its default transport or to a mounted one (proxies from
    # the environment are mounts): wrapping them all leaves the client's routing untouched.
    inner: Any = client
    inner._transport = transport(inner._transport, limiter=limiter, workload=workload)
    inner._mounts = {
        pattern: None if mounted is None else transport(mounted, limiter=limiter, workload=workload)
        for pattern, mounted in inner._mounts.items()
    }
    return client


def transport(inner: T, *, limiter: Any = None, workload: str | None = None) -> T:
    """Wrap an ``AsyncBaseTransport`` so that each request it handles holds a slot.

    The slot is taken before the request is sent, and given back when the response body has
    been read to the end or the response is closed (by any task), when sending fails, or when
    the response is garbage collected without being closed.

    Args:
        inner: An ``httpx2.AsyncBaseTransport`` or ``httpx.AsyncBaseTransport``.
        limiter: As in :func:`client`.
        workload: As in :func:`client`.

    Returns:
        A transport of the same stack.

    Raises:
        TypeError: ``inner`` is not an async transport of either stack.
    """
    module = _stack_of(inner, "AsyncBaseTransport")
    if module is None:
        raise TypeError(
            f"slotwise.httpx.transport() takes an httpx2 or httpx AsyncBaseTransport, "
            f"got {type(inner).__name__}"
        )
    cls = _transport_class(module.AsyncBaseTransport, module.AsyncByteStream, module.ByteStream)
    wrapped: Any = cls(inner, limiter=limiter, workload=workload)
    return wrapped  # type: ignore[no-any-return]


def _stack_of(obj: object, name: str) -> ModuleType | None:
    for stack in _STACKS:
        module = sys.modules.get(stack)
        if module is not None and isinstance(obj, getattr(module, name)):
            return module
    return None


@cache
def _transport_class(base: type, stream_base: type, in_memory: type) -> type[_SlotTransport]:
    stream_cls = type("SlotStream", (_SlotStream, stream_base), {"__module__": __name__})
    return type(
        "SlotTransport",
        (_SlotTransport, base),
        {"__module__": __name__, "_stream_class": stream_cls, "_in_memory": in_memory},
    )


def _outcome(exc: BaseException) -> Outcome:
    return "cancelled" if isinstance(exc, anyio.get_cancelled_exc_class()) else "failed"


class _SlotTransport:
    """The transport; combined with the stack's ``AsyncBaseTransport`` by ``transport()``."""

    _stream_class: type[_SlotStream]
    _in_memory: type

    def __init__(self, inner: Any, *, limiter: Any, workload: str | None) -> None:
        self._inner = inner
        self._limiter = limiter
        self._workload = workload
        self._open: weakref.WeakSet[_SlotStream] = weakref.WeakSet()

    async def handle_async_request(self, request: Any) -> Any:
        slot = await acquire(self._workload, limiter=self._limiter)
        if slot.lease is None:  # no limiter here nor in the current run: nothing to hold
            return await self._inner.handle_async_request(request)
        try:
            response = await self._inner.handle_async_request(request)
        except BaseException as exc:
            await slot.release(_outcome(exc))
            raise
        if isinstance(response.stream, self._in_memory):
            # The body is already in memory (a mock, a cache): the exchange is over.
            await slot.release("failed" if response.status_code >= 400 else "completed")
            return response
        stream = self._stream_class(
            response.stream, slot, failed=response.status_code >= 400, schedule=later()
        )
        response.stream = stream
        self._open.add(stream)
        return response

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            # Responses of a closed client cannot be read any more: their slots go back now.
            for stream in list(self._open):
                await stream._release("cancelled")

    async def __aenter__(self) -> Any:
        await self._inner.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        name = getattr(self._limiter, "name", None)
        target = "the current run's limiter" if name is None else repr(name)
        return f"<slotwise.httpx transport {target} workload={self._workload!r} {self._inner!r}>"


class _SlotStream:
    """A response body that gives its slot back when read to the end, closed, or collected.

    Combined with the stack's ``AsyncByteStream`` by ``transport()``, so the client accepts it.
    """

    def __init__(
        self,
        inner: Any,
        slot: Slot,
        *,
        failed: bool,
        schedule: Start,
    ) -> None:
        self._inner = inner
        self._slot = slot
        self._failed = failed
        self._iterator: Any = None
        # The finalizer must not refer to this object, or it would never be collected.
        self._finalizer = weakref.finalize(self, _collected, slot, inner, schedule)
        self._finalizer.atexit = False

    def __aiter__(self) -> _SlotStream:
        return self

    async def __anext__(self) -> bytes:
        if self._iterator is None:
            self._iterator = self._inner.__aiter__()
        try:
            chunk: bytes = await self._iterator.__anext__()
        except StopAsyncIteration:
            await self._release("failed" if self._failed else "completed")
            raise
        except BaseException as exc:
            await self._release(_outcome(exc))
            raise
        return chunk

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
            iterator, self._iterator = self._iterator, None
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                # Raises RuntimeError while another task is inside it: closing the stream
                # above ends that read.
                with contextlib.suppress(RuntimeError):
                    await aclose()
        finally:
            await self._release("cancelled")

    async def _release(self, outcome: Outcome) -> None:
        self._finalizer.detach()
        await self._slot.release(outcome)


def _collected(slot: Slot, inner: Any, schedule: Start) -> None:
    async def reclaim() -> None:
        with anyio.CancelScope(shield=True):
            if not slot.released and slot.lease is not None and dispatch.wants(slot.limiter):
                slot._emit(
                    ReclaimedEvent,
                    lease_id=slot.lease.lease_id,
                    hold_time=anyio.current_time() - slot._acquired_at,
                    source="unclosed-response",
                )
            try:
                # Closing the body also gives its connection back to the client's pool.
                with anyio.move_on_after(_CLOSE_TIMEOUT):
                    await inner.aclose()
            except Exception as exc:
                _logger.debug("slotwise: closing an abandoned response failed: %r", exc)
            finally:
                await slot.release("cancelled")
        _logger.warning(
            "slotwise: reclaimed a slot of limiter %r (workload %r, lease %s) from a response "
            "that was garbage collected without being closed; close responses (async with, "
            "aclose) to give their slots back at once",
            slot.limiter_name,
            slot.workload,
            slot.lease_id,
        )

    if slot.released:
        return
    try:
        schedule(reclaim)
    except Exception as exc:  # the event loop is gone: so is the lease, with it
        _logger.debug("slotwise: cannot reclaim an abandoned response's slot: %r", exc)
