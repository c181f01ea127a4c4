"""``python -m slotwise status``: a read-only view of the PostgresLimiters stored in a schema.

Everything comes from the database: the limits from each limiter's stored row, the active
slots from the leases, the waiting requests from the queue, and every time on the database's
clock. Each snapshot is one short read-only transaction (REPEATABLE READ, so its queries agree)
that takes no lock a limiter waits for. The queries name their columns, so columns added to
the tables later do not disturb them; keys added to the stored limits pass through to the
JSON output as they are.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, TextIO

import psycopg
from psycopg import sql

__all__ = ("FORMAT_VERSION", "StatusError", "main", "snapshot")

FORMAT_VERSION = 1
SOONEST = 5  # leases listed per limiter: those that expire first
EXTRA = "slotwise[status]"
TABLES = ("limiters", "queue", "leases")


class StatusError(Exception):
    """A condition reported in one message, without a traceback."""


# -- reading --------------------------------------------------------------------------------

_LIMITERS = """
SELECT name, settings, updated_at FROM {s}.limiters
WHERE %(name)s::text IS NULL OR name = %(name)s
ORDER BY name
"""
# Valid and expired (not yet swept) leases per limiter, workload and owner.
_LEASES = """
SELECT limiter, workload, owner::text,
       count(*) FILTER (WHERE expires_at > %(t)s),
       count(*) FILTER (WHERE expires_at <= %(t)s),
       extract(epoch FROM min(expires_at) FILTER (WHERE expires_at > %(t)s) - %(t)s)::float8
FROM {s}.leases
WHERE limiter = ANY(%(names)s)
GROUP BY limiter, workload, owner
"""
# A queue entry is live (the allocation sees it) until its process stops refreshing it
# (stale_at) or its deadline passes: the limiter's own definition.
_LIVE = "stale_at > %(t)s AND (deadline IS NULL OR deadline > %(t)s)"
_QUEUE = f"""
SELECT limiter, workload, owner::text, count(*),
       extract(epoch FROM %(t)s - min(enqueued_at))::float8
FROM {{s}}.queue
WHERE limiter = ANY(%(names)s) AND {_LIVE}
GROUP BY limiter, workload, owner
"""
_OLDEST = f"""
SELECT DISTINCT ON (limiter) limiter, workload, owner::text, request_id,
       extract(epoch FROM %(t)s - enqueued_at)::float8,
       extract(epoch FROM deadline - %(t)s)::float8
FROM {{s}}.queue
WHERE limiter = ANY(%(names)s) AND {_LIVE}
ORDER BY limiter, enqueued_at, seq
"""
_SOONEST = """
SELECT limiter, lease_id, workload, owner, request_id,
       extract(epoch FROM %(t)s - granted_at)::float8,
       extract(epoch FROM expires_at - %(t)s)::float8
FROM (SELECT limiter, lease_id::text, workload, owner::text, request_id, granted_at,
             expires_at,
             row_number() OVER (PARTITION BY limiter ORDER BY expires_at, lease_id) AS rank
      FROM {s}.leases
      WHERE limiter = ANY(%(names)s) AND expires_at > %(t)s) AS soonest
WHERE rank <= %(soonest)s
ORDER BY limiter, expires_at, lease_id
"""


def snapshot(
    conn: psycopg.Connection[Any], *, schema: str, name: str | None = None
) -> dict[str, Any]:
    """Read the state of the schema's limiters (or of the one named) in one transaction.

    Returns:
        The document that ``--json`` prints (its shape is described in the PostgreSQL
        reference page).

    Raises:
        StatusError: The schema or its tables do not exist, or no limiter has the name.
        psycopg.Error: The database failed.
    """

    def q(text: str) -> sql.Composed:
        return sql.SQL(text).format(s=sql.Identifier(schema))

    with conn.transaction():
        # A view must never wait long: not behind a migration's lock, not on a slow server.
        conn.execute(
            "SELECT set_config('lock_timeout', '2s', true), "
            "set_config('statement_timeout', '10s', true)"
        )
        _check_tables(conn, schema)
        cur = conn.execute("SELECT clock_timestamp()")
        now: datetime = _one(cur.fetchone())
        rows = conn.execute(q(_LIMITERS), {"name": name}).fetchall()
        if name is not None and not rows:
            stored = conn.execute(q("SELECT name FROM {s}.limiters ORDER BY name")).fetchall()
            names = ", ".join(repr(row[0]) for row in stored) or "none"
            raise StatusError(
                f"no limiter named {name!r} in schema {schema!r} (limiters stored there: {names})"
            )
        args = {"t": now, "names": [row[0] for row in rows], "soonest": SOONEST}
        leases = conn.execute(q(_LEASES), args).fetchall()
        queue = conn.execute(q(_QUEUE), args).fetchall()
        oldest = conn.execute(q(_OLDEST), args).fetchall()
        soonest = conn.execute(q(_SOONEST), args).fetchall()

    limiters = {
        limiter: _limiter(
            settings,
            updated_at,
            leases=[row[1:] for row in leases if row[0] == limiter],
            queue=[row[1:] for row in queue if row[0] == limiter],
            oldest=next((row[1:] for row in oldest if row[0] == limiter), None),
            soonest=[row[1:] for row in soonest if row[0] == limiter],
        )
        for limiter, settings, updated_at in rows
    }
    return {
        "version": FORMAT_VERSION,
        "schema": schema,
        "database_time": _iso(now),
        "limiters": limiters,
    }


def _check_tables(conn: psycopg.Connection[Any], schema: str) -> None:
    cur = conn.execute(
        """
        SELECT n.nspname IS NOT NULL, array_remove(array_agg(c.relname::text), NULL)
        FROM (SELECT %(schema)s::name AS wanted) w
        LEFT JOIN pg_namespace n ON n.nspname = w.wanted
        LEFT JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = ANY(%(tables)s)
        GROUP BY n.nspname
        """,
        {"schema": schema, "tables": list(TABLES)},
    )
    exists, found = cur.fetchone() or (False, [])
    where = f"database {conn.info.dbname!r}"
    if not exists:
        raise StatusError(
            f"schema {schema!r} does not exist in {where}: no PostgresLimiter has used it "
            "(pass --schema if the limiters use another one)"
        )
    missing = [table for table in TABLES if table not in found]
    if missing:
        raise StatusError(
            f"schema {schema!r} in {where} has no slotwise tables "
            f"(missing: {', '.join(missing)}); a PostgresLimiter creates them on first use"
        )


def _limiter(
    settings: Any,
    updated_at: datetime,
    *,
    leases: list[tuple[Any, ...]],
    queue: list[tuple[Any, ...]],
    oldest: tuple[Any, ...] | None,
    soonest: list[tuple[Any, ...]],
) -> dict[str, Any]:
    limits = settings if isinstance(settings, dict) else {}
    stored = limits.get("workloads")
    stored = stored if isinstance(stored, dict) else {}
    seen = {row[0] for row in leases} | {row[0] for row in queue}

    def priority(workload: str) -> Any:
        rule = stored.get(workload)
        value = rule.get("priority") if isinstance(rule, dict) else None
        return value if isinstance(value, int | float) else 0

    order = sorted(stored, key=lambda w: (-priority(w), w))
    order += sorted(seen - set(stored))
    workloads: dict[str, dict[str, Any]] = {
        w: {"active": 0, "queued": 0, "longest_wait": None} for w in order
    }
    processes: dict[str, dict[str, Any]] = {}

    def process(owner: str) -> dict[str, Any]:
        return processes.setdefault(
            owner,
            {"active": 0, "queued": 0, "next_expiry": None, "longest_wait": None, "workloads": {}},
        )

    def share(owner: str, workload: str) -> dict[str, int]:
        shares: dict[str, dict[str, int]] = process(owner)["workloads"]
        return shares.setdefault(workload, {"active": 0, "queued": 0})

    expired = 0
    for workload, owner, active, gone, expires_in in leases:
        expired += gone
        if not active:
            continue
        workloads[workload]["active"] += active
        process(owner)["active"] += active
        share(owner, workload)["active"] += active
        process(owner)["next_expiry"] = _least(process(owner)["next_expiry"], expires_in)
    for workload, owner, count, waited in queue:
        workloads[workload]["queued"] += count
        workloads[workload]["longest_wait"] = _most(workloads[workload]["longest_wait"], waited)
        process(owner)["queued"] += count
        share(owner, workload)["queued"] += count
        process(owner)["longest_wait"] = _most(process(owner)["longest_wait"], waited)

    for entry in workloads.values():
        entry["longest_wait"] = _round(entry["longest_wait"])
    for entry in processes.values():
        entry["next_expiry"] = _round(entry["next_expiry"])
        entry["longest_wait"] = _round(entry["longest_wait"])
        entry["workloads"] = {w: entry["workloads"][w] for w in order if w in entry["workloads"]}
    ordered = sorted(processes, key=lambda o: (-processes[o]["active"], -processes[o]["queued"], o))
    return {
        "limits": settings,
        "limits_updated_at": _iso(updated_at),
        "active": sum(entry["active"] for entry in workloads.values()),
        "queued": sum(entry["queued"] for entry in workloads.values()),
        "expired": expired,
        "workloads": workloads,
        "oldest_waiter": None
        if oldest is None
        else {
            "workload": oldest[0],
            "owner": oldest[1],
            "request_id": oldest[2],
            "waited": _round(oldest[3]),
            "deadline_in": _round(oldest[4]),
        },
        "expiring_first": [
            {
                "lease_id": lease_id,
                "workload": workload,
                "owner": owner,
                "request_id": request_id,
                "held": _round(held),
                "expires_in": _round(expires_in),
            }
            for lease_id, workload, owner, request_id, held, expires_in in soonest
        ],
        "processes": {owner: processes[owner] for owner in ordered},
    }


def _one(row: tuple[Any, ...] | None) -> Any:
    assert row is not None
    return row[0]


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _most(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# -- the terminal view -----------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 10:
        return f"{value:.1f}s"
    if value < 60:
        return f"{value:.0f}s"
    minutes, secs = divmod(round(value), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _short(owner: str | None) -> str:
    return (owner or "-")[:8]


def render(doc: dict[str, Any], *, note: str = "") -> Any:
    """The rich renderable of a snapshot: a heading, then each limiter's tables."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def table(*headers: str) -> Table:
        # Rows never wrap: a long name is cut with an ellipsis, at a width that leaves the
        # numbers room in 80 columns.
        grid = Table(box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), pad_edge=False, show_edge=False)
        for header in headers:
            width = _TEXT_COLUMNS.get(header)
            grid.add_column(
                header,
                justify="left" if width else "right",
                no_wrap=True,
                overflow="ellipsis",
                max_width=width,
                min_width=min(width or len(header), len(header)),
            )
        return grid

    clock = doc["database_time"][11:19]
    parts: list[Any] = [
        Text.assemble(
            ("slotwise status", "bold"),
            f" · schema {doc['schema']} · {clock} UTC",
            (f" · {note}" if note else "", "dim"),
            no_wrap=True,
            overflow="ellipsis",
        )
    ]
    if not doc["limiters"]:
        parts.append(Text("\nNo limiters are stored in this schema yet.", style="dim"))
    for name, lim in doc["limiters"].items():
        limits = lim["limits"] if isinstance(lim["limits"], dict) else {}
        stored = limits.get("workloads")
        stored = stored if isinstance(stored, dict) else {}
        max_queued = limits.get("max_queued")
        heading = Text.assemble(
            "\n",
            (name, "bold cyan"),
            f"  {lim['active']}/{limits.get('max_concurrent', '?')} active",
            f" · {lim['queued']} queued",
            f" (max {max_queued})" if max_queued is not None else "",
            f" · {len(lim['processes'])} process" + ("es" if len(lim["processes"]) != 1 else ""),
            no_wrap=True,
            overflow="ellipsis",
        )
        parts.append(heading)
        detail = f"limits stored {lim['limits_updated_at'][:19].replace('T', ' ')} UTC"
        if lim["expired"]:
            detail += f" · {lim['expired']} expired lease(s) not yet swept"
        others = {k: v for k, v in limits.items() if k not in _KNOWN_LIMITS}
        for key, value in others.items():
            detail += f" · {key} {json.dumps(value, separators=(',', ':'))}"
        parts.append(Text(detail, style="dim", no_wrap=True, overflow="ellipsis"))

        grid = table(
            "workload", "active", "queued", "longest wait", "reserved", "priority", "max wait"
        )
        for workload, entry in lim["workloads"].items():
            rule = stored.get(workload)
            rule = rule if isinstance(rule, dict) else {}
            ceiling = rule.get("max_concurrent", "?") if rule else "?"
            max_wait = rule.get("max_wait")
            bound = rule.get("max_queued")  # stored only when the workload has one
            grid.add_row(
                workload if rule else f"{workload} (not in limits)",
                f"{entry['active']}/{ceiling}",
                f"{entry['queued']}/{bound}" if bound is not None else str(entry["queued"]),
                _seconds(entry["longest_wait"]),
                str(rule.get("reserved", "-")),
                str(rule.get("priority", "-")),
                "none" if max_wait is None else _seconds(max_wait),
            )
        parts.append(grid)

        waiter = lim["oldest_waiter"]
        if waiter is not None:
            deadline = waiter["deadline_in"]
            parts.append(
                Text(
                    f"Oldest waiter: {waiter['workload']} {_seconds(waiter['waited'])}"
                    + (f" (gives up in {_seconds(deadline)})" if deadline is not None else "")
                    + f", process {_short(waiter['owner'])}"
                    + (f", request {waiter['request_id']}" if waiter["request_id"] else ""),
                    no_wrap=True,
                    overflow="ellipsis",
                )
            )

        if lim["processes"]:
            grid = table("process", "workload", "active", "queued", "next expiry", "longest wait")
            for owner, entry in lim["processes"].items():
                for index, (workload, counts) in enumerate(entry["workloads"].items()):
                    first = index == 0
                    grid.add_row(
                        _short(owner) if first else "",
                        workload,
                        str(counts["active"]),
                        str(counts["queued"]),
                        _seconds(entry["next_expiry"]) if first else "",
                        _seconds(entry["longest_wait"]) if first else "",
                    )
            parts.append(Text("Processes", style="bold"))
            parts.append(grid)

        if lim["expiring_first"]:
            grid = table("lease", "workload", "process", "request", "held", "expires in")
            for lease in lim["expiring_first"]:
                grid.add_row(
                    _short(lease["lease_id"]),
                    lease["workload"],
                    _short(lease["owner"]),
                    lease["request_id"] or "-",
                    _seconds(lease["held"]),
                    _seconds(lease["expires_in"]),
                )
            parts.append(Text("Leases that expire first", style="bold"))
            parts.append(grid)
    return Group(*parts)


_TEXT_COLUMNS = {"workload": 20, "process": 8, "lease": 8, "request": 12}
_KNOWN_LIMITS = frozenset({"max_concurrent", "max_queued", "workloads"})


# -- the command ----------------------------------------------------------------------------


def _connect(dsn: str) -> psycopg.Connection[Any]:
    try:
        given = psycopg.conninfo.conninfo_to_dict(dsn)
        extra: dict[str, Any] = {"fallback_application_name": "slotwise status"}
        if "connect_timeout" not in given:
            extra["connect_timeout"] = 5
        conn = psycopg.connect(dsn, autocommit=True, **extra)
    except psycopg.Error as exc:
        raise StatusError(f"cannot connect to PostgreSQL: {_message(exc)}") from None
    conn.read_only = True
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    return conn


def _message(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return " ".join(lines) or type(exc).__name__


def _snapshots(
    dsn: str, *, schema: str, name: str | None, watch: float | None
) -> Iterator[dict[str, Any] | StatusError]:
    """One snapshot, or one per interval. While watching, a failure after the first
    snapshot is yielded (and the connection reopened) rather than raised."""
    conn: psycopg.Connection[Any] | None = None
    first = True
    try:
        while True:
            try:
                if conn is None or conn.closed:
                    conn = _connect(dsn)
                result: dict[str, Any] | StatusError = snapshot(conn, schema=schema, name=name)
            except (StatusError, psycopg.Error) as exc:
                if first or watch is None:
                    if isinstance(exc, StatusError):
                        raise
                    raise StatusError(f"the database failed: {_message(exc)}") from None
                # A lost connection reports itself closed, and the next round reconnects.
                result = exc if isinstance(exc, StatusError) else StatusError(_message(exc))
            first = False
            yield result
            if watch is None:
                return
            time.sleep(watch)
    finally:
        if conn is not None:
            conn.close()


def main(
    *,
    dsn: str,
    name: str | None,
    schema: str,
    watch: float | None,
    as_json: bool,
    out: TextIO,
    err: TextIO,
) -> int:
    """``python -m slotwise status``; returns the exit code."""
    if not as_json:
        try:
            import rich  # noqa: F401
        except ModuleNotFoundError:
            err.write(
                f"slotwise status: the table view needs rich: pip install '{EXTRA}' "
                "(or pass --json)\n"
            )
            return 1
    try:
        if as_json:
            for result in _snapshots(dsn, schema=schema, name=name, watch=watch):
                if isinstance(result, StatusError):
                    err.write(f"slotwise status: {result}\n")
                    continue
                out.write(json.dumps(result, indent=None if watch else 2) + "\n")
                out.flush()
            return 0
        return _show(_snapshots(dsn, schema=schema, name=name, watch=watch), watch, out)
    except StatusError as exc:
        err.write(f"slotwise status: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 0


def _show(results: Iterator[dict[str, Any] | StatusError], watch: float | None, out: TextIO) -> int:
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    console = Console(file=out, highlight=False)
    note = f"every {watch:g}s, Ctrl-C stops" if watch is not None else ""
    last: dict[str, Any] | None = None

    def view(result: dict[str, Any] | StatusError) -> Any:
        nonlocal last
        if isinstance(result, StatusError):
            from rich.console import Group

            failure = Text(f"{result} (retrying)", style="bold red", overflow="ellipsis")
            return failure if last is None else Group(failure, render(last, note="stale"))
        last = result
        return render(result, note=note)

    if watch is None or not console.is_terminal:
        for result in results:
            console.print(view(result))
        return 0
    with Live(console=console, auto_refresh=False, vertical_overflow="ellipsis") as live:
        for result in results:
            live.update(view(result), refresh=True)
    return 0
