"""Fixtures for the PostgreSQL tests: a reachable server (or a skip), unique schemas, and a
throwaway server of the tests' own for the tests that restart or kill it.

The server's address comes from SLOTWISE_POSTGRES_DSN (default: the local test server). When
it is unreachable the tests skip, unless SLOTWISE_REQUIRE_SERVICES=1 makes that a failure.
PostgresLimiter is asyncio-only, so these tests run on asyncio alone.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import anyio
import pytest

psycopg = pytest.importorskip("psycopg")

DSN = os.environ.get("SLOTWISE_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
REQUIRED = os.environ.get("SLOTWISE_REQUIRE_SERVICES") == "1"


def unavailable(reason: str) -> NoReturn:
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


@pytest.fixture
def make(tagged_dsn: str, schema: str, limiters: list[object]) -> Callable[..., Any]:
    """``make(**kwargs)``: a PostgresLimiter named "claude" in this test's schema, polling
    every 50 ms (``conninfo=`` another pool or address), closed at the end of the test."""
    from slotwise.postgres import PostgresLimiter

    def make(**kwargs: Any) -> PostgresLimiter[Any]:
        kwargs.setdefault("name", "claude")
        kwargs.setdefault("schema", schema)
        kwargs.setdefault("poll_interval", 0.05)
        limiter: PostgresLimiter[Any] = PostgresLimiter(
            kwargs.pop("conninfo", tagged_dsn), **kwargs
        )
        limiters.append(limiter)
        return limiter

    return make


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


# -- a throwaway server, for the tests that restart or kill it -----------------------------


class Cluster:
    """A throwaway PostgreSQL server on a unix socket in a temporary folder."""

    def __init__(self, bindir: Path, root: Path, user: str | None) -> None:
        self.bindir = bindir
        self.root = root
        self.user = user  # the server refuses to run as root: run it as this user then
        self.port = 5432  # of a socket in a folder of its own: no clash with any server
        self.proc: subprocess.Popen[bytes] | None = None
        self.dsn = f"host={root} port={self.port} user=postgres dbname=postgres"

    def init(self) -> None:
        subprocess.run(
            [
                str(self.bindir / "initdb"),
                "--pgdata",
                str(self.root / "data"),
                "--username=postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            ],
            user=self.user,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def start(self) -> None:
        with open(self.root / "server.log", "ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(self.bindir / "postgres"),
                    "-D",
                    str(self.root / "data"),
                    "-k",
                    str(self.root),
                    "-p",
                    str(self.port),
                    "-c",
                    "listen_addresses=",
                    "-c",
                    "fsync=off",  # a kill -9 of the server loses nothing the OS has
                ],
                user=self.user,
                start_new_session=True,  # its own process group, to kill it whole
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(self.dsn, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "the throwaway server did not start: "
                        + (self.root / "server.log").read_text(errors="replace")[-2000:]
                    ) from None
                time.sleep(0.05)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """A fast shutdown (as ``pg_ctl stop -m fast``): sessions are ended, then it exits."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=30)

    def kill(self) -> None:
        """``kill -9`` of the server: the postmaster and every backend at once."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # every backend gone: the next start may begin
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.02)


@pytest.fixture(scope="session")
def throwaway_server() -> Iterator[Cluster]:
    """A PostgreSQL server of the tests' own, started once: ``initdb`` and ``postgres`` from
    ``pg_config --bindir`` (Debian keeps them off PATH), as the ``postgres`` user when the
    tests run as root; removed at the end."""
    pg_config = shutil.which("pg_config")
    if pg_config is None:
        unavailable("pg_config is not installed (Debian: apt-get install -y postgresql)")
    bindir = Path(
        subprocess.run([pg_config, "--bindir"], capture_output=True, text=True).stdout.strip()
    )
    if not (bindir / "initdb").exists():
        unavailable(f"initdb is not in {bindir} (pg_config --bindir)")
    user = None
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres").pw_name
        except KeyError:
            unavailable("running as root, and there is no 'postgres' user to run the server")
    root = Path(tempfile.mkdtemp(prefix="slotwise-pg-"))
    cluster = Cluster(bindir, root, user)
    try:
        if user is not None:
            shutil.chown(root, user)
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        if cluster.running():
            cluster.kill()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cluster(throwaway_server: Cluster) -> Cluster:
    """The throwaway server, running (a test that failed midway may have left it down)."""
    if not throwaway_server.running():
        throwaway_server.start()
    return throwaway_server
