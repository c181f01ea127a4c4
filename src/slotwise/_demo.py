"""The demo: interactive chats and background jobs share one MemoryLimiter."""

from __future__ import annotations

import random

import anyio

from . import ConcurrencyTimeoutError, MemoryLimiter, Workload


def main(*, seconds: float) -> int:
    return anyio.run(_simulate, seconds)


async def _simulate(seconds: float) -> int:
    claude = MemoryLimiter(
        name="claude",
        max_concurrent=8,
        max_queued=200,
        workloads={
            "interactive": Workload(reserved=2, priority=10, max_wait=5.0),
            "background": Workload(max_concurrent=6, max_wait=30.0),
        },
    )
    peak = {"interactive": 0, "background": 0, "total": 0}
    active = {"interactive": 0, "background": 0}
    served = {"interactive": 0, "background": 0}
    timeouts = 0
    rng = random.Random(7)

    async def request(workload: str) -> None:
        nonlocal timeouts
        try:
            async with claude.slot(workload):
                active[workload] += 1
                peak[workload] = max(peak[workload], active[workload])
                peak["total"] = max(peak["total"], sum(active.values()))
                await anyio.sleep(rng.uniform(0.05, 0.3))  # the simulated provider
                active[workload] -= 1
                served[workload] += 1
        except ConcurrencyTimeoutError:
            timeouts += 1

    async with anyio.create_task_group() as tg:
        end = anyio.current_time() + seconds
        while anyio.current_time() < end:
            tg.start_soon(request, "background" if rng.random() < 0.7 else "interactive")
            await anyio.sleep(0.01)
    print(f"{claude!r}")
    print(
        f"peak in flight: {peak['total']}/8 in all, interactive {peak['interactive']}, "
        f"background {peak['background']}/6"
    )
    print(
        f"served: interactive {served['interactive']}, background {served['background']}; "
        f"timeouts {timeouts}"
    )
    return 0 if peak["total"] <= 8 and peak["background"] <= 6 else 1
