"""Tool calls under concurrency limits: a global limit and per-tool pools, admitted together.

A model response can hold several tool calls; the runtime, not the model, decides how many run
at once, and every call gets a result. `ToolBox` runs them, each holding a slot of one limiter
in its tool's pool (a workload), so tool pools get what provider slots have: leases, runs and
their budgets, events, stats, OpenTelemetry, and PostgreSQL for pools shared by several
processes. `import slotwise` does not import this module.

Example:
    ```python
    from slotwise import MemoryLimiter, Workload
    from slotwise.tools import ToolBox, ToolCall

    tools = ToolBox(limiter=MemoryLimiter(name="tools", max_concurrent=4, workloads={
        "search": Workload(max_concurrent=1, max_wait=10.0),
        "default": Workload(max_wait=30.0),
    }))

    @tools.tool(pool="search", timeout=10.0)
    async def search_docs(query: str) -> str: ...

    results = await tools.run([ToolCall(id="1", name="search_docs", arguments={"query": "x"})])
    ```
"""

from contextlib import suppress as _suppress

from .._events import ToolEffect as ToolEffect
from .._events import ToolFinishedEvent as ToolFinishedEvent
from .._events import ToolOutcome as ToolOutcome
from .._events import ToolRejectedEvent as ToolRejectedEvent
from .._events import ToolRejection as ToolRejection
from .._events import ToolStartedEvent as ToolStartedEvent
from ._adapters import from_anthropic as from_anthropic
from ._adapters import from_openai as from_openai
from ._adapters import from_openai_responses as from_openai_responses
from ._adapters import to_anthropic as to_anthropic
from ._adapters import to_openai as to_openai
from ._adapters import to_openai_responses as to_openai_responses
from ._box import ToolBox as ToolBox
from ._values import Tool as Tool
from ._values import ToolCall as ToolCall
from ._values import ToolError as ToolError
from ._values import ToolResult as ToolResult

__all__ = (
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolEffect",
    "ToolError",
    "ToolFinishedEvent",
    "ToolOutcome",
    "ToolRejectedEvent",
    "ToolRejection",
    "ToolResult",
    "ToolStartedEvent",
    "from_anthropic",
    "from_openai",
    "from_openai_responses",
    "to_anthropic",
    "to_openai",
    "to_openai_responses",
)

# Public classes say `slotwise.tools.X` in reprs, tracebacks and docs.
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("slotwise."):
        with _suppress(AttributeError, TypeError):
            _obj.__module__ = __name__
del _name, _obj
