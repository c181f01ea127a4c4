"""Every public function that takes a limiter and a workload checks the name against a typed
limiter's names; the message names the limiter's public class and its names."""

from typing import Literal

import httpx
import httpx2

import slotwise
import slotwise.httpx
from slotwise import MemoryLimiter, Workload
from slotwise.tools import ToolBox

Name = Literal["interactive", "background"]

claude: MemoryLimiter[Name] = MemoryLimiter(
    name="claude",
    max_concurrent=8,
    workloads={"interactive": Workload(reserved=2), "background": Workload()},
    default_workload="background",
)
mock = httpx2.MockTransport(lambda request: httpx2.Response(200))


async def correct() -> None:
    async with slotwise.slot(workload="interactive", limiter=claude):
        pass
    async with slotwise.slot("background", limiter=claude):
        pass
    async with slotwise.slot(limiter=claude):
        pass
    slot = await slotwise.acquire(workload="interactive", limiter=claude)
    await slot.release()
    with slotwise.sync_slot(workload="background", limiter=claude):
        pass
    async with slotwise.run(limiter=claude, workload="interactive"):
        pass
    async with (
        slotwise.run(limiter=claude),
        slotwise.slot(workload="unchecked: no limiter is named here"),
    ):
        pass
    a: httpx2.AsyncClient = slotwise.httpx.client(limiter=claude, workload="interactive")
    b: httpx.AsyncClient = slotwise.httpx.client(limiter=claude, stack="httpx")
    c: httpx2.Client = slotwise.httpx.sync_client(limiter=claude, workload="background")
    d: httpx.Client = slotwise.httpx.sync_client(limiter=claude, stack="httpx")
    e: httpx2.AsyncClient = slotwise.httpx.wrap(a, limiter=claude, workload="background")
    f: httpx2.MockTransport = slotwise.httpx.transport(mock, limiter=claude, workload="background")
    ToolBox(limiter=claude).tool(pool="background")
    del b, c, d, e, f


async def typos() -> None:
    async with slotwise.slot(workload="typo", limiter=claude):  # E[arg-type]: "MemoryLimiter[Literal['interactive', 'background']]"
        pass
    async with slotwise.slot("interactiv", limiter=claude):  # E[arg-type]: "MemoryLimiter[Literal['interactive', 'background']]"
        pass
    await slotwise.acquire(workload="typo", limiter=claude)  # E[arg-type]: "MemoryLimiter[Literal['interactive', 'background']]"
    with slotwise.sync_slot(workload="typo", limiter=claude):  # E[arg-type]: "MemoryLimiter[Literal['interactive', 'background']]"
        pass
    async with slotwise.run(limiter=claude, workload="typo"):  # E[arg-type]: "MemoryLimiter[Literal['interactive', 'background']]"
        pass
    slotwise.httpx.client(limiter=claude, workload="typo")  # E[arg-type]: "MemoryLimiter[Literal['interactive', 'background']]"
    slotwise.httpx.client(limiter=claude, workload="typo", stack="httpx")  # E[call-overload]: "MemoryLimiter[Literal['interactive', 'background']]"
    slotwise.httpx.sync_client(limiter=claude, workload="typo")  # E[arg-type]: "MemoryLimiter[Literal['interactive', 'background']]"
    slotwise.httpx.wrap(httpx2.AsyncClient(), limiter=claude, workload="typo")  # E[arg-type]: "MemoryLimiter[Literal['interactive', 'background']]"
    slotwise.httpx.transport(mock, limiter=claude, workload="typo")  # E[arg-type]: "MemoryLimiter[Literal['interactive', 'background']]"
    ToolBox(limiter=claude).tool(pool="typo")  # E[call-overload]: "tool" of "ToolBox"


def workload_from_elsewhere(name: str) -> None:
    slotwise.slot(workload=name, limiter=claude)  # E[arg-type]: "MemoryLimiter[Literal['interactive', 'background']]"
    slotwise.run(limiter=claude, workload=name)  # E[arg-type]: "MemoryLimiter[Literal['interactive', 'background']]"
