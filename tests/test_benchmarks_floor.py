"""The floor benchmark (benchmarks/floor.py): its tiny run measures every row, and its
limiter, with every duty and with each one removed, is a correct limiter on asyncio and trio.

No timing is asserted: the figures of a tiny run mean nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import Iterator

import anyio
import anyio.lowlevel
import pytest

import benchmarks.floor
import benchmarks.handoff
import benchmarks.uncontended
from benchmarks._harness import ANYIO, FULL, SLOTWISE, TINY, Row
from benchmarks.floor import (
    ALL,
    DUTIES,
    FLOOR,
    FloorLimiter,
    Slot,
    format_table,
    handoff_sizes,
    main,
    run,
    verdicts,
)

PEERS = [ANYIO, SLOTWISE, FLOOR, *(f"{FLOOR} - {duty}" for duty in DUTIES)]
VARIANTS = [ALL, *(ALL - {duty} for duty in DUTIES)]
VARIANT_IDS = ["all", *(f"without-{duty}" for duty in DUTIES)]


# -- the measurement ----------------------------------------------------------------------------


@contextlib.contextmanager
def _gc_left_on() -> Iterator[None]:
    yield


@pytest.fixture(autouse=True, scope="module")
def _no_full_collections() -> Iterator[None]:
    """Each timing starts with a full collection (benchmarks._harness.no_gc): over the test
    pytest's heap, seconds in all, for figures that mean nothing at this size."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(benchmarks.uncontended, "no_gc", _gc_left_on)
        patch.setattr(benchmarks.handoff, "no_gc", _gc_left_on)
        yield


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    return run(TINY, ["asyncio", "trio"])


def test_the_tiny_run_measures_every_peer_section_and_size(rows: list[Row]) -> None:
    expected = {
        (backend, section, peer, n)
        for backend in ("asyncio", "trio")
        for section, sizes in (("uncontended", (TINY.cycles,)), ("hand-off", TINY.handoff))
        for n in sizes
        for peer in PEERS
    }
    assert {(row.backend, row.section, row.peer, row.n) for row in rows} == expected
    assert len(rows) == len(expected)
    for row in rows:
        assert row.value > 0, row
        assert row.ratio is not None
        assert row.ratio > 0, row
        if row.peer == ANYIO:
            assert row.ratio == 1.0
        assert row.unit == ("us/cycle" if row.section == "uncontended" else "grants/s")


def test_the_full_run_hands_off_at_a_thousand_and_ten_thousand() -> None:
    assert handoff_sizes(FULL) == (1_000, 10_000)
    assert handoff_sizes(TINY) == TINY.handoff


def test_the_table_and_a_verdict_per_backend_and_section(rows: list[Row]) -> None:
    table = format_table(rows).splitlines()
    assert table[0].split() == [
        "backend",
        "section",
        "peer",
        "N",
        "figure",
        "unit",
        "peer",
        "/",
        "anyio",
    ]
    assert len(table) == len(rows) + 2
    lines = verdicts(rows)
    assert len(lines) == 4
    for line, (backend, section) in zip(
        lines,
        [(b, s) for b in ("asyncio", "trio") for s in ("uncontended", "hand-off")],
        strict=True,
    ):
        assert line.startswith(("MET   ", "MISSED")), line
        assert f"[{backend}] {section}:" in line


def test_the_command_prints_its_header(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tiny", "--backend", "asyncio"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("slotwise floor benchmark: Python ")
    assert "load average" in out.splitlines()[0]
    assert "command: python -m benchmarks.floor --tiny --backend asyncio" in out
    assert "## targets" in out
    assert "[trio]" not in out


# -- the limiter --------------------------------------------------------------------------------

variants = pytest.mark.parametrize("duties", VARIANTS, ids=VARIANT_IDS)


@pytest.mark.anyio
@variants
async def test_never_more_than_the_limit(duties: frozenset[str]) -> None:
    limiter = FloorLimiter(3, duties)
    active = peak = done = 0

    async def request() -> None:
        nonlocal active, peak, done
        async with limiter.slot():
            active += 1
            peak = max(peak, active)
            for _ in range(3):
                await anyio.lowlevel.checkpoint()
            active -= 1
        done += 1

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            for _ in range(50):
                group.start_soon(request)
    assert (peak, done) == (3, 50)
    assert (limiter.active, limiter.waiting) == (0, 0)


async def _all_enter_at_once(limiter: FloorLimiter, count: int) -> None:
    """``count`` tasks hold a slot at the same time (else this times out)."""
    inside = 0
    everyone = anyio.Event()
    leave = anyio.Event()

    async def hold() -> None:
        nonlocal inside
        async with limiter.slot():
            inside += 1
            if inside == count:
                everyone.set()
            await leave.wait()

    with anyio.fail_after(2):
        async with anyio.create_task_group() as group:
            for _ in range(count):
                group.start_soon(hold)
            await everyone.wait()
            leave.set()


@pytest.mark.anyio
@variants
@pytest.mark.parametrize("seed", [1, 2])
async def test_cancelled_waiters_lose_no_slot(duties: frozenset[str], seed: int) -> None:
    """Waiters cancelled while they wait, and others just after their grant (woken, not yet
    resumed): every slot comes back."""
    limit, count = 3, 40
    rng = random.Random(seed)
    limiter = FloorLimiter(limit, duties)
    gate = anyio.Event()
    scopes: dict[int, anyio.CancelScope] = {}
    requests: dict[int, Slot] = {}
    entered: set[int] = set()
    ids = list(range(count))
    rng.shuffle(ids)
    before, after = set(ids[:10]), set(ids[10:20])
    cancelled_after_grant: set[int] = set()
    finished = 0

    def cancel_the_granted() -> None:
        # Right after a release: the waiter it granted is woken but has not resumed.
        for i in after:
            if requests[i]._granted and i not in entered and not scopes[i].cancel_called:
                scopes[i].cancel()
                cancelled_after_grant.add(i)

    async def holder() -> None:
        async with limiter.slot():
            await gate.wait()
        cancel_the_granted()

    async def waiter(i: int) -> None:
        nonlocal finished
        with anyio.CancelScope() as scope:
            scopes[i] = scope
            request = requests[i] = limiter.slot()
            async with request:
                entered.add(i)
                await anyio.lowlevel.checkpoint()
            cancel_the_granted()
        finished += 1

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            for _ in range(limit):
                group.start_soon(holder)
            for _ in range(3):
                await anyio.lowlevel.checkpoint()
            for i in range(count):
                group.start_soon(waiter, i)
            while limiter.waiting < count:
                await anyio.lowlevel.checkpoint()
            for i in before:  # cancelled while they wait
                scopes[i].cancel()
            while limiter.waiting > count - len(before):
                await anyio.lowlevel.checkpoint()
            gate.set()
    assert finished == count
    assert not entered & before
    assert cancelled_after_grant, "no waiter was cancelled between its grant and resuming"
    if "cancel-check" in duties:
        # The cancellation beat the grant: those bodies never ran.
        assert not entered & cancelled_after_grant
    assert (limiter.active, limiter.waiting) == (0, 0)
    await _all_enter_at_once(limiter, limit)
    assert (limiter.active, limiter.waiting) == (0, 0)


@variants
def test_a_native_asyncio_cancel_after_the_grant_wins(duties: frozenset[str]) -> None:
    """task.cancel() between the grant and the waiter's resumption: the waiter raises as it
    resumes (whether or not it looks), and its slot goes on."""

    async def scenario() -> None:
        limiter = FloorLimiter(1, duties)
        gate = asyncio.Event()
        ran: list[str] = []

        async def waiter(name: str) -> None:
            async with limiter.slot():
                ran.append(name)

        async def holder() -> None:
            async with limiter.slot():
                await gate.wait()
            first.cancel()  # granted the slot just now, not resumed yet

        holding = asyncio.create_task(holder())
        await asyncio.sleep(0)
        first = asyncio.create_task(waiter("first"))
        second = asyncio.create_task(waiter("second"))
        for _ in range(3):
            await asyncio.sleep(0)
        assert limiter.waiting == 2
        gate.set()
        await asyncio.wait_for(asyncio.gather(holding, first, second, return_exceptions=True), 5)
        assert first.cancelled()
        assert ran == ["second"]
        assert (limiter.active, limiter.waiting) == (0, 0)

    asyncio.run(scenario())


@pytest.mark.anyio
@variants
async def test_cancelled_at_the_free_slot_yield_gives_it_back(duties: frozenset[str]) -> None:
    limiter = FloorLimiter(2, duties)
    with anyio.CancelScope() as scope:
        scope.cancel()
        async with limiter.slot():
            pytest.fail("the body ran in a cancelled scope")
    assert scope.cancelled_caught
    assert (limiter.active, limiter.waiting) == (0, 0)
    await _all_enter_at_once(limiter, 2)


@pytest.mark.anyio
async def test_the_slot_duty_yields_the_slot() -> None:
    async with FloorLimiter(2).slot() as slot:
        assert isinstance(slot, Slot)
        assert slot.workload == "default"
        assert slot.run is None
    async with FloorLimiter(2, ALL - {"slot"}).slot() as nothing:
        assert nothing is None


@pytest.mark.anyio
async def test_the_guard_refuses_a_nested_slot_of_the_same_limiter() -> None:
    limiter, other = FloorLimiter(2), FloorLimiter(2)
    async with limiter.slot(), other.slot():
        with pytest.raises(RuntimeError, match="already holds a slot"):
            async with limiter.slot():
                pass
    async with limiter.slot():  # released: allowed again
        assert limiter.active == 1
    unguarded = FloorLimiter(2, ALL - {"guard"})
    async with unguarded.slot(), unguarded.slot():
        assert unguarded.active == 2
    assert (limiter.active, limiter.waiting, unguarded.active) == (0, 0, 0)


def test_one_limiter_for_asyncio_and_trio_in_two_threads() -> None:
    """The "lock" duty: a limit of 3 holds across an asyncio loop and a trio run in other
    threads, each woken by releases in the other."""
    limiter = FloorLimiter(3)
    count = threading.Lock()
    state = {"active": 0, "peak": 0, "done": 0}
    errors: list[BaseException] = []

    async def requests() -> None:
        async def one() -> None:
            async with limiter.slot():
                with count:
                    state["active"] += 1
                    state["peak"] = max(state["peak"], state["active"])
                await anyio.sleep(0.0005)
                with count:
                    state["active"] -= 1
            with count:
                state["done"] += 1

        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                for _ in range(30):
                    group.start_soon(one)

    def in_thread(backend: str) -> None:
        try:
            anyio.run(requests, backend=backend)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=in_thread, args=(b,)) for b in ("asyncio", "trio")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not errors
    assert state == {"active": 0, "peak": 3, "done": 60}
    assert (limiter.active, limiter.waiting) == (0, 0)


def test_unknown_duties_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown duties"):
        FloorLimiter(2, {"lock", "locks"})
