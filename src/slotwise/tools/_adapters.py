"""Tool calls in, results out, in the shapes of the provider SDKs.

Each `from_*` reads the SDK's response objects (or the same data as plain dicts) and each
`to_*` returns plain dicts that the SDK accepts as request parameters. Neither SDK is
imported at run time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._values import ToolCall, ToolResult

if TYPE_CHECKING:
    from anthropic.types import Message, ToolResultBlockParam
    from openai.types.chat import ChatCompletionMessage, ChatCompletionToolMessageParam
    from openai.types.responses import Response, ResponseInputItemParam, ResponseOutputItem

__all__ = (
    "from_anthropic",
    "from_openai",
    "from_openai_responses",
    "to_anthropic",
    "to_openai",
    "to_openai_responses",
)


def _get(obj: Any, key: str) -> Any:
    """A field of an SDK object, or of the same data as a dict."""
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, key, None)


def from_anthropic(message: Message | Mapping[str, Any]) -> list[ToolCall]:
    """The calls of an Anthropic message: its `tool_use` blocks, in order.

    Args:
        message: What `client.messages.create(...)` returned (or its dict form).

    Returns:
        One `ToolCall` per `tool_use` block (none when the model asked for no tool).
    """
    content = _get(message, "content")
    if isinstance(content, str) or content is None:
        return []
    return [
        ToolCall(id=_get(block, "id"), name=_get(block, "name"), arguments=_get(block, "input"))
        for block in content
        if _get(block, "type") == "tool_use"
    ]


def to_anthropic(results: Iterable[ToolResult]) -> list[ToolResultBlockParam]:
    """`tool_result` blocks for the next user message, one per result, in order.

    Example:
        ```python
        messages += [
            {"role": "assistant", "content": response.content},
            {"role": "user", "content": to_anthropic(results)},
        ]
        ```
    """
    return [
        {
            "type": "tool_result",
            "tool_use_id": result.call_id,
            "content": result.content,
            "is_error": result.is_error,
        }
        for result in results
    ]


def from_openai(message: ChatCompletionMessage | Mapping[str, Any]) -> list[ToolCall]:
    """The calls of an OpenAI chat completions message: its function `tool_calls`.

    The arguments stay JSON text until `ToolBox.run` parses them, so malformed JSON becomes
    an `"invalid-arguments"` result for that call alone.

    Args:
        message: `completion.choices[0].message` (or its dict form).
    """
    return [
        ToolCall(
            id=_get(call, "id"),
            name=_get(function, "name"),
            arguments=_get(function, "arguments") or "",
        )
        for call in _get(message, "tool_calls") or ()
        if (function := _get(call, "function")) is not None
    ]


def to_openai(results: Iterable[ToolResult]) -> list[ChatCompletionToolMessageParam]:
    """`role: "tool"` messages, one per result, in order, to append to the conversation
    after the assistant message that asked for the calls."""
    return [
        {"role": "tool", "tool_call_id": result.call_id, "content": result.content}
        for result in results
    ]


def from_openai_responses(
    response: Response | Mapping[str, Any] | Sequence[ResponseOutputItem],
) -> list[ToolCall]:
    """The calls of an OpenAI Responses API response: its `function_call` output items.

    Args:
        response: What `client.responses.create(...)` returned, its dict form, or its
            `output` items.
    """
    items = response if isinstance(response, Sequence) else _get(response, "output") or ()
    return [
        ToolCall(
            id=_get(item, "call_id"),
            name=_get(item, "name"),
            arguments=_get(item, "arguments") or "",
        )
        for item in items
        if _get(item, "type") == "function_call"
    ]


def to_openai_responses(results: Iterable[ToolResult]) -> list[ResponseInputItemParam]:
    """`function_call_output` items, one per result, in order: the next request's `input`
    (with `previous_response_id`), or items to add to the conversation you send."""
    return [
        {"type": "function_call_output", "call_id": result.call_id, "output": result.content}
        for result in results
    ]
