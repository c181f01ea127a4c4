"""ToolBox: a model's tool calls, each holding a slot of one limiter in its tool's pool."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Generic, Literal, TypeAlias, TypeVar, final, overload

import anyio
from anyio.lowlevel import checkpoint

from .._config import DEFAULT_WORKLOAD, seconds
from .._errors import (
    ConcurrencyConfigError,
    ConcurrencyError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
)
from .._events import (
    ToolEffect,
    ToolFinishedEvent,
    ToolOutcome,
    ToolRejectedEvent,
    ToolStartedEvent,
)
from .._protocol import Limiter, TypedLimiter, W
from .._runtime import dispatch
from .._runtime.lifecycle import Slot, is_cancellation, slot
from .._runtime.loop import own_cancellation, require
from .._runtime.runs import Run, current_run
from .._runtime.runs import run as start_run
from ._budget import allowances, cut_note
from ._values import Tool, ToolCall, ToolError, ToolResult

__all__ = ("ToolBox",)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

_TIMED_OUT: Any = object()  # what a handler cancelled by its timeout "returned"


class _Unbounded:
    """Stands for the cancel scope that bounds a wait, when nothing does."""

    deadline = math.inf
    cancelled_caught = False

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


_UNBOUNDED = _Unbounded()

# Why a call never ran (its result's error), and why a running call stopped.
_Refusal: TypeAlias = Literal[
    "unknown-tool", "invalid-arguments", "concurrency-limit", "limiter-error", "budget-exhausted"
]
_Stop: TypeAlias = Literal["failed", "timed-out", "limiter-error"]


@final
class ToolBox(Generic[W]):
    """Runs a model's tool calls: each call holds a slot of `limiter` in its tool's pool.

    A pool is a workload of the limiter, with its ceiling, reservation, priority and
    `max_wait`; several tools may share one. The limiter's `max_concurrent` is the global
    limit. A call's slot is granted in one decision of the limiter that checks both, so no
    call ever holds global capacity while it waits for its pool.

    Build the ToolBox once, beside the limiter, and share it: two runs that use the same
    ToolBox (or the same limiter) share its limits. A ToolBox built inside a run limits
    only that run.

    Args:
        limiter: Any limiter (`MemoryLimiter`, `PostgresLimiter` for pools shared by several
            processes, or a custom one); its workloads are the pools.
        result_budget: Characters of tool output one batch may return; results that do not
            fit are cut (see `run`). None: no budget.
        max_calls_per_run: Calls one run, its child runs included, may make; the calls
            beyond it get `"budget-exhausted"` results. None: no limit.

    Raises:
        ConcurrencyConfigError: `limiter` is not a limiter, or a budget is not a positive
            integer.

    Example:
        ```python
        tools = ToolBox(
            limiter=MemoryLimiter(
                name="tools",
                max_concurrent=4,
                workloads={
                    "search": Workload(max_concurrent=1, max_wait=10.0),
                    "payments": Workload(max_concurrent=1, max_wait=0),
                    "default": Workload(max_wait=30.0),
                },
            ),
            result_budget=40_000,
            max_calls_per_run=20,
        )


        @tools.tool(pool="search", timeout=10.0)
        async def search_docs(query: str) -> str: ...
        ```
    """

    __slots__ = ("_calls", "_limiter", "_lock", "_max_calls", "_result_budget", "_tools")

    @overload
    def __init__(
        self: ToolBox[str],
        *,
        limiter: Limiter[str],
        result_budget: int | None = ...,
        max_calls_per_run: int | None = ...,
    ) -> None: ...

    @overload
    def __init__(
        self: ToolBox[W],
        *,
        limiter: TypedLimiter[W],
        result_budget: int | None = ...,
        max_calls_per_run: int | None = ...,
    ) -> None: ...

    def __init__(
        self,
        *,
        limiter: Limiter[Any],
        result_budget: int | None = None,
        max_calls_per_run: int | None = None,
    ) -> None:
        missing = [m for m in ("acquire", "renew", "release") if not hasattr(limiter, m)]
        if missing:
            raise ConcurrencyConfigError(
                f"limiter must be a limiter (an object with async acquire, renew and "
                f"release), got {limiter!r}, which has no {', '.join(missing)}"
            )
        self._limiter = limiter
        self._result_budget = _positive_or_none("result_budget", result_budget)
        self._max_calls = _positive_or_none("max_calls_per_run", max_calls_per_run)
        self._tools: dict[str, Tool] = {}
        # Calls counted per root run: a run tree shares one count, gone with its root.
        self._calls: weakref.WeakKeyDictionary[Run, int] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    @property
    def limiter(self) -> Any:
        """The limiter whose slots the calls hold."""
        return self._limiter

    @property
    def result_budget(self) -> int | None:
        """Characters of tool output one batch may return; None: no budget."""
        return self._result_budget

    @property
    def max_calls_per_run(self) -> int | None:
        """Calls one run tree may make; None: no limit."""
        return self._max_calls

    @property
    def tools(self) -> Mapping[str, Tool]:
        """The registered tools, by name."""
        return self._tools

    # -- registering tools ----------------------------------------------------------------

    @overload
    def tool(self, handler: F, /) -> F: ...

    @overload
    def tool(
        self,
        handler: None = None,
        /,
        *,
        name: str | None = None,
        pool: W | None = None,
        timeout: float | None = None,
        sequential: bool = False,
        writes: bool = False,
    ) -> Callable[[F], F]: ...

    def tool(
        self,
        handler: F | None = None,
        /,
        *,
        name: str | None = None,
        pool: W | None = None,
        timeout: float | None = None,
        sequential: bool = False,
        writes: bool = False,
    ) -> F | Callable[[F], F]:
        """Register an async function as a tool: `@tools.tool` or `@tools.tool(pool=...)`.

        The function is returned unchanged. The model's arguments are passed to it as
        keyword arguments; what it returns becomes the result's content (a `str` as is,
        anything else as JSON); what it raises becomes an error result naming the
        exception's type and message.

        Args:
            handler: The function, when used as `@tools.tool` without parentheses.
            name: The name the model calls it by; default: the function's name.
            pool: The workload of the limiter its calls hold a slot of; default: the
                limiter's default workload.
            timeout: Seconds a call's handler may run; then it is cancelled (the
                cancellation reaches its I/O) and the result is `"timed-out"`. None: no
                limit but the run's budget.
            sequential: The calls of every sequential tool in a batch run one at a time, in
                the order the model gave them, alongside the parallel calls; each still
                holds its slot while it runs.
            writes: The tool changes something: a call stopped part-way (timed out,
                cancelled, failed) has the effect `"unknown"` instead of `"none"`.

        Raises:
            ConcurrencyConfigError: the pool is not a workload of the limiter (or none is
                named and the limiter has no default), the timeout is not a positive number
                of seconds, or the name is empty or already taken.
            TypeError: the function is not an async function.
        """

        def register(fn: F) -> F:
            if not _is_async(fn):
                raise TypeError(f"a tool must be an async function, got {fn!r}")
            tool_name = fn.__name__ if name is None else name
            if not isinstance(tool_name, str) or not tool_name:
                raise ConcurrencyConfigError(
                    f"a tool's name must be a non-empty string, got {tool_name!r}"
                )
            if tool_name in self._tools:
                raise ConcurrencyConfigError(f"a tool named {tool_name!r} is already registered")
            self._tools[tool_name] = Tool(
                name=tool_name,
                handler=fn,
                pool=self._pool(pool),
                timeout=None if timeout is None else seconds("timeout", timeout),
                sequential=bool(sequential),
                writes=bool(writes),
                signature=(signature := inspect.signature(fn)),
                fits=_fits(signature),
            )
            return fn

        return register if handler is None else register(handler)

    def _pool(self, pool: str | None) -> str:
        validate = getattr(type(self._limiter), "validate_workload", None)
        if validate is not None:
            return str(validate(self._limiter, pool))
        return DEFAULT_WORKLOAD if pool is None else str(pool)

    # -- running a batch ------------------------------------------------------------------

    async def run(self, calls: Iterable[ToolCall]) -> list[ToolResult]:
        """Run one batch of calls (one model response's) and return one result per call, in
        the calls' order, whatever failed.

        - Parallel calls start at once, each as soon as the limiter grants a slot in its
          tool's pool; the calls of sequential tools form one chain, run one at a time in the
          given order, alongside them.
        - A call waits for its slot up to its pool's `max_wait` (a parallel call from the
          start of the batch, a sequential one from its turn in the chain) or the run's
          budget; a pool with `max_wait=0` fails fast.
          Either way the result is `"concurrency-limit"`, and the call is never retried.
        - Unknown tools, arguments that do not fit the handler, and the calls beyond
          `max_calls_per_run` get error results and never take a slot.
        - With a `result_budget`, results that together exceed it are cut: those under an
          equal share stay whole, the rest share what remains, and each cut result ends with
          a note saying how much was cut (the notes are not counted).

        Inside a run, the calls belong to it (and count against its `max_calls_per_run`
        with its whole run tree); outside any run, the batch is a run of its own. The run's
        budget bounds every wait and handler; when it ends, the run raises as runs do.

        Args:
            calls: The calls, in the model's order.

        Returns:
            One `ToolResult` per call, in the calls' order.

        Raises:
            ValueError: a call has no id, or two calls share one (nothing has run).
            TypeError: an item is not a `ToolCall`.

        Cancelling `run()` (or its run) cancels every call: a running handler is cancelled,
        a call still waiting for a slot never enters its handler, and no slot is left held.
        """
        batch = list(calls)
        seen: set[str] = set()
        for call in batch:
            if not isinstance(call, ToolCall):
                raise TypeError(f"calls must be ToolCall objects, got {call!r}")
            if not isinstance(call.id, str) or not call.id:
                raise ValueError(
                    f"tool call {call.name!r} has no id: ids are non-empty strings, got {call.id!r}"
                )
            if call.id in seen:
                raise ValueError(f"two tool calls share the id {call.id!r}")
            seen.add(call.id)
        run = current_run()
        if run is None:
            async with start_run() as run:
                return await _Batch(self, run, batch).run()
        await checkpoint()
        return await _Batch(self, run, batch).run()

    def _reserve(self, run: Run, wanted: int) -> int:
        """Count up to `wanted` calls against the run tree's budget; return how many fit."""
        if self._max_calls is None:
            return wanted
        root = _root(run)
        with self._lock:
            used = self._calls.get(root, 0)
            granted = max(0, min(wanted, self._max_calls - used))
            self._calls[root] = used + granted
        return granted

    def _refund(self, run: Run, count: int) -> None:
        if self._max_calls is None or not count:
            return
        root = _root(run)
        with self._lock:
            self._calls[root] = self._calls.get(root, count) - count

    def __repr__(self) -> str:
        limiter = getattr(self._limiter, "name", type(self._limiter).__name__)
        tools = ", ".join(f"{tool.name} ({tool.pool})" for tool in self._tools.values())
        return f"<slotwise.tools.ToolBox limiter={limiter!r} tools: {tools or 'none'}>"


_is_async: Callable[[object], bool] = inspect.iscoroutinefunction
_to_json = json.JSONEncoder(ensure_ascii=False).encode


def _clock() -> Callable[[], float]:
    """The running loop's clock, as `anyio.current_time()` reads it, without looking the
    event loop up at each read (the runtime's lookup, safe while another thread is still
    importing trio)."""
    return require().clock


def _fits(signature: inspect.Signature) -> Callable[[Mapping[str, Any]], bool]:
    """Whether keyword arguments fit a handler: a set comparison for the usual signatures,
    `Signature.bind` for the others."""
    kinds = {p.kind for p in signature.parameters.values()}
    if kinds & {inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL}:

        def binds(arguments: Mapping[str, Any]) -> bool:
            try:
                signature.bind(**arguments)
            except TypeError:
                return False
            return True

        return binds
    names = frozenset(signature.parameters) - {
        p.name for p in signature.parameters.values() if p.kind == p.VAR_KEYWORD
    }
    required = frozenset(
        p.name
        for p in signature.parameters.values()
        if p.default is p.empty and p.kind != p.VAR_KEYWORD
    )
    if inspect.Parameter.VAR_KEYWORD in kinds:
        return lambda arguments: required <= arguments.keys()
    return lambda arguments: required <= arguments.keys() <= names


def _root(run: Run) -> Run:
    while run._parent is not None:
        run = run._parent
    return run


def _positive_or_none(setting: str, value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConcurrencyConfigError(f"{setting} must be None or a positive integer, got {value!r}")
    return value


def _limits(limiter: Any, pool: str) -> tuple[int | None, float | None]:
    """The pool's ceiling and max_wait, as far as the limiter says (None: unknown)."""
    workloads = getattr(limiter, "workloads", None)
    settings = workloads.get(pool) if isinstance(workloads, Mapping) else None
    ceiling = getattr(settings, "max_concurrent", None) or getattr(limiter, "max_concurrent", None)
    max_wait = getattr(settings, "max_wait", None)
    return (
        ceiling if isinstance(ceiling, int) else None,
        float(max_wait) if isinstance(max_wait, int | float) else None,
    )


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Batch:
    """One `run()` call: its calls, their results, and the workers that run them."""

    __slots__ = (
        "arguments",
        "box",
        "calls",
        "in_run",
        "limiter",
        "limiter_name",
        "lineage",
        "now",
        "results",
        "started",
        "taken",
        "tools",
    )

    def __init__(self, box: ToolBox[Any], run: Run, calls: list[ToolCall]) -> None:
        self.box = box
        self.in_run = run
        self.calls = calls
        self.limiter = box._limiter
        self.limiter_name = str(getattr(self.limiter, "name", type(self.limiter).__name__))
        self.lineage = (run.run_id, run.root_run_id, run.parent_run_id)
        self.results: list[ToolResult | None] = [None] * len(calls)
        self.tools: list[Tool | None] = [None] * len(calls)
        self.arguments: list[dict[str, Any]] = [{}] * len(calls)
        self.taken = [False] * len(calls)
        self.now = _clock()
        self.started = 0.0

    async def run(self) -> list[ToolResult]:
        self.started = self.now()
        ready = [i for i in range(len(self.calls)) if self._prepare(i)]
        granted = self.box._reserve(self.in_run, len(ready))
        for i in ready[granted:]:
            tool = self.tools[i]
            assert tool is not None
            limit = self.box._max_calls
            self._reject(
                i,
                "budget-exhausted",
                f"Tool {tool.name!r} did not run: this run has made its {limit} tool calls.",
            )
        workers = self._plan(ready[:granted])
        try:
            if len(workers) == 1:
                await self._work(*workers[0])
            elif workers:
                async with anyio.create_task_group() as tg:
                    for worker in workers:
                        tg.start_soon(self._work, *worker)
        except BaseException:
            self._abandon(ready[:granted])
            raise
        results: list[ToolResult] = []
        for result in self.results:
            assert result is not None
            results.append(result)
        budget = self.box._result_budget
        if budget is not None:
            results = _fit(results, budget)
        return results

    # -- before anything runs -------------------------------------------------------------

    def _prepare(self, i: int) -> bool:
        """Find the call's tool and check its arguments; False (with a result) if it cannot
        run."""
        call = self.calls[i]
        tool = self.box._tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.box._tools)) or "none"
            self._reject(i, "unknown-tool", f"Unknown tool {call.name!r}. The tools are: {known}.")
            return False
        self.tools[i] = tool
        arguments: Any = call.arguments
        problem = None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                problem = f"they are not valid JSON ({exc.msg} at character {exc.pos})"
        if problem is None and not (
            isinstance(arguments, Mapping) and all(isinstance(key, str) for key in arguments)
        ):
            problem = "they must be a JSON object"
        if problem is None:
            try:
                if not tool._fits(arguments):
                    tool._signature.bind(**arguments)  # raises, saying why
            except TypeError as exc:
                problem = str(exc)
        if problem is not None:
            self._reject(
                i,
                "invalid-arguments",
                f"Invalid arguments for tool {tool.name!r}: {problem}.",
            )
            return False
        self.arguments[i] = dict(arguments)
        return True

    def _plan(self, admitted: list[int]) -> list[tuple[deque[int], bool, float | None]]:
        """The workers: their queue of calls, whether it is the sequential chain, and when a
        call of theirs stops waiting for a slot (None: only the run's budget bounds it).

        A pool gets one worker per slot it can ever hold, each taking the pool's next call in
        the model's order: more would only queue behind this batch's own calls (and a batch
        of a thousand calls never puts a thousand requests in the limiter's queue). The first
        call of each worker asks the limiter at once and waits up to the pool's `max_wait`;
        a later one has waited for this batch's earlier calls, so it waits only what is left
        of `max_wait` since the batch started. A fail-fast pool refuses at once the calls
        beyond its ceiling: they could not have had a slot.
        """
        chain: deque[int] = deque()
        pools: dict[str, list[int]] = {}
        for i in admitted:
            tool = self.tools[i]
            assert tool is not None
            if tool.sequential:
                chain.append(i)
            else:
                pools.setdefault(tool.pool, []).append(i)
        workers: list[tuple[deque[int], bool, float | None]] = []
        for pool, indices in pools.items():
            ceiling, max_wait = _limits(self.limiter, pool)
            if ceiling is not None and max_wait == 0:
                for i in indices[ceiling:]:
                    self.taken[i] = True
                    self._reject(i, "concurrency-limit", self._busy(i))
                del indices[ceiling:]
            count = len(indices) if ceiling is None else min(len(indices), ceiling)
            bound = None if max_wait is None else self.started + max_wait
            workers += [(deque(indices), False, bound)] * count
        if chain:
            workers.append((chain, True, None))
        return workers

    # -- running calls --------------------------------------------------------------------

    async def _work(self, queue: deque[int], chain: bool, bound: float | None) -> None:
        first = True
        while queue:
            i = queue.popleft()
            self.taken[i] = True
            if chain:
                await self._call(i, self.now(), None)
            else:
                await self._call(i, self.started, None if first else bound)
            first = False

    async def _call(self, i: int, since: float, bound: float | None) -> None:
        """Run call ``i``: wait for its slot (until ``bound`` at most, besides the limiter's
        own `max_wait` and the run's budget), run its handler, and set its result."""
        tool = self.tools[i]
        assert tool is not None
        waiting: Any = _UNBOUNDED
        if bound is not None:
            if self.now() >= bound:
                self._reject(i, "concurrency-limit", self._busy(i), waited=self.now() - since)
                return
            waiting = anyio.CancelScope(deadline=bound)
        held: Slot | None = None
        running = returned = False
        started = ended = since
        value: Any = _TIMED_OUT
        try:
            with waiting:
                async with slot(tool.pool, limiter=self.limiter, allow_nested=True) as held:
                    # Granted: the bound was on the wait only. Nothing awaited since the
                    # grant, so it cannot have fired meanwhile.
                    waiting.deadline = math.inf
                    started = self.now()
                    running = True
                    self._emit(ToolStartedEvent, i, held.request_id, wait_time=started - since)
                    if tool.timeout is None:
                        value = await tool.handler(**self.arguments[i])
                    else:
                        with anyio.move_on_after(tool.timeout):
                            value = await tool.handler(**self.arguments[i])
                    ended = self.now()
                    returned = True
        except Exception as exc:
            if not running:
                self._refused(i, exc, self.now() - since)
                return
            if not returned:
                ended = self.now()
                lost = held is not None and held.lost
                self._stopped(
                    i,
                    "limiter-error" if lost else "failed",
                    (
                        f"Tool {tool.name!r} was stopped: its slot's lease was lost."
                        if lost
                        else f"Tool {tool.name!r} failed: {_describe(exc)}"
                    ),
                    held,
                    started - since,
                    ended - started,
                    None if lost else type(exc).__name__,
                )
                return
            # The handler returned, then the lease was lost: what it returned stands.
        except BaseException as exc:
            now = self.now()
            if (
                running
                and isinstance(exc, asyncio.CancelledError)
                and not own_cancellation(exc, require())
            ):
                # The handler awaited something that another task cancelled (an HTTP
                # client's own request task, say): its failure, not the batch's cancellation.
                self._stopped(
                    i,
                    "failed",
                    f"Tool {tool.name!r} failed: {_describe(exc)}",
                    held,
                    started - since,
                    now - started,
                    type(exc).__name__,
                )
                return
            if running:
                # As the slot's `released` says: a cancellation, or a BaseException that is
                # none (KeyboardInterrupt, SystemExit, a subclass of its own) and goes on.
                cancelled = is_cancellation(exc, require().cancelled)
                self._finished(
                    i,
                    held,
                    started - since,
                    now - started,
                    "cancelled" if cancelled else "failed",
                    self._stopped_effect(i),
                    None if cancelled else type(exc).__name__,
                )
            else:
                self._emit(
                    ToolRejectedEvent,
                    i,
                    held.request_id if held is not None else None,
                    wait_time=now - since,
                    reason="cancelled",
                )
            raise
        if waiting.cancelled_caught:  # the bound ended the wait
            self._reject(i, "concurrency-limit", self._busy(i), waited=self.now() - since)
            return
        assert held is not None
        self._returned(i, held, value, started - since, ended - started)

    def _returned(self, i: int, held: Slot, value: Any, waited: float, duration: float) -> None:
        """The handler ended without raising: it returned ``value``, or its timeout stopped
        it."""
        tool = self.tools[i]
        assert tool is not None
        if value is _TIMED_OUT:
            note = " It may or may not have taken effect." if tool.writes else ""
            self._stopped(
                i,
                "timed-out",
                f"Tool {tool.name!r} did not finish within {tool.timeout:g} s and was "
                f"cancelled.{note}",
                held,
                waited,
                duration,
                None,
            )
            return
        try:
            content = value if isinstance(value, str) else _to_json(value)
        except (TypeError, ValueError) as exc:
            self._finished(i, held, waited, duration, "failed", "done", type(exc).__name__)
            self._set(
                i,
                f"Tool {tool.name!r} returned a {type(value).__name__}, which is not JSON: "
                f"{_describe(exc)}",
                "failed",
                "done",
                waited,
                duration,
            )
            return
        self._finished(i, held, waited, duration, "completed", "done", None)
        self._set(i, content, None, "done", waited, duration)

    def _refused(self, i: int, exc: Exception, waited: float) -> None:
        """The call got no slot: say why, as a result."""
        reason: _Refusal
        if isinstance(exc, ConcurrencyTimeoutError | ConcurrencyQueueFullError):
            reason, content = "concurrency-limit", self._busy(i)
        else:
            tool = self.tools[i]
            assert tool is not None
            reason = "limiter-error"
            content = (
                f"Tool {tool.name!r} did not run: its slot could not be taken ({_describe(exc)})."
            )
        request_id = exc.request_id if isinstance(exc, ConcurrencyError) else None
        self._reject(i, reason, content, request_id=request_id, waited=waited)

    def _busy(self, i: int) -> str:
        tool = self.tools[i]
        assert tool is not None
        return (
            f"Tool {tool.name!r} did not run: no slot was free in its pool {tool.pool!r} "
            "in time (too many calls at once). It was not retried."
        )

    def _stopped_effect(self, i: int) -> ToolEffect:
        tool = self.tools[i]
        return "unknown" if tool is not None and tool.writes else "none"

    def _stopped(
        self,
        i: int,
        error: _Stop,
        content: str,
        held: Slot | None,
        waited: float,
        duration: float,
        exception: str | None,
    ) -> None:
        """The handler started and did not return."""
        effect = self._stopped_effect(i)
        self._finished(i, held, waited, duration, error, effect, exception)
        self._set(i, content, error, effect, waited, duration)

    # -- results and events ---------------------------------------------------------------

    def _set(
        self,
        i: int,
        content: str,
        error: ToolError | None,
        effect: ToolEffect,
        waited: float,
        duration: float,
    ) -> None:
        call = self.calls[i]
        self.results[i] = ToolResult(
            call_id=call.id,
            name=call.name,
            content=content,
            error=error,
            effect=effect,
            wait_time=waited,
            duration=duration,
        )

    def _reject(
        self,
        i: int,
        reason: _Refusal,
        content: str,
        *,
        request_id: str | None = None,
        waited: float = 0.0,
    ) -> None:
        self._emit(ToolRejectedEvent, i, request_id, wait_time=waited, reason=reason)
        self._set(i, content, reason, "none", waited, 0.0)

    def _finished(
        self,
        i: int,
        held: Slot | None,
        waited: float,
        duration: float,
        outcome: ToolOutcome,
        effect: ToolEffect,
        exception: str | None,
    ) -> None:
        self._emit(
            ToolFinishedEvent,
            i,
            held.request_id if held is not None else None,
            wait_time=waited,
            duration=duration,
            outcome=outcome,
            effect=effect,
            exception=exception,
        )

    def _emit(self, cls: Any, i: int, request_id: str | None, **fields: Any) -> None:
        if not dispatch.wants(self.limiter):
            return
        call = self.calls[i]
        tool = self.tools[i]
        run_id, root_run_id, parent_run_id = self.lineage
        dispatch.emit(
            self.limiter,
            cls(
                timestamp=time.time(),
                limiter=self.limiter_name,
                workload=tool.pool if tool is not None else None,
                run_id=run_id,
                root_run_id=root_run_id,
                parent_run_id=parent_run_id,
                request_id=request_id,
                tool=call.name,
                call_id=call.id,
                **fields,
            ),
        )

    def _abandon(self, admitted: list[int]) -> None:
        """The batch was cancelled: the calls no worker took never reach admission."""
        untaken = [i for i in admitted if not self.taken[i]]
        now = self.now()
        for i in untaken:
            self._emit(ToolRejectedEvent, i, None, wait_time=now - self.started, reason="cancelled")
        self.box._refund(self.in_run, len(untaken))


def _fit(results: list[ToolResult], budget: int) -> list[ToolResult]:
    lengths = [len(result.content) for result in results]
    kept = allowances(lengths, budget)
    fitted = []
    for result, length, keep in zip(results, lengths, kept, strict=True):
        if keep < length:
            result = ToolResult(
                call_id=result.call_id,
                name=result.name,
                content=result.content[:keep] + cut_note(length - keep, length),
                error=result.error,
                effect=result.effect,
                wait_time=result.wait_time,
                duration=result.duration,
                truncated=length - keep,
            )
        fitted.append(result)
    return fitted
