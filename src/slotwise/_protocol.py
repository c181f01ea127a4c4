"""What a limiter is: the protocol every backend, built-in or custom, implements.

The runtime (``slotwise.slot``) owns the slot lifecycle: waiting bounds from the run's budget,
renewal, release, events and errors. A limiter owns allocation, queue order and storage.
"""

import sys
from collections.abc import Mapping
from typing import Generic, Protocol, runtime_checkable

import attrs

if sys.version_info >= (3, 13):
    from typing import TypeVar
else:
    from typing_extensions import TypeVar

__all__ = ("AcquireRequest", "Lease", "Limiter", "SupportsLease", "TypedLimiter", "W")

# A limiter's workload names: `str`, or a `Literal` or `StrEnum` of them. Written bare
# (`MemoryLimiter`, `Limiter`, `AcquireRequest`), a class means names of any `str`.
W = TypeVar("W", bound=str, default=str)
W_co = TypeVar("W_co", bound=str, covariant=True, default=str)
W_contra = TypeVar("W_contra", bound=str, contravariant=True, default=str)


@attrs.frozen(kw_only=True)
class AcquireRequest(Generic[W_co]):
    """What ``Limiter.acquire`` is asked for.

    Attributes:
        workload: The resolved workload name.
        request_id: Unique per request; appears in events and errors.
        run_id: The run making the request, None outside a run.
        root_run_id: The root of that run's tree.
        parent_run_id: The run's parent.
        deadline: When the request must stop waiting, on ``anyio.current_time()``'s clock
            of the calling event loop, from the run's budget; None for no budget. The
            limiter waits until the earlier of this and its workload's ``max_wait``, then
            raises ``ConcurrencyTimeoutError``; a deadline already past means "take a free
            slot or fail now".
        tokens: The request's estimated tokens (0: none given), for a limiter with token
            rate limits: charged when the slot is granted.
    """

    workload: W_co
    request_id: str
    run_id: str | None = None
    root_run_id: str | None = None
    parent_run_id: str | None = None
    deadline: float | None = None
    tokens: int = 0


class SupportsLease(Protocol):
    """The least a lease must carry."""

    @property
    def lease_id(self) -> str: ...

    @property
    def workload(self) -> str: ...


@attrs.frozen(kw_only=True)
class Lease:
    """A granted slot, valid until ``expires_at`` unless renewed.

    Attributes:
        lease_id: Never reused by the limiter that issued it.
        workload: The workload it counts against.
        expires_at: On the limiter's clock (``time.monotonic()`` for MemoryLimiter, or a
            trio ``MockClock`` in tests; the database clock for PostgresLimiter).
    """

    lease_id: str
    workload: str
    expires_at: float


@runtime_checkable
class Limiter(Protocol[W_contra]):
    """Any object with these members backs a limit through ``slotwise.slot(limiter=obj)``.

    A limiter must allocate atomically, give leases that expire, make ``renew`` and
    ``release`` idempotent, never reuse a lease id, and make ``acquire`` safe to cancel (a
    slot granted as the caller is cancelled must be given back). Two optional members are
    used when present: ``validate_workload(name: str | None) -> str`` resolves the default
    and raises ``ConcurrencyConfigError`` for an unknown name; ``async stats()`` returns
    `slotwise.LimiterStats`. A ``lease_ttl`` attribute (seconds) sets how often the runtime
    renews (a third of it; 30 s when absent). Two more optional members inform the runtime
    and `slotwise.opentelemetry`: ``workloads``, a mapping of names to objects with
    ``max_wait``, ``max_concurrent`` and ``reserved`` (the ``wait-started`` deadline and the
    limit metrics), and ``max_concurrent``. A class that defines ``stats_nowait()`` (the
    `slotwise.LimiterStats` of now, without an `await`) gives `slotwise.opentelemetry` its
    limit in force and its pause; without it, they are read from its events.

    `Limiter[W]` is generic in the workload names it takes: written bare, `Limiter` takes any
    `str`, as a custom limiter whose `acquire` takes a bare `AcquireRequest` does. A
    `MemoryLimiter[Literal["a", "b"]]` is a `Limiter[Literal["a", "b"]]`, so a type checker
    refuses other names wherever it is passed with a workload.

    Fast paths a limiter's class may define (looked up on the class, never on the instance,
    so a wrapper that forwards attributes with ``__getattr__`` still has its own ``renew``
    and ``release`` called): ``release_nowait(lease)``, which the runtime then calls instead
    of ``release`` (no shielded scope per slot, and `Slot.release_sync` works), and
    ``renew_nowait(lease)`` instead of ``renew`` (no task per renewal).
    """

    @property
    def name(self) -> str: ...

    async def acquire(self, request: AcquireRequest[W_contra]) -> SupportsLease:
        """Wait for a slot and return its lease.

        Raises:
            ConcurrencyTimeoutError: no slot before the deadline or ``max_wait``.
            ConcurrencyQueueFullError: too many requests are waiting.
        """
        ...

    async def renew(self, lease: SupportsLease) -> SupportsLease | None:
        """Extend a lease; None when it is no longer held. Raise only for transient faults."""
        ...

    async def release(self, lease: SupportsLease) -> None:
        """Give a slot back. Idempotent."""
        ...


class TypedLimiter(Limiter[W], Protocol[W]):
    """A limiter whose workload names are typed: `MemoryLimiter[W]` and `PostgresLimiter[W]`.

    Its `workloads` mapping ties `W` to one set of names (a mapping's keys are invariant), so
    that `slotwise.slot(workload=..., limiter=...)` and the other functions that take both
    check the name against the limiter's. A limiter that takes any `str` (a custom one, or
    a built-in one with untyped names) is matched as a `Limiter[str]` first.
    """

    @property
    def workloads(self) -> Mapping[W, object]: ...
