"""Token buckets: the rate limits (requests and tokens per period) that share the allocation
decision with the slots, as pure values with ``now`` passed in.

A bucket holds up to ``capacity`` units and refills continuously at ``capacity / per`` units a
second, starting full, as providers document their own limits. A grant takes its cost from
every bucket that applies to it (the limiter's and its workload's); a token count corrected
after the fact may leave a bucket below zero, which later grants then wait out.

A bucket may also hold a limit learned from the provider (`Bank.learn`: the
``x-ratelimit-limit-*`` headers): its capacity, and its refill with it, is then the lesser of
the configured one and the learned one, until ``LEARNED_FOR`` seconds after the provider last
stated it. Each statement replaces the one before (higher or lower), so a provider that
raises its limit is followed up to the configured capacity, never above it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import attrs

__all__ = ("LEARNED_FOR", "PROVIDER_WINDOW", "Bank", "Bucket", "BucketRule", "Cost", "bucket_key")

# What one request costs: units per bucket kind ("requests", "tokens").
Cost = Mapping[str, int]
# The share of a cost a refill may fall short by through float rounding alone.
_ROUNDING = 1e-9
# The window of the limits providers state (OpenAI's and Anthropic's are per minute), seconds.
PROVIDER_WINDOW = 60.0
# How long a learned limit stands once the provider last stated it, seconds: every response
# states it again, so only a limiter that has sent nothing for this long forgets it.
LEARNED_FOR = 3600.0


def bucket_key(scope: str | None, kind: str) -> str:
    """The name of a bucket: ``"requests"`` / ``"tokens"`` for the limiter's, and
    ``"<workload>.requests"`` / ``"<workload>.tokens"`` for a workload's."""
    return kind if scope is None else f"{scope}.{kind}"


@attrs.frozen(kw_only=True)
class BucketRule:
    """One bucket's limit: ``capacity`` units per ``per`` seconds, granting only while
    ``reserve`` units would be left.

    The reserve covers the time a granted request takes to reach the provider, which counts
    it only then: a provider's bucket that is full in the meantime loses the refill that this
    one, having charged at the grant, gets. A grant that leaves the refill of that time in
    the bucket never reaches the provider before the provider's own bucket holds its cost.
    """

    kind: str  # "requests" or "tokens"
    capacity: int
    per: float
    reserve: float = 0.0

    @property
    def per_second(self) -> float:
        return self.capacity / self.per

    def need(self, units: int) -> float:
        """The level a grant of ``units`` needs (a request as large as the bucket needs it
        full, whatever the reserve)."""
        return min(float(self.capacity), units + self.reserve)


@attrs.define(kw_only=True)
class Bucket:
    """A bucket's level at ``updated`` (it refills from there), and the capacity learned from
    the provider (``learned``, in force until ``learned_until``)."""

    rule: BucketRule
    level: float
    updated: float
    learned: float = math.inf
    learned_until: float = -math.inf

    @property
    def capacity(self) -> float:
        """The capacity in force: the configured one, or a lesser one learned."""
        return min(float(self.rule.capacity), self.learned)

    @property
    def per_second(self) -> float:
        return self.capacity / self.rule.per

    def refill(self, now: float) -> None:
        if now >= self.learned_until and self.learned != math.inf:
            self.learned, self.learned_until = math.inf, -math.inf  # lapsed
        if now > self.updated:
            capacity = self.capacity
            self.level = min(capacity, self.level + (now - self.updated) * capacity / self.rule.per)
            self.updated = now

    def need(self, units: int) -> float:
        """The level a grant of ``units`` needs (a request as large as the capacity in force
        needs the bucket full, whatever the reserve)."""
        return min(self.capacity, units + self.rule.reserve)

    def holds(self, cost: int) -> bool:
        """Whether the bucket can grant ``cost`` units now (refilled to ``updated``), but for
        what float rounding of the refill leaves short at the moment `wait` named."""
        return self.level >= self.need(cost) * (1 - _ROUNDING)

    def wait(self, cost: int) -> float:
        """Seconds until the bucket can grant ``cost`` units (refilled to ``updated``
        already)."""
        if cost > self.rule.capacity:
            return math.inf
        if self.holds(cost):
            return 0.0
        return (self.need(cost) - self.level) / self.per_second


class Bank:
    """Every bucket of a limiter, by key; the buckets a request draws from are its limiter's
    and its workload's of each kind it has a cost for."""

    __slots__ = ("buckets",)

    def __init__(self, rules: Mapping[str, BucketRule], now: float) -> None:
        self.buckets = {
            key: Bucket(rule=rule, level=float(rule.capacity), updated=now)
            for key, rule in rules.items()
        }

    def __bool__(self) -> bool:
        return bool(self.buckets)

    def refill(self, now: float) -> None:
        for bucket in self.buckets.values():
            bucket.refill(now)

    def applying(self, workload: str, cost: Cost) -> Iterator[tuple[str, Bucket, int]]:
        """The buckets a request of ``workload`` with ``cost`` takes from, with its cost
        in each (buckets it would take nothing from are left out)."""
        for kind, units in cost.items():
            if units <= 0:
                continue
            for key in (kind, bucket_key(workload, kind)):
                bucket = self.buckets.get(key)
                if bucket is not None:
                    yield key, bucket, units

    def take(self, workload: str, cost: Cost) -> None:
        for _, bucket, units in self.applying(workload, cost):
            bucket.level -= units

    def give(self, workload: str, kind: str, units: int) -> None:
        """Charge ``units`` more (or refund, when negative) of ``kind`` to the buckets of
        ``workload``; a refund never fills a bucket past its capacity."""
        for key in (kind, bucket_key(workload, kind)):
            bucket = self.buckets.get(key)
            if bucket is not None:
                bucket.level = min(bucket.capacity, bucket.level - units)

    def observe(self, key: str, remaining: int, now: float) -> bool:
        """The provider says ``remaining`` units are left in bucket ``key``: lower the
        bucket to that if it holds more (never raise it). Returns whether it changed."""
        bucket = self.buckets.get(key)
        if bucket is None:
            return False
        bucket.refill(now)
        if remaining >= bucket.level:
            return False
        bucket.level = float(remaining)
        return True

    def learn(self, key: str, limit: int, now: float) -> bool:
        """The provider says its limit of bucket ``key``'s kind is ``limit`` units a
        `PROVIDER_WINDOW`: the bucket's capacity is that (scaled to its own period), or the
        configured one when lower, until `LEARNED_FOR` from ``now``; a bucket that holds more
        than that is lowered to it. Returns whether the capacity in force changed."""
        bucket = self.buckets.get(key)
        if bucket is None:
            return False
        bucket.refill(now)
        before = bucket.capacity
        bucket.learned = limit * bucket.rule.per / PROVIDER_WINDOW
        bucket.learned_until = now + LEARNED_FOR
        bucket.level = min(bucket.level, bucket.capacity)
        return bucket.capacity != before

    def oversized(self, workload: str, cost: Cost) -> tuple[str, int, BucketRule] | None:
        """A bucket that can never hold ``cost``: (key, units, its rule), or None."""
        for key, bucket, units in self.applying(workload, cost):
            if units > bucket.rule.capacity:
                return key, units, bucket.rule
        return None
