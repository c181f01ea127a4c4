"""Fixtures for the PostgreSQL tests: a reachable server (or a skip), unique schemas.

The server's address comes from SLOTWISE_POSTGRES_DSN (default: the local test server). When
it is unreachable the tests skip, unless SLOTWISE_REQUIRE_SERVICES=1 makes that a failure.
PostgresLimiter is asyncio-only, so these tests run on asyncio alone.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import pytest

psycopg = pytest.importorskip("psycopg")

DSN = os.environ.get("SLOTWISE_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
REQUIRED = os.environ.get("SLOTWISE_REQUIRE_SERVICES") == "1"


def unavailable(reason: str) -> None:
    """Skip, or fail when the services are required."""
    if REQUIRED:
        pytest.fail(f"{reason} (SLOTWISE_REQUIRE_SERVICES=1)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def dsn() -> str:
    """The server's conninfo, after checking that it answers."""
    try:
        with psycopg.connect(DSN, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        unavailable(f"PostgreSQL is unreachable at {DSN}: {exc}")
    return str(DSN)


@pytest.fixture
def anyio_backend() -> str:
    """PostgresLimiter is asyncio-only (psycopg's async API)."""
    return "asyncio"


@pytest.fixture
def schema(dsn: str) -> Iterator[str]:
    """A schema name used by this test alone, dropped afterwards."""
    name = f"slotwise_test_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            [name],
        )
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.fixture
def tagged_dsn(dsn: str, schema: str) -> str:
    """The conninfo, with the schema name as application_name: a test can find (and
    terminate) exactly its own connections."""
    return str(psycopg.conninfo.make_conninfo(dsn, application_name=schema))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def pgbouncer_dsn(dsn: str) -> Iterator[str]:
    """A PgBouncer in transaction mode in front of the server, on a loopback port."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not Path(binary).exists():
        unavailable("pgbouncer is not installed (Debian: apt-get install -y pgbouncer)")
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        ini = Path(tmp, "pgbouncer.ini")
        users = Path(tmp, "users.txt")
        users.write_text(f'"{info.get("user", "postgres")}" ""\n')
        ini.write_text(
            "[databases]\n"
            f"* = host={info.get('host', '127.0.0.1')} port={info.get('port', 5432)}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {port}\n"
            "auth_type = trust\n"
            f"auth_file = {users}\n"
            "pool_mode = transaction\n"
            "default_pool_size = 4\n"
            "max_client_conn = 200\n"
            "ignore_startup_parameters = extra_float_digits,application_name\n"
            f"unix_socket_dir = {tmp}\n"
            f"logfile = {tmp}/pgbouncer.log\n"
            f"pidfile = {tmp}/pgbouncer.pid\n"
        )
        args = [binary, str(ini)]
        if os.geteuid() == 0:
            args.insert(1, "--user=postgres")
            os.chmod(tmp, 0o777)
            for path in (ini, users):
                os.chmod(path, 0o644)
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        bouncer = psycopg.conninfo.make_conninfo(dsn, host="127.0.0.1", port=port)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    with psycopg.connect(bouncer, connect_timeout=2) as conn:
                        conn.execute("SELECT 1")
                    break
                except psycopg.Error as exc:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log = Path(tmp, "pgbouncer.log")
                        out = log.read_text() if log.exists() else ""
                        unavailable(f"pgbouncer did not start: {exc} {out}")
                    time.sleep(0.1)
            yield bouncer
        finally:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture
async def limiters() -> AsyncIterator[list[object]]:
    """Limiters appended here are closed at the end of the test."""
    made: list[object] = []
    yield made
    for limiter in made:
        await limiter.aclose()  # type: ignore[attr-defined]


Eventually = Callable[[Callable[[], Awaitable[bool]]], Awaitable[None]]


async def _eventually(check: Callable[[], Awaitable[bool]]) -> None:
    with anyio.fail_after(20):
        for _ in itertools.count():
            if await check():
                return
            await anyio.sleep(0.01)


@pytest.fixture
def eventually() -> Eventually:
    """``await eventually(check)``: wait until ``check()`` is true (polled: the state lives
    in another process or the database); fail after 20 s, a generous bound."""
    return _eventually
