"""Typed pools: with a limiter typed by its workload names, a pool's typo in `tools.tool()` is
a type error, and a decorated handler keeps its own type."""

from __future__ import annotations

import subprocess
import sys

SNIPPET = """
from typing import Literal

from slotwise import MemoryLimiter, Workload
from slotwise.tools import ToolBox

limiter: MemoryLimiter[Literal["search", "default"]] = MemoryLimiter(
    max_concurrent=2, workloads={"search": Workload(), "default": Workload()}
)
tools = ToolBox(limiter=limiter)


@tools.tool(pool="search")
async def search(query: str) -> str:
    return query


@tools.tool
async def count(text: str) -> int:
    return len(text)


async def use() -> None:
    found: str = await search("x")
    size: int = await count("x")
    tools.tool(pool="serch")
"""


def test_a_pool_typo_is_a_type_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "-c", SNIPPET],
        capture_output=True,
        text=True,
        check=False,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, result.stdout
    line = SNIPPET.splitlines().index('    tools.tool(pool="serch")') + 1
    assert errors[0].startswith(f'<string>:{line}: error: No overload variant of "tool"')
