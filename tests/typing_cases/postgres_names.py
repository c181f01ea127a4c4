"""PostgresLimiter's workload names are checked as MemoryLimiter's are, and the messages
name PostgresLimiter."""

from typing import Literal

import slotwise
from slotwise import Workload
from slotwise.postgres import PostgresLimiter

Name = Literal["interactive", "background"]

claude: PostgresLimiter[Name] = PostgresLimiter(
    "postgresql:///test",
    name="claude",
    max_concurrent=8,
    workloads={"interactive": Workload(reserved=2), "background": Workload()},
    default_workload="background",
)


async def correct() -> None:
    async with claude.slot(workload="interactive"):
        pass
    async with slotwise.slot(workload="background", limiter=claude):
        pass
    async with slotwise.run(limiter=claude, workload="interactive"):
        pass


async def typos() -> None:
    async with claude.slot(workload="typo"):  # E[arg-type]: Argument "workload" to "slot" of "PostgresLimiter"
        pass
    async with slotwise.slot(workload="typo", limiter=claude):  # E[arg-type]: "PostgresLimiter[Literal['interactive', 'background']]"
        pass
    async with slotwise.run(limiter=claude, workload="typo"):  # E[arg-type]: "PostgresLimiter[Literal['interactive', 'background']]"
        pass
