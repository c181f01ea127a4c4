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
from anyio.abc import TaskGroup
from anyio.lowlevel import checkpoint

from .._config import DEFAULT_WORKLOAD, Workload, seconds
from .._core.backlog import Backlog
from .._core.rules import Rules, WorkloadRule
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
from .._runtime.lifecycle import Slot, SlotContext, is_cancellation
from .._runtime.loop import Loop, own_cancellation, require
from .._runtime.runs import Run, current_run
from .._runtime.runs import run as start_run
from ._budget import allowances, cut_note
from ._values import Tool, ToolCall, ToolError, ToolResult, make_result

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

    __slots__ = ("_calls", "_limiter", "_lock", "_max_calls", "_result_budget", "_rules", "_tools")

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
        # The limiter's rules as its settings state them, kept while those stay the same.
        self._rules: tuple[object, object, Rules] | None = None

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

    def _limits_of(self, pools: Iterable[str], calls: int) -> Rules:
        """The allocation rules of the limiter's public settings (`max_concurrent`,
        `workloads`), for the batch to ask for no more slots than the limiter could grant it:
        a pool it says nothing of may hold every slot; a limiter that states no
        `max_concurrent` lets every call ask at once."""
        limiter = self._limiter
        total = getattr(limiter, "max_concurrent", None)
        workloads = getattr(limiter, "workloads", None)
        # What the settings were (a limiter may change its mapping in place).
        stated_then = tuple(workloads.items()) if isinstance(workloads, Mapping) else workloads
        kept = self._rules
        if kept is not None and kept[0] == stated_then and kept[1] == total:
            rules = kept[2]
        else:
            limit = total if isinstance(total, int) and total > 0 else None
            stated: dict[str, WorkloadRule] = {}
            if limit is not None and isinstance(workloads, Mapping):
                for name, settings in workloads.items():
                    if isinstance(settings, Workload):
                        ceiling = min(limit, max(1, settings.max_concurrent or limit))
                        stated[str(name)] = WorkloadRule(
                            ceiling=ceiling,
                            reserved=min(ceiling, max(0, settings.reserved)),
                            priority=settings.priority,
                        )
            if sum(rule.reserved for rule in stated.values()) > (limit or 0):
                stated = {
                    name: WorkloadRule(ceiling=rule.ceiling, reserved=0, priority=rule.priority)
                    for name, rule in stated.items()
                }
            rules = Rules(max_concurrent=limit or 0, workloads=stated)
            self._rules = (stated_then, total, rules)
        missing = [pool for pool in pools if pool not in rules.workloads]
        if rules.max_concurrent and not missing:
            return rules
        limit = rules.max_concurrent or max(calls, 1)
        unstated = WorkloadRule(ceiling=limit, reserved=0, priority=0)
        return Rules(
            max_concurrent=limit, workloads={**rules.workloads, **dict.fromkeys(missing, unstated)}
        )

    def __repr__(self) -> str:
        limiter = getattr(self._limiter, "name", type(self._limiter).__name__)
        tools = ", ".join(f"{tool.name} ({tool.pool})" for tool in self._tools.values())
        return f"<slotwise.tools.ToolBox limiter={limiter!r} tools: {tools or 'none'}>"


_is_async: Callable[[object], bool] = inspect.iscoroutinefunction
_is_str: Callable[[object], bool] = str.__instancecheck__  # isinstance(x, str), for map()
_to_json = json.JSONEncoder(ensure_ascii=False).encode


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


class _Turn:
    """The sequential chain's call whose turn has come: when it came, and whether the call
    started then or, set when it starts, later."""

    __slots__ = ("at_once", "call", "since", "started")

    def __init__(self, call: int, since: float) -> None:
        self.call = call
        self.since = since
        self.at_once = False
        self.started = anyio.Event()


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Batch:
    """One `run()` call: its calls, their results, and the workers that run them."""

    __slots__ = (
        "arguments",
        "bounds",
        "box",
        "calls",
        "contexts",
        "group",
        "idle",
        "in_run",
        "limiter",
        "limiter_name",
        "lineage",
        "live",
        "loop",
        "now",
        "pending",
        "pools",
        "results",
        "started",
        "taken",
        "tools",
        "turn",
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
        self.pools = [""] * len(calls)  # each call's pool, once its tool is known
        self.arguments: list[dict[str, Any]] = [{}] * len(calls)
        self.taken = [False] * len(calls)
        # The running loop, looked up once (the runtime's lookup, safe while another thread
        # is still importing trio), and its clock, as `anyio.current_time()` reads it.
        self.loop: Loop = require()
        self.now = self.loop.clock
        self.started = 0.0
        # Calls not started yet, by pool, in the model's order, and the batch's calls started
        # and not ended, under the limiter's rules (set by `_plan`).
        self.pending = Backlog(Rules(max_concurrent=0, workloads={}))
        self.bounds: dict[str, float] = {}  # when a pool's calls stop waiting, by pool
        # `async with` a slot of each pool: one object per pool, entered by each call (set by
        # `_plan`). An exit releases the slot its own task entered last through that object;
        # only `_call` enters these, never across a `yield`, so no other task's exit can find
        # a slot of this batch (`slot()` makes one per call: a generator that holds a slot
        # across a `yield` may be closed by another task).
        self.contexts: dict[str, SlotContext[Any]] = {}
        self.group: TaskGroup | None = None
        self.turn: _Turn | None = None  # the chain's call whose turn has come
        self.live = 0  # workers running calls
        self.idle: anyio.Event | None = None  # set when none is left, for `_expire`

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
        admitted = ready[:granted]
        first, chain = self._plan(admitted)
        turn = self.turn
        workers = len(first) - (turn is not None and turn.at_once) + (turn is not None)
        try:
            if workers == 1 and not self.pending:
                self.live = 1
                kept = self._start(first, True, keep=True)
                await (self._chain(chain) if kept is None else self._work(kept, True))
            elif workers:
                async with anyio.create_task_group() as self.group:
                    self._start(first, True)
                    if turn is not None:
                        self.live += 1
                        self.group.start_soon(self._chain, chain)
                    await self._expire()
        except BaseException:
            self._abandon(admitted)
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
        self.pools[i] = tool.pool
        arguments: Any = call.arguments
        problem = None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                problem = f"they are not valid JSON ({exc.msg} at character {exc.pos})"
        if problem is None and not (
            isinstance(arguments, dict | Mapping) and all(map(_is_str, arguments))
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

    def _plan(self, admitted: list[int]) -> tuple[list[int], deque[int]]:
        """Queue the calls by pool and return those to start now, and the sequential chain.

        The batch asks the limiter for no more slots than the limiter could grant it, were
        it alone: which of its calls start, and which start next whenever one ends, are
        decided by the limiter's own allocation rules (ceilings, reservations, priority)
        applied to the batch's calls, in the model's order. The rest wait in the batch, not
        in the limiter's queue: a batch of a thousand calls never puts a thousand requests
        there, nor a request behind its own. A call that starts later has waited since the
        batch started: it waits only what is left of its pool's `max_wait`, and one still
        waiting in the batch when that runs out is refused then (`_expire`). A fail-fast
        pool's calls that cannot start at once are refused at once. The chain of sequential
        calls joins in one call at a time: its next call waits among the others from its
        turn on.
        """
        pools = {self.pools[i] for i in admitted}
        rules = self.box._limits_of(pools, len(admitted))
        self.contexts = {
            pool: SlotContext(pool, self.limiter, True, loop=self.loop) for pool in pools
        }
        self.pending = pending = Backlog(rules)
        chain: deque[int] = deque()
        for i in admitted:
            tool = self.tools[i]
            assert tool is not None
            if tool.sequential:
                chain.append(i)
            else:
                pending.add(tool.pool, i)
        first = self._turns(chain) if chain else self._next()
        for pool in list(pending.queues):
            max_wait = _limits(self.limiter, pool)[1]
            if max_wait == 0:
                turn = None if self.turn is None else self.turn.call  # the chain's: its own
                for i in pending.clear(pool):
                    if i == turn:
                        pending.add(pool, i)
                    else:
                        self.taken[i] = True
                        self._reject(i, "concurrency-limit", self._busy(i))
            elif max_wait is not None:
                self.bounds[pool] = self.started + max_wait
        return first, chain

    def _next(self) -> list[int]:
        """The waiting calls that start now (counted), in the order they start."""
        pending = self.pending
        # A call's key among those waiting is its index: its place in the model's order.
        started = pending.grant()
        if not started and pending and not any(pending.active.values()):
            # The rules as the limiter states them give the batch no room even alone (a pool
            # without a reservation where reservations take every slot): its first call
            # asks anyway, and the limiter answers it, as it would answer anyone.
            queues = pending.queues
            started = [pending.take(min(queues, key=lambda pool: queues[pool][0]))]
        return started

    def _start(self, indices: list[int], first: bool = False, keep: bool = False) -> int | None:
        """Start the calls ``indices``: the chain's call goes on in the chain, the others in
        workers of their own but one, returned for the caller to run itself if ``keep``."""
        kept = None
        for i in indices:
            if self.turn is not None and i == self.turn.call:
                self.turn.started.set()
            elif keep and kept is None:
                kept = i
            else:
                assert self.group is not None
                self.live += 1
                self.group.start_soon(self._work, i, first)
        return kept

    def _turns(self, chain: deque[int]) -> list[int]:
        """Give the chain's next call its turn: from now on it waits among the batch's calls,
        or, if its pool fails fast and it cannot start at once, it is refused and the next
        one has its turn. Return the calls that start now."""
        started: list[int] = []
        while chain:
            i = chain.popleft()
            pool = self.pools[i]
            self.pending.add(pool, i)
            self.turn = _Turn(i, self.now())
            started += self._next()
            if i in started:
                self.turn.at_once = True
                break
            if _limits(self.limiter, pool)[1] != 0:
                break
            self._refuse_turn(i, self.turn.since)
        return started

    def _refuse_turn(self, i: int, since: float) -> None:
        """The chain's call ``i`` waited in the batch as long as its pool allows: refused."""
        self.pending.remove(self.pools[i], i)
        self.turn = None
        self.taken[i] = True
        self._reject(i, "concurrency-limit", self._busy(i), waited=self.now() - since)

    async def _expire(self) -> None:
        """Refuse the calls still waiting in the batch when their pool's `max_wait` (from
        the start of the batch) runs out, until the workers are done."""
        expiring = sorted((bound, pool) for pool, bound in self.bounds.items())
        if not any(pool in self.pending for _, pool in expiring):
            return
        self.idle = anyio.Event()
        if not self.live:
            return
        for bound, pool in expiring:
            with anyio.move_on_at(bound):
                await self.idle.wait()
            if self.idle.is_set():
                return
            turn = None if self.turn is None else self.turn.call  # the chain's: its own
            for i in self.pending.clear(pool):
                if i == turn:
                    self.pending.add(pool, i)
                else:
                    self.taken[i] = True
                    self._reject(i, "concurrency-limit", self._busy(i), waited=bound - self.started)

    def _retire(self) -> None:
        """A worker is done."""
        self.live -= 1
        if not self.live and self.idle is not None:
            self.idle.set()

    # -- running calls --------------------------------------------------------------------

    async def _work(self, i: int | None, first: bool) -> None:
        """Run call ``i``, then each call that the end of the previous one lets start."""
        try:
            while i is not None:
                pool = self.pools[i]
                self.taken[i] = True
                await self._call(i, self.started, None if first else self.bounds.get(pool))
                self.pending.end(pool)
                i, first = self._start(self._next(), keep=True), False
        finally:
            self._retire()

    async def _chain(self, chain: deque[int]) -> None:
        """Run the sequential calls one at a time, in the order given: each waits from its
        turn, at most its pool's `max_wait`."""
        try:
            while self.turn is not None:
                turn = self.turn
                i = turn.call
                pool = self.pools[i]
                bound = None
                if not turn.at_once:
                    max_wait = _limits(self.limiter, pool)[1]
                    bound = None if max_wait is None else turn.since + max_wait
                    with anyio.move_on_at(math.inf if bound is None else bound):
                        await turn.started.wait()
                    if not turn.started.is_set():
                        self._refuse_turn(i, turn.since)
                        self._start(self._turns(chain) if chain else self._next())
                        continue
                self.turn = None
                self.taken[i] = True
                await self._call(i, turn.since, bound)
                self.pending.end(pool)
                self._start(self._turns(chain) if chain else self._next())
        finally:
            self._retire()

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
                async with self.contexts[tool.pool] as held:
                    # Granted: the bound was on the wait only. Nothing awaited since the
                    # grant, so it cannot have fired meanwhile.
                    waiting.deadline = math.inf
                    started = self.now()
                    running = True
                    if dispatch.wants(self.limiter):
                        self._emit(ToolStartedEvent, i, held, wait_time=started - since)
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
                and not own_cancellation(exc, self.loop)
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
                cancelled = is_cancellation(exc, self.loop.cancelled)
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
                    held,
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
            if isinstance(value, str):
                content = value
            elif type(value) is int:  # a count or an id: its JSON is its digits
                content = str(value)
            else:
                content = _to_json(value)
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
        self.results[i] = make_result(call.id, call.name, content, error, effect, waited, duration)

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
        if not dispatch.wants(self.limiter):
            return
        self._emit(
            ToolFinishedEvent,
            i,
            held,
            wait_time=waited,
            duration=duration,
            outcome=outcome,
            effect=effect,
            exception=exception,
        )

    def _emit(self, cls: Any, i: int, source: Slot | str | None, **fields: Any) -> None:
        """Emit a tool event of call ``i``; ``source``: its slot, or the id of its request."""
        if not dispatch.wants(self.limiter):
            return  # and no request is numbered for nobody to read
        request_id = source.request_id if isinstance(source, Slot) else source
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
