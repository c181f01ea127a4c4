"""The effective limit under provider pushback (AIMD) and the backoff of a pause, as pure
arithmetic.

Additive increase, multiplicative decrease: on pushback the effective limit is multiplied by
``backoff``; after as many successes as the limit (about one round trip of every slot) it
climbs by one. A burst of refusals of requests that were all in flight before a decrease
counts once: each lease remembers the ``epoch`` it was granted in, and only leases granted
since the last decrease can cause the next one (or count as successes for the climb).

A success counts only when at least half the limit was occupied at its release (as in Netflix's
concurrency-limits; occupied: held, or reserved for a workload and not in use, which no other
workload can take): a limit that is not reached, because the rate buckets or the demand hold
the requests back, says nothing of the room above it, and climbing on such successes would
leave the limit far above what the provider takes by the time the requests come back.

The limit never climbs more than one slot above what the provider has been seen to take: each
lease also remembers how many slots were occupied once it was granted (its own included), and
the highest of those among the successes since the last decrease is ``proven``. A climb needs
``limit <= proven``: a request granted with the limit full has succeeded. So only one slot at a
time is ever tried above what the provider took, and finding its limit costs the requests
granted in that one slot before the first refusal pauses the limiter, not one per success
that came back meanwhile.

Slow start: a limit that starts at ``floor`` rather than at its ceiling climbs by one on every
success of a request that found the limit full (about one slot a round trip), until the first
pushback; from there on the climb is additive (one slot after as many successes as the limit).
No more requests than the starting limit reach the provider before it has answered any.
"""

from __future__ import annotations

import math

import attrs

__all__ = ("Aimd", "backoff_delay")

_BACKOFF_BASE = 1.0  # seconds of the first pause without a retry-after
_BACKOFF_CAP = 60.0


def backoff_delay(step: int, jitter: float) -> float:
    """Seconds of the ``step``-th consecutive pause with no retry-after from the provider:
    doubling from one second, at most a minute, times ``jitter`` (the shell's random factor,
    0.75 to 1.25, so that processes pausing together do not resume together)."""
    # The exponent is capped: 2.0**1024 overflows, and the cap is reached long before.
    return min(_BACKOFF_CAP, _BACKOFF_BASE * 2.0 ** min(step, 32)) * jitter


@attrs.define(kw_only=True)
class Aimd:
    """An effective limit between ``floor`` and ``ceiling``."""

    floor: int
    ceiling: int
    backoff: float
    limit: int
    epoch: int = 0  # decreases so far
    credit: float = 0.0  # successes toward the next climb, in round trips
    slow_start: bool = False  # no pushback yet: every success climbs
    proven: int = 0  # the most slots occupied at the grant of a success since the last decrease

    def pushback(self, granted_in: int) -> int | None:
        """A request granted in epoch ``granted_in`` was refused by the provider: the new
        limit, or None when it does not change."""
        if granted_in < self.epoch:
            return None  # already decreased for the round trip it belonged to
        lower = max(self.floor, math.floor(self.limit * self.backoff))
        self.epoch += 1
        self.credit = 0.0
        self.slow_start = False
        self.proven = 0  # the provider took less than thought: what it took before is void
        if lower == self.limit:
            return None
        self.limit = lower
        return lower

    def success(self, granted_in: int, occupied: int, tried: int) -> int | None:
        """A request granted in epoch ``granted_in`` succeeded, with ``tried`` slots occupied
        once it was granted and ``occupied`` at its release (its own included both times;
        see `slotwise._core.rules.occupied`): the new limit, or None."""
        if granted_in < self.epoch:
            return None
        if tried > self.proven:
            self.proven = tried
        if self.limit >= self.ceiling or 2 * occupied < self.limit or self.limit > self.proven:
            return None
        if self.slow_start:
            self.limit += 1
            return self.limit
        self.credit += 1.0 / self.limit
        if self.credit < 1.0:
            return None
        self.credit -= 1.0
        self.limit += 1
        return self.limit
