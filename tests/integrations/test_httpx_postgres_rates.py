"""The openai and anthropic SDKs in four processes, through `slotwise.httpx` and one
`PostgresLimiter` at the provider's limits, against a fake provider that enforces its
requests, tokens and concurrency and answers 429 past them: no call is refused, and the
rates held requests back; the same calls with slots alone are refused.

The workers (``_sdk_worker.py``) are real processes: the rates hold only through the buckets
stored with the limiter. The tests skip without a reachable PostgreSQL, unless
SLOTWISE_REQUIRE_SERVICES=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import FakeProvider

pytest.importorskip("openai")
pytest.importorskip("anthropic")
psycopg = pytest.importorskip("psycopg")

from slotwise.postgres import schema_sql  # noqa: E402

WORKER = str(Path(__file__).with_name("_sdk_worker.py"))
DSN = os.environ.get("SLOTWISE_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
REQUIRED = os.environ.get("SLOTWISE_REQUIRE_SERVICES") == "1"

PROCESSES, CALLS = 4, 5
# The provider's limits: requests and tokens per PER seconds, and requests in flight.
CONCURRENCY, REQUESTS, TOKENS, PER = 4, 6, 1_200, 2.0
# The longest a granted request may take to reach the provider: from the grant, in one
# process's transaction, to the call of the process that waits for it, on a busy machine.
LATENCY = 1.0


@pytest.fixture
def schema() -> Iterator[str]:
    """A schema of this test's own, its tables made (the workers start together), dropped
    afterwards."""
    name = f"slotwise_test_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(DSN, autocommit=True, connect_timeout=3) as conn:
            conn.execute(schema_sql(name).encode())
    except psycopg.OperationalError as exc:
        if REQUIRED:
            pytest.fail(f"PostgreSQL is unreachable at {DSN}: {exc} (SLOTWISE_REQUIRE_SERVICES=1)")
        pytest.skip(f"PostgreSQL is unreachable at {DSN}: {exc}")
    yield name
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'.encode())


def run_workers(provider: FakeProvider, schema: str, rate: dict[str, Any] | None) -> list[Any]:
    """Each worker's summary; the SDKs alternate, openai first."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                WORKER,
                json.dumps(
                    {
                        "sdk": ("openai", "anthropic")[seed % 2],
                        "seed": seed,
                        "calls": CALLS,
                        "url": provider.url,
                        "dsn": DSN,
                        "schema": schema,
                        "max_concurrent": CONCURRENCY,
                        "rate": rate,
                    }
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(PROCESSES)
    ]
    summaries = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        summaries.append(json.loads(out.splitlines()[-1]))
    return summaries


def test_the_sdks_in_four_processes_get_no_429_through_one_postgres_limiter(
    provider: FakeProvider, schema: str
) -> None:
    provider.limit(concurrency=CONCURRENCY, requests=REQUESTS, tokens=TOKENS, per=PER)
    rate = {"requests": REQUESTS, "tokens": TOKENS, "per": PER, "latency": LATENCY}
    summaries = run_workers(provider, schema, rate)
    assert [s["refused"] for s in summaries] == [0] * PROCESSES
    assert [s["answered"] for s in summaries] == [CALLS] * PROCESSES
    assert provider.rate_limited == 0
    assert len(provider.charged) == PROCESSES * CALLS
    assert provider.max_active <= CONCURRENCY
    waited_for = {kind for s in summaries for kind in s["waited_for"]}
    assert {"requests", "tokens"} <= waited_for  # both rates held requests back


def test_with_slots_alone_the_same_calls_are_refused(provider: FakeProvider, schema: str) -> None:
    """The control for the test above: the provider's concurrency alone does not keep its
    rates."""
    provider.limit(concurrency=CONCURRENCY, requests=REQUESTS, tokens=TOKENS, per=PER)
    summaries = run_workers(provider, schema, None)
    assert provider.rate_limited > 0
    assert sum(s["refused"] for s in summaries) == provider.rate_limited
