"""A worker process for the multi-process tests: ``python _worker.py '<json>'``.

Modes:
    load    ``requests`` slots with random workloads, hold times and cancellations; prints a
            JSON summary of outcomes.
    hold    holds ``hold`` slots and queues ``queue`` more requests, prints "ready", then
            sleeps until killed.
    start   starts a limiter on a (possibly fresh) schema, takes one slot, prints "ok".
    chaos   ``tasks`` tasks take slots in a loop, through whatever the database does, until
            stdin closes; prints "started", then every body's interval on time.monotonic()
            (one clock for every process of the machine) and the outcomes, as JSON.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
import time
from typing import Any

import anyio

import slotwise
from slotwise import Rate, Workload
from slotwise.postgres import PostgresLimiter


def make_limiter(spec: dict[str, Any]) -> PostgresLimiter[str]:
    workloads = {name: Workload(**w) for name, w in spec.get("workloads", {}).items()} or None
    return PostgresLimiter(
        spec["dsn"],
        name=spec["name"],
        schema=spec["schema"],
        max_concurrent=spec["max_concurrent"],
        max_queued=spec.get("max_queued"),
        lease_ttl=spec.get("lease_ttl", 30.0),
        queue_entry_ttl=spec.get("queue_entry_ttl", 15.0),
        poll_interval=spec.get("poll_interval", 0.1),
        workloads=workloads,
        default_workload=spec.get("default_workload"),
        rate=Rate(**spec["rate"]) if spec.get("rate") else None,
        listen=spec.get("listen", True),
        synchronous_commit=spec.get("synchronous_commit", True),
        db_timeout=spec.get("db_timeout", 5.0),
    )


async def load(spec: dict[str, Any]) -> None:
    rng = random.Random(spec["seed"])
    limiter = make_limiter(spec)
    outcomes: dict[str, int] = {}
    names = list(spec.get("workloads", {})) or ["default"]
    parallel = anyio.Semaphore(spec.get("parallel", 20))

    async def one() -> None:
        workload = rng.choice(names)
        hold = rng.uniform(0, spec.get("max_hold", 0.02))
        cancel_after = rng.uniform(0, 0.05) if rng.random() < spec.get("cancel", 0.2) else None
        outcome = "completed"
        async with parallel:
            try:
                with anyio.CancelScope() as scope:
                    if cancel_after is not None:
                        scope.deadline = anyio.current_time() + cancel_after
                    async with limiter.slot(workload):
                        await anyio.sleep(hold)
                if scope.cancelled_caught:
                    outcome = "cancelled"
            except slotwise.ConcurrencyError as exc:
                outcome = type(exc).__name__
                if exc.__cause__ is not None:
                    outcome += f" from {exc.__cause__!r}"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    async with limiter, anyio.create_task_group() as tg:
        for _ in range(spec["requests"]):
            tg.start_soon(one)
    print(json.dumps(outcomes), flush=True)


async def hold(spec: dict[str, Any]) -> None:
    limiter = make_limiter(spec)
    await limiter.start()
    holding = 0

    async def keep() -> None:
        nonlocal holding
        async with limiter.slot():
            holding += 1
            await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        for _ in range(spec["hold"]):
            tg.start_soon(keep)
        for _ in itertools.count():  # wait for the slots, then for the queue entries
            if holding == spec["hold"]:
                break
            await anyio.sleep(0.01)
        for _ in range(spec["queue"]):
            tg.start_soon(keep)
        for _ in itertools.count():
            if (await limiter.stats()).queued == spec["queue"]:
                break
            await anyio.sleep(0.01)
        print("ready", flush=True)


async def start(spec: dict[str, Any]) -> None:
    async with make_limiter(spec) as limiter, limiter.slot():
        pass
    print("ok", flush=True)


async def chaos(spec: dict[str, Any]) -> None:
    rng = random.Random(spec["seed"])
    limiter = make_limiter(spec)
    intervals: list[tuple[float, float]] = []
    outcomes: dict[str, int] = {}

    async def loop() -> None:
        while True:
            # Most bodies are short; some hold their slot across a fault; some requests are
            # cancelled, waiting or running.
            hold = rng.uniform(0.3, 1.2) if rng.random() < 0.1 else rng.uniform(0.005, 0.03)
            outcome = "completed"
            try:
                with anyio.CancelScope() as scope:
                    if rng.random() < 0.2:
                        scope.deadline = anyio.current_time() + rng.uniform(0.02, 0.5)
                    async with limiter.slot():
                        begin = time.monotonic()
                        try:
                            await anyio.sleep(hold)
                        finally:
                            intervals.append((begin, time.monotonic()))
                if scope.cancelled_caught:
                    outcome = "cancelled"
            except slotwise.ConcurrencyError as exc:  # anything else ends the worker
                outcome = type(exc).__name__
                await anyio.sleep(0.05)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    async with limiter:
        print("started", flush=True)
        async with anyio.create_task_group() as tg:
            for _ in range(spec["tasks"]):
                tg.start_soon(loop)
            await anyio.to_thread.run_sync(sys.stdin.read)  # until the test closes stdin
            tg.cancel_scope.cancel()
    print(json.dumps({"intervals": intervals, "outcomes": outcomes}), flush=True)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    modes = {"load": load, "hold": hold, "start": start, "chaos": chaos}
    asyncio.run(modes[spec["mode"]](spec))
