"""The floor: the least any limiter with slotwise's contract can cost, measured beside anyio.

``python -m benchmarks.floor [--tiny] [--backend asyncio|trio|all]``

Two targets compare ``MemoryLimiter`` with ``anyio.CapacityLimiter``: an uncontended
``async with`` cycle in at most anyio's time, and a contended hand-off (N waiters behind a
full limit of 8) at least as many grants per second as anyio. Whether a target can be met at
all depends on what every slot must do. `FloorLimiter` answers that: it is anyio's own
algorithm (an ordered dict of waiters, first come first served; a release hands its slot
directly to the head of the queue and wakes it; a free slot yields once) fused with the
duties that slotwise's contract imposes on every slot, each written in the cheapest form we
know, and nothing else. If the floor misses a target, no implementation that keeps those
duties meets it; and the floor with each duty removed in turn (the ablation) shows what each
one costs.

The duties, and why each is part of the contract:

``lock``
    One limiter serves every thread and every event loop (asyncio in one thread, trio in
    another, plain threads through ``sync_slot()``). So its state is read and written under a
    ``threading.Lock``; each slot finds the caller's event loop (a limiter cannot pick its
    backend once, at construction, as anyio does); and waking a waiter checks which thread
    it runs in, going through ``call_soon_threadsafe`` or the trio token when the release
    happens in another.
``lease``
    Each grant is a lease with an id, a workload, an expiry and a tether (a weak reference to
    the slot). A slot whose holder dies (a task garbage collected mid-body, a loop that
    stops) is reclaimed when its lease expires, instead of being lost for good; lease ids
    are what events and the Postgres limiter speak of. Without this duty the
    floor keeps a plain count of borrowers, as anyio does.
``slot``
    ``async with limiter.slot() as slot`` yields a `Slot` that carries the workload and the
    run it belongs to (the lineage, read from a context variable), for events, errors and
    child runs. Without this duty the floor yields None, as anyio does.
``guard``
    The nested-slot guard: a task that holds a slot of a limiter and asks it for another can
    deadlock a small limiter (a tool started inside a slot that starts a child run waits for
    the slot its own parent holds), so entering checks the slots this task holds (a context
    variable) and refuses.
``workloads``
    Slots are counted per workload, each against its own ceiling, instead of in one global
    count.
``cancel-check``
    A waiter granted a slot may be cancelled between the grant and its resumption; a
    cancellation that arrives before the body runs wins, and the slot goes to the next
    waiter. After a wake-up the waiter looks: at anyio's cancel scopes on asyncio (anyio does
    not deliver a scope's cancellation to a task whose wait has just ended; a native
    ``task.cancel()`` reaches it anyway), ``trio.lowlevel.checkpoint_if_cancelled()`` on
    trio.

What the floor leaves out, all of which ``MemoryLimiter`` also does, so that the floor is a
lower bound and not a rival implementation: events and their subscribers; priorities and
reservations between workloads (the floor serves one queue, strictly first come first
served, where a head whose workload is full holds back the rest); rate limits (requests and
tokens per minute); adaptive limits; the clock watch that wakes waiters at deadlines and
lease expiries (the floor only looks at the earliest expiry when a request arrives); waits
with a deadline or ``max_wait``; a full queue's refusal; virtual clocks (trio's
``MockClock``; the floor reads ``time.monotonic()``); slots entered and left by async
generators in other tasks, contexts or threads; and the validation of arguments.

The measurement (`run`, and ``python -m benchmarks.floor``) times anyio's limiter, slotwise's,
the floor and the floor without each duty exactly as ``python -m benchmarks`` times its
uncontended and hand-off sections (the same harness, waiters and clock), with one
difference: the peers take turns within each repetition, so that a drift of the machine
hits them all alike, and each keeps its best. Every ratio is the peer's figure over
anyio's: time for the cycle (lower is better), grants per second for the hand-off (higher
is better).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import os
import platform
import secrets
import sys
import textwrap
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Iterable, Sequence
from contextvars import ContextVar, Token
from functools import partial
from types import FunctionType, TracebackType
from typing import Any

import anyio
import attrs
import sniffio
import trio

from . import handoff, uncontended
from ._harness import (
    ANYIO,
    FULL,
    SLOTWISE,
    TINY,
    Peer,
    Row,
    Size,
    cpu_model,
    peers_for,
)
from ._harness import (
    format_table as _format_table,
)
from .handoff import LIMIT

__all__ = (
    "ALL",
    "DEFAULT_WORKLOAD",
    "DUTIES",
    "FLOOR",
    "FloorLimiter",
    "Lease",
    "Slot",
    "floor_peers",
    "format_table",
    "handoff_sizes",
    "main",
    "run",
    "verdicts",
)

DUTIES = ("lock", "lease", "slot", "guard", "workloads", "cancel-check")
ALL = frozenset(DUTIES)
DEFAULT_WORKLOAD = "default"
LEASE_TTL = 30.0  # seconds, MemoryLimiter's default lease_ttl

FLOOR = "floor"  # the peer with every duty; "floor - <duty>" without one

# duty "slot": the run a request belongs to (its lineage), set by whoever starts the run.
_current_run: ContextVar[object | None] = ContextVar("floor_run", default=None)
# duty "guard": the slots this task holds, innermost last.
_holding: ContextVar[tuple[Slot, ...]] = ContextVar("floor_holding", default=())

_ident = threading.get_ident
_monotonic = time.monotonic
_get_running_loop = asyncio._get_running_loop  # None outside a running loop; no exception
_sniffio = sniffio.thread_local  # trio names itself here while it runs a task


def _anyio_task_states() -> dict[Any, Any] | None:
    """anyio's cancel scope state of each asyncio task: the dict inside its
    WeakKeyDictionary (keyed by weak references to the tasks, looked up without the
    mapping's own Python-level get()), or None if anyio's internals moved: the cancellation
    check then calls anyio's public function."""
    try:
        from anyio._backends._asyncio import _task_states
    except Exception:
        return None
    if not isinstance(_task_states, weakref.WeakKeyDictionary):
        return None
    data: dict[Any, Any] = vars(_task_states)["data"]  # not in typeshed's stubs
    return data


_task_states = _anyio_task_states()
_ref = weakref.ref

# asyncio.current_task() is C from Python 3.12; on 3.11 it is a Python function that looks the
# running loop up in this dict, which the cancellation check reads directly (no frame).
_current_tasks: dict[Any, asyncio.Task[Any]] | None = (
    getattr(asyncio.tasks, "_current_tasks", None)
    if isinstance(asyncio.current_task, FunctionType)
    else None
)


class Lease:
    """duty "lease": one grant, tethered to the slot that holds it."""

    __slots__ = ("expires_at", "lease_id", "tether", "workload")

    def __init__(
        self, lease_id: str, workload: str, expires_at: float, tether: weakref.ref[Slot]
    ) -> None:
        self.lease_id = lease_id
        self.workload = workload
        self.expires_at = expires_at
        self.tether = tether


class FloorLimiter:
    """anyio's CapacityLimiter algorithm with the ``duties`` of slotwise's contract.

    ``async with limiter.slot() as slot``: ``slot`` is the `Slot` with the "slot" duty, else
    None. Usable on asyncio and on trio; without the "lock" duty, only on the event loop
    (asyncio or trio) that runs where it is constructed, as anyio's limiter.
    """

    __slots__ = (
        "_active",
        "_cancel_check",
        "_ceilings",
        "_counts",
        "_expiries",
        "_guard",
        "_kind",
        "_lease",
        "_leases",
        "_limit",
        "_lock",
        "_prefix",
        "_queue",
        "_seq",
        "_slot",
        "_ttl",
        "_workloads",
        "duties",
    )

    def __init__(
        self, limit: int, duties: Iterable[str] = ALL, *, lease_ttl: float = LEASE_TTL
    ) -> None:
        self.duties = frozenset(duties)
        unknown = self.duties - ALL
        if unknown:
            raise ValueError(f"unknown duties {sorted(unknown)}; known: {', '.join(DUTIES)}")
        self._limit = limit
        # anyio's queue: every waiter, in arrival order (the values are unused).
        self._queue: OrderedDict[Slot, None] = OrderedDict()
        self._active = 0  # slots held, without the "workloads" duty

        # duty "lock": one lock for every thread; the backend is found per slot (None).
        # Without it the backend is found once, here, as anyio does.
        self._lock = threading.Lock() if "lock" in self.duties else None
        self._kind: type[Slot] | None = None if self._lock is not None else _slot_kind()

        # duty "lease": the live leases by id, and their expiries in a heap.
        self._lease = "lease" in self.duties
        self._leases: dict[str, Lease] = {}
        self._expiries: list[tuple[float, str]] = []
        self._seq = itertools.count(1)
        self._prefix = secrets.token_hex(6)
        self._ttl = lease_ttl

        # duty "slot"
        self._slot = "slot" in self.duties

        # duty "guard"
        self._guard = "guard" in self.duties

        # duty "workloads": slots held per workload, each against its ceiling.
        self._workloads = "workloads" in self.duties
        self._counts = {DEFAULT_WORKLOAD: 0}
        self._ceilings = {DEFAULT_WORKLOAD: limit}

        # duty "cancel-check"
        self._cancel_check = "cancel-check" in self.duties

    def slot(self, workload: str = DEFAULT_WORKLOAD) -> Slot:
        """One request for a slot, entered with ``async with``."""
        kind = self._kind
        if kind is None:
            # duty "lock": whichever loop runs here, found once per slot (_slot_kind()
            # without its look for asyncio's loop: asyncio's own calls fail without one).
            kind = _TrioSlot if _sniffio.name == "trio" else _AsyncioSlot
        return kind(self, workload)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return len(self._queue)

    @property
    def active(self) -> int:
        """Slots held."""
        return sum(self._counts.values()) if self._workloads else self._active

    # -- the state, read and written under the lock (with the "lock" duty) --------------------

    def _has_room(self, workload: str) -> bool:
        if self._workloads:  # duty "workloads"
            return self._counts[workload] < self._ceilings[workload]
        return self._active < self._limit

    def _grant(self, slot: Slot, now: float) -> None:
        workload = slot.workload
        if self._workloads:  # duty "workloads"
            self._counts[workload] += 1
        else:
            self._active += 1
        slot._granted = True
        if self._lease:  # duty "lease"
            lease_id = f"{self._prefix}-{next(self._seq)}"
            expires_at = now + self._ttl
            self._leases[lease_id] = Lease(lease_id, workload, expires_at, weakref.ref(slot))
            heapq.heappush(self._expiries, (expires_at, lease_id))
            slot._lease_id = lease_id

    def _release(self, slot: Slot) -> Slot | None:
        """Give ``slot``'s grant back (once); return the waiter it was handed to, to wake."""
        if not slot._granted:
            return None
        slot._granted = False
        now = 0.0
        if self._lease:  # duty "lease"
            if self._leases.pop(slot._lease_id, None) is None:
                return None  # expired and reclaimed already
            expiries = self._expiries
            if len(expiries) > 2 * len(self._leases) + 64:
                # Stale entries (released leases) outnumber live ones: rebuild the heap.
                self._expiries = [(lease.expires_at, lid) for lid, lease in self._leases.items()]
                heapq.heapify(self._expiries)
            now = _monotonic()
        if self._workloads:  # duty "workloads"
            self._counts[slot.workload] -= 1
        else:
            self._active -= 1
        # anyio's hand-off: the slot goes straight to the head of the queue.
        queue = self._queue
        if queue:
            head, _ = queue.popitem(last=False)
            if (
                self._counts[head.workload] < self._ceilings[head.workload]
                if self._workloads  # duty "workloads"
                else self._active < self._limit
            ):
                self._grant(head, now)
                return head
            queue[head] = None  # its workload is full: it stays first in line
            queue.move_to_end(head, last=False)
        return None

    def _sweep(self, now: float) -> list[Slot]:
        """duty "lease": reclaim the slots of leases that expired with their holder gone;
        a lease whose slot is still held lives on. Returns the waiters granted."""
        expiries = self._expiries
        reclaimed = 0
        while expiries and expiries[0][0] <= now:
            _, lease_id = heapq.heappop(expiries)
            lease = self._leases.get(lease_id)
            if lease is None or lease.expires_at > now:
                continue  # released, or renewed
            holder = lease.tether()
            if holder is not None and holder._granted:
                lease.expires_at = now + self._ttl  # held: the tether keeps it alive
                heapq.heappush(expiries, (lease.expires_at, lease_id))
                continue
            del self._leases[lease_id]
            if self._workloads:
                self._counts[lease.workload] -= 1
            else:
                self._active -= 1
            reclaimed += 1
        granted = []
        queue = self._queue
        while queue and reclaimed:
            head = next(iter(queue))
            if not self._has_room(head.workload):
                break
            del queue[head]
            self._grant(head, now)
            granted.append(head)
        return granted


class Slot:
    """One request: the async context manager that ``slot()`` returns and, with the "slot"
    duty, the slot it yields (a separate object would cost one more allocation)."""

    __slots__ = (
        "__weakref__",  # duty "lease": the tether
        "_granted",
        "_lease_id",
        "_limiter",
        "_thread",
        "_token",
        "run",
        "workload",
    )

    run: object  # duty "slot": the run the request belongs to
    _lease_id: str  # duty "lease"
    _thread: int  # duty "lock": the thread the waiter runs in
    _token: Token[tuple[Slot, ...]]  # duty "guard"

    def __init__(self, limiter: FloorLimiter, workload: str) -> None:
        self._limiter = limiter
        self.workload = workload
        self._granted = False

    # The backend's part, in the subclasses.

    @staticmethod
    def _turn() -> Awaitable[None]:
        """Yield to the loop once (a checkpoint)."""
        raise NotImplementedError

    def _prepare(self) -> None:
        """Get ready to park, under the limiter's lock (the grant may come before parking)."""
        raise NotImplementedError

    def _park(self) -> Awaitable[None]:
        """Wait until woken; a cancellation of the task raises."""
        raise NotImplementedError

    def _wake(self) -> None:
        """Wake the parked waiter, from any thread."""
        raise NotImplementedError

    def _cancelled_check(self) -> Awaitable[None] | None:
        """An awaitable that raises if the task was cancelled meanwhile, or None when it
        certainly was not."""
        raise NotImplementedError

    async def __aenter__(self) -> Slot | None:
        limiter = self._limiter
        if limiter._guard:  # duty "guard"
            held = _holding.get()
            if held and any(other._limiter is limiter for other in held):
                raise RuntimeError(
                    "this task already holds a slot of this limiter; taking another inside "
                    "it can deadlock"
                )
        if limiter._slot:  # duty "slot": the lineage
            self.run = _current_run.get()
        lock = limiter._lock
        if lock is not None:  # duty "lock"
            lock.acquire()
        try:
            now = 0.0
            swept: list[Slot] | None = None
            if limiter._lease:  # duty "lease": a due expiry is swept first
                now = _monotonic()
                expiries = limiter._expiries
                if expiries and expiries[0][0] <= now:
                    swept = limiter._sweep(now)
            if not limiter._queue and (
                limiter._counts[self.workload] < limiter._ceilings[self.workload]
                if limiter._workloads  # duty "workloads"
                else limiter._active < limiter._limit
            ):
                limiter._grant(self, now)
                parked = False
            else:
                self._prepare()
                limiter._queue[self] = None
                parked = True
        finally:
            if lock is not None:
                lock.release()
        if swept:
            for other in swept:
                other._wake()
        try:
            if parked:
                await self._park()
                if limiter._cancel_check:  # duty "cancel-check": a cancellation wins
                    check = self._cancelled_check()
                    if check is not None:
                        await check
            else:
                await self._turn()  # a free slot yields once, as anyio's does
        except BaseException:
            self._leave()
            raise
        if limiter._guard:  # duty "guard"
            self._token = _holding.set((*held, self))
        return self if limiter._slot else None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        limiter = self._limiter
        if limiter._guard:  # duty "guard"
            _holding.reset(self._token)
        lock = limiter._lock
        if lock is None:
            woken = limiter._release(self)
        else:  # duty "lock" (not `with`, which costs twice as much on CPython 3.11)
            lock.acquire()
            try:
                woken = limiter._release(self)
            finally:
                lock.release()
        if woken is not None:
            woken._wake()

    def _leave(self) -> None:
        """Cancelled while waiting or as the slot was granted: withdraw, or give it back."""
        limiter = self._limiter
        lock = limiter._lock
        if lock is not None:  # duty "lock"
            lock.acquire()
        try:
            if self._granted:
                woken = limiter._release(self)
            else:
                limiter._queue.pop(self, None)
                woken = None
        finally:
            if lock is not None:
                lock.release()
        if woken is not None:
            woken._wake()


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _AsyncioSlot(Slot):
    """A waiter is a bare future (anyio's asyncio.Event without its set of futures)."""

    __slots__ = ("_future",)

    _turn = staticmethod(partial(asyncio.sleep, 0))

    def _prepare(self) -> None:
        self._future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._limiter._lock is not None:  # duty "lock"
            self._thread = _ident()

    def _park(self) -> Awaitable[None]:
        return self._future

    def _wake(self) -> None:
        future = self._future
        if self._limiter._lock is not None and self._thread != _ident():  # duty "lock"
            with contextlib.suppress(RuntimeError):  # its loop is closed, its waiter with it
                future.get_loop().call_soon_threadsafe(_set_result, future)
        elif not future.done():
            future.set_result(None)

    def _cancelled_check(self) -> Awaitable[None] | None:
        # duty "cancel-check": a cancelled anyio cancel scope around the task. anyio delivers
        # a scope's cancellation with task.cancel() only to a task whose wait has not ended,
        # so a task woken with its grant would run its body: it looks, and yields once if
        # cancelled (anyio then delivers it). A native task.cancel() needs no look: with
        # the future it awaits done, the task raises CancelledError as it resumes.
        if _current_tasks is not None:
            task = _current_tasks.get(_get_running_loop())
        else:
            task = asyncio.current_task()
        if task is None:
            return None
        if _task_states is None:
            return anyio.lowlevel.checkpoint_if_cancelled()
        state = _task_states.get(_ref(task))
        scope = None if state is None else state.cancel_scope
        while scope is not None:
            if scope.cancel_called:
                return asyncio.sleep(0)
            if scope.shield:
                return None
            scope = scope._parent_scope
        return None


class _TrioSlot(Slot):
    """A waiter parks with trio.lowlevel.wait_task_rescheduled (trio.Event without its
    ParkingLot)."""

    __slots__ = ("_set", "_task", "_trio_token")

    _turn = staticmethod(trio.lowlevel.checkpoint)

    def _prepare(self) -> None:
        self._set = False
        self._task: Any = None
        if self._limiter._lock is not None:  # duty "lock"
            self._thread = _ident()
            self._trio_token = trio.lowlevel.current_trio_token()

    # The awaitables below are returned, not awaited: the caller awaits them, with no
    # coroutine frame of ours around them.

    def _park(self) -> Awaitable[None]:
        if self._set:  # granted already
            return trio.lowlevel.checkpoint()  # noqa: ASYNC105
        self._task = trio.lowlevel.current_task()
        return trio.lowlevel.wait_task_rescheduled(self._abort)  # noqa: ASYNC105

    def _abort(self, _: Any) -> trio.lowlevel.Abort:
        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _wake(self) -> None:
        if self._limiter._lock is not None and self._thread != _ident():  # duty "lock"
            with contextlib.suppress(trio.RunFinishedError):  # its run ended, its waiter with it
                self._trio_token.run_sync_soon(self._wake_here)
        else:
            self._wake_here()

    def _wake_here(self) -> None:
        if self._set:
            return
        self._set = True
        task = self._task
        if task is not None:
            self._task = None
            trio.lowlevel.reschedule(task)

    def _cancelled_check(self) -> Awaitable[None] | None:
        return trio.lowlevel.checkpoint_if_cancelled()  # noqa: ASYNC105 (duty "cancel-check")


def _slot_kind() -> type[Slot]:
    """The `Slot` class of the event loop that runs here: trio names itself in sniffio's
    thread-local while it runs a task; else asyncio's running loop (sniffio's own lookup,
    without its asyncio.current_task() call)."""
    if _sniffio.name == "trio":
        return _TrioSlot
    if _get_running_loop() is not None:
        return _AsyncioSlot
    raise RuntimeError("FloorLimiter needs a running asyncio or trio event loop")


# -- the measurement ----------------------------------------------------------------------------

UNCONTENDED = uncontended.SECTION
HANDOFF = handoff.SECTION


def _floor_peer(name: str, duties: frozenset[str]) -> Peer:
    async def waiting(limiter: FloorLimiter) -> int:
        return limiter.waiting

    return Peer(
        name=name,
        make=lambda limit: FloorLimiter(limit, duties),
        enter=lambda limiter: limiter.slot,
        waiting=waiting,
    )


def floor_peers(backend: str) -> list[Peer]:
    """anyio's limiter, slotwise's, the floor, and the floor without each duty in turn."""
    theirs = {peer.name: peer for peer in peers_for(backend)}
    return [
        theirs[ANYIO],
        theirs[SLOTWISE],
        _floor_peer(FLOOR, ALL),
        *(_floor_peer(f"{FLOOR} - {duty}", ALL - {duty}) for duty in DUTIES),
    ]


def handoff_sizes(size: Size) -> tuple[int, ...]:
    """N for the hand-off: 1,000 and 10,000 at full size; a tiny run's own sizes."""
    return tuple(n for n in size.handoff if 1_000 <= n <= 10_000) or size.handoff


async def _measure(backend: str, size: Size) -> list[Row]:
    # Timed exactly as benchmarks.uncontended and benchmarks.handoff time their sections.
    peers = floor_peers(backend)
    rows = await uncontended.measure(peers, backend, size)
    return rows + await handoff.measure(peers, backend, size, handoff_sizes(size))


def _with_ratios(rows: list[Row]) -> list[Row]:
    """Each row's figure divided by anyio's in its group: time for the cycle (lower is
    better), grants per second for the hand-off (higher is better)."""
    anyio_rows = {row.group: row for row in rows if row.peer == ANYIO}
    return [attrs.evolve(row, ratio=row.value / anyio_rows[row.group].value) for row in rows]


def run(size: Size, backends: Sequence[str]) -> list[Row]:
    """The uncontended cycle and the hand-off, for anyio, slotwise, the floor and the floor
    without each duty, on each of ``backends``; each row's ratio is against anyio's."""
    rows: list[Row] = []
    for backend in backends:
        rows += _with_ratios(anyio.run(_measure, backend, size, backend=backend))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """The rows as an aligned text table, each ratio against anyio's."""
    return _format_table(rows, ratio="peer / anyio", sections=True)


def _meets(section: str, ratios: Sequence[float]) -> bool:
    if section == UNCONTENDED:
        return max(ratios) <= 1.0
    return min(ratios) >= 1.0


def _ratios(rows: Sequence[Row], peer: str) -> list[tuple[int, float]]:
    return [(row.n, row.ratio) for row in rows if row.peer == peer and row.ratio is not None]


def _shown(section: str, ratios: Sequence[tuple[int, float]]) -> str:
    if section == UNCONTENDED:
        return f"{ratios[0][1]:.2f}x"
    return ", ".join(f"{ratio:.2f}x at {n:,}" for n, ratio in ratios)


def verdicts(rows: Sequence[Row]) -> list[str]:
    """Per backend and section: whether the floor meets the target, and which single duty
    removed would make it meet it."""
    out = []
    for backend in dict.fromkeys(row.backend for row in rows):
        for section in (UNCONTENDED, HANDOFF):
            here = [row for row in rows if (row.backend, row.section) == (backend, section)]
            if not here:
                continue
            target = (
                "cycle <= 1.0x anyio's time"
                if section == UNCONTENDED
                else "hand-off >= 1.0x anyio's grants/s at every N"
            )
            floor = _ratios(here, FLOOR)
            met = _meets(section, [ratio for _, ratio in floor])
            enough = []
            for duty in DUTIES:
                without = _ratios(here, f"{FLOOR} - {duty}")
                if _meets(section, [ratio for _, ratio in without]):
                    enough.append(f"{duty} ({_shown(section, without)})")
            if met:
                removals = "met with every duty"
            elif enough:
                removals = "removing one duty would meet it: " + ", ".join(enough)
            else:
                removals = "no single duty removed meets it"
            out.append(
                f"{'MET   ' if met else 'MISSED'}  [{backend}] {section}: {target}; the floor "
                f"with every duty: {_shown(section, floor)}; {removals}"
            )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the floor beside anyio and slotwise, and print the table and the verdicts."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.floor",
        description="The floor (anyio's algorithm plus the duties of slotwise's contract, "
        "in the cheapest form) and its ablation, beside anyio.CapacityLimiter and "
        "slotwise.MemoryLimiter.",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--backend", choices=["asyncio", "trio", "all"], default="all")
    args = parser.parse_args(argv)
    size = TINY if args.tiny else FULL
    backends = ["asyncio", "trio"] if args.backend == "all" else [args.backend]

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"slotwise floor benchmark: Python {platform.python_version()} on {cpu_model()}, "
        f"{os.cpu_count()} CPUs, load average {load:.2f}"
    )
    print(
        "command: python -m benchmarks.floor "
        f"{' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()
        + f"  (best of {size.repeats}+ repetitions, peers interleaved; process CPU time; "
        "garbage collector off while timing)"
    )
    legend = (
        f"{FLOOR}: anyio's algorithm with every duty ({', '.join(DUTIES)}); "
        f"'{FLOOR} - X': without duty X. Uncontended: us per `async with` cycle, limit "
        f"{LIMIT}, never full (lower is better). Hand-off: N waiters behind a full limit of "
        f"{LIMIT} (higher grants/s is better). peer / anyio: the figure over anyio's."
    )
    print("\n" + textwrap.fill(legend, width=88, break_on_hyphens=False) + "\n")
    started = time.perf_counter()
    rows = run(size, backends)
    print(format_table(rows))
    print("\n## targets (ratios measured in this run)\n")
    for line in verdicts(rows):
        print(line)
    print(f"\ntotal time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
