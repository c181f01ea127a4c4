"""``conformance_cases``: the cases, bound to a user's limiter factory."""

from __future__ import annotations

import sys
import unittest
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn, final

import anyio

from ._cases import CASES, CaseSpec
from ._harness import BlockStorage, ConformanceFailure, Harness, Timing

__all__ = ("CAPABILITIES", "ConformanceCase", "conformance_cases")

CAPABILITIES: Mapping[str, str] = {
    "workloads": "several named workloads in one limiter (ceilings, the longest-wait "
    "tie-break, workload validation); implied by 'priority' and 'reservations'",
    "priority": "Workload(priority=...)",
    "reservations": "Workload(reserved=...)",
    "max_queued": "max_queued: a full queue fails at once",
    "max_wait": "Workload(max_wait=...), for a single workload named 'default' too",
    "deadline": "AcquireRequest.deadline: a request stops waiting at its run's deadline",
    "stats": "await limiter.stats()",
    "workload_max_queued": "Workload(max_queued=...): a bound on one workload's queue; "
    "declared with supports=",
    "rates": "rate=Rate(...) on the limiter and its workloads (token buckets), "
    "AcquireRequest.tokens charged at grant, and charge_tokens(lease, tokens) for "
    "Slot.used_tokens(); declared with supports=",
    "pushback": "throttle(lease, retry_after) for Slot.throttled(), and "
    "await set_limits(...); declared with supports=",
}
"""The capabilities a case may need, by name, and what each covers. A limiter has the first
ones unless it names them in ``skip``; it has ``workload_max_queued``, ``rates`` and
``pushback`` only when it names them in ``supports``. Every other duty (atomic allocation,
expiring leases, idempotent renew and release, renew returning None, unique lease ids, safe
cancellation, arrival order, invalid limits) is required."""

# Capabilities added after the first cases: a limiter written before them has none of them,
# so the cases that need them run only when it declares them.
_DECLARED_ONLY = frozenset({"workload_max_queued", "rates", "pushback"})

_BLOCK_STORAGE = "block_storage"  # needed by a case: given as conformance_cases(block_storage=)


def _skip(reason: str) -> NoReturn:
    # pytest is not a dependency of slotwise: use it when it runs the case, else unittest's
    # SkipTest, which pytest also reports as a skip.
    pytest = sys.modules.get("pytest")
    if pytest is None:
        raise unittest.SkipTest(reason)
    try:  # report the user's test as the skip's location, as a skip marker does
        skipped = pytest.skip.Exception(reason, _use_item_location=True)
    except TypeError:
        skipped = pytest.skip.Exception(reason)
    raise skipped


def _why(capability: str, reasons: Mapping[str, str]) -> str:
    if reasons.get(capability):
        return f" ({reasons[capability]})"
    if capability in _DECLARED_ONLY:
        return f" (declare it with conformance_cases(supports=[{capability!r}]))"
    return ""


def _first_failure(group: ExceptionGroup[Exception]) -> Exception:
    """The group's first ConformanceFailure, else its first exception."""
    leaves = []
    for exc in group.exceptions:
        leaf = _first_failure(exc) if isinstance(exc, ExceptionGroup) else exc
        if isinstance(leaf, ConformanceFailure):
            return leaf
        leaves.append(leaf)
    return leaves[0]


@final
class ConformanceCase:
    """One duty of a limiter, bound to the factory that builds the limiters to test.

    Cases come from ``conformance_cases()``; run one with ``await case.run()``.
    """

    __slots__ = ("_block_storage", "_create", "_skip_reason", "_spec", "_supported", "_timing")

    _spec: CaseSpec
    _create: Callable[..., Any]
    _timing: Timing
    _supported: frozenset[str]
    _skip_reason: str | None
    _block_storage: BlockStorage | None

    def __init__(self) -> None:
        raise TypeError("conformance cases come from slotwise.conformance.conformance_cases()")

    @classmethod
    def _bind(
        cls,
        spec: CaseSpec,
        create_limiter: Callable[..., Any],
        *,
        timing: Timing,
        supported: frozenset[str],
        skip_reason: str | None,
        block_storage: BlockStorage | None,
    ) -> ConformanceCase:
        case = cls.__new__(cls)
        case._spec = spec
        case._create = create_limiter
        case._timing = timing
        case._supported = supported
        case._skip_reason = skip_reason
        case._block_storage = block_storage
        return case

    @property
    def name(self) -> str:
        """A short identifier, such as ``"atomic_allocation"``: use it as the test id."""
        return self._spec.name

    @property
    def duty(self) -> str:
        """The duty in words; a failure's message starts with it."""
        return self._spec.duty

    @property
    def requires(self) -> frozenset[str]:
        """The capabilities (names in ``CAPABILITIES``) the case needs, and
        ``"block_storage"`` when it needs that argument of ``conformance_cases``."""
        return self._spec.requires

    @property
    def skip_reason(self) -> str | None:
        """Why the case is skipped (the limiter lacks a capability it needs), or None."""
        return self._skip_reason

    async def run(self) -> None:
        """Run the case: build limiters with the factory, probe them, close them.

        A case the limiter declared it cannot pass (see ``skip_reason``) calls
        ``pytest.skip`` with the reason (raises ``unittest.SkipTest`` outside pytest).

        Raises:
            ConformanceFailure: the limiter broke the duty (an ``AssertionError`` whose
                message starts with the duty).
        """
        if self.skip_reason is not None:
            _skip(f"{self.name}: {self.skip_reason}")
        outcome: Exception | None = None
        try:
            with anyio.move_on_after(self._timing.budget) as budget:
                outcome = await self._probe()
        except Exception as exc:  # closing a limiter failed
            outcome = exc
        if outcome is not None:
            failure = _first_failure(outcome) if isinstance(outcome, ExceptionGroup) else outcome
            if isinstance(failure, ConformanceFailure):
                raise failure from failure.__cause__  # keep its cause, drop the group
            raise ConformanceFailure(f"{self.duty}: the limiter raised {failure!r}") from failure
        if budget.cancelled_caught:
            raise ConformanceFailure(
                f"{self.duty}: the case did not finish within {self._timing.budget:g}s"
            )

    async def _probe(self) -> Exception | None:
        # Each limiter is opened and closed by an owner task of its own, so a factory's
        # context manager (which may hold a task group or a cancel scope) is entered and
        # exited in one task, and closes only after the probes using it have ended.
        closing = anyio.Event()
        outcome: Exception | None = None
        async with anyio.create_task_group() as owners:
            try:
                async with anyio.create_task_group() as probes:
                    harness = Harness(
                        duty=self.duty,
                        case=self.name,
                        create_limiter=self._create,
                        timing=self._timing,
                        supported=self._supported,
                        owners=owners,
                        closing=closing,
                        task_group=probes,
                        block_storage=self._block_storage,
                    )
                    await self._spec.body(harness)
                    # Probes still waiting (a bug already reported, or a case that ends
                    # with requests queued) are cancelled before the limiters close.
                    probes.cancel_scope.cancel()
            except Exception as exc:  # a failure: report it once the limiters are closed
                outcome = exc
            finally:
                closing.set()
        return outcome

    def __repr__(self) -> str:
        state = f" skipped: {self.skip_reason}" if self.skip_reason else ""
        return f"<slotwise.conformance.ConformanceCase {self.name!r}{state}>"


def conformance_cases(
    create_limiter: Callable[..., Any],
    *,
    skip: Iterable[str] | Mapping[str, str] = (),
    supports: Iterable[str] = (),
    time_scale: float = 1.0,
    block_storage: BlockStorage | None = None,
) -> list[ConformanceCase]:
    """The conformance suite: one case per duty of a limiter, to run under pytest.

    Args:
        create_limiter: Called as ``create_limiter(**limits)`` with the keywords of
            ``slotwise.MemoryLimiter`` (always a fresh ``name``), once or more per
            case. It returns a limiter, an awaitable of one, or an async context manager
            yielding one (entered for the case and exited after it: the place to close
            connections or drop tables). A limiter that is itself an async context manager
            is entered the same way.
        skip: Capabilities the limiter lacks (names in ``CAPABILITIES``), or a
            mapping from each to the reason. The cases that need them are reported as
            skipped, with the reason; the required duties cannot be skipped.
        supports: The capabilities a limiter has only when it says so:
            ``"workload_max_queued"``, ``"rates"`` and ``"pushback"`` (see
            ``CAPABILITIES``). The cases that need one it does not name are skipped.
        time_scale: Multiplies every duration the cases use (lease lifetimes, waiting
            bounds); raise it for a backend that is slow to answer or a busy CI machine.
        block_storage: Called with a limiter under test, it returns an async context
            manager while which that limiter's storage does not answer (another connection
            holds its lock, its server is paused). The ``blocked_storage`` case uses it to
            check that ``acquire`` keeps its deadline and cancellation meanwhile; without
            it, that case is skipped. A limiter whose state lives in its own process has
            no storage to block.

    Returns:
        The cases, each with ``name`` and an async ``run()``.

    Raises:
        ValueError: ``skip`` or ``supports`` names something that is not a capability, or
            both name the same one.

    Example:
        ```python
        @pytest.mark.anyio
        @pytest.mark.parametrize(
            "case", conformance_cases(create_limiter), ids=lambda case: case.name
        )
        async def test_conformance(case):
            await case.run()
        ```
    """
    if isinstance(skip, str):
        skip = (skip,)
    reasons = dict(skip) if isinstance(skip, Mapping) else dict.fromkeys(skip, "")
    unknown = sorted(set(reasons) - set(CAPABILITIES))
    if unknown:
        raise ValueError(
            f"cannot skip {', '.join(map(repr, unknown))}: the capabilities a limiter may "
            f"lack are {', '.join(map(repr, CAPABILITIES))}; every other duty is required"
        )
    declared = {supports} if isinstance(supports, str) else set(supports)
    unknown = sorted(declared - set(CAPABILITIES))
    if unknown:
        raise ValueError(
            f"cannot declare {', '.join(map(repr, unknown))}: the capabilities are "
            f"{', '.join(map(repr, CAPABILITIES))}"
        )
    both = sorted(declared & set(reasons))
    if both:
        raise ValueError(f"{', '.join(map(repr, both))} is both in skip and in supports")
    if not time_scale > 0:
        raise ValueError(f"time_scale must be positive, got {time_scale!r}")
    supported = (frozenset(CAPABILITIES) - _DECLARED_ONLY - set(reasons)) | declared
    timing = Timing.scaled(time_scale)
    cases = []
    for spec in CASES:
        missing = sorted(spec.requires - supported - {_BLOCK_STORAGE})
        skip_reason = None
        if missing:
            skip_reason = "the limiter declares no " + ", ".join(
                f"{name!r} support" + _why(name, reasons) for name in missing
            )
        elif _BLOCK_STORAGE in spec.requires and block_storage is None:
            skip_reason = (
                "no block_storage was given (a way to make the limiter's storage stop "
                "answering for a while)"
            )
        cases.append(
            ConformanceCase._bind(
                spec,
                create_limiter,
                timing=timing,
                supported=supported,
                skip_reason=skip_reason,
                block_storage=block_storage,
            )
        )
    return cases
