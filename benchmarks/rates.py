"""Rates, tokens and pushback against a fake provider: 429s, capacity used, latency.

    python -m benchmarks.rates [--duration 60] [--variant NAME ...] [--dsn CONNINFO] [--tiny]
                               [--pushback SLOTS,RATES] [--no-limit-headers] [--timeline PATH]

A fake provider (`benchmarks.fake_provider`, its own process) enforces 600 requests and
100,000 tokens a minute (token buckets, full at the start) and 16 requests in flight, and
answers 429 with ``retry-after`` past any of them. Like OpenAI and Anthropic it states its
limits on every answer (``x-ratelimit-limit-*``), unless ``--no-limit-headers``. Four processes of 100 tasks each send it
chat completions for ``--duration`` seconds: every task loops, and retries each request until
it succeeds. The mix is the same for every variant (seeded per task): prompts of 200 to 8,000
tokens and ``max_tokens`` of 100 to 1,000, both log-uniform; the provider produces 30-100% of
``max_tokens`` in 0.3 to 1.5 s. For this mix tokens are the binding limit, by far.

Each variant is what a user would write, and differs only in what paces the attempts:

- ``none``: no limiter; a refused request is retried after the provider's ``retry-after``
  (as the SDKs do when the header is there).
- ``backoff``: no limiter; exponential backoff with jitter as the openai SDK computes it
  (0.5 s doubling up to 8 s, less up to 25%), without reading ``retry-after``.
- ``semaphore``: one ``asyncio.Semaphore(16 / 4)`` per process around each attempt; a refused
  request is retried after ``retry-after``, outside the semaphore.
- ``aiolimiter``: per process, one ``aiolimiter.AsyncLimiter`` for a quarter of the RPM and
  one for a quarter of the TPM (charged the request's estimate); no concurrency limit.
- ``litellm``: LiteLLM-style per-process cooldown: after a 429 the process sends nothing for
  ``retry-after`` (5 s when absent, LiteLLM's default cooldown). LiteLLM itself cools a
  deployment down only once half the minute's requests failed: this peer is quicker to stop.
- ``slotwise-postgres``: one `PostgresLimiter` shared by the 4 processes, at the provider's
  limits: ``max_concurrent=16, rate=Rate(requests=600, tokens=100_000, per=60)``. Each attempt
  holds ``limiter.slot(tokens=estimate)`` (prompt plus ``max_tokens``) and, as
  `slotwise.httpx` would, calls ``slot.used_tokens(usage)`` on success,
  ``slot.throttled(retry_after)`` on a 429 (after ``used_tokens(0)``: a refusal costs no
  tokens), ``slot.provider_limits(...)`` with the ``x-ratelimit-limit-*`` headers and
  ``slot.provider_remaining(...)`` with the ``x-ratelimit-remaining-*`` headers.
- ``pushback-postgres``: the same, configured at twice the provider's limits (32 slots, 1,200
  RPM, 200,000 TPM) with ``adaptive=Adaptive(min_concurrent=2, slow_start=True)``;
  ``--pushback 2,1`` sets only the concurrency too high, ``--pushback 1,2`` only the rates.
- ``slotwise-memory`` and ``pushback-memory``: the same with a `MemoryLimiter` in one process
  of 400 tasks, which stands in when the PostgreSQL variants cannot run.

By default every peer runs, then the PostgreSQL variants when this `PostgresLimiter` supports
rates, pushback and adaptive limits and the database answers, or else the memory stand-ins.

Reported per variant (from the provider's own counts): requests sent, 429s (count and share),
successful requests per second, the share of the provider's capacity used (the binding one of
its three limits: requests, tokens, or request-seconds in flight, each against what it allows
in the run: a full bucket plus its refill), which limit that is, p50 and p95 latency of the
successful requests (from the first attempt, waits and retries included), their mean tokens
(below the mix's mean when small requests get through and large ones wait), the clients' CPU
and the load average over the variant's run; then when the 429s came, which limit refused
them, and how long the provider's token bucket sat full (capacity nobody used).

Every task always has a request under way, so the load is far above what the provider allows
(by design: the limiter, not the demand, must set the pace) and latency is mostly waiting.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import IO, Any

import anyio
import attrs
import httpx

from slotwise import Adaptive, MemoryLimiter, Rate

from ._harness import cpu_model

# -- the provider's limits and the mix ------------------------------------------------------

RPM = 600
TPM = 100_000
CONCURRENCY = 16
PROMPT = (200, 8_000)  # prompt tokens, log-uniform
MAX_TOKENS = (100, 1_000)  # max_tokens, log-uniform
OUTPUT = (0.3, 1.0)  # the provider's output, as a share of max_tokens
DSN = os.environ.get("SLOTWISE_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
SCHEMA = f"slotwise_bench_rates_{os.getpid()}"  # this run's own: runs may overlap


def _loguniform_mean(low: float, high: float) -> float:
    return (high - low) / math.log(high / low)


def mix_mean() -> tuple[float, float]:
    """The mix's mean tokens per request (prompt plus output) and mean duration."""
    output = _loguniform_mean(*MAX_TOKENS) * sum(OUTPUT) / 2
    return _loguniform_mean(*PROMPT) + output, 0.3 + 1.2 * output / 1000


@attrs.frozen(kw_only=True)
class Request:
    prompt: int
    max_tokens: int

    @property
    def estimate(self) -> int:
        """What the provider charges when it admits the request."""
        return self.prompt + self.max_tokens

    def body(self) -> bytes:
        # 4 characters per token, as the provider counts them.
        message = {"role": "user", "content": "word" * self.prompt}
        return json.dumps(
            {"model": "fake-1", "messages": [message], "max_tokens": self.max_tokens}
        ).encode()


def draw(rng: random.Random) -> Request:
    def loguniform(low: int, high: int) -> int:
        return round(math.exp(rng.uniform(math.log(low), math.log(high))))

    return Request(prompt=loguniform(*PROMPT), max_tokens=loguniform(*MAX_TOKENS))


# -- the variants -----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Variant:
    key: str
    label: str
    one_process: bool = False  # all the tasks in one process
    postgres: bool = False
    goal: tuple[float, float] | None = None  # (most 429s, least capacity), as fractions


VARIANTS = {
    v.key: v
    for v in (
        Variant(key="none", label="no limiter, retry-after"),
        Variant(key="backoff", label="no limiter, SDK backoff"),
        Variant(key="semaphore", label="asyncio.Semaphore(4) per process"),
        Variant(key="aiolimiter", label="aiolimiter RPM+TPM per process"),
        Variant(key="litellm", label="LiteLLM-style cooldown per process"),
        Variant(
            key="slotwise-postgres",
            label="slotwise PostgresLimiter, provider's limits",
            postgres=True,
            goal=(0.0, 0.95),
        ),
        Variant(
            key="pushback-postgres",
            label="slotwise PostgresLimiter, 2x limits + adaptive",
            postgres=True,
            goal=(0.02, 0.90),
        ),
        Variant(
            key="slotwise-memory",
            label="slotwise MemoryLimiter, provider's limits [1 process stand-in]",
            one_process=True,
            goal=(0.0, 0.95),
        ),
        Variant(
            key="pushback-memory",
            label="slotwise MemoryLimiter, 2x limits + adaptive [1 process stand-in]",
            one_process=True,
            goal=(0.02, 0.90),
        ),
    )
}
PEERS = ("none", "backoff", "semaphore", "aiolimiter", "litellm")
STAND_IN = {"slotwise-postgres": "slotwise-memory", "pushback-postgres": "pushback-memory"}


def limiter_settings(key: str, factors: tuple[int, int] = (2, 2)) -> dict[str, Any]:
    """A slotwise variant's limits: the provider's, or for pushback ``factors`` times its
    concurrency and rates (twice both by default) with an adaptive limit."""
    if key.startswith("pushback"):
        slots, rates = factors
        return {
            "max_concurrent": slots * CONCURRENCY,
            "rate": Rate(requests=rates * RPM, tokens=rates * TPM, per=60.0),
            "adaptive": Adaptive(min_concurrent=2, slow_start=True),
        }
    return {"max_concurrent": CONCURRENCY, "rate": Rate(requests=RPM, tokens=TPM, per=60.0)}


def postgres_unsupported() -> str | None:
    """Why the PostgreSQL variants cannot run with this slotwise, or None."""
    try:
        from slotwise.postgres import PostgresLimiter
    except ImportError as exc:
        return f"slotwise.postgres unavailable ({exc})"
    accepted = inspect.signature(PostgresLimiter.__init__).parameters
    missing = [name for name in ("rate", "adaptive") if name not in accepted]
    # What Slot.used_tokens() and Slot.throttled() look up on the limiter's class.
    missing += [
        hook for hook in ("charge_tokens", "throttle") if not hasattr(PostgresLimiter, hook)
    ]
    if missing:
        return f"not supported by this PostgresLimiter (no {', '.join(missing)})"
    return None


def postgres_unreachable(dsn: str) -> str | None:
    try:
        import psycopg

        with psycopg.connect(dsn, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:
        return f"PostgreSQL unreachable at {dsn} ({type(exc).__name__})"
    return None


def prepare_schema(dsn: str) -> None:
    """A fresh schema, created once here rather than by 4 processes at once."""
    import psycopg

    from slotwise.postgres import schema_sql

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
        conn.execute(schema_sql(SCHEMA))


def drop_schema(dsn: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')


# -- a worker process: one variant's share of the tasks --------------------------------------


@attrs.frozen(kw_only=True)
class Outcome:
    ok: bool
    retry_after: float | None = None
    tokens: int = 0
    remaining: dict[str, int] = attrs.Factory(dict)
    limits: dict[str, int] = attrs.Factory(dict)


def retry_after(headers: httpx.Headers) -> float | None:
    """``retry-after-ms``, else ``retry-after`` in seconds, as the openai SDK reads them."""
    if "retry-after-ms" in headers:
        return float(headers["retry-after-ms"]) / 1000
    if "retry-after" in headers:
        return float(headers["retry-after"])
    return None


class Driver:
    """One process's HTTP client, counters and deadline."""

    def __init__(self, client: httpx.AsyncClient, deadline: float) -> None:
        self.client = client
        self.deadline = deadline
        self.attempts = 0
        self.refused = 0
        self.latencies: list[float] = []
        self.notes: dict[str, Any] = {}

    async def attempt(self, request: Request, started: float) -> Outcome:
        """Send ``request`` once. An attempt that has started runs to its end even when the
        run ends meanwhile: the provider has counted it."""
        if anyio.current_time() >= self.deadline:
            await anyio.sleep_forever()  # the run is over: wait for its cancellation
        with anyio.CancelScope(shield=True):
            response = await self.client.post(
                "/v1/chat/completions",
                content=request.body(),
                headers={"content-type": "application/json"},
            )
        self.attempts += 1
        remaining = {
            kind: int(response.headers[f"x-ratelimit-remaining-{kind}"])
            for kind in ("requests", "tokens")
            if f"x-ratelimit-remaining-{kind}" in response.headers
        }
        limits = {
            kind: int(response.headers[f"x-ratelimit-limit-{kind}"])
            for kind in ("requests", "tokens")
            if f"x-ratelimit-limit-{kind}" in response.headers
        }
        if response.status_code == 429:
            self.refused += 1
            return Outcome(
                ok=False,
                retry_after=retry_after(response.headers),
                remaining=remaining,
                limits=limits,
            )
        response.raise_for_status()
        self.latencies.append(anyio.current_time() - started)
        return Outcome(
            ok=True,
            tokens=response.json()["usage"]["total_tokens"],
            remaining=remaining,
            limits=limits,
        )


Send = Callable[[Driver, Request, float], Awaitable[None]]


async def send_none(driver: Driver, request: Request, started: float) -> None:
    while True:
        outcome = await driver.attempt(request, started)
        if outcome.ok:
            return
        await anyio.sleep(outcome.retry_after or 1.0)


async def send_backoff(driver: Driver, request: Request, started: float) -> None:
    retries = 0
    while not (await driver.attempt(request, started)).ok:
        await anyio.sleep(min(0.5 * 2.0**retries, 8.0) * (1 - 0.25 * random.random()))
        retries += 1


def semaphore_sender(limit: int) -> Send:
    semaphore = asyncio.Semaphore(limit)

    async def send(driver: Driver, request: Request, started: float) -> None:
        while True:
            async with semaphore:
                outcome = await driver.attempt(request, started)
            if outcome.ok:
                return
            await anyio.sleep(outcome.retry_after or 1.0)

    return send


def aiolimiter_sender(share: float) -> Send:
    from aiolimiter import AsyncLimiter

    requests = AsyncLimiter(RPM * share, 60.0)
    tokens = AsyncLimiter(TPM * share, 60.0)

    async def send(driver: Driver, request: Request, started: float) -> None:
        while True:
            await requests.acquire()
            await tokens.acquire(request.estimate)
            outcome = await driver.attempt(request, started)
            if outcome.ok:
                return
            await anyio.sleep(outcome.retry_after or 1.0)

    return send


def cooldown_sender(default: float = 5.0) -> Send:
    until = 0.0

    async def send(driver: Driver, request: Request, started: float) -> None:
        nonlocal until
        while True:
            await anyio.sleep_until(until)  # the process's cooldown, if any
            outcome = await driver.attempt(request, started)
            if outcome.ok:
                return
            cooldown = outcome.retry_after if outcome.retry_after is not None else default
            until = max(until, anyio.current_time() + cooldown)

    return send


def slotwise_sender(limiter: Any) -> Send:
    async def send(driver: Driver, request: Request, started: float) -> None:
        while True:
            async with limiter.slot(tokens=request.estimate) as slot:
                outcome = await driver.attempt(request, started)
                slot.used_tokens(outcome.tokens)
                if outcome.limits:
                    slot.provider_limits(**outcome.limits)
                if outcome.remaining:
                    slot.provider_remaining(**outcome.remaining)
                if outcome.ok:
                    return
                slot.throttled(outcome.retry_after)

    return send


@asynccontextmanager
async def sender(spec: dict[str, Any], driver: Driver) -> AsyncIterator[Send]:
    key, processes = spec["variant"], spec["processes"]
    if key == "none":
        yield send_none
    elif key == "backoff":
        yield send_backoff
    elif key == "semaphore":
        yield semaphore_sender(CONCURRENCY // processes)
    elif key == "aiolimiter":
        yield aiolimiter_sender(1 / processes)
    elif key == "litellm":
        yield cooldown_sender()
    else:
        limiter: Any
        if VARIANTS[key].postgres:
            from slotwise.postgres import PostgresLimiter

            limiter = PostgresLimiter(
                spec["dsn"],
                name=spec["name"],
                schema=spec["schema"],
                ensure_schema=False,
                **limiter_settings(key, spec["factors"]),
            )
        else:
            limiter = MemoryLimiter(name=spec["name"], **limiter_settings(key, spec["factors"]))
        pauses = 0
        limits: list[int] = []
        events: list[tuple[float, str, float]] = []  # for the timeline

        def count(event: Any) -> None:
            nonlocal pauses
            if event.kind == "paused":
                pauses += 1
                events.append((time.time(), "paused for", event.until - time.time()))
            elif event.kind == "limit-changed":
                limits.append(event.new)
                events.append((time.time(), "limit", event.new))

        unsubscribe = limiter.subscribe(count)
        try:
            if VARIANTS[key].postgres:
                await limiter.start()
            yield slotwise_sender(limiter)
            stats = await limiter.stats()
            driver.notes = {
                "pauses": pauses,
                "lowest_limit": min(limits, default=None),
                "final_limit": getattr(stats, "effective_max_concurrent", None),
                "events": events,
            }
        finally:
            unsubscribe()
            if VARIANTS[key].postgres:
                await limiter.aclose()


async def task(driver: Driver, send: Send, seed: int) -> None:
    rng = random.Random(seed)
    while True:
        await send(driver, draw(rng), anyio.current_time())


async def run_variant(spec: dict[str, Any], commands: IO[str]) -> dict[str, Any]:
    """Set the variant up, say so, wait for the start, run until the deadline, report."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=spec["tasks"])
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{spec['port']}", limits=limits, timeout=60.0, trust_env=False
    ) as client:
        driver = Driver(client, deadline=math.inf)
        async with sender(spec, driver) as send:
            print(json.dumps({"ready": True}), flush=True)
            start_at = json.loads(await anyio.to_thread.run_sync(commands.readline))["go"]
            start = anyio.current_time() + (start_at - time.time())
            driver.deadline = start + spec["duration"]
            await anyio.sleep_until(start)
            cpu = time.process_time()
            async with anyio.create_task_group() as tg:
                for i in range(spec["tasks"]):
                    tg.start_soon(task, driver, send, spec["seed"] + i)
                await anyio.sleep_until(driver.deadline)
                tg.cancel_scope.cancel()
            cpu = time.process_time() - cpu
    return {
        "attempts": driver.attempts,
        "refused": driver.refused,
        "latencies": driver.latencies,
        "cpu": cpu,
        "notes": driver.notes,
    }


def worker() -> None:
    """Run the variants the parent sends on stdin, one JSON line each, until it closes."""
    for line in sys.stdin:
        spec = json.loads(line)
        result = anyio.run(run_variant, spec, sys.stdin, backend="asyncio")
        print(json.dumps({"result": result}), flush=True)


# -- the parent: the provider, the workers, the report ----------------------------------------


class Process:
    """A child process spoken to in JSON lines."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.proc.args} ended with status {self.proc.wait()}")
        message: dict[str, Any] = json.loads(line)
        return message

    def close(self) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


class Provider(Process):
    def __init__(self, limit_headers: bool = True) -> None:
        super().__init__(
            "-m",
            "benchmarks.fake_provider",
            f"--rpm={RPM}",
            f"--tpm={TPM}",
            f"--concurrency={CONCURRENCY}",
            "--limit-headers" if limit_headers else "--no-limit-headers",
        )
        self.port = int(self.receive()["port"])

    def call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        response = httpx.request(
            method, f"http://127.0.0.1:{self.port}{path}", json=body, trust_env=False
        )
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result


@attrs.frozen(kw_only=True)
class Figures:
    variant: Variant
    shape: str  # processes x tasks
    skipped: str | None = None
    sent: int = 0
    refused: int = 0
    refused_by: dict[str, int] = attrs.Factory(dict)
    ok_per_s: float = 0.0
    capacity: float = 0.0
    binding: str = ""
    p50: float = math.nan
    p95: float = math.nan
    tokens_per_ok: float = 0.0
    cpu: float = 0.0
    load: float = math.nan
    notes: str = ""

    @property
    def refused_share(self) -> float:
        return self.refused / self.sent if self.sent else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def figures(
    variant: Variant, shape: str, duration: float, provider: dict[str, Any], results: list[Any]
) -> Figures:
    allowed = {
        "requests": RPM + RPM / 60 * duration,
        "tokens": TPM + TPM / 60 * duration,
        "concurrency": CONCURRENCY * duration,
    }
    used = {
        "requests": provider["admitted"],
        "tokens": provider["tokens_used"],
        "concurrency": provider["busy"],
    }
    shares = {kind: used[kind] / allowed[kind] for kind in allowed}
    binding = max(shares, key=shares.__getitem__)
    latencies = [latency for result in results for latency in result["latencies"]]
    refused = sum(provider["refused"].values())
    notes = []
    slotwise = [result["notes"] for result in results if result["notes"]]
    if slotwise:
        notes.append(f"{sum(n['pauses'] for n in slotwise)} pauses")
        lowest = [n["lowest_limit"] for n in slotwise if n["lowest_limit"] is not None]
        if lowest:
            final = [n["final_limit"] for n in slotwise if n["final_limit"] is not None]
            notes.append(f"limit down to {min(lowest)}, {max(final, default='?')} at the end")
    if refused:
        first = provider["refused_per_second"][0]
        notes.append(
            f"429s: {first:,} in the first second; "
            + ", ".join(f"{kind} {n:,}" for kind, n in provider["refused"].items() if n)
        )
    notes.append(f"token bucket full {provider['seconds_full']['tokens']:.1f} s")
    if provider["timeline"]:
        notes.append(f"{provider['timeline'][-1]['tokens']:,} tokens left at the end")
    return Figures(
        variant=variant,
        shape=shape,
        sent=provider["admitted"] + refused,
        refused=refused,
        refused_by=provider["refused"],
        ok_per_s=provider["completed"] / duration,
        capacity=shares[binding],
        binding=binding,
        p50=percentile(latencies, 0.50),
        p95=percentile(latencies, 0.95),
        tokens_per_ok=provider["tokens_used"] / max(1, provider["completed"]),
        cpu=sum(result["cpu"] for result in results),
        notes="; ".join(notes),
    )


def format_table(rows: list[Figures]) -> str:
    header = (
        "variant",
        "procs x tasks",
        "sent",
        "429s",
        "429 %",
        "ok/s",
        "capacity",
        "binds",
        "p50 s",
        "p95 s",
        "tok/ok",
        "CPU s",
        "load",
        "",
    )
    lines = []
    for row in rows:
        if row.skipped:
            lines.append((row.variant.label, row.shape, *["-"] * 11, row.skipped))
            continue
        lines.append(
            (
                row.variant.label,
                row.shape,
                f"{row.sent:,}",
                f"{row.refused:,}",
                f"{100 * row.refused_share:.1f}%",
                f"{row.ok_per_s:.2f}",
                f"{100 * row.capacity:.1f}%",
                row.binding,
                f"{row.p50:.1f}",
                f"{row.p95:.1f}",
                f"{row.tokens_per_ok:,.0f}",
                f"{row.cpu:.1f}",
                f"{row.load:.2f}",
                row.notes,
            )
        )
    widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(len(header))]
    left = {0, 1, 7, 13}

    def fmt(cells: tuple[str, ...]) -> str:
        return "  ".join(
            cell.ljust(width) if i in left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    rule = "  ".join("-" * width for width in widths).rstrip()
    return "\n".join([fmt(header), rule, *(fmt(cells) for cells in lines)])


def verdicts(rows: list[Figures]) -> list[str]:
    out = []
    for row in rows:
        if row.variant.goal is None:
            continue
        most, least = row.variant.goal
        target = (
            f"{row.variant.label}: 429s <= {100 * most:g}% of requests"
            if most
            else f"{row.variant.label}: 0 429s"
        ) + f" and >= {100 * least:g}% of the provider's capacity"
        if row.skipped:
            out.append(f"NOT RUN {target}: {row.skipped}")
            continue
        met = row.refused_share <= most and row.capacity >= least
        measured = (
            f"{row.refused:,} 429s ({100 * row.refused_share:.1f}%), {100 * row.capacity:.1f}%"
        )
        out.append(f"{'MET    ' if met else 'MISSED '} {target}: {measured}")
    return out


def choose(requested: list[str] | None, dsn: str) -> tuple[list[str], dict[str, str]]:
    """The variants to run, and why the PostgreSQL ones cannot run (if so)."""
    reason = postgres_unsupported() or postgres_unreachable(dsn)
    skipped = {key: reason for key, v in VARIANTS.items() if v.postgres and reason}
    if requested and "all" in requested:
        return list(VARIANTS), skipped
    if requested:
        return [key for key in VARIANTS if key in requested], skipped
    keys = list(PEERS)
    for key, stand_in in STAND_IN.items():
        keys.append(stand_in if key in skipped else key)
    return keys, skipped


def factors(text: str) -> tuple[int, int]:
    slots, rates = (int(part) for part in text.split(","))
    if slots < 1 or rates < 1:
        raise ValueError(text)
    return slots, rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rates",
        description="429s, capacity used and latency against a fake provider, per limiter.",
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per variant")
    parser.add_argument(
        "--variant",
        action="append",
        choices=[*VARIANTS, "all"],
        metavar="NAME",
        help=f"run this variant (repeatable): {', '.join(VARIANTS)}, or all",
    )
    parser.add_argument("--processes", type=int, default=4, help="worker processes")
    parser.add_argument("--tasks", type=int, default=100, help="tasks per process")
    parser.add_argument("--dsn", default=DSN, help="PostgreSQL for the PostgresLimiter variants")
    parser.add_argument(
        "--pushback",
        type=factors,
        default=(2, 2),
        metavar="SLOTS,RATES",
        help="the pushback variants' limits as multiples of the provider's: concurrency, "
        "then rates (default 2,2)",
    )
    parser.add_argument(
        "--limit-headers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="whether the provider states its limits in x-ratelimit-limit-* headers, as "
        "OpenAI and Anthropic do (default: yes)",
    )
    parser.add_argument(
        "--timeline", metavar="PATH", help="write the provider's timeline of each variant (JSON)"
    )
    parser.add_argument("--tiny", action="store_true", help="2 s, 2 x 10 tasks: a smoke run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker()
        return 0
    if args.tiny:
        args.duration, args.processes, args.tasks = 2.0, 2, 10

    started = time.perf_counter()
    load = os.getloadavg()[0]
    tokens, duration = mix_mean()
    per_limit = {  # requests per second each limit allows the mix over the run
        "requests": (RPM + RPM / 60 * args.duration) / args.duration,
        "tokens": (TPM + TPM / 60 * args.duration) / args.duration / tokens,
        "concurrency": CONCURRENCY / duration,
    }
    binding = min(per_limit, key=per_limit.__getitem__)
    print(
        f"slotwise rates benchmark: Python {platform.python_version()} on "
        f"{cpu_model()}, {os.cpu_count()} CPUs, load average "
        f"{load:.2f}"
    )
    print(f"command: python -m benchmarks.rates {' '.join(argv or sys.argv[1:])}".rstrip())
    print(
        f"provider: {RPM} RPM, {TPM:,} TPM, {CONCURRENCY} in flight (buckets full at the start; "
        f"limits {'stated' if args.limit_headers else 'NOT stated'} in x-ratelimit-limit-*); "
        f"mix: {tokens:,.0f} tokens and {duration:.2f} s per request on average, so it allows "
        f"{per_limit[binding]:.2f} requests/s over {args.duration:g} s ({binding} bind); "
        f"{args.processes} processes x {args.tasks} tasks, each retrying until success"
    )
    keys, skipped = choose(args.variant, args.dsn)
    provider = Provider(limit_headers=args.limit_headers)
    workers: list[Process] = []
    rows: list[Figures] = []
    timelines: dict[str, Any] = {}
    prepared = False
    try:
        for key in keys:
            variant = VARIANTS[key]
            if key.startswith("pushback") and args.pushback != (2, 2):
                slots, rates = args.pushback
                label = variant.label.replace("2x limits", f"{slots}x slots, {rates}x rates")
                variant = attrs.evolve(variant, label=label)
            if not args.limit_headers:
                variant = attrs.evolve(variant, label=f"{variant.label}, no limit headers")
            processes = 1 if variant.one_process else args.processes
            tasks = args.tasks * args.processes // processes
            shape = f"{processes} x {tasks}"
            if key in skipped:
                rows.append(Figures(variant=variant, shape=shape, skipped=skipped[key]))
                continue
            if variant.postgres:
                prepare_schema(args.dsn)
                prepared = True
            while len(workers) < processes:
                workers.append(Process("-m", "benchmarks.rates", "--worker"))
            spec = {
                "variant": key,
                "port": provider.port,
                "processes": processes,
                "tasks": tasks,
                "duration": args.duration,
                "dsn": args.dsn,
                "name": f"rates-{key}-{os.getpid()}",
                "factors": args.pushback,
                "schema": SCHEMA,
            }
            for i, child in enumerate(workers[:processes]):
                child.send({**spec, "seed": i * tasks})  # the same requests in every shape
            for child in workers[:processes]:
                child.receive()  # ready
            provider.call("POST", "/reset", {"start_in": 0.5, "duration": args.duration})
            start_at = time.time() + 0.5
            for child in workers[:processes]:
                child.send({"go": start_at})
            results = [child.receive()["result"] for child in workers[:processes]]
            stats = provider.call("GET", "/stats")
            timelines[key] = {
                "provider": stats["timeline"],
                "limiter": sorted(
                    (round(at - start_at, 3), kind, round(value, 3))
                    for result in results
                    for at, kind, value in result["notes"].get("events", ())
                ),
            }
            row = figures(variant, shape, args.duration, stats, results)
            rows.append(attrs.evolve(row, load=os.getloadavg()[0]))
    finally:
        for child in workers:
            child.close()
        provider.close()
        if prepared:
            drop_schema(args.dsn)
    print(f"\n## rates: {args.duration:g} s per variant, against the provider's own counts\n")
    print(format_table(rows))
    print("\n## targets\n")
    for line in verdicts(rows):
        print(line)
    if args.timeline:
        with open(args.timeline, "w", encoding="utf-8") as out:
            json.dump(timelines, out)
        print(f"\nthe timelines (the provider's each second, slotwise's events): {args.timeline}")
    print(f"\ntotal time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
