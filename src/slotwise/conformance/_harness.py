"""The machinery behind the conformance cases: opening limiters, probes and holder counts.

A case talks to the limiter through the protocol itself (``acquire``, ``renew``, ``release``,
``stats``), not through ``slotwise.slot``: the runtime renews leases and hides cancellation
races, and the duties are the limiter's. Every lease a probe obtains is counted, so a case
notices the moment more slots are held than the limits allow, whatever it was probing.
"""

from __future__ import annotations

import inspect
import itertools
import secrets
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, NoReturn

import anyio
import attrs
from anyio.abc import TaskGroup, TaskStatus

from .._config import Workload
from .._errors import ConcurrencyConfigError, ConcurrencyError
from .._protocol import AcquireRequest, Lease
from .._runtime.loop import trio_running

__all__ = (
    "BlockStorage",
    "ConformanceFailure",
    "Harness",
    "Probe",
    "Subject",
    "Timing",
    "open_limiter",
)

BlockStorage = Callable[[Any], AbstractAsyncContextManager[Any]]

_request_ids = itertools.count(1)


class ConformanceFailure(AssertionError):
    """A limiter broke one of its duties; the message starts with the duty's name."""


@attrs.frozen(kw_only=True)
class Timing:
    """The durations every case uses, in seconds, already multiplied by ``time_scale``.

    Attributes:
        lease_ttl: The lease lifetime of the cases that watch leases expire.
        within: How long something that should happen promptly (a grant after a release,
            an error "at once") may take before the case fails. A generous bound, never a
            measurement.
        quiet: How long a case watches for something that must not happen (a grant beyond
            the limits). Too short a window can only let a bug pass, never fail a limiter.
        budget: The most one case may take in all.
    """

    lease_ttl: float
    within: float
    quiet: float
    budget: float

    @classmethod
    def scaled(cls, scale: float) -> Timing:
        return cls(lease_ttl=0.3 * scale, within=3.0 * scale, quiet=0.15 * scale, budget=60 * scale)


def _is_limiter(obj: object) -> bool:
    return all(hasattr(obj, member) for member in ("name", "acquire", "renew", "release"))


@asynccontextmanager
async def open_limiter(
    create_limiter: Callable[..., Any], limits: Mapping[str, Any]
) -> AsyncIterator[Any]:
    """Build a limiter with ``create_limiter(**limits)`` and close it afterwards.

    ``create_limiter`` may return a limiter, an awaitable of one, or an async context
    manager (an ``@asynccontextmanager`` function, or a limiter that is itself one, such as a
    limiter owning a connection pool): it is entered here and exited when the case ends.
    """
    obj = create_limiter(**limits)
    if inspect.isawaitable(obj):
        obj = await obj
    if hasattr(obj, "__aenter__") and hasattr(obj, "__aexit__"):
        async with obj as entered:
            yield entered if entered is not None else obj
    else:
        yield obj


class Harness:
    """What a case body gets: limiters to test, probes to start, and ``fail``."""

    def __init__(
        self,
        *,
        duty: str,
        case: str,
        create_limiter: Callable[..., Any],
        timing: Timing,
        supported: frozenset[str],
        owners: TaskGroup,
        closing: anyio.Event,
        task_group: TaskGroup,
        block_storage: BlockStorage | None = None,
    ) -> None:
        self.duty = duty
        self.case = case
        self.timing = timing
        self.supported = supported
        self._create = create_limiter
        self._block_storage = block_storage
        self._owners = owners
        self._closing = closing
        self._tg = task_group

    def fail(self, detail: str, *, cause: BaseException | None = None) -> NoReturn:
        """Fail the case with a message naming its duty."""
        raise ConformanceFailure(f"{self.duty}: {detail}") from cause

    def supports(self, capability: str) -> bool:
        """Whether the limiter under test declared ``capability``."""
        return capability in self.supported

    def member(self, subject: Subject, name: str, capability: str) -> Callable[..., Any]:
        """The method ``name`` of the limiter's class, which ``capability`` needs: looked up
        on the class, as the runtime looks it up (`Slot.used_tokens` calls
        ``charge_tokens``, `Slot.throttled` calls ``throttle``)."""
        found = getattr(type(subject.limiter), name, None)
        if not callable(found):
            self.fail(
                f"the limiter declares {capability!r} support, but its class has no "
                f"{name}() (the runtime looks it up on the class and does nothing without it)"
            )
        return found  # type: ignore[no-any-return]

    def block_storage(self, subject: Subject) -> AbstractAsyncContextManager[Any]:
        """The user's ``block_storage(limiter)``: while entered, the storage does not answer."""
        assert self._block_storage is not None  # the case requires it
        return self._block_storage(subject.limiter)

    @staticmethod
    def stall(seconds: float) -> None:
        """Block the event loop for ``seconds`` of its clock, as a long synchronous call (or
        an overloaded machine) does: no task runs meanwhile. On a trio ``MockClock`` the
        clock jumps instead."""
        if trio_running():
            jump = getattr(sys.modules["trio"].lowlevel.current_clock(), "jump", None)
            if jump is not None:
                jump(seconds)
                return
        time.sleep(seconds)

    def unique_name(self) -> str:
        """A limiter name no other case uses, so a shared backend keeps cases apart."""
        return f"conformance-{self.case.replace('_', '-')}-{secrets.token_hex(4)}"

    async def limiter(self, **limits: Any) -> Subject:
        """A limiter built by the user's ``create_limiter``, closed when the case ends."""
        limits.setdefault("name", self.unique_name())
        limiter = await self._owners.start(self._own, limits)
        if not _is_limiter(limiter):
            self.fail(
                f"create_limiter(**{limits!r}) gave {limiter!r}, which is not a limiter "
                "(it needs name, acquire, renew and release)"
            )
        return Subject(self, limiter, limits)

    async def _own(
        self, limits: Mapping[str, Any], *, task_status: TaskStatus[Any] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async with open_limiter(self._create, limits) as limiter:
            task_status.started(limiter)
            await self._closing.wait()

    def start(
        self,
        subject: Subject,
        workload: str = "default",
        *,
        label: str | None = None,
        deadline: float | None = None,
        gate: anyio.Event | None = None,
        tokens: int = 0,
    ) -> Probe:
        """Start one ``acquire`` in its own task (after ``gate`` is set, if given)."""
        label = label or f"{workload}#{next(_request_ids)}"
        probe = Probe(subject, workload, label, deadline, tokens)
        self._tg.start_soon(probe._run, gate)
        return probe

    async def take(
        self,
        subject: Subject,
        workload: str = "default",
        *,
        what: str,
        within: float | None = None,
        tokens: int = 0,
    ) -> Probe:
        """Acquire a slot that must be granted promptly."""
        probe = self.start(subject, workload, tokens=tokens)
        await probe.granted(what, within=within)
        return probe

    async def queued(self, subject: Subject, count: int) -> None:
        """Wait until ``count`` requests wait in ``subject``'s queues.

        Read from ``stats()`` when the limiter has it; otherwise the probes get a quiet
        window to reach the queue.
        """
        if not (self.supports("stats") and hasattr(subject.limiter, "stats")):
            await anyio.sleep(self.timing.quiet)
            return
        with anyio.move_on_after(self.timing.within):
            # stats() is the only view of the queue a limiter offers (in a database, say).
            while (await subject.limiter.stats()).queued < count:  # noqa: ASYNC110
                await anyio.sleep(0.005)
            return
        self.fail(f"stats() never showed {count} waiting requests (needed to order the probes)")

    async def capacity(self, subject: Subject, *, after: str) -> None:
        """Check that every slot of a single-workload limiter can be held at once."""
        probes: list[Probe] = []
        for _ in range(subject.max_concurrent):
            probes.append(
                await self.take(
                    subject,
                    what=f"after {after}, only {len(probes)} of max_concurrent="
                    f"{subject.max_concurrent} slots could be acquired: a slot leaked",
                )
            )
        for probe in probes:
            await probe.release()

    async def settle(self, probes: Iterable[Probe], *, what: str) -> None:
        """Release each probe as it is granted until every one has ended, in any order."""
        pending = list(probes)
        with anyio.move_on_after(self.timing.within * max(1, len(pending))):
            while pending:
                for probe in list(pending):
                    if probe.lease is not None:
                        await probe.release()
                    if probe.error is not None and not isinstance(probe.error, ConcurrencyError):
                        self.fail(f"{what}: acquire raised {probe.error!r}", cause=probe.error)
                    if probe.done.is_set() and probe.lease is None:
                        pending.remove(probe)
                if pending:
                    await anyio.sleep(0.005)
            return
        self.fail(f"{what}: {', '.join(p.label for p in pending)} never got a slot or an error")

    async def rejects(self, limits: Mapping[str, Any], *, setting: str, why: str) -> None:
        """Check that ``create_limiter(**limits)`` raises ConcurrencyConfigError about
        ``setting``."""
        limits = {"name": self.unique_name(), **limits}
        shown = ", ".join(f"{key}={value!r}" for key, value in limits.items() if key != "name")
        try:
            async with open_limiter(self._create, limits):
                pass
        except ConcurrencyConfigError as exc:
            if setting not in str(exc):
                self.fail(
                    f"{why} ({shown}) was rejected, but the message does not name the "
                    f"setting {setting!r}: {exc}"
                )
            return
        except Exception as exc:
            self.fail(f"{why} ({shown}) raised {exc!r}, not ConcurrencyConfigError")
        self.fail(f"{why} ({shown}) was accepted; it must raise ConcurrencyConfigError")


class Subject:
    """A limiter under test, with the counts of the leases its probes hold."""

    def __init__(self, harness: Harness, limiter: Any, limits: Mapping[str, Any]) -> None:
        self.harness = harness
        self.limiter = limiter
        self.limits = dict(limits)
        self.name: str = limits["name"]
        self.max_concurrent: int = limits["max_concurrent"]
        workloads: Mapping[str, Workload] = limits.get("workloads") or {"default": Workload()}
        self.ceilings = {
            name: settings.max_concurrent or self.max_concurrent
            for name, settings in workloads.items()
        }
        self.active: Counter[str] = Counter()
        self.next_grant = anyio.Event()  # set (and replaced) at every grant
        self.grants: list[str] = []
        self.arrivals: list[str] = []  # probe labels, in the order they called acquire
        self.lease_ids: list[str] = []

    async def acquire(self, workload: str = "default", *, deadline: float | None = None) -> Any:
        """Call ``acquire`` and count the lease it returns."""
        request = AcquireRequest(
            workload=workload, request_id=f"conformance-{next(_request_ids)}", deadline=deadline
        )
        lease = await self.limiter.acquire(request)
        self.hold(lease, workload, label=request.request_id)
        return lease

    def hold(self, lease: Any, workload: str, *, label: str) -> None:
        """Count a lease just granted; fail if the limits are exceeded."""
        fail = self.harness.fail
        lease_id = getattr(lease, "lease_id", None)
        if not isinstance(lease_id, str):
            fail(f"acquire returned {lease!r}, whose lease_id is not a string")
        if getattr(lease, "workload", None) != workload:
            fail(f"a request for workload {workload!r} got a lease for {lease.workload!r}")
        self.active[workload] += 1
        self.next_grant.set()
        self.next_grant = anyio.Event()
        self.grants.append(label)
        self.lease_ids.append(lease_id)
        total = sum(self.active.values())
        if total > self.max_concurrent:
            fail(
                f"{total} leases were held at once with max_concurrent={self.max_concurrent} "
                f"(held: {dict(self.active)})"
            )
        if self.active[workload] > self.ceilings[workload]:
            fail(
                f"workload {workload!r} held {self.active[workload]} leases at once, above "
                f"its ceiling of {self.ceilings[workload]}"
            )

    def forget(self, lease: Any) -> None:
        """Stop counting a lease whose holder walked away (it will expire)."""
        self.active[lease.workload] -= 1

    async def release(self, lease: Any) -> None:
        """Stop counting a lease, then release it (shielded, as the runtime does)."""
        self.forget(lease)
        with anyio.CancelScope(shield=True):
            await self.limiter.release(lease)

    async def renew(self, lease: Any) -> Any:
        """Call ``renew``; check that a renewed lease is still the same lease."""
        renewed = await self.limiter.renew(lease)
        if renewed is not None and (
            getattr(renewed, "lease_id", None) != lease.lease_id
            or getattr(renewed, "workload", None) != lease.workload
        ):
            self.harness.fail(
                f"renew({lease.lease_id!r}) returned {renewed!r}: a renewed lease keeps its "
                "lease_id and workload"
            )
        return renewed

    def lease(self, lease_id: str, workload: str = "default") -> Lease:
        """A lease object for ``lease_id``, as a caller holding only the id would build."""
        return Lease(lease_id=lease_id, workload=workload, expires_at=0.0)


class Probe:
    """One ``acquire`` running in its own task, observed by a case."""

    def __init__(
        self, subject: Subject, workload: str, label: str, deadline: float | None, tokens: int
    ) -> None:
        self.subject = subject
        self.workload = workload
        self.label = label
        self.deadline = deadline
        self.tokens = tokens
        # The grant happened between these two times (anyio.current_time()): when acquire
        # was called, and when it returned the lease.
        self.sent: float | None = None
        self.seen: float | None = None
        self.lease: Any = None
        self.error: Exception | None = None  # what acquire raised
        self.cancelled = False
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self._timing = subject.harness.timing

    async def _run(self, gate: anyio.Event | None) -> None:
        try:
            if gate is not None:
                await gate.wait()
            with self.scope:
                request = AcquireRequest(
                    workload=self.workload,
                    request_id=f"conformance-{self.label}",
                    deadline=self.deadline,
                    tokens=self.tokens,
                )
                # Arrival at the limiter is the call: no await between this and it.
                self.subject.arrivals.append(self.label)
                self.sent = anyio.current_time()
                lease = await self.subject.limiter.acquire(request)
                # No await between acquire returning and the lease being counted.
                self.seen = anyio.current_time()
                self.subject.hold(lease, self.workload, label=self.label)
                self.lease = lease
            self.cancelled = self.scope.cancelled_caught
        except ConformanceFailure:
            # A grant beyond the limits: fail the case with it at once, whatever the case
            # was waiting for (the probes' task group cancels the case's body).
            raise
        except Exception as exc:  # judged by the case: some errors are the duty
            self.error = exc
        finally:
            self.done.set()

    def cancel(self) -> None:
        """Cancel the acquire (wherever it is)."""
        self.scope.cancel()

    async def granted(self, what: str, *, within: float | None = None) -> None:
        """Fail unless the probe gets a slot in time."""
        within = self._timing.within if within is None else within
        with anyio.move_on_after(within):
            await self.done.wait()
        if self.lease is None:
            if self.error is not None:
                self.subject.harness.fail(
                    f"{what}: acquire raised {self.error!r}", cause=self.error
                )
            if self.done.is_set():
                self.subject.harness.fail(f"{what}: acquire ended without a lease")
            self.subject.harness.fail(f"{what} (no slot within {within:g}s)")

    async def waits(self, what: str) -> None:
        """Fail if the probe gets a slot (or an error) during a quiet window."""
        with anyio.move_on_after(self._timing.quiet):
            await self.done.wait()
        if self.lease is not None:
            self.subject.harness.fail(what)
        if self.error is not None:
            self.subject.harness.fail(
                f"{what}: acquire raised {self.error!r} instead of waiting", cause=self.error
            )

    async def ends(self, what: str, *, within: float | None = None) -> None:
        """Fail unless the probe's task ends in time (granted, failed or cancelled)."""
        within = self._timing.within if within is None else within
        with anyio.move_on_after(within):
            await self.done.wait()
            return
        self.subject.harness.fail(f"{what} (acquire still running after {within:g}s)")

    async def release(self) -> None:
        """Release the probe's lease (idempotent here: the lease is dropped once)."""
        lease, self.lease = self.lease, None
        if lease is not None:
            await self.subject.release(lease)

    def abandon(self) -> Any:
        """Walk away from the lease without releasing or renewing it; return it."""
        lease, self.lease = self.lease, None
        if lease is not None:
            self.subject.forget(lease)
        return lease

    def __repr__(self) -> str:
        state = "granted" if self.lease else "failed" if self.error else "waiting"
        return f"<probe {self.label} {state}>"
