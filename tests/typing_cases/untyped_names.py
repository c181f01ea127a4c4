"""A limiter built as the README shows it, with no annotation: it type-checks as it is, and any
workload name is accepted (the limiter checks names when the slot is taken)."""

import slotwise
from slotwise import MemoryLimiter, Workload

claude = MemoryLimiter(name="claude", max_concurrent=8)
shared = MemoryLimiter(
    max_concurrent=8,
    workloads={"interactive": Workload(reserved=2), "background": Workload()},
)


async def correct() -> None:
    async with claude.slot():
        pass
    async with claude.slot(workload="default"):
        pass
    async with slotwise.slot(limiter=claude):
        pass
    async with shared.slot(workload="interactive"):
        pass
    async with shared.slot(workload="anything"):
        pass
