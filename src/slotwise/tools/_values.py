"""The values a ToolBox takes and gives: calls, results, registered tools."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, TypeAlias

import attrs

from .._events import ToolEffect

__all__ = ("Tool", "ToolCall", "ToolError", "ToolResult")

ToolError: TypeAlias = Literal[
    "unknown-tool",
    "invalid-arguments",
    "failed",
    "timed-out",
    "concurrency-limit",
    "limiter-error",
    "budget-exhausted",
]


@attrs.frozen(kw_only=True)
class ToolCall:
    """One call the model asked for.

    The adapters (`from_anthropic`, `from_openai`, `from_openai_responses`) build these from
    a provider's response.

    Attributes:
        id: The call's id (Anthropic's `tool_use` id, OpenAI's `tool_call_id` or `call_id`).
            Results are matched to calls by it.
        name: The tool the model called.
        arguments: The handler's keyword arguments: a mapping, or the JSON text of one as
            OpenAI sends it. Text that does not parse, or is not a JSON object, becomes an
            `"invalid-arguments"` result.

    Example:
        ```python
        ToolCall(id="toolu_01", name="search_docs", arguments={"query": "refunds"})
        ```
    """

    id: str
    name: str
    arguments: Mapping[str, Any] | str = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class ToolResult:
    """What one call gave, ready to go back to the model.

    Attributes:
        call_id: The id of the call it answers.
        name: The tool the model called.
        content: What the model reads: a handler's `str` as is, anything else as JSON; for an
            error, what went wrong (the exception's type and message, never a traceback nor
            the arguments). A result cut by the result budget ends with a note.
        error: None when the handler returned; else why not: `"unknown-tool"`,
            `"invalid-arguments"` (they do not fit the handler's signature, or are not a JSON
            object), `"failed"` (the handler raised, or returned what is not JSON), `"timed-out"`
            (the tool's `timeout` cancelled it), `"concurrency-limit"` (no slot within its
            pool's `max_wait`, or the queue was full: it never ran and is not retried),
            `"limiter-error"` (the limiter failed, or the slot's lease was lost while the
            handler ran) or `"budget-exhausted"` (the run used its `max_calls_per_run`).
        effect: `"none"`: nothing happened (the handler never started, or a tool that does
            not write stopped part-way); `"done"`: the handler returned; `"unknown"`: a tool
            declared with `writes=True` started and did not return, so its write may or may
            not have happened.
        wait_time: Seconds the call waited for its slot (for a parallel call, from the start
            of the batch).
        duration: Seconds the handler ran (0 if it never started).
        truncated: Characters of `content` cut by the result budget (0: whole).
    """

    call_id: str
    name: str
    content: str
    error: ToolError | None = None
    effect: ToolEffect = "done"
    wait_time: float = 0.0
    duration: float = 0.0
    truncated: int = 0

    @property
    def is_error(self) -> bool:
        """Whether the call failed or never ran (`error` is not None)."""
        return self.error is not None


_new = object.__new__
(
    _set_call_id,
    _set_name,
    _set_content,
    _set_error,
    _set_effect,
    _set_wait_time,
    _set_duration,
    _set_truncated,
) = (ToolResult.__dict__[field.name].__set__ for field in attrs.fields(ToolResult))


def make_result(
    call_id: str,
    name: str,
    content: str,
    error: ToolError | None,
    effect: ToolEffect,
    wait_time: float,
    duration: float,
) -> ToolResult:
    """``ToolResult(call_id=..., ...)`` (``truncated=0``) for a batch's results: the same
    value, its slots filled directly, where the frozen class's ``__init__`` makes a call of
    a bound ``object.__setattr__`` per field and parses keywords (about twice the time, and
    6% of a tool call's whole cost)."""
    result = _new(ToolResult)
    _set_call_id(result, call_id)
    _set_name(result, name)
    _set_content(result, content)
    _set_error(result, error)
    _set_effect(result, effect)
    _set_wait_time(result, wait_time)
    _set_duration(result, duration)
    _set_truncated(result, 0)
    return result


@attrs.frozen(kw_only=True)
class Tool:
    """A tool registered with `ToolBox.tool`.

    Attributes:
        name: The name the model calls it by.
        handler: The async function that runs a call.
        pool: The workload of the ToolBox's limiter its calls hold a slot of.
        timeout: Seconds a call's handler may run before it is cancelled; None: no limit
            but the run's budget.
        sequential: Whether its calls join the batch's sequential chain.
        writes: Whether it changes something, so that a call stopped part-way has an
            `"unknown"` effect.
    """

    name: str
    handler: Callable[..., Awaitable[Any]]
    pool: str
    timeout: float | None = None
    sequential: bool = False
    writes: bool = False
    _signature: inspect.Signature = attrs.field(repr=False, eq=False)
    _fits: Callable[[Mapping[str, Any]], bool] = attrs.field(repr=False, eq=False)
