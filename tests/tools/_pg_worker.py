"""A worker process for the multi-process tool tests: ``python _pg_worker.py '<json>'``.

It builds the ToolBox of ``toolbox()`` on a PostgresLimiter (the same configuration in every
process), runs ``batches`` random batches of ``calls`` calls, and prints one JSON line: each
handler's (tool, pool, start, end) on the system-wide monotonic clock, and the count of each result
error.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections import Counter
from typing import Any

import anyio

from slotwise import Workload
from slotwise.postgres import PostgresLimiter
from slotwise.tools import ToolBox, ToolCall

POOLS = {"search": 1, "customers": 2, "default": 4}
MAX_CONCURRENT = 4


def toolbox(limiter: Any, intervals: list[tuple[str, str, float, float]]) -> ToolBox[str]:
    """The shared configuration: three pools under a global limit of 4, and tools that hold
    their slot a while, fail, or time out."""
    box = ToolBox(limiter=limiter)

    def register(name: str, pool: str, **options: Any) -> None:
        async def handler(hold: float, fail: bool = False) -> str:
            start = time.monotonic()
            try:
                await anyio.sleep(hold)
            finally:
                intervals.append((name, pool, start, time.monotonic()))
            if fail:
                raise RuntimeError("broke")
            return name

        box.tool(name=name, pool=pool, **options)(handler)

    register("search_docs", "search", timeout=0.3)
    register("lookup_customer", "customers")
    register("update_customer", "customers", sequential=True, writes=True)
    register("summarise", "default")
    return box


def limiter_for(spec: dict[str, Any]) -> PostgresLimiter[str]:
    return PostgresLimiter(
        spec["dsn"],
        name=spec["name"],
        schema=spec["schema"],
        max_concurrent=MAX_CONCURRENT,
        workloads={
            pool: Workload(max_concurrent=ceiling, max_wait=30.0) for pool, ceiling in POOLS.items()
        },
        poll_interval=0.02,
    )


async def main(spec: dict[str, Any]) -> None:
    rng = random.Random(spec["seed"])
    intervals: list[tuple[str, str, float, float]] = []
    errors: Counter[str] = Counter()
    async with limiter_for(spec) as limiter:
        box = toolbox(limiter, intervals)
        names = list(box.tools)
        for batch in range(spec["batches"]):
            calls = [
                ToolCall(
                    id=f"{batch}-{n}",
                    name=rng.choice(names),
                    arguments={"hold": rng.uniform(0.02, 0.12), "fail": rng.random() < 0.15},
                )
                for n in range(spec["calls"])
            ]
            for result in await box.run(calls):
                errors[result.error or "none"] += 1
    print(json.dumps({"intervals": intervals, "errors": errors}))


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
