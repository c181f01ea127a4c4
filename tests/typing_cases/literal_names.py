"""Workload names declared as a ``Literal``: a typo is a type error, correct names pass."""

from typing import Literal

import slotwise
from slotwise import MemoryLimiter, Workload

Name = Literal["interactive", "background"]

claude: MemoryLimiter[Name] = MemoryLimiter(
    name="claude",
    max_concurrent=8,
    workloads={
        "interactive": Workload(reserved=2, priority=10, max_wait=60.0),
        "background": Workload(max_concurrent=6, max_wait=300.0),
    },
    default_workload="background",
)


async def correct() -> None:
    async with claude.slot(workload="interactive"):
        pass
    async with claude.slot(workload="background") as slot:
        assert slot.workload == "background"
    async with claude.slot("background"):
        pass
    async with claude.slot():
        pass
    async with slotwise.run(limiter=claude, workload="background"):
        pass


async def typos() -> None:
    async with claude.slot(workload="typo"):  # E[arg-type]: "slot" of "MemoryLimiter"
        pass
    async with claude.slot("interactiv"):  # E[arg-type]: Argument 1 to "slot" of "MemoryLimiter"
        pass


def workload_from_elsewhere(name: str) -> None:
    claude.slot(workload=name)  # E[arg-type]: Argument "workload" to "slot" of "MemoryLimiter"


misnamed: MemoryLimiter[Name] = MemoryLimiter(
    max_concurrent=8,
    workloads={"interactive": Workload(), "batch": Workload()},  # E[dict-item]: 'batch'
)
misdefaulted: MemoryLimiter[Name] = MemoryLimiter(
    max_concurrent=8,
    workloads={"interactive": Workload(), "background": Workload()},
    default_workload="batch",  # E[arg-type]: Argument "default_workload"
)
