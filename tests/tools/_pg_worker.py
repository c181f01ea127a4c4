"""A worker process for the multi-process tool tests: ``python _pg_worker.py '<json>'``.

It builds the ToolBox of ``toolbox()`` on a PostgresLimiter (the same configuration in every
process) and runs ``batches`` random batches of ``calls`` calls of tools that sleep, fail or
time out; the batch numbered ``cancel`` is cancelled part-way, once ``CANCEL_AFTER`` of its
handlers have started. Each handler writes a line to the shared journal (``journal``, a file
every worker appends to under an exclusive lock) when it starts and when it ends, so that the
journal's order is the order in which handlers started and ended across the processes: replayed,
it counts the handlers running at once. The worker prints one JSON line: each batch's calls and
its results (None for the cancelled batch).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import random
import sys
from typing import Any

import anyio

from slotwise import Workload
from slotwise.postgres import PostgresLimiter
from slotwise.tools import ToolBox, ToolCall

POOLS = {"search": 1, "customers": 2, "default": 3}
MAX_CONCURRENT = 4
# Tool name: (pool, sequential and writes).
TOOLS = {
    "search_docs": ("search", False),
    "lookup_customer": ("customers", False),
    "update_customer": ("customers", True),
    "summarise": ("default", False),
    "send_email": ("default", True),
}
KINDS = ("sleep", "fail", "slow")  # "slow" sleeps past the tools' timeout
TIMEOUT = 1.0
CANCEL_AFTER = 3


class Journal:
    """Lines appended to one file by every worker, each under an exclusive lock: their order in
    the file is the order in which the handlers wrote them."""

    def __init__(self, path: str, worker: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.worker = worker

    def write(self, edge: str, tool: str, pool: str, call_id: str) -> None:
        line = json.dumps([self.worker, edge, tool, pool, call_id]) + "\n"
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            os.write(self.fd, line.encode())
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)


def toolbox(limiter: Any, journal: Journal, on_start: Any) -> ToolBox[str]:
    """The shared configuration: three pools under a global limit of 4, two sequential tools
    (in different pools), and every tool with a timeout. A handler journals its start and end,
    then sleeps ``hold`` seconds (or far past its timeout if ``kind`` is "slow"), then fails if
    ``kind`` is "fail", else returns its ``tag``."""
    box = ToolBox(limiter=limiter)

    def register(name: str, pool: str, sequential: bool) -> None:
        async def handler(tag: str, kind: str, hold: float) -> str:
            journal.write("+", name, pool, tag)
            try:
                on_start()
                await anyio.sleep(60.0 if kind == "slow" else hold)
            finally:
                journal.write("-", name, pool, tag)
            if kind == "fail":
                raise RuntimeError("broke")
            return tag

        box.tool(name=name, pool=pool, timeout=TIMEOUT, sequential=sequential, writes=sequential)(
            handler
        )

    for name, (pool, sequential) in TOOLS.items():
        register(name, pool, sequential)
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
    journal = Journal(spec["journal"], spec["worker"])
    batches: list[dict[str, Any]] = []
    started = 0
    scope = anyio.CancelScope()

    def on_start() -> None:
        nonlocal started
        started += 1
        if len(batches) - 1 == spec["cancel"] and started == CANCEL_AFTER:
            scope.cancel()

    async with limiter_for(spec) as limiter:
        box = toolbox(limiter, journal, on_start)
        for batch in range(spec["batches"]):
            plan = [
                (f"{batch}-{n}", rng.choice(list(TOOLS)), rng.choices(KINDS, (6, 2, 1))[0])
                for n in range(spec["calls"])
            ]
            calls = [
                ToolCall(
                    id=call_id,
                    name=name,
                    arguments={"tag": call_id, "kind": kind, "hold": rng.uniform(0.01, 0.05)},
                )
                for call_id, name, kind in plan
            ]
            batches.append({"calls": plan, "results": None})
            started = 0
            scope = anyio.CancelScope()
            with scope:
                results = await box.run(calls)
                batches[-1]["results"] = [
                    (r.call_id, r.error, r.effect, r.content) for r in results
                ]
    print(json.dumps({"batches": batches}))


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
