"""PostgreSQL backend: one capacity shared by every worker process that uses a limiter name.

Install with ``pip install 'slotwise[postgres]'`` (psycopg 3 and psycopg_pool). asyncio only.
"""

from ._limiter import PostgresLimiter as PostgresLimiter
from ._schema import schema_sql as schema_sql

__all__ = ("PostgresLimiter", "schema_sql")

PostgresLimiter.__module__ = "slotwise.postgres"
schema_sql.__module__ = "slotwise.postgres"
