"""The tables of PostgresLimiter, and the DDL that creates them."""

from __future__ import annotations

from psycopg import sql

__all__ = ("NEWEST_COLUMN", "NEWEST_TABLE", "channel_name", "schema_ddl", "schema_sql")

# Four tables per schema, shared by every limiter name in it:
#   limiters  one row per limiter name: its limits, and the row whose lock serialises every
#             allocation of that limiter (SELECT ... FOR UPDATE).
#   queue     waiting requests. ``stale_at`` is pushed forward by the waiting process; a dead
#             process's entries pass it and are swept. ``deadline`` is on the database clock.
#   leases    granted slots, valid until ``expires_at`` (database clock) unless renewed.
#   owners    one row per waiting process (limiter object): its queue entries are granted
#             only while ``alive_until`` is ahead, which its poller pushes forward once per
#             poll interval, so a process that died stops receiving slots at once.
#
# The rates and pushback state came later: they are added by ``ALTER TABLE ... ADD COLUMN IF
# NOT EXISTS``, each with a constant default (a catalog change only, no table rewrite), so
# the same DDL creates a new installation and upgrades an existing one in place.
#   limiters.limits          the limits set at run time by set_limits() (NULL: ``settings``)
#   limiters.limits_version  counts changes of the limits in force; processes compare it
#   limiters.buckets         each rate bucket's level at a time (database clock, epoch s)
#   limiters.paused_until    no grant before this (provider pushback); NULL: never paused
#   limiters.backoffs        pauses without a retry-after since the last success
#   limiters.adaptive        the adaptive limit: its value, epoch and credit
#   queue.tokens             the request's token estimate, charged at grant
#   queue.waited_for         the buckets the request has had to wait for
#   leases.epoch             the adaptive limit's epoch when the lease was granted
#   leases.tried             with an adaptive limit: the slots occupied once it was granted
#   leases.throttled         the provider refused the lease's request
#   leases.waited_for        what held the request back ("pause" included)
_DDL = """\
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.limiters (
    name text PRIMARY KEY,
    settings jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS {schema}.queue (
    entry_id uuid PRIMARY KEY,
    limiter text NOT NULL,
    workload text NOT NULL,
    owner uuid NOT NULL,
    request_id text NOT NULL,
    seq bigserial NOT NULL,
    enqueued_at timestamptz NOT NULL,
    deadline timestamptz,
    stale_at timestamptz NOT NULL,
    lease_ttl double precision NOT NULL
);
CREATE INDEX IF NOT EXISTS queue_by_limiter ON {schema}.queue (limiter, enqueued_at, seq);
CREATE INDEX IF NOT EXISTS queue_by_owner ON {schema}.queue (owner);
CREATE TABLE IF NOT EXISTS {schema}.leases (
    lease_id uuid PRIMARY KEY,
    limiter text NOT NULL,
    workload text NOT NULL,
    owner uuid NOT NULL,
    entry_id uuid,
    request_id text,
    granted_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS leases_by_limiter ON {schema}.leases (limiter, expires_at);
CREATE INDEX IF NOT EXISTS leases_by_entry ON {schema}.leases (entry_id);
CREATE TABLE IF NOT EXISTS {schema}.owners (
    owner uuid PRIMARY KEY,
    alive_until timestamptz NOT NULL
);
ALTER TABLE {schema}.limiters
    ADD COLUMN IF NOT EXISTS limits jsonb,
    ADD COLUMN IF NOT EXISTS limits_version bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS buckets jsonb NOT NULL DEFAULT '{{}}',
    ADD COLUMN IF NOT EXISTS paused_until timestamptz,
    ADD COLUMN IF NOT EXISTS backoffs integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS adaptive jsonb;
ALTER TABLE {schema}.queue
    ADD COLUMN IF NOT EXISTS tokens bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS waited_for text[] NOT NULL DEFAULT '{{}}';
ALTER TABLE {schema}.leases
    ADD COLUMN IF NOT EXISTS epoch bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS throttled boolean NOT NULL DEFAULT false,
    ADD COLUMN IF NOT EXISTS waited_for text[] NOT NULL DEFAULT '{{}}',
    ADD COLUMN IF NOT EXISTS tried integer NOT NULL DEFAULT 0;
"""

# The last column and the last table added: a schema that has both is current.
NEWEST_COLUMN = ("leases", "tried")
NEWEST_TABLE = "owners"


def schema_ddl(schema: str) -> list[sql.Composed]:
    """The DDL statements, one by one, the schema name quoted as an identifier."""
    return [
        sql.SQL(statement).format(schema=sql.Identifier(schema))
        for statement in _DDL.split(";\n")
        if statement.strip()
    ]


def schema_sql(schema: str = "slotwise") -> str:
    """Return the DDL that creates PostgresLimiter's tables, for a migration.

    Apply it once (it is idempotent) and pass `ensure_schema=False` to limiters whose
    database role may not run DDL. Apply it again after an upgrade of slotwise: it adds the
    columns a newer version needs to existing tables (`ADD COLUMN IF NOT EXISTS`, with
    constant defaults: no table rewrite) and changes nothing else.

    Args:
        schema: The schema to create the tables in; quoted as an identifier.

    Returns:
        SQL text: `CREATE SCHEMA IF NOT EXISTS ...`, the `CREATE TABLE` and
        `CREATE INDEX` statements, and the `ALTER TABLE ... ADD COLUMN IF NOT EXISTS`
        statements of later columns.

    Example:
        ```python
        print(schema_sql("limits").splitlines()[0])  # CREATE SCHEMA IF NOT EXISTS "limits";
        ```
    """
    if not isinstance(schema, str) or not schema:
        raise ValueError(f"schema must be a non-empty string, got {schema!r}")
    return "".join(f"{statement.as_string()};\n" for statement in schema_ddl(schema))


def channel_name(schema: str) -> str:
    """The NOTIFY channel of a schema's limiters (at most 63 bytes, PostgreSQL's limit)."""
    return f"slotwise.{schema}".encode()[:63].decode(errors="ignore")
