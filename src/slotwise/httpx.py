"""One slot for every HTTP request an `httpx` or `httpx2` client sends.

The official `openai` and `anthropic` SDKs send every request, each retry included, through
the `http_client` they are given. Give them one from here and each attempt holds a slot from
the moment it is sent until its response body has been read to the end or closed, streaming
included, by whichever task closes it:

```python
from openai import AsyncOpenAI
import slotwise.httpx

openai = AsyncOpenAI(http_client=slotwise.httpx.client(limiter=claude, workload="interactive"))
```

A slot covers one attempt: the SDK's backoff sleeps between retries hold none. A response
that nobody reads nor closes gives its slot back after `idle_timeout` seconds, or sooner if
it is garbage collected.

slotwise's errors (`ConcurrencyTimeoutError`, `ConcurrencyQueueFullError`, ...) reach the
caller of the SDK unchanged, and the SDK does not retry them: the wait already happened.

Both HTTP stacks are served: `httpx2` (what `anthropic` 2.x requires and `openai` 3.x
prefers) and the legacy `httpx`. Neither is imported until it is used.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import sys
import weakref
from functools import cache
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import anyio

from . import ConcurrencyError, Outcome, ReclaimedEvent, Slot, acquire, current_run
from ._config import seconds
from ._runtime.loop import Start, later, loop_identity, now, spawn

if TYPE_CHECKING:
    import httpx
    import httpx2

__all__ = ("client", "transport", "wrap")

T = TypeVar("T")

_logger = logging.getLogger("slotwise")
_STACKS = ("httpx2", "httpx")
# What each stack's package is installed with.
_INSTALL = {"httpx2": "pip install 'slotwise[httpx]'", "httpx": "pip install httpx"}
# The connection pool of the SDKs' own clients (`DefaultAsyncHttpxClient`).
_SDK_MAX_CONNECTIONS = 1000
_SDK_MAX_KEEPALIVE = 100
# The SDKs' base error classes: each SDK raises an error of its own class unchanged and
# without retrying it (any other error of the HTTP client may be wrapped and retried).
_SDK_ERRORS = (("openai", "OpenAIError"), ("anthropic", "AnthropicError"))
# How long a reclaimed response gets to close its connection before the slot goes back anyway.
_CLOSE_TIMEOUT = 5.0


@overload
def client(
    *,
    limiter: Any = None,
    workload: str | None = None,
    stack: Literal["httpx2"] = "httpx2",
    idle_timeout: float | None = 60.0,
    **client_kwargs: Any,
) -> httpx2.AsyncClient: ...


@overload
def client(
    *,
    limiter: Any = None,
    workload: str | None = None,
    stack: Literal["httpx"],
    idle_timeout: float | None = 60.0,
    **client_kwargs: Any,
) -> httpx.AsyncClient: ...


def client(
    *,
    limiter: Any = None,
    workload: str | None = None,
    stack: Literal["httpx2", "httpx"] = "httpx2",
    idle_timeout: float | None = 60.0,
    **client_kwargs: Any,
) -> Any:
    """An `AsyncClient` whose every request holds a slot.

    The client has the SDKs' own defaults (`openai.DefaultAsyncHttpxClient`,
    `anthropic.DefaultAsyncHttpxClient`): it follows redirects and pools up to 1000
    connections (more if the limiter allows more requests at once), 100 of them kept alive.

    Args:
        limiter: The limiter; default: the current run's at the time of each request
            (outside a run and with no limiter, requests are not limited).
        workload: The workload of every request; default: the current run's, else the
            limiter's default.
        stack: `"httpx2"` (for `anthropic` 2.x, and `openai` 3.x) or `"httpx"` (the legacy
            package, which `openai` 3.x still accepts).
        idle_timeout: Seconds a response body may wait, unread and unclosed, before slotwise
            closes it and gives its slot back (`None`: only when it is garbage collected).
            The time the server takes to send the next bytes never counts: only the time
            during which nobody is reading.
        **client_kwargs: Passed to `AsyncClient` (`timeout`, `limits`, `proxy`, `transport`,
            `mounts`, `follow_redirects`, ...), overriding the defaults above. Proxies from
            the environment keep working: every transport the client builds is wrapped.

    Returns:
        A new `httpx2.AsyncClient` or `httpx.AsyncClient`.

    Raises:
        ModuleNotFoundError: The stack's package is not installed; the message names the
            command that installs it (`pip install 'slotwise[httpx]'` for `httpx2`).
        ValueError: `stack` is neither `"httpx2"` nor `"httpx"`.
        ConcurrencyConfigError: `idle_timeout` is not a positive number of seconds or None.

    Example:
        ```python
        from anthropic import AsyncAnthropic

        anthropic = AsyncAnthropic(
            http_client=slotwise.httpx.client(limiter=claude, workload="background")
        )
        ```
    """
    if stack not in _STACKS:
        raise ValueError(f"stack must be 'httpx2' or 'httpx', got {stack!r}")
    module = _import(stack)
    client_kwargs.setdefault("follow_redirects", True)
    if "limits" not in client_kwargs:
        most = getattr(limiter, "max_concurrent", None)
        connections = max(_SDK_MAX_CONNECTIONS, most if isinstance(most, int) else 0)
        client_kwargs["limits"] = module.Limits(
            max_connections=connections, max_keepalive_connections=_SDK_MAX_KEEPALIVE
        )
    return wrap(
        module.AsyncClient(**client_kwargs),
        limiter=limiter,
        workload=workload,
        idle_timeout=idle_timeout,
    )


def _import(stack: str) -> ModuleType:
    try:
        return importlib.import_module(stack)
    except ModuleNotFoundError as exc:
        if exc.name != stack:
            raise
        raise ModuleNotFoundError(
            f"slotwise.httpx.client(stack={stack!r}) needs the {stack} package, which is not "
            f"installed: {_INSTALL[stack]}",
            name=stack,
        ) from exc


def wrap(
    client: T,
    *,
    limiter: Any = None,
    workload: str | None = None,
    idle_timeout: float | None = 60.0,
) -> T:
    """Make every request of an existing `AsyncClient` hold a slot, and return the client.

    Use it to keep a client built elsewhere, such as the SDK's own defaults:
    `AsyncOpenAI(http_client=slotwise.httpx.wrap(openai.DefaultAsyncHttpxClient(), ...))`.
    Wrap a client before it sends its first request, and only once per limiter.

    Args:
        client: An `httpx2.AsyncClient` or `httpx.AsyncClient`.
        limiter: As in `client()`.
        workload: As in `client()`.
        idle_timeout: As in `client()`.

    Returns:
        The same client.

    Raises:
        TypeError: `client` is not an `AsyncClient` of either stack.
    """
    module = _stack_of(client, "AsyncClient")
    if module is None or not hasattr(client, "_transport") or not hasattr(client, "_mounts"):
        raise TypeError(
            f"slotwise.httpx.wrap() takes an httpx2.AsyncClient or httpx.AsyncClient, "
            f"got {type(client).__name__}"
        )
    options: dict[str, Any] = {
        "limiter": limiter,
        "workload": workload,
        "idle_timeout": idle_timeout,
    }
    # The client routes each URL to its default transport or to a mounted one (proxies from
    # the environment are mounts): wrapping them all leaves the client's routing untouched.
    inner: Any = client
    inner._transport = transport(inner._transport, **options)
    inner._mounts = {
        pattern: None if mounted is None else transport(mounted, **options)
        for pattern, mounted in inner._mounts.items()
    }
    return client


def transport(
    inner: T,
    *,
    limiter: Any = None,
    workload: str | None = None,
    idle_timeout: float | None = 60.0,
) -> T:
    """Wrap an `AsyncBaseTransport` so that each request it handles holds a slot.

    The slot is taken when the request can be sent: if `inner` is a connection pool that
    allows a limited number of connections (HTTP/1.1), a request first waits, holding no slot,
    until fewer requests than that are in flight through this transport (bounded by the
    client's `pool` timeout, raising the stack's `PoolTimeout`). The slot is given back when
    the response body has been read to the end or the response is closed (by any task), when
    sending fails, when nobody has read the body for `idle_timeout` seconds, or when the
    response is garbage collected without being closed.

    Args:
        inner: An `httpx2.AsyncBaseTransport` or `httpx.AsyncBaseTransport`.
        limiter: As in `client()`.
        workload: As in `client()`.
        idle_timeout: As in `client()`.

    Returns:
        A transport of the same stack.

    Raises:
        TypeError: `inner` is not an async transport of either stack.
        ConcurrencyConfigError: `idle_timeout` is not a positive number of seconds or None.
    """
    module = _stack_of(inner, "AsyncBaseTransport")
    if module is None:
        raise TypeError(
            f"slotwise.httpx.transport() takes an httpx2 or httpx AsyncBaseTransport, "
            f"got {type(inner).__name__}"
        )
    idle = None if idle_timeout is None else seconds("idle_timeout", idle_timeout)
    wrapped: Any = _transport_class(module)(
        inner, limiter=limiter, workload=workload, idle_timeout=idle
    )
    return wrapped  # type: ignore[no-any-return]


def _stack_of(obj: object, name: str) -> ModuleType | None:
    for stack in _STACKS:
        module = sys.modules.get(stack)
        if module is not None and isinstance(obj, getattr(module, name)):
            return module
    return None


@cache
def _transport_class(module: ModuleType) -> type[_SlotTransport]:
    stream_cls = type(
        "SlotStream",
        (_SlotStream, module.AsyncByteStream),
        {"__module__": __name__, "_read_error": module.ReadError},
    )
    return type(
        "SlotTransport",
        (_SlotTransport, module.AsyncBaseTransport),
        {
            "__module__": __name__,
            "_stream_class": stream_cls,
            "_in_memory": module.ByteStream,
            "_pool_timeout": module.PoolTimeout,
        },
    )


def _connection_limit(inner: Any) -> int | None:
    """How many requests `inner` can have in flight at once, when its pool says so.

    The stacks' `AsyncHTTPTransport` keeps an httpcore pool with `max_connections`; over
    HTTP/1.1 each connection carries one request at a time, so a request beyond that number
    waits in the pool. Over HTTP/2 one connection carries many, and other transports (mocks,
    ASGI apps) have no pool: no limit is known for those.
    """
    pool = getattr(inner, "_pool", None)
    limit = getattr(pool, "_max_connections", None)
    if not isinstance(limit, int) or limit >= sys.maxsize or getattr(pool, "_http2", True):
        return None
    return limit


def _limited(limiter: Any) -> bool:
    if limiter is not None:
        return True
    run = current_run()
    return run is not None and run.limiter is not None


def _passed_through_by_sdks(exc: ConcurrencyError) -> None:
    """Make `exc` also an instance of the loaded SDKs' base error classes.

    `anthropic` wraps any other error of its HTTP client in `APIConnectionError` and retries
    it; `openai` passes errors it does not know through today. A slot that could not be had
    is no connection failure, and retrying it repeats a wait that already happened (and
    multiplies `max_wait` by the retry count). An error of its own class is what each SDK
    raises unchanged and does not retry, so the error becomes one, keeping its slotwise class,
    its fields, its cause and its traceback.
    """
    bases = tuple(
        base
        for module_name, name in _SDK_ERRORS
        if (module := sys.modules.get(module_name)) is not None
        and isinstance(base := getattr(module, name, None), type)
        and not isinstance(exc, base)
    )
    if bases:
        cls: type = type(exc)
        exc.__class__ = _with_sdk_bases(cls, bases)


@cache
def _with_sdk_bases(cls: type, bases: tuple[type, ...]) -> type:
    def __reduce__(self: ConcurrencyError) -> tuple[Any, ...]:
        # Unpickled as the plain slotwise class: the SDKs need not be importable there.
        return cls, self.args, self.__dict__

    return type(
        cls.__name__,
        (cls, *bases),
        {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__reduce__": __reduce__},
    )


class _SlotTransport:
    """The transport; combined with the stack's `AsyncBaseTransport` by `transport()`."""

    _stream_class: type[_SlotStream]
    _in_memory: type
    _pool_timeout: type[Exception]

    def __init__(
        self, inner: Any, *, limiter: Any, workload: str | None, idle_timeout: float | None
    ) -> None:
        self._inner = inner
        self._limiter = limiter
        self._workload = workload
        self._idle_timeout = idle_timeout
        self._open: set[_Attempt] = set()
        self._gate: anyio.Semaphore | None
        # Requests in flight through this transport never outnumber the connections of its
        # pool, so that a request holding a slot never waits for a connection. A wrapper of a
        # wrapper takes over the inner one's gate: the outer slot is taken first.
        if isinstance(inner, _SlotTransport):
            self._gate, inner._gate = inner._gate, None
        else:
            limit = _connection_limit(inner)
            self._gate = None if limit is None else anyio.Semaphore(limit)

    async def handle_async_request(self, request: Any) -> Any:
        gate = self._gate if _limited(self._limiter) else None
        if gate is not None:
            await self._enter(gate, request)
        try:
            slot = await acquire(self._workload, limiter=self._limiter)
        except BaseException as exc:
            if gate is not None:
                gate.release()
            if isinstance(exc, ConcurrencyError):
                _passed_through_by_sdks(exc)
            raise
        if slot.lease is None:  # no limiter here nor in the current run: nothing to hold
            if gate is not None:
                gate.release()
            return await self._inner.handle_async_request(request)
        attempt = _Attempt(slot, gate)
        try:
            response = await self._inner.handle_async_request(request)
        except BaseException as exc:
            await attempt.end(_outcome(exc))
            raise
        attempt.failed = response.status_code >= 400
        if isinstance(response.stream, self._in_memory):
            # The body is already in memory (a mock, a cache): the exchange is over.
            await attempt.end("failed" if attempt.failed else "completed")
            return response
        attempt.hold(response.stream, self._open, self._idle_timeout)
        response.stream = self._stream_class(attempt)
        return response

    async def _enter(self, gate: Any, request: Any) -> None:
        timeout = request.extensions.get("timeout", {}).get("pool")
        with anyio.move_on_after(math.inf if timeout is None else timeout) as scope:
            await gate.acquire()
        if scope.cancelled_caught:
            raise self._pool_timeout(  # type: ignore[call-arg]
                "no connection of the pool became free within the pool timeout",
                request=request,
            )

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            # Responses of a closed client cannot be read any more: their slots go back now.
            for attempt in list(self._open):
                await attempt.end(attempt.outcome(None))

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


def _outcome(exc: BaseException) -> Outcome:
    cancelled = anyio.get_cancelled_exc_class()
    if isinstance(exc, BaseExceptionGroup):
        # A cancelled task group (a trio nursery) raises a group made only of cancellations.
        return "cancelled" if exc.split(cancelled)[1] is None else "failed"
    return "cancelled" if isinstance(exc, cancelled) else "failed"


class _Attempt:
    """What one HTTP attempt holds (its slot, its place at the pool's gate, its response body)
    and gives back once, by whichever way it ends first: read to the end, closed, cut short,
    left unread past the idle bound, or garbage collected. It never refers to the response
    or its stream, so that these can be collected."""

    __slots__ = (
        "body",
        "done",
        "failed",
        "gate",
        "idle_timeout",
        "last_read",
        "open",
        "reading",
        "reclaimed",
        "slot",
        "started",
        "watch",
    )

    def __init__(self, slot: Slot, gate: Any) -> None:
        self.slot = slot
        self.gate = gate
        self.started = now()
        self.failed = False
        self.done = False
        self.body: Any = None
        self.open: set[_Attempt] = set()
        self.idle_timeout: float | None = None
        self.reading = False
        self.reclaimed = False
        self.last_read = 0.0
        self.watch: _IdleWatch | None = None

    def hold(self, body: Any, open: set[_Attempt], idle_timeout: float | None) -> None:
        """Keep the slot while `body` is being read, and watch it for idleness."""
        self.body = body
        self.open = open
        open.add(self)
        self.idle_timeout = idle_timeout
        self.last_read = now()
        if idle_timeout is not None and not math.isinf(idle_timeout):
            self.watch = _IdleWatch.add(self, idle_timeout)

    def outcome(self, exc: BaseException | None) -> Outcome:
        """The outcome of a body that ended early (with `exc`, or closed unread). An error
        response failed, however its body ends."""
        if self.failed or (exc is not None and _outcome(exc) == "failed"):
            return "failed"
        return "cancelled"

    async def end(self, outcome: Outcome) -> None:
        if self.done:
            return
        self.done = True
        self.open.discard(self)
        if self.watch is not None:
            self.watch.attempts.pop(self, None)
        try:
            await self.slot.release(outcome)
        finally:
            if self.gate is not None:
                self.gate.release()

    async def reclaim(self, why: Literal["idle", "collected"] = "idle") -> None:
        """Close the abandoned body (its connection goes back to the pool) and give the slot
        back; reading the body afterwards raises the stack's `ReadError`."""
        if self.done:
            return
        self.reclaimed = True
        slot = self.slot
        with anyio.CancelScope(shield=True):
            slot._emit(
                ReclaimedEvent,
                lease_id=slot.lease_id,
                hold_time=now() - self.started,
                source="unclosed-response",
            )
            try:
                with anyio.move_on_after(_CLOSE_TIMEOUT):
                    await self.body.aclose()
            except Exception as exc:
                _logger.debug("slotwise: closing an abandoned response failed: %r", exc)
            finally:
                await self.end(self.outcome(None))
        what = (
            f"that nobody read for {self.idle_timeout:g} s (idle_timeout)"
            if why == "idle"
            else "that was garbage collected"
        )
        _logger.warning(
            "slotwise: reclaimed a slot of limiter %r (workload %r, lease %s) from a response "
            "%s without being closed; close responses (async with, aclose) to give their slots "
            "back at once",
            slot.limiter_name,
            slot.workload,
            slot.lease_id,
            what,
        )


class _IdleWatch:
    """The responses of one event loop that are watched for idleness, and the one task that
    watches them (not one per response): it sleeps until the first of them could have been
    idle for its `idle_timeout`, closes those that were, and ends when none is left."""

    __slots__ = ("alarm", "attempts", "key", "wake")

    def __init__(self, key: object) -> None:
        self.key = key
        # attempt -> its idle_timeout; insertion-ordered: O(1) to add and to remove.
        self.attempts: dict[_Attempt, float] = {}
        self.alarm = math.inf
        self.wake: anyio.Event | None = None

    @staticmethod
    def add(attempt: _Attempt, idle_timeout: float) -> _IdleWatch:
        """Watch `attempt`, whose body has just been handed to the caller."""
        key = loop_identity()
        watch = _watches.get(key)
        if watch is None:
            watch = _watches[key] = _IdleWatch(key)
            spawn(watch.main)
        watch.attempts[attempt] = idle_timeout
        if attempt.last_read + idle_timeout < watch.alarm and watch.wake is not None:
            watch.wake.set()  # it sleeps past this one's bound (a shorter idle_timeout)
        return watch

    async def main(self) -> None:
        try:
            while self.attempts:
                t = now()
                alarm = math.inf
                for attempt, idle_timeout in list(self.attempts.items()):
                    # A read in progress is never idle: the server's pace does not count.
                    due = (t if attempt.reading else attempt.last_read) + idle_timeout
                    if due <= t:
                        del self.attempts[attempt]
                        attempt.reclaimed = True  # a read starting now raises ReadError
                        spawn(attempt.reclaim)
                    else:
                        alarm = min(alarm, due)
                if not self.attempts:
                    break
                self.alarm, self.wake = alarm, anyio.Event()
                with anyio.move_on_after(alarm - t):
                    await self.wake.wait()
                self.alarm, self.wake = math.inf, None
        finally:
            if _watches.get(self.key) is self:
                del _watches[self.key]


# The watch of each running event loop (an asyncio loop, a trio run), while its task runs.
_watches: dict[object, _IdleWatch] = {}


class _SlotStream:
    """A response body that gives its attempt's slot back when read to the end, closed,
    left unread, or collected.

    Combined with the stack's `AsyncByteStream` by `transport()`, so the client accepts it.
    """

    _read_error: type[Exception]

    def __init__(self, attempt: _Attempt) -> None:
        self._attempt = attempt
        self._iterator: Any = None
        # The finalizer must not refer to this object, or it would never be collected.
        self._finalizer = weakref.finalize(self, _collected, attempt, later())
        self._finalizer.atexit = False

    def __aiter__(self) -> _SlotStream:
        return self

    async def __anext__(self) -> bytes:
        attempt = self._attempt
        if attempt.reclaimed:
            raise self._read_error(
                f"slotwise.httpx closed this response and gave its slot back: nobody read it "
                f"for {attempt.idle_timeout:g} s (idle_timeout)"
            )
        if self._iterator is None:
            self._iterator = attempt.body.__aiter__()
        attempt.reading = True
        try:
            chunk: bytes = await self._iterator.__anext__()
        except StopAsyncIteration:
            # The body is complete: its connection goes back to the pool before the slot.
            try:
                with contextlib.suppress(Exception):
                    await attempt.body.aclose()
            finally:
                await self._end("failed" if attempt.failed else "completed")
            raise
        except BaseException as exc:
            await self._end(attempt.outcome(exc))
            raise
        finally:
            attempt.reading = False
            attempt.last_read = now()
        return chunk

    async def aclose(self) -> None:
        attempt = self._attempt
        try:
            await attempt.body.aclose()
            iterator, self._iterator = self._iterator, None
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                # Raises RuntimeError while another task is inside it: closing the stream
                # above ends that read.
                with contextlib.suppress(RuntimeError):
                    await aclose()
        finally:
            await self._end(attempt.outcome(None))

    async def _end(self, outcome: Outcome) -> None:
        self._finalizer.detach()
        await self._attempt.end(outcome)


def _collected(attempt: _Attempt, schedule: Start) -> None:
    """The finalizer of a response's stream, run wherever the collector runs."""
    if attempt.done:
        return

    async def reclaim() -> None:
        await attempt.reclaim("collected")

    try:
        schedule(reclaim)
    except Exception as exc:  # the event loop is gone: so is the lease, with it
        _logger.debug("slotwise: cannot reclaim an abandoned response's slot: %r", exc)
