"""What one process's rounds carry: the queued requests as the allocation sees them, what a
round found and did, what held slots learned from the provider between two rounds, and the
waiters and releases of this process that the next round serves."""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import final

import anyio
import attrs

from .._config import Settings
from .._errors import ConcurrencyConfigError
from .._protocol import Lease

__all__ = (
    "Charge",
    "Cycle",
    "Entry",
    "Learned",
    "Limit",
    "Observed",
    "Pushback",
    "Release",
    "Waiter",
    "cost_of",
    "enqueued_at",
    "entry_cost",
    "entry_key",
    "unsucceeded",
)


@attrs.frozen(kw_only=True)
class Entry:
    """A queued request as the allocation sees it."""

    entry_id: str
    workload: str
    key: tuple[int, int]  # (enqueued_at in microseconds, seq): who has waited longest
    owner: str  # the process (limiter object) that waits for it
    tokens: int = 0  # its token estimate
    waited_for: tuple[str, ...] = ()  # the buckets it has had to wait for so far


def entry_key(entry: Entry) -> tuple[int, int]:
    return entry.key


def entry_cost(entry: Entry) -> Mapping[str, int]:
    return cost_of(entry.tokens)


def cost_of(tokens: int) -> Mapping[str, int]:
    return {"requests": 1, "tokens": tokens} if tokens else {"requests": 1}


def enqueued_at(entry: Entry) -> float:
    return entry.key[0] / 1e6


@attrs.frozen(kw_only=True)
class Cycle:
    """What one allocation transaction found and did."""

    granted: dict[str, Lease]  # this process's entries that hold a lease now
    present: frozenset[str]  # this process's asked-about entries still queued
    queued: int  # live entries, ours included
    # Entries enqueued by this cycle and dropped at once: "no-wait", or why the queue is
    # full (max_queued, the limiter's or the workload's).
    refused: dict[str, str] = attrs.field(factory=dict)
    since: dict[str, datetime] = attrs.field(factory=dict)  # their enqueued_at (database)
    # The stored limits are not this process's: nothing was allocated (releases and
    # withdrawals were still applied); the waiters of this process fail with it.
    error: ConcurrencyConfigError | None = None
    settings: tuple[Settings, int] | None = None  # the limits in force, when they changed
    changes: tuple[tuple[int, int, str], ...] = ()  # (old, new, reason) of the limit in force
    wake: float | None = None  # seconds until time alone can grant something
    paused_until: float = -math.inf  # database clock, seconds since the epoch
    backoffs: int = 0


# What a process learns from the provider between two of its transactions (the sync calls
# of a held slot), stored by the next one.
@attrs.frozen(kw_only=True)
class Pushback:
    lease_id: str | None
    retry_after: float | None
    jitter: float


@attrs.frozen(kw_only=True)
class Charge:
    workload: str
    units: int


@attrs.frozen(kw_only=True)
class Observed:
    kind: str
    remaining: int


@attrs.frozen(kw_only=True)
class Limit:
    kind: str
    limit: int


Learned = Pushback | Charge | Observed | Limit


@final
class Waiter:
    __slots__ = (
        "entry_id",
        "error",
        "event",
        "lease",
        "refused",
        "request_id",
        "since",
        "tokens",
        "until",
        "wait",
        "workload",
    )

    def __init__(
        self,
        workload: str,
        request_id: str,
        wait: float,
        since: datetime | None = None,
        tokens: int = 0,
    ) -> None:
        self.entry_id = str(uuid.uuid4())
        self.workload = workload
        self.request_id = request_id
        self.tokens = tokens  # its token estimate, charged at grant
        self.wait = wait  # seconds it may wait, from when it is enqueued
        self.until = anyio.current_time() + wait  # when it stops waiting
        self.since = since  # enqueued_at in the database: a request queued again keeps it
        self.event = anyio.Event()
        self.lease: Lease | None = None
        self.error: BaseException | None = None
        self.refused = False  # the allocation dropped its entry at once (set with event)


@final
class Release:
    """A release waiting for the poller's next round (or under way in it)."""

    __slots__ = ("error", "event", "succeeded")

    def __init__(self, *, succeeded: bool) -> None:
        self.event = anyio.Event()  # set when its transaction ended
        self.error: BaseException | None = None
        self.succeeded = succeeded  # else its release does not count as a success


def unsucceeded(releases: dict[str, Release]) -> list[str]:
    """The leases of ``releases`` whose requests did not succeed."""
    return [lease_id for lease_id, done in releases.items() if not done.succeeded]
