"""`python -m benchmarks.instructions`: the workloads run, and `--opcodes` counts them.

No figure is asserted beyond what holds by construction: a ToolBox call takes a slot and does
more, so it runs more Python than the bare slot.
"""

from __future__ import annotations

import re

import pytest

from benchmarks import instructions


def per_operation(report: str) -> float:
    match = re.match(r"tools (\w+) (\w+): ([\d,]+) opcodes per operation\n", report)
    assert match is not None, report
    return float(match[3].replace(",", ""))


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_opcodes_of_a_tool_call(backend: str) -> None:
    box = instructions.opcodes("tools", "toolbox", 1, backend)
    floor = instructions.opcodes("tools", "floor", 1, backend)
    assert per_operation(box) > per_operation(floor) > 0
    functions = [line.split()[-1] for line in box.splitlines()[1:]]
    assert len(functions) == 15
    assert "_box.py:_call" in functions


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize(
    "argv",
    [
        ["tools", "semaphores", "1"],
        ["cycle", "slotwise", "10"],
        ["handoff", "anyio", "10"],
        ["cancel", "slotwise", "10"],
        ["cancel", "floor", "10"],
    ],
)
def test_each_workload_runs(argv: list[str], backend: str) -> None:
    instructions.main([*argv, backend])


@pytest.mark.parametrize(
    "argv", [[], ["tools", "anyio", "1", "asyncio"], ["--opcodes", "cycle", "slotwise", "1"]]
)
def test_a_wrong_command_shows_the_usage(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match="Instructions per operation"):
        instructions.main(argv)
