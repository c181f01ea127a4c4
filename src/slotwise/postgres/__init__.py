"""PostgreSQL backend: one capacity shared by every worker process that uses a limiter name.

Install with ``pip install 'slotwise[postgres]'`` (psycopg 3 and psycopg_pool). asyncio only.
"""

try:
    from ._limiter import PostgresLimiter as PostgresLimiter
    from ._schema import schema_sql as schema_sql
except ModuleNotFoundError as exc:
    if (exc.name or "").partition(".")[0] not in ("psycopg", "psycopg_pool"):
        raise
    raise ModuleNotFoundError(
        f"slotwise.postgres needs {exc.name}, which is not installed: "
        "pip install 'slotwise[postgres]'",
        name=exc.name,
    ) from exc

__all__ = ("PostgresLimiter", "schema_sql")

PostgresLimiter.__module__ = "slotwise.postgres"
schema_sql.__module__ = "slotwise.postgres"
