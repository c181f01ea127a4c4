"""The statements of PostgresLimiter, with the schema quoted in."""

from __future__ import annotations

from typing import final

from psycopg import sql

__all__ = ("Queries", "quote")


def quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


@final
class Queries:
    """The statements, with the schema quoted in; every value is a bound parameter."""

    __slots__ = (
        "alive",
        "count_workloads",
        "drop_entries",
        "enqueue",
        "fetch_mine",
        "grant",
        "insert_limiter",
        "load",
        "lock_limiter",
        "lock_state",
        "mark_throttled",
        "mark_waited",
        "renew",
        "replace_limits",
        "save_state",
        "state",
        "stats",
        "store_limits",
        "sweep",
        "timeouts",
    )

    def __init__(self, schema: str) -> None:
        # Rendered to bytes once: psycopg then converts each statement's placeholders once
        # per process (its cache is keyed by the query's bytes), not at every execution.
        def q(text: str) -> bytes:
            return sql.SQL(text).format(s=sql.Identifier(schema)).as_bytes(None)

        self.insert_limiter = q(
            "INSERT INTO {s}.limiters (name, settings) VALUES (%s, %s::jsonb) "
            "ON CONFLICT (name) DO NOTHING"
        )
        self.lock_limiter = q(
            "SELECT settings = %s::jsonb, settings FROM {s}.limiters WHERE name = %s FOR UPDATE"
        )
        # New limits deployed: those set at run time by set_limits() go too.
        self.replace_limits = q(
            "UPDATE {s}.limiters SET settings = %s::jsonb, updated_at = clock_timestamp(), "
            "limits = NULL, limits_version = limits_version + 1 WHERE name = %s"
        )
        # The transaction's timeouts, and generic plans for its prepared statements: left to
        # choose, the server plans the sweep and the load again at every execution (custom
        # plans), while the limiter's row lock is held. plan_cache_mode is PostgreSQL 12's.
        self.timeouts = q(
            "SELECT set_config('lock_timeout', %s, true), set_config('statement_timeout', %s, true),"
            " CASE WHEN current_setting('server_version_num')::int >= 120000"
            " THEN set_config('plan_cache_mode', 'force_generic_plan', true) END"
        )
        # The rates and pushback state, and the limits in force when they are not those
        # this process last saw; with the row lock and the check of lock_limiter.
        state = """
            buckets, extract(epoch FROM paused_until)::float8, backoffs, adaptive,
            limits_version, CASE WHEN limits_version <> %(version)s THEN limits END,
            extract(epoch FROM clock_timestamp())::float8
            FROM {s}.limiters WHERE name = %(name)s
        """
        self.state = q("SELECT " + state)
        self.lock_state = q(
            "SELECT settings = %(settings)s::jsonb, settings, " + state + " FOR UPDATE"
        )
        self.save_state = q(
            """
            UPDATE {s}.limiters
            SET buckets = %(buckets)s::jsonb,
                paused_until = to_timestamp(%(paused_until)s::float8),
                backoffs = %(backoffs)s, adaptive = %(adaptive)s::jsonb
            WHERE name = %(name)s
            """
        )
        self.store_limits = q(
            "UPDATE {s}.limiters SET limits = %(limits)s::jsonb, "
            "limits_version = %(version)s WHERE name = %(name)s"
        )
        self.mark_throttled = q(
            """
            UPDATE {s}.leases SET throttled = true
            WHERE lease_id = ANY(%(leases)s::uuid[]) AND limiter = %(name)s
            RETURNING lease_id::text, epoch
            """
        )
        self.mark_waited = q(
            """
            UPDATE {s}.queue q SET waited_for = ARRAY(SELECT jsonb_array_elements_text(b.value))
            FROM jsonb_each(%s::jsonb) AS b
            WHERE q.entry_id = b.key::uuid
            """
        )
        # The live entries of these workloads waiting before the batch being enqueued.
        self.count_workloads = q(
            """
            SELECT workload, count(*)::int FROM {s}.queue
            WHERE limiter = %(name)s AND workload = ANY(%(workloads)s::text[])
              AND NOT entry_id = ANY(%(fresh)s::uuid[]) AND stale_at > clock_timestamp()
              AND (deadline IS NULL OR deadline > clock_timestamp())
            GROUP BY workload
            """
        )
        # Expired leases (and the one being released) go; so do other processes' entries
        # that are stale or past their deadline, and this process's withdrawn entries with
        # any slot granted to them. The entries this process still waits for are refreshed.
        self.sweep = q(
            """
            WITH gone AS (
                DELETE FROM {s}.leases
                WHERE limiter = %(name)s
                  AND (expires_at <= clock_timestamp() OR lease_id = ANY(%(release)s::uuid[])
                       OR (entry_id = ANY(%(withdraw)s::uuid[]) AND owner = %(owner)s::uuid))
                RETURNING lease_id, epoch, throttled, workload, tried
            ), stale AS (
                DELETE FROM {s}.queue
                WHERE limiter = %(name)s
                  AND ((owner <> %(owner)s::uuid
                        AND (stale_at <= clock_timestamp() OR deadline <= clock_timestamp()))
                       OR (entry_id = ANY(%(withdraw)s::uuid[]) AND owner = %(owner)s::uuid))
                RETURNING 1
            ), beat AS (
                UPDATE {s}.queue
                SET stale_at = clock_timestamp() + make_interval(secs => %(entry_ttl)s)
                WHERE %(beat)s AND entry_id = ANY(%(asked)s::uuid[]) AND owner = %(owner)s::uuid
                RETURNING 1
            ), dead AS (
                DELETE FROM {s}.owners
                WHERE %(beat)s AND alive_until < clock_timestamp() - interval '1 hour'
                RETURNING 1
            )
            SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM stale),
                   (SELECT count(*) FROM beat), (SELECT count(*) FROM dead),
                   (SELECT json_agg(json_build_array(epoch, throttled, lease_id, workload,
                                                     tried)
                                    ORDER BY array_position(%(release)s::uuid[], lease_id))
                    FROM gone WHERE lease_id = ANY(%(release)s::uuid[]))
            """
        )
        self.alive = q(
            "INSERT INTO {s}.owners (owner, alive_until) "
            "VALUES (%s, clock_timestamp() + make_interval(secs => %s)) "
            "ON CONFLICT (owner) DO UPDATE SET alive_until = EXCLUDED.alive_until"
        )
        # A batch, in its order; an entry queued again keeps its enqueued_at (`since`).
        self.enqueue = q(
            """
            INSERT INTO {s}.queue (entry_id, limiter, workload, owner, request_id,
                                   enqueued_at, deadline, stale_at, lease_ttl, tokens)
            SELECT e.entry_id, %(name)s, e.workload, %(owner)s, e.request_id,
                   coalesce(e.since, clock_timestamp()),
                   clock_timestamp() + make_interval(secs => e.wait),
                   clock_timestamp() + make_interval(secs => %(entry_ttl)s),
                   %(lease_ttl)s, e.tokens
            FROM unnest(%(entries)s::uuid[], %(workloads)s::text[], %(request_ids)s::text[],
                        %(waits)s::float8[], %(since)s::timestamptz[], %(tokens)s::bigint[])
                 WITH ORDINALITY AS e(entry_id, workload, request_id, wait, since, tokens, n)
            ORDER BY e.n
            RETURNING entry_id::text, enqueued_at
            """
        )
        # The snapshot the allocation needs: active leases per workload, the number of live
        # entries, the first max_concurrent live entries of each workload (no more can be
        # granted at once) among those of processes that still say they wait (a process
        # that died is granted nothing more), and the leases already granted to the entries
        # asked about.
        self.load = q(
            """
            WITH live AS (
                SELECT entry_id, workload, enqueued_at, seq, owner, tokens, waited_for
                FROM {s}.queue
                WHERE limiter = %(name)s AND stale_at > clock_timestamp()
                  AND (deadline IS NULL OR deadline > clock_timestamp()
                       OR entry_id = ANY(%(fresh)s::uuid[]))
            )
            SELECT
                (SELECT json_object_agg(workload, n) FROM (
                    SELECT workload, count(*) AS n FROM {s}.leases
                    WHERE limiter = %(name)s GROUP BY workload) a),
                (SELECT count(*) FROM live),
                (SELECT json_agg(json_build_array(entry_id, workload, micros, seq, owner,
                                                  tokens, waited_for)
                                 ORDER BY micros, seq)
                 FROM (SELECT entry_id, workload, seq, owner, tokens, waited_for,
                              (extract(epoch FROM enqueued_at) * 1000000)::bigint AS micros,
                              row_number() OVER (PARTITION BY workload
                                                 ORDER BY enqueued_at, seq) AS rank
                       FROM live
                       WHERE owner = %(owner)s::uuid OR owner IN (
                           SELECT owner FROM {s}.owners
                           WHERE alive_until > clock_timestamp())) h
                 WHERE rank <= %(heads)s),
                (SELECT json_agg(json_build_array(entry_id, lease_id, workload,
                                                  extract(epoch FROM expires_at), waited_for))
                 FROM {s}.leases
                 WHERE entry_id = ANY(%(asked)s::uuid[]) AND expires_at > clock_timestamp()),
                (SELECT json_agg(entry_id) FROM {s}.queue
                 WHERE entry_id = ANY(%(asked)s::uuid[])),
                extract(epoch FROM clock_timestamp())::float8
            """
        )
        self.drop_entries = q("DELETE FROM {s}.queue WHERE entry_id = ANY(%s::uuid[])")
        self.grant = q(
            """
            WITH g AS (
                SELECT * FROM unnest(%(entries)s::uuid[], %(leases)s::uuid[],
                                     %(waited)s::text[], %(tried)s::int[])
                    AS g(entry_id, lease_id, waited, tried)
            ), d AS (
                DELETE FROM {s}.queue q USING g
                WHERE q.entry_id = g.entry_id AND q.limiter = %(name)s
                RETURNING q.entry_id, g.lease_id, q.workload, q.owner, q.request_id,
                          q.lease_ttl, g.waited, g.tried
            ), i AS (
                INSERT INTO {s}.leases (lease_id, limiter, workload, owner, entry_id,
                                        request_id, granted_at, expires_at, epoch, waited_for,
                                        tried)
                SELECT lease_id, %(name)s, workload, owner, entry_id, request_id,
                       clock_timestamp(), clock_timestamp() + make_interval(secs => lease_ttl),
                       %(epoch)s, ARRAY(SELECT jsonb_array_elements_text(waited::jsonb)), tried
                FROM d
                RETURNING entry_id, lease_id, workload, owner, expires_at
            ), n AS (
                -- The other processes granted a slot, for their listeners: "look now", never
                -- what was granted (any role may send a notification; the listener reads
                -- its grants, and what they waited for, from the leases). A payload must
                -- stay under 8000 bytes, so a long list becomes "everyone look".
                SELECT json_build_object('k', json_agg(DISTINCT owner))::text AS owners
                FROM i WHERE owner <> %(owner)s::uuid
                HAVING count(*) > 0
            )
            SELECT pg_notify(%(channel)s, CASE WHEN octet_length(owners) < 7900 THEN owners
                                               ELSE '{{"k": "*"}}' END)
            FROM n
            """
        )
        self.fetch_mine = q(
            "SELECT entry_id::text, lease_id::text, workload, "
            "extract(epoch FROM expires_at)::float8, "
            "extract(epoch FROM clock_timestamp())::float8, waited_for FROM {s}.leases "
            "WHERE entry_id = ANY(%s::uuid[]) AND expires_at > clock_timestamp()"
        )
        self.renew = q(
            """
            UPDATE {s}.leases
            SET expires_at = clock_timestamp() + make_interval(secs => %(ttl)s)
            WHERE lease_id = %(lease_id)s::uuid AND limiter = %(name)s
              AND expires_at > clock_timestamp()
            RETURNING workload, extract(epoch FROM expires_at)
            """
        )
        self.stats = q(
            """
            SELECT 'active', workload, count(*)::int FROM {s}.leases
            WHERE limiter = %(name)s AND expires_at > clock_timestamp() GROUP BY workload
            UNION ALL
            SELECT 'queued', workload, count(*)::int FROM {s}.queue
            WHERE limiter = %(name)s AND stale_at > clock_timestamp()
              AND (deadline IS NULL OR deadline > clock_timestamp())
            GROUP BY workload
            """
        )
