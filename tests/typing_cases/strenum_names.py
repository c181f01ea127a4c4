"""Workload names declared as a ``StrEnum``: a typo is a type error, members pass."""

from enum import StrEnum

from slotwise import MemoryLimiter, Workload


class Kind(StrEnum):
    INTERACTIVE = "interactive"
    BACKGROUND = "background"


# Inferred from the keys: MemoryLimiter[Kind].
claude = MemoryLimiter(
    name="claude",
    max_concurrent=8,
    workloads={
        Kind.INTERACTIVE: Workload(reserved=2, priority=10),
        Kind.BACKGROUND: Workload(max_concurrent=6),
    },
    default_workload=Kind.BACKGROUND,
)
annotated: MemoryLimiter[Kind] = claude


async def correct() -> None:
    async with claude.slot(workload=Kind.INTERACTIVE):
        pass
    async with annotated.slot(Kind.BACKGROUND):
        pass
    async with claude.slot():
        pass


async def typos() -> None:
    async with claude.slot(workload="typo"):  # E[arg-type]: Argument "workload" to "slot"
        pass
    async with annotated.slot(workload="typo"):  # E[arg-type]: Argument "workload" to "slot"
        pass
    async with claude.slot(workload=Kind.TYPO):  # E[attr-defined]: "TYPO"
        pass
