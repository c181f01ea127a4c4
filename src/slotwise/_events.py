"""The structured events a limiter emits, one frozen class per ``kind``.

Events identify the limiter, the workload, the run lineage and the request, and carry only the
fields below: never a prompt, an argument, a header or a credential.
"""

from typing import Literal, TypeAlias

import attrs

__all__ = (
    "AcquiredEvent",
    "ConcurrencyEvent",
    "ConfigErrorEvent",
    "EventKind",
    "LeaseLostEvent",
    "LimitChangedEvent",
    "LimiterErrorEvent",
    "Outcome",
    "PausedEvent",
    "QueueFullEvent",
    "ReclaimedEvent",
    "ReleaseFailedEvent",
    "ReleasedEvent",
    "RenewalFailedEvent",
    "TimedOutEvent",
    "ToolEffect",
    "ToolFinishedEvent",
    "ToolOutcome",
    "ToolRejectedEvent",
    "ToolRejection",
    "ToolStartedEvent",
    "WaitCancelledEvent",
    "WaitStartedEvent",
)

Outcome: TypeAlias = Literal["completed", "failed", "cancelled"]


@attrs.frozen(kw_only=True)
class _Event:
    """Fields every event has.

    Attributes:
        limiter: The limiter's name.
        workload: The request's workload (None when it could not be resolved).
        run_id: The run that made the request, None outside a run.
        root_run_id: The root of that run's tree.
        parent_run_id: The run's parent, None for a root run.
        request_id: The slot request this event belongs to.
        timestamp: When it happened, in seconds since the epoch.
    """

    limiter: str
    workload: str | None
    run_id: str | None
    root_run_id: str | None
    parent_run_id: str | None
    request_id: str | None
    timestamp: float


@attrs.frozen(kw_only=True)
class WaitStartedEvent(_Event):
    """A request asked for a slot. ``deadline`` (epoch seconds) is when it stops waiting."""

    kind: Literal["wait-started"] = "wait-started"
    deadline: float | None


@attrs.frozen(kw_only=True)
class AcquiredEvent(_Event):
    """A request got its slot after ``wait_time`` seconds. ``waited_for`` names what held it
    back besides a free slot: rate buckets (``"requests"``, ``"tokens"``,
    ``"<workload>.requests"``, ``"<workload>.tokens"``) and ``"pause"`` (provider pushback)."""

    kind: Literal["acquired"] = "acquired"
    lease_id: str
    wait_time: float
    waited_for: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class TimedOutEvent(_Event):
    """No slot before the deadline; the request left the queue."""

    kind: Literal["timed-out"] = "timed-out"
    wait_time: float


@attrs.frozen(kw_only=True)
class QueueFullEvent(_Event):
    """The queue was full; the request was refused at once."""

    kind: Literal["queue-full"] = "queue-full"
    wait_time: float


@attrs.frozen(kw_only=True)
class WaitCancelledEvent(_Event):
    """The waiting request was cancelled and left the queue."""

    kind: Literal["wait-cancelled"] = "wait-cancelled"
    wait_time: float


@attrs.frozen(kw_only=True)
class LimiterErrorEvent(_Event):
    """The limiter failed during acquisition; the body did not run. ``error`` names the
    exception type and message."""

    kind: Literal["limiter-error"] = "limiter-error"
    wait_time: float
    error: str


@attrs.frozen(kw_only=True)
class ConfigErrorEvent(_Event):
    """The request named an unknown workload, or none where one is required."""

    kind: Literal["config-error"] = "config-error"
    error: str


@attrs.frozen(kw_only=True)
class ReleasedEvent(_Event):
    """The slot was given back after ``hold_time`` seconds."""

    kind: Literal["released"] = "released"
    lease_id: str
    hold_time: float
    outcome: Outcome


@attrs.frozen(kw_only=True)
class ReclaimedEvent(_Event):
    """The holder of a slot was abandoned without giving it back (garbage collected, or left
    unread past its idle bound), and slotwise gave it back. ``source`` says what was abandoned:
    ``"unclosed-response"``, an HTTP response neither read to its end nor closed. The
    ``released`` event (outcome ``"cancelled"``, or ``"failed"`` for an error response)
    follows."""

    kind: Literal["reclaimed"] = "reclaimed"
    lease_id: str
    hold_time: float
    source: Literal["unclosed-response"]


@attrs.frozen(kw_only=True)
class RenewalFailedEvent(_Event):
    """A renewal raised; it is retried until the lease would expire."""

    kind: Literal["renewal-failed"] = "renewal-failed"
    lease_id: str
    error: str


@attrs.frozen(kw_only=True)
class LeaseLostEvent(_Event):
    """The lease was gone while the slot was held; its body is cancelled."""

    kind: Literal["lease-lost"] = "lease-lost"
    lease_id: str
    hold_time: float


@attrs.frozen(kw_only=True)
class ReleaseFailedEvent(_Event):
    """Giving the slot back raised. The body's own result or exception stands; the lease
    expires on its own."""

    kind: Literal["release-failed"] = "release-failed"
    lease_id: str
    error: str


ToolRejection: TypeAlias = Literal[
    "unknown-tool",
    "invalid-arguments",
    "concurrency-limit",
    "limiter-error",
    "budget-exhausted",
    "cancelled",
]
ToolOutcome: TypeAlias = Literal["completed", "failed", "timed-out", "limiter-error", "cancelled"]
ToolEffect: TypeAlias = Literal["none", "done", "unknown"]


@attrs.frozen(kw_only=True)
class _ToolEvent(_Event):
    """Fields every tool event has, beside those of every event (``limiter`` is the ToolBox's
    limiter, ``workload`` the tool's pool, ``request_id`` the call's slot request, if any).

    Attributes:
        tool: The tool's name, as the model called it.
        call_id: The call's id, as the model gave it.
        wait_time: Seconds the call waited for a slot (for a parallel call, from the start of
            its batch).
    """

    tool: str
    call_id: str
    wait_time: float

    @property
    def pool(self) -> str | None:
        """The tool's pool: the workload of the ToolBox's limiter its calls hold."""
        return self.workload


@attrs.frozen(kw_only=True)
class ToolStartedEvent(_ToolEvent):
    """A tool call got its slot and its handler starts."""

    kind: Literal["tool-started"] = "tool-started"


@attrs.frozen(kw_only=True)
class ToolFinishedEvent(_ToolEvent):
    """A tool call's handler ended after ``duration`` seconds, and its slot was given back.

    ``outcome``: ``"completed"`` (it returned), ``"failed"`` (it raised; ``exception`` names
    the exception's type, never its message), ``"timed-out"`` (the tool's ``timeout`` cancelled
    it), ``"limiter-error"`` (its slot's lease was lost) or ``"cancelled"`` (its batch or run
    was cancelled). ``effect`` is the result's: ``"done"``, ``"unknown"`` (a tool that writes
    stopped part-way) or ``"none"``."""

    kind: Literal["tool-finished"] = "tool-finished"
    duration: float
    outcome: ToolOutcome
    effect: ToolEffect
    exception: str | None


@attrs.frozen(kw_only=True)
class ToolRejectedEvent(_ToolEvent):
    """A tool call ended without its handler ever starting, for ``reason``: the result's
    error (``"unknown-tool"``, ``"invalid-arguments"``, ``"concurrency-limit"``,
    ``"limiter-error"``, ``"budget-exhausted"``), or ``"cancelled"`` when its batch or run was
    cancelled before it got a slot."""

    kind: Literal["tool-rejected"] = "tool-rejected"
    reason: ToolRejection


@attrs.frozen(kw_only=True)
class PausedEvent(_Event):
    """The provider pushed back (a 429, 529 or 503): the limiter grants nothing until
    ``until`` (seconds since the epoch). ``reason`` says what paused it (the HTTP status,
    or ``"throttled"``); the lineage is that of the refused request."""

    kind: Literal["paused"] = "paused"
    until: float
    reason: str


@attrs.frozen(kw_only=True)
class LimitChangedEvent(_Event):
    """The limit in force (``max_concurrent``) went from ``old`` to ``new``: ``"pushback"``
    and ``"recovered"`` for an adaptive limit, ``"set_limits"`` for a change by hand."""

    kind: Literal["limit-changed"] = "limit-changed"
    old: int
    new: int
    reason: str


ConcurrencyEvent: TypeAlias = (
    WaitStartedEvent
    | AcquiredEvent
    | TimedOutEvent
    | QueueFullEvent
    | WaitCancelledEvent
    | LimiterErrorEvent
    | ConfigErrorEvent
    | ReleasedEvent
    | ReclaimedEvent
    | RenewalFailedEvent
    | LeaseLostEvent
    | ReleaseFailedEvent
    | PausedEvent
    | LimitChangedEvent
    | ToolStartedEvent
    | ToolFinishedEvent
    | ToolRejectedEvent
)

EventKind: TypeAlias = Literal[
    "wait-started",
    "acquired",
    "timed-out",
    "queue-full",
    "wait-cancelled",
    "limiter-error",
    "config-error",
    "released",
    "reclaimed",
    "renewal-failed",
    "lease-lost",
    "release-failed",
    "paused",
    "limit-changed",
    "tool-started",
    "tool-finished",
    "tool-rejected",
]
