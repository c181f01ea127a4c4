"""One slot for every HTTP request an `httpx` or `httpx2` client sends.

The official `openai` and `anthropic` SDKs send every request, each retry included, through
the `http_client` they are given. Give them one from here and each attempt holds a slot from
the moment it is sent until its response body has been read to the end or closed, streaming
included, by whichever task or thread closes it:

```python
from openai import AsyncOpenAI, OpenAI
import slotwise.httpx

openai = AsyncOpenAI(
    http_client=slotwise.httpx.client(limiter=claude, workload="interactive")
)
# In code with no event loop (Django, Flask, Celery, scripts), the sync clients:
openai_sync = OpenAI(http_client=slotwise.httpx.sync_client(limiter=claude))
```

A slot covers one attempt: the SDK's backoff sleeps between retries hold none. A response
that nobody reads nor closes gives its slot back after `idle_timeout` seconds, or sooner if
it is garbage collected.

slotwise's errors (`ConcurrencyTimeoutError`, `ConcurrencyQueueFullError`, ...) reach the
caller of the SDK unchanged, and the SDK does not retry them: the wait already happened.

What the provider says of its limits reaches the limiter too, for the OpenAI and Anthropic
request shapes. With a token `Rate`, each request is charged an estimate when its slot is
granted (its output cap, `max_tokens`, `max_completion_tokens` or `max_output_tokens`, plus
its JSON body's size over 4) and the `usage` of its response corrects it (from a JSON body,
or from the events of a stream that carry one). A 429, 529 or 503 pauses every new grant for
the longest wait its headers give (`retry-after`, `retry-after-ms`, OpenAI's
`x-ratelimit-reset-*`, Anthropic's `anthropic-ratelimit-*-reset`), or a backoff. Every
response's `x-ratelimit-remaining-*` and `anthropic-ratelimit-*-remaining` counts lower the
rate buckets when the provider has less left than slotwise thinks, and its
`x-ratelimit-limit-*` and `anthropic-ratelimit-*-limit` limits cap the rates: a `Rate`
configured above the provider's limit holds and refills no faster than the provider's. A
malformed header, or a limiter that fails to record any of this, never fails the response.

Both HTTP stacks are served: `httpx2` (what `anthropic` 2.x requires and `openai` 3.x
prefers) and the legacy `httpx`. Neither is imported until it is used.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from functools import cache, partial
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import anyio

from . import ConcurrencyError, Outcome, ReclaimedEvent, Slot, acquire, current_run
from ._config import Rate, seconds
from ._errors import ConcurrencyConfigError
from ._protocol import Limiter, TypedLimiter, W
from ._provider import UsageMeter, estimate_tokens, read_rate_headers, usage_meter
from ._runtime.lifecycle import acquire_sync, can_block, outcome_of
from ._runtime.loop import later, loop_identity, now, spawn

if TYPE_CHECKING:
    import httpx
    import httpx2

__all__ = ("client", "sync_client", "transport", "wrap")

T = TypeVar("T")

_logger = logging.getLogger("slotwise")
_STACKS = ("httpx2", "httpx")
# What each stack's package is installed with.
_INSTALL = {"httpx2": "pip install 'slotwise[httpx]'", "httpx": "pip install httpx"}
# The connection pool of the SDKs' own clients (`DefaultHttpxClient`, `DefaultAsyncHttpxClient`).
_SDK_MAX_CONNECTIONS = 1000
_SDK_MAX_KEEPALIVE = 100
# The SDKs' base error classes: each SDK raises an error of its own class unchanged and
# without retrying it (any other error of the HTTP client may be wrapped and retried).
_SDK_ERRORS = (("openai", "OpenAIError"), ("anthropic", "AnthropicError"))
# How long a reclaimed response gets to close its connection before the slot goes back anyway.
_CLOSE_TIMEOUT = 5.0
_Why = Literal["idle", "collected"]
# The statuses by which a provider refuses a request for its load: too many requests (429),
# Anthropic's overloaded (529), unavailable (503).
_PUSHBACK = frozenset({429, 503, 529})


@overload
def client(
    *,
    limiter: Limiter[str] | None = None,
    workload: str | None = None,
    stack: Literal["httpx2"] = "httpx2",
    idle_timeout: float | None = 60.0,
    **client_kwargs: Any,
) -> httpx2.AsyncClient: ...


@overload
def client(
    *,
    limiter: Limiter[str] | None = None,
    workload: str | None = None,
    stack: Literal["httpx"],
    idle_timeout: float | None = 60.0,
    **client_kwargs: Any,
) -> httpx.AsyncClient: ...


@overload
def client(
    *,
    limiter: TypedLimiter[W],
    workload: W | None = None,
    stack: Literal["httpx2"] = "httpx2",
    idle_timeout: float | None = 60.0,
    **client_kwargs: Any,
) -> httpx2.AsyncClient: ...


@overload
def client(
    *,
    limiter: TypedLimiter[W],
    workload: W | None = None,
    stack: Literal["httpx"],
    idle_timeout: float | None = 60.0,
    **client_kwargs: Any,
) -> httpx.AsyncClient: ...


def client(
    *,
    limiter: Limiter[Any] | None = None,
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
    return _new_client("client", limiter, workload, stack, idle_timeout, client_kwargs)


@overload
def sync_client(
    *,
    limiter: Limiter[str] | None = None,
    workload: str | None = None,
    stack: Literal["httpx2"] = "httpx2",
    idle_timeout: float | None = 60.0,
    **client_kwargs: Any,
) -> httpx2.Client: ...


@overload
def sync_client(
    *,
    limiter: Limiter[str] | None = None,
    workload: str | None = None,
    stack: Literal["httpx"],
    idle_timeout: float | None = 60.0,
    **client_kwargs: Any,
) -> httpx.Client: ...


@overload
def sync_client(
    *,
    limiter: TypedLimiter[W],
    workload: W | None = None,
    stack: Literal["httpx2"] = "httpx2",
    idle_timeout: float | None = 60.0,
    **client_kwargs: Any,
) -> httpx2.Client: ...


@overload
def sync_client(
    *,
    limiter: TypedLimiter[W],
    workload: W | None = None,
    stack: Literal["httpx"],
    idle_timeout: float | None = 60.0,
    **client_kwargs: Any,
) -> httpx.Client: ...


def sync_client(
    *,
    limiter: Limiter[Any] | None = None,
    workload: str | None = None,
    stack: Literal["httpx2", "httpx"] = "httpx2",
    idle_timeout: float | None = 60.0,
    **client_kwargs: Any,
) -> Any:
    """A sync `Client` whose every request holds a slot: `client()` for code with no event
    loop, such as the sync `OpenAI()` and `Anthropic()` clients in Django or Flask views,
    Celery tasks and scripts.

    A request blocks its thread until it has a slot (or the workload's `max_wait` or the
    current run's budget ends); its response holds the slot until its body is read to the end
    or closed, by any thread. One limiter serves any number of threads and event loops at
    once, so the same `MemoryLimiter` can limit the sync clients of a thread pool and the
    async clients of an event loop together.

    The limiter must be able to block a thread (`MemoryLimiter` can; a `PostgresLimiter`,
    which waits on an event loop, cannot, and is refused). A request made in a thread that
    runs an event loop raises `ConcurrencyConfigError`: blocking there would stall the loop.

    Args:
        limiter: As in `client()` (a limiter that can block a thread).
        workload: As in `client()`.
        stack: As in `client()`.
        idle_timeout: As in `client()`. One daemon thread per process watches the
            responses of every sync client, and closes those left unread.
        **client_kwargs: Passed to `Client`, overriding the same defaults as `client()`.

    Returns:
        A new `httpx2.Client` or `httpx.Client`.

    Raises:
        ModuleNotFoundError: As in `client()`.
        ValueError: As in `client()`.
        ConcurrencyConfigError: `idle_timeout` is not a positive number of seconds or None,
            or `limiter` cannot block a thread.

    Example:
        ```python
        from anthropic import Anthropic

        anthropic = Anthropic(http_client=slotwise.httpx.sync_client(limiter=claude))
        ```
    """
    return _new_client("sync_client", limiter, workload, stack, idle_timeout, client_kwargs)


def _new_client(
    function: str,
    limiter: Any,
    workload: str | None,
    stack: str,
    idle_timeout: float | None,
    client_kwargs: dict[str, Any],
) -> Any:
    if stack not in _STACKS:
        raise ValueError(f"stack must be 'httpx2' or 'httpx', got {stack!r}")
    module = _import(stack, function)
    client_kwargs.setdefault("follow_redirects", True)
    if "limits" not in client_kwargs:
        most = getattr(limiter, "max_concurrent", None)
        connections = max(_SDK_MAX_CONNECTIONS, most if isinstance(most, int) else 0)
        client_kwargs["limits"] = module.Limits(
            max_connections=connections, max_keepalive_connections=_SDK_MAX_KEEPALIVE
        )
    cls = module.AsyncClient if function == "client" else module.Client
    return wrap(cls(**client_kwargs), limiter=limiter, workload=workload, idle_timeout=idle_timeout)


def _import(stack: str, function: str) -> ModuleType:
    try:
        return importlib.import_module(stack)
    except ModuleNotFoundError as exc:
        if exc.name != stack:
            raise
        raise ModuleNotFoundError(
            f"slotwise.httpx.{function}(stack={stack!r}) needs the {stack} package, which is "
            f"not installed: {_INSTALL[stack]}",
            name=stack,
        ) from exc


@overload
def wrap(
    client: T,
    *,
    limiter: Limiter[str] | None = None,
    workload: str | None = None,
    idle_timeout: float | None = 60.0,
) -> T: ...


@overload
def wrap(
    client: T,
    *,
    limiter: TypedLimiter[W],
    workload: W | None = None,
    idle_timeout: float | None = 60.0,
) -> T: ...


def wrap(
    client: T,
    *,
    limiter: Limiter[Any] | None = None,
    workload: str | None = None,
    idle_timeout: float | None = 60.0,
) -> T:
    """Make every request of an existing client hold a slot, and return the client.

    Use it to keep a client built elsewhere, such as the SDK's own defaults:
    `AsyncOpenAI(http_client=slotwise.httpx.wrap(openai.DefaultAsyncHttpxClient(), ...))`,
    or `OpenAI(http_client=slotwise.httpx.wrap(openai.DefaultHttpxClient(), ...))` in sync
    code. Wrap a client before it sends its first request, and only once per limiter.

    Args:
        client: An `AsyncClient` or a sync `Client` of `httpx2` or `httpx`.
        limiter: As in `client()`; for a sync `Client`, as in `sync_client()`.
        workload: As in `client()`.
        idle_timeout: As in `client()`.

    Returns:
        The same client.

    Raises:
        TypeError: `client` is not an `AsyncClient` or `Client` of either stack.
        ConcurrencyConfigError: As in `client()` and `sync_client()`.
    """
    module = _stack_of(client, "AsyncClient") or _stack_of(client, "Client")
    if module is None or not hasattr(client, "_transport") or not hasattr(client, "_mounts"):
        raise TypeError(
            f"slotwise.httpx.wrap() takes an AsyncClient or a Client of httpx2 or httpx, "
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


@overload
def transport(
    inner: T,
    *,
    limiter: Limiter[str] | None = None,
    workload: str | None = None,
    idle_timeout: float | None = 60.0,
) -> T: ...


@overload
def transport(
    inner: T,
    *,
    limiter: TypedLimiter[W],
    workload: W | None = None,
    idle_timeout: float | None = 60.0,
) -> T: ...


def transport(
    inner: T,
    *,
    limiter: Limiter[Any] | None = None,
    workload: str | None = None,
    idle_timeout: float | None = 60.0,
) -> T:
    """Wrap a transport so that each request it handles holds a slot.

    The slot is taken when the request can be sent: if `inner` is a connection pool that
    allows a limited number of connections (HTTP/1.1), a request first waits, holding no slot,
    until fewer requests than that are in flight through this transport (bounded by the
    client's `pool` timeout, raising the stack's `PoolTimeout`). The slot is given back when
    the response body has been read to the end or the response is closed (by any task or
    thread), when sending fails, when nobody has read the body for `idle_timeout` seconds, or
    when the response is garbage collected without being closed.

    A transport that is both sync and async (`MockTransport`) stays both.

    Args:
        inner: An `AsyncBaseTransport` or a sync `BaseTransport` of `httpx2` or `httpx`.
        limiter: As in `client()`; for a sync transport, as in `sync_client()`.
        workload: As in `client()`.
        idle_timeout: As in `client()`.

    Returns:
        A transport of the same stack and kind.

    Raises:
        TypeError: `inner` is not a transport of either stack.
        ConcurrencyConfigError: `idle_timeout` is not a positive number of seconds or None,
            or `inner` is only sync and `limiter` cannot block a thread.
    """
    module = _stack_of(inner, "AsyncBaseTransport") or _stack_of(inner, "BaseTransport")
    if module is None:
        raise TypeError(
            f"slotwise.httpx.transport() takes an AsyncBaseTransport or a BaseTransport of "
            f"httpx2 or httpx, got {type(inner).__name__}"
        )
    is_async = isinstance(inner, module.AsyncBaseTransport)
    is_sync = isinstance(inner, module.BaseTransport)
    idle = None if idle_timeout is None else seconds("idle_timeout", idle_timeout)
    if not is_async and limiter is not None and not _can_block(limiter):
        advice = getattr(type(limiter), "_sync_advice", None)  # see acquire_sync
        raise ConcurrencyConfigError(
            f"limiter {getattr(limiter, 'name', limiter)!r} ({type(limiter).__name__}) cannot "
            "limit a sync client: a sync request waits by blocking its thread, and only a "
            "limiter that can block one (such as MemoryLimiter) can serve it. Use an async "
            "client with this limiter" + (f". {advice}" if advice else "")
        )
    wrapped: Any = _transport_class(module, is_async, is_sync)(
        inner, limiter=limiter, workload=workload, idle_timeout=idle
    )
    return wrapped  # type: ignore[no-any-return]


def _stack_of(obj: object, name: str) -> ModuleType | None:
    for stack in _STACKS:
        module = sys.modules.get(stack)
        if module is not None and isinstance(obj, getattr(module, name)):
            return module
    return None


def _can_block(limiter: Any) -> bool:
    """Whether `limiter` can make a thread wait (a capability of its class)."""
    return can_block(limiter)


@cache
def _transport_class(module: ModuleType, is_async: bool, is_sync: bool) -> type[_SlotTransport]:
    faces: list[type[_AsyncFace] | type[_SyncFace]] = []
    namespace: dict[str, Any] = {
        "__module__": __name__,
        "_in_memory": module.ByteStream,
        "_pool_timeout": module.PoolTimeout,
    }
    for wanted, face, stream, byte_stream in (
        (is_async, _AsyncFace, _AsyncSlotStream, "AsyncByteStream"),
        (is_sync, _SyncFace, _SyncSlotStream, "SyncByteStream"),
    ):
        if wanted:
            faces.append(face)
            namespace[face.stream_attribute] = type(
                stream.__name__.lstrip("_"),
                (stream, getattr(module, byte_stream)),
                {"__module__": __name__, "_read_error": module.ReadError},
            )
    bases = [*faces, *(getattr(module, f.base_name) for f in faces)]
    return type("SlotTransport", tuple(bases), namespace)


def _connection_limit(inner: Any) -> int | None:
    """How many requests `inner` can have in flight at once, when its pool says so.

    The stacks' `AsyncHTTPTransport` and `HTTPTransport` keep an httpcore pool with
    `max_connections`; over HTTP/1.1 each connection carries one request at a time, so a
    request beyond that number waits in the pool. Over HTTP/2 one connection carries many,
    and other transports (mocks, ASGI and WSGI apps) have no pool: no limit is known for those.
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


def _observes(limiter: Any) -> bool:
    """Whether `limiter` keeps rate buckets that the provider's remaining counts can lower
    (its class can be told them, and it has a `rate`, or does not say)."""
    return (
        hasattr(type(limiter), "observe_remaining")
        and getattr(limiter, "rate", _Unknown) is not None
    )


class _Unknown:
    """What a limiter that does not say whether it has a `rate` has."""


def _token_capacity(limiter: Any, workload: str | None) -> int | None:
    """The capacity of the smallest token bucket a request of `workload` draws from (the
    limiter's `rate` and its workload's), resolved as `acquire()` resolves them; None when
    the request's limiter counts no tokens."""
    run = current_run()
    if limiter is None:
        limiter = None if run is None else run.limiter
        if limiter is None:
            return None
    if workload is None and run is not None and run.limiter is limiter:
        workload = run.workload
    if workload is None:
        workload = getattr(limiter, "default_workload", None)
    workloads = getattr(limiter, "workloads", None)
    spec = workloads.get(workload) if isinstance(workloads, Mapping) else None
    capacities = [
        rate.tokens
        for rate in (getattr(limiter, "rate", None), getattr(spec, "rate", None))
        if isinstance(rate, Rate) and rate.tokens is not None
    ]
    return min(capacities, default=None)


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


# -- the transport ------------------------------------------------------------------------------


class _SlotTransport:
    """What the transport's async and sync faces share; `transport()` combines the faces
    that `inner` has with the stack's base classes."""

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
        self._gate: Any
        # Requests in flight through this transport never outnumber the connections of its
        # pool, so that a request holding a slot never waits for a connection. A wrapper of a
        # wrapper takes over the inner one's gate: the outer slot is taken first.
        if isinstance(inner, _SlotTransport):
            self._gate, inner._gate = inner._gate, None
        else:
            limit = _connection_limit(inner)
            self._gate = None if limit is None else self._new_gate(limit)

    def _new_gate(self, limit: int) -> Any:
        raise NotImplementedError

    def _no_slot(self, gate: Any, exc: BaseException) -> None:
        """A request got no slot: its place at the gate goes back, and a slot error becomes
        one that the SDKs raise as it is."""
        if gate is not None:
            gate.release()
        if isinstance(exc, ConcurrencyError):
            _passed_through_by_sdks(exc)

    def _pool_timed_out(self, request: Any) -> Exception:
        return self._pool_timeout(  # type: ignore[call-arg]
            "no connection of the pool became free within the pool timeout", request=request
        )

    def _estimate(self, request: Any) -> int | None:
        """The request's token estimate when its limiter counts tokens (None when not), at
        most what its smallest token bucket holds: a request costlier than that waits for a
        full bucket, and its usage corrects the charge afterwards."""
        most = _token_capacity(self._limiter, self._workload)
        if most is None:
            return None
        try:
            body = request.content
        except Exception:  # a body sent as a stream (an upload): nothing to count
            return 0
        try:
            return min(estimate_tokens(body), most)
        except Exception as exc:
            _logger.warning("slotwise: estimating a request's tokens failed: %r", exc)
            return 0

    def _respond(self, attempt: _Attempt, response: Any, stream_class: type) -> Outcome | None:
        """Give `response` a body that holds the attempt's slot until it ends; or, when the
        body is already in memory (a mock, a cache), the outcome of the finished exchange.

        The one place, for both faces, where an attempt learns from its response: its
        status, the provider's rate-limit headers, and the usage its body will carry."""
        attempt.failed = response.status_code >= 400
        attempt.learn(response)
        if isinstance(response.stream, self._in_memory):
            if attempt.meter is not None:
                body: Any = response.stream
                for chunk in body:
                    attempt.meter.feed(chunk)
            return "failed" if attempt.failed else "completed"
        attempt.hold(response.stream, self._open, self._idle_timeout)
        response.stream = stream_class(attempt)
        return None

    def __repr__(self) -> str:
        name = getattr(self._limiter, "name", None)
        target = "the current run's limiter" if name is None else repr(name)
        return f"<slotwise.httpx transport {target} workload={self._workload!r} {self._inner!r}>"


class _AsyncFace(_SlotTransport):
    """The async face: `handle_async_request`, on the event loop of the request."""

    base_name = "AsyncBaseTransport"
    stream_attribute = "_async_stream"
    _async_stream: type[_AsyncSlotStream]

    def _new_gate(self, limit: int) -> Any:
        return anyio.Semaphore(limit)

    async def handle_async_request(self, request: Any) -> Any:
        gate = self._gate if _limited(self._limiter) else None
        tokens = self._estimate(request)
        if gate is not None:
            await self._enter(gate, request)
        try:
            slot = await acquire(self._workload, limiter=self._limiter, tokens=tokens)
        except BaseException as exc:
            self._no_slot(gate, exc)
            raise
        if slot.lease is None:  # no limiter here nor in the current run: nothing to hold
            if gate is not None:
                gate.release()
            return await self._inner.handle_async_request(request)
        attempt = _AsyncAttempt(slot, gate, tokens)
        try:
            response = await self._inner.handle_async_request(request)
        except BaseException as exc:
            await attempt.end(attempt.outcome(exc))
            raise
        outcome = self._respond(attempt, response, self._async_stream)
        if outcome is not None:
            await attempt.end(outcome)
        return response

    async def _enter(self, gate: Any, request: Any) -> None:
        timeout = request.extensions.get("timeout", {}).get("pool")
        with anyio.move_on_after(math.inf if timeout is None else timeout) as scope:
            await gate.acquire()
        if scope.cancelled_caught:
            raise self._pool_timed_out(request)

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            # Responses of a closed client cannot be read any more: their slots go back now.
            for attempt in list(self._open):
                if isinstance(attempt, _AsyncAttempt):
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


class _SyncFace(_SlotTransport):
    """The sync face: `handle_request`, blocking the thread of the request."""

    base_name = "BaseTransport"
    stream_attribute = "_sync_stream"
    _sync_stream: type[_SyncSlotStream]

    def _new_gate(self, limit: int) -> Any:
        return threading.Semaphore(limit)

    def handle_request(self, request: Any) -> Any:
        gate = self._gate if _limited(self._limiter) else None
        tokens = self._estimate(request)
        if gate is not None:
            timeout = request.extensions.get("timeout", {}).get("pool")
            if not gate.acquire(timeout=timeout):
                raise self._pool_timed_out(request)
        try:
            slot = acquire_sync(self._workload, limiter=self._limiter, tokens=tokens)
        except BaseException as exc:
            self._no_slot(gate, exc)
            raise
        if slot.lease is None:  # no limiter here nor in the current run: nothing to hold
            if gate is not None:
                gate.release()
            return self._inner.handle_request(request)
        attempt = _SyncAttempt(slot, gate, tokens)
        try:
            response = self._inner.handle_request(request)
        except BaseException as exc:
            attempt.end(attempt.outcome(exc))
            raise
        outcome = self._respond(attempt, response, self._sync_stream)
        if outcome is not None:
            attempt.end(outcome)
        return response

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            for attempt in list(self._open):
                if isinstance(attempt, _SyncAttempt):
                    attempt.end(attempt.outcome(None))

    def __enter__(self) -> Any:
        self._inner.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        self.close()


# -- one attempt --------------------------------------------------------------------------------


class _Attempt:
    """What one HTTP attempt holds (its slot, its place at the pool's gate, its response body)
    and gives back once, by whichever way it ends first: read to the end, closed, cut short,
    left unread past the idle bound, or garbage collected. It never refers to the response
    or its stream, so that these can be collected.

    The async and sync kinds differ in how they release (awaiting, or not), in their clock
    (the event loop's, or `time.monotonic`) and in who watches them for idleness (a task of
    their event loop, or the process's reclaimer thread). What an attempt learns from its
    exchange is kept here, for both.
    """

    __slots__ = (
        "body",
        "done",
        "failed",
        "gate",
        "idle_timeout",
        "last_read",
        "meter",
        "open",
        "reading",
        "reclaimed",
        "slot",
        "started",
        "tokens",
        "watch",
    )

    def __init__(self, slot: Slot, gate: Any, tokens: int | None = None) -> None:
        self.slot = slot
        self.gate = gate
        self.tokens = tokens  # the estimate charged; None: the limiter counts no tokens
        self.meter: UsageMeter | None = None  # reads the usage in the body as it passes
        self.started = self.clock()
        self.failed = False
        self.done = False
        self.body: Any = None
        self.open: set[_Attempt] = set()
        self.idle_timeout: float | None = None
        self.reading = False
        self.reclaimed = False
        self.last_read = 0.0
        self.watch: Any = None  # what watches it for idleness: `attempts` maps it to its bound

    @staticmethod
    def clock() -> float:
        raise NotImplementedError

    @staticmethod
    def cancelled() -> type[BaseException]:
        """What says that the code was interrupted rather than failed."""
        raise NotImplementedError

    def learn(self, response: Any) -> None:
        """Tell the limiter what the response says of the provider's limits: the limits
        themselves and what is left (lowering the rate buckets), and a refusal for its load (429, 529, 503), which
        refunds the token estimate and pauses new grants for as long as the headers say (a
        backoff when they do not). Ready a meter for the usage in the body when the limiter
        counts tokens. Never raises: a failure here must not fail the response."""
        slot = self.slot
        status = response.status_code
        pushback = status in _PUSHBACK
        headers = response.headers
        if self.tokens is not None and not self.failed:
            self.meter = _quietly(
                slot,
                usage_meter,
                headers.get("content-type", ""),
                headers.get("content-encoding", ""),
            )
        if not pushback and not _observes(slot.limiter):
            return
        said = _quietly(
            slot, read_rate_headers, headers.multi_items(), time.time(), self.tokens or 0
        )
        if said is None:
            return
        if pushback and self.tokens:
            _quietly(slot, slot.used_tokens, 0)  # refused: it used nothing
        if said.requests_limit is not None:
            _quietly(slot, slot.provider_limits, requests=said.requests_limit)
        if said.tokens_limit is not None:
            _quietly(slot, slot.provider_limits, tokens=said.tokens_limit)
        if said.requests is not None:
            _quietly(slot, slot.provider_remaining, requests=said.requests)
        if said.tokens is not None:
            _quietly(slot, slot.provider_remaining, tokens=said.tokens)
        if pushback:
            _quietly(slot, slot.throttled, said.retry_after, reason=str(status))

    def account(self, outcome: Outcome) -> None:
        """Correct the token estimate with the usage the body carried, if it said."""
        meter, self.meter = self.meter, None
        if meter is None:
            return
        used = meter.total(outcome == "completed")
        if used is not None:
            _quietly(self.slot, self.slot.used_tokens, used)

    def hold(self, body: Any, open: set[_Attempt], idle_timeout: float | None) -> None:
        """Keep the slot while `body` is being read, and watch it for idleness."""
        self.body = body
        self.open = open
        open.add(self)
        self.idle_timeout = idle_timeout
        self.last_read = self.clock()
        self.watch = self._watch(idle_timeout)

    def _watch(self, idle_timeout: float | None) -> Any:
        raise NotImplementedError

    def begin_read(self) -> bool:
        """Mark a read as in progress (never idle meanwhile); False if it was reclaimed."""
        if self.reclaimed:
            return False
        self.reading = True
        return True

    def end_read(self) -> None:
        self.last_read = self.clock()  # before `reading` drops: never idle in between
        self.reading = False

    def outcome(self, exc: BaseException | None) -> Outcome:
        """The outcome of an exchange that ended early (with `exc`, or closed unread). An
        error response failed, however its body ends."""
        if self.failed or (exc is not None and outcome_of(exc, self.cancelled()) == "failed"):
            return "failed"
        return "cancelled"

    def ended(self, exc: BaseException) -> Outcome:
        """The outcome of a body whose read ended with `exc` (its end, or an error)."""
        if isinstance(exc, StopIteration | StopAsyncIteration):
            return "failed" if self.failed else "completed"
        return self.outcome(exc)

    def _finish(self) -> bool:
        """Mark the attempt done; False if it already was."""
        if self.done:
            return False
        self.done = True
        self.open.discard(self)
        if self.watch is not None:
            self.watch.attempts.pop(self, None)
        return True

    def _announce(self) -> None:
        """Report that the slot is being taken back from an abandoned response."""
        self.reclaimed = True  # a read starting now raises ReadError
        slot = self.slot
        slot._emit(
            ReclaimedEvent,
            lease_id=slot.lease_id,
            hold_time=self.clock() - self.started,
            source="unclosed-response",
        )

    def _warn(self, why: _Why) -> None:
        slot = self.slot
        what = (
            f"that nobody read for {self.idle_timeout:g} s (idle_timeout)"
            if why == "idle"
            else "that was garbage collected"
        )
        _logger.warning(
            "slotwise: reclaimed a slot of limiter %r (workload %r, lease %s) from a response "
            "%s without being closed; close responses (with / async with, close / aclose) to "
            "give their slots back at once",
            slot.limiter_name,
            slot.workload,
            slot.lease_id,
            what,
        )


def _quietly(slot: Slot, function: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """Call `function`, which tells `slot`'s limiter what the provider said; a failure is
    logged, never raised: what the limiter learns must not fail the response."""
    try:
        return function(*args, **kwargs)
    except Exception as exc:
        _logger.warning(
            "slotwise: telling limiter %r what the provider said of its limits failed (%s): %r",
            slot.limiter_name,
            getattr(function, "__name__", function),
            exc,
        )
        return None


def _close_failed(exc: Exception) -> None:
    _logger.debug("slotwise: closing an abandoned response failed: %r", exc)


class _AsyncAttempt(_Attempt):
    __slots__ = ()

    clock = staticmethod(now)
    cancelled = staticmethod(anyio.get_cancelled_exc_class)

    def _watch(self, idle_timeout: float | None) -> Any:
        if idle_timeout is None or math.isinf(idle_timeout):
            return None
        return _IdleWatch.add(self, idle_timeout)

    async def end(self, outcome: Outcome) -> None:
        if not self._finish():
            return
        try:
            self.account(outcome)
            await self.slot.release(outcome)
        finally:
            if self.gate is not None:
                self.gate.release()

    async def reclaim(self, why: _Why = "idle") -> None:
        """Close the abandoned body (its connection goes back to the pool) and give the slot
        back; reading the body afterwards raises the stack's `ReadError`."""
        if self.done:
            return
        with anyio.CancelScope(shield=True):
            self._announce()
            try:
                with anyio.move_on_after(_CLOSE_TIMEOUT):
                    await self.body.aclose()
            except Exception as exc:
                _close_failed(exc)
            finally:
                await self.end(self.outcome(None))
        self._warn(why)


def _interrupted() -> type[BaseException]:
    return KeyboardInterrupt  # a thread is never cancelled: only interrupted in the main one


class _SyncAttempt(_Attempt):
    """An attempt of a sync client: read, closed and reclaimed from any thread, so what
    several threads decide on (done, reclaimed, reading) is decided under the reclaimer's
    lock."""

    __slots__ = ()

    clock = staticmethod(time.monotonic)
    cancelled = staticmethod(_interrupted)

    def _watch(self, idle_timeout: float | None) -> Any:
        return _reclaimer.add(self, idle_timeout)

    def begin_read(self) -> bool:
        with _reclaimer.lock:
            return super().begin_read()

    def _finish(self) -> bool:
        with _reclaimer.lock:
            return super()._finish()

    def end(self, outcome: Outcome) -> None:
        if not self._finish():
            return
        try:
            self.account(outcome)
            self.slot.release_sync(outcome)
        finally:
            if self.gate is not None:
                self.gate.release()

    def reclaim(self, why: _Why = "idle") -> None:
        """As `_AsyncAttempt.reclaim`, in the reclaimer's thread."""
        if self.done:
            return
        try:
            self._announce()
            self.body.close()
        except Exception as exc:
            _close_failed(exc)
        finally:
            self.end(self.outcome(None))
        self._warn(why)


# -- watching for idleness --------------------------------------------------------------------


def _sweep(attempts: dict[_Attempt, float], t: float) -> tuple[list[_Attempt], float]:
    """Take out of `attempts` (each mapped to its idle bound) those nobody has read for their
    bound at time `t`, marked reclaimed, and say when the next of the others could be."""
    idle = []
    alarm = math.inf
    for attempt, idle_timeout in list(attempts.items()):
        # A read in progress is never idle: the server's pace does not count.
        due = (t if attempt.reading else attempt.last_read) + idle_timeout
        if due <= t:
            del attempts[attempt]
            attempt.reclaimed = True  # a read starting now raises ReadError
            idle.append(attempt)
        else:
            alarm = min(alarm, due)
    return idle, alarm


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
    def add(attempt: _AsyncAttempt, idle_timeout: float) -> _IdleWatch:
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
                idle, alarm = _sweep(self.attempts, t)
                for attempt in idle:
                    assert isinstance(attempt, _AsyncAttempt)
                    spawn(attempt.reclaim)
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


class _Reclaimer:
    """The responses of every sync client of the process, and the one daemon thread that
    takes their slots back: from those nobody has read for their `idle_timeout`, and from
    those garbage collected unclosed.

    Sync code has no event loop to run a watcher task, so one thread serves the whole
    process. It is started with the first sync response body and then stays, blocked on its
    inbox when there is nothing to watch. It sleeps until the first watched response could
    be idle (a shorter bound wakes it), as the watcher task of an event loop does. A
    response's finalizer only posts the reclaim to the inbox (`SimpleQueue.put` is safe in a
    finalizer): the collector may run it in any thread, even one inside the connection
    pool's lock that closing the body needs. A forked child starts afresh.
    """

    __slots__ = ("alarm", "attempts", "inbox", "lock", "thread")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attempts: dict[_Attempt, float] = {}
        self.alarm = math.inf
        self.inbox: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def add(self, attempt: _SyncAttempt, idle_timeout: float | None) -> _Reclaimer | None:
        """Watch `attempt`, whose body has just been handed to the caller; make sure the
        thread runs, which also reclaims the body if it is collected unclosed."""
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self.main, name="slotwise-httpx-reclaimer", daemon=True
                )
                self.thread.start()
            if idle_timeout is None or math.isinf(idle_timeout):
                return None
            self.attempts[attempt] = idle_timeout
            sooner = attempt.last_read + idle_timeout < self.alarm
        if sooner:
            self.inbox.put(None)
        return self

    def post(self, job: Callable[[], object]) -> None:
        """Run `job` in the reclaimer's thread; callable from a finalizer."""
        self.inbox.put(job)

    def main(self) -> None:
        while True:
            with self.lock:
                t = time.monotonic()
                idle, self.alarm = _sweep(self.attempts, t)
            for attempt in idle:
                assert isinstance(attempt, _SyncAttempt)
                self._run(attempt.reclaim)
            if idle:
                continue
            try:
                job = self.inbox.get(timeout=None if self.alarm == math.inf else self.alarm - t)
            except queue.Empty:
                continue
            if job is not None:
                self._run(job)

    @staticmethod
    def _run(job: Callable[[], object]) -> None:
        try:
            job()
        except BaseException:  # a slot's release reports its own failures; this is a bug
            # Or a subscriber's SystemExit or KeyboardInterrupt, which in this daemon thread
            # would stop nothing but the reclaims of every sync client.
            _logger.exception("slotwise: reclaiming an abandoned response's slot failed")


_reclaimer = _Reclaimer()


def _start_afresh() -> None:
    # A forked child keeps none of the parent's threads, and maybe a lock held by one of them.
    global _reclaimer
    _reclaimer = _Reclaimer()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_start_afresh)


# -- the response body --------------------------------------------------------------------------


class _SlotStream:
    """A response body that gives its attempt's slot back when read to the end, closed,
    left unread, or collected.

    Combined with the stack's `AsyncByteStream` or `SyncByteStream` by `transport()`, so the
    client accepts it.
    """

    _read_error: type[Exception]

    def __init__(self, attempt: _Attempt, schedule: Callable[[Callable[[], Any]], None]) -> None:
        self._attempt = attempt
        self._iterator: Any = None
        # The finalizer must not refer to this object, or it would never be collected.
        self._finalizer = weakref.finalize(self, _collected, attempt, schedule)
        self._finalizer.atexit = False

    def _reading(self) -> _Attempt:
        """The attempt, now reading; the stack's `ReadError` if it was reclaimed."""
        attempt = self._attempt
        if not attempt.begin_read():
            raise self._read_error(
                f"slotwise.httpx closed this response and gave its slot back: nobody read it "
                f"for {attempt.idle_timeout:g} s (idle_timeout)"
            )
        return attempt


class _AsyncSlotStream(_SlotStream):
    _attempt: _AsyncAttempt

    def __init__(self, attempt: _AsyncAttempt) -> None:
        super().__init__(attempt, later())

    def __aiter__(self) -> _AsyncSlotStream:
        return self

    async def __anext__(self) -> bytes:
        attempt = self._reading()
        try:
            if self._iterator is None:
                self._iterator = attempt.body.__aiter__()
            chunk: bytes = await self._iterator.__anext__()
            meter = attempt.meter  # read once: another task may end the attempt
            if meter is not None:
                meter.feed(chunk)
        except BaseException as exc:
            try:
                if isinstance(exc, StopAsyncIteration):
                    # The body is complete: its connection goes back to the pool first.
                    with contextlib.suppress(Exception):
                        await attempt.body.aclose()
            finally:
                await self._end(attempt.ended(exc))
            raise
        finally:
            attempt.end_read()
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


class _SyncSlotStream(_SlotStream):
    _attempt: _SyncAttempt

    def __init__(self, attempt: _SyncAttempt) -> None:
        super().__init__(attempt, _reclaimer.post)

    def __iter__(self) -> _SyncSlotStream:
        return self

    def __next__(self) -> bytes:
        attempt = self._reading()
        try:
            if self._iterator is None:
                self._iterator = iter(attempt.body)
            chunk: bytes = next(self._iterator)
            meter = attempt.meter  # read once: another task may end the attempt
            if meter is not None:
                meter.feed(chunk)
        except BaseException as exc:
            try:
                if isinstance(exc, StopIteration):
                    with contextlib.suppress(Exception):
                        attempt.body.close()
            finally:
                self._end(attempt.ended(exc))
            raise
        finally:
            attempt.end_read()
        return chunk

    def close(self) -> None:
        attempt = self._attempt
        try:
            attempt.body.close()
            iterator, self._iterator = self._iterator, None
            close = getattr(iterator, "close", None)
            if close is not None:
                # Raises ValueError while another thread is inside it: closing the stream
                # above ends that read.
                with contextlib.suppress(ValueError):
                    close()
        finally:
            self._end(attempt.outcome(None))

    def _end(self, outcome: Outcome) -> None:
        self._finalizer.detach()
        self._attempt.end(outcome)


def _collected(attempt: _Attempt, schedule: Callable[[Callable[[], Any]], None]) -> None:
    """The finalizer of a response's stream, run wherever the collector runs: it hands the
    reclaim to the attempt's event loop, or to the reclaimer thread."""
    if attempt.done:
        return
    try:
        schedule(partial(attempt.reclaim, "collected"))  # type: ignore[attr-defined]
    except Exception as exc:  # the event loop is gone: so is the lease, with it
        _logger.debug("slotwise: cannot reclaim an abandoned response's slot: %r", exc)
