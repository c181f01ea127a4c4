"""``python -m slotwise demo``: the summary shows the limits held, and would show them broken.

The async tests run on asyncio in real time and on trio with a MockClock (in virtual time).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import trio.testing

import slotwise
from slotwise import MemoryLimiter, Workload
from slotwise.__main__ import main
from slotwise._demo import (
    MAX_CONCURRENT,
    Tool,
    Variant,
    make_trace,
    run_demo,
    summary,
    variants,
)

pytestmark = pytest.mark.anyio

BACKENDS = [
    pytest.param("asyncio", id="asyncio"),
    pytest.param(
        ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}), id="trio-mockclock"
    ),
]


@pytest.mark.parametrize("anyio_backend", BACKENDS)
async def test_summary_shows_limits_held() -> None:
    events: list[slotwise.ConcurrencyEvent] = []
    unsubscribe = slotwise.subscribe(events.append)
    try:
        result = await run_demo(seconds=2.0, seed=3, out=io.StringIO())
    finally:
        unsubscribe()

    assert [f.key for f in result.fleets] == ["example", "priority-only", "one-queue"]
    for fleet in result.fleets:
        assert 0 < fleet.peak_total <= MAX_CONCURRENT
        for workload in fleet.workloads.values():
            assert workload.peak <= workload.limit
        assert (fleet.leftover_active, fleet.leftover_queued) == (0, 0)
    example = result.fleets[0].workloads
    assert (example["interactive"].limit, example["background"].limit) == (8, 6)
    assert example["background"].peak == 6  # the load saturates background work
    assert example["interactive"].served > 0
    assert sum(w.queue_full for w in example.values()) > 0  # the batch overflows the queue
    assert result.held

    text = summary(result)
    assert "Limits held" in text
    assert "EXCEEDED" not in text
    assert "What the reservation bought" in text

    acquired = [e for e in events if isinstance(e, slotwise.AcquiredEvent)]
    assert any(e.parent_run_id is not None for e in acquired), "no child run took a slot"


def loose(variant: Variant) -> MemoryLimiter[str]:
    """Twice the slots and no background ceiling: a limiter the demo must catch."""
    return MemoryLimiter(
        max_concurrent=2 * MAX_CONCURRENT,
        workloads={"interactive": Workload(), "background": Workload()},
    )


@pytest.mark.parametrize("anyio_backend", BACKENDS)
async def test_a_broken_limit_shows_in_the_summary() -> None:
    result = await run_demo(
        seconds=1.5, seed=3, out=io.StringIO(), configs=variants()[:1], make_limiter=loose
    )

    fleet = result.fleets[0]
    assert fleet.workloads["background"].peak > fleet.workloads["background"].limit
    assert not result.held
    assert "LIMIT EXCEEDED" in summary(result)


def test_trace_is_seeded_and_has_child_runs() -> None:
    trace = make_trace(5.0, 1)
    assert trace == make_trace(5.0, 1)
    assert trace != make_trace(5.0, 2)
    assert {s.workload for s in trace} == {"interactive", "background"}
    steps = [step for s in trace for _, script in s.turns for step in script]
    assert any(isinstance(step, Tool) and step.child for step in steps)


def test_command_prints_the_live_view_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--seconds", "1.5", "--seed", "3", "--no-compare"])

    out = capsys.readouterr().out
    assert code == 0
    assert "[t=" in out  # a periodic line, as stdout is not a terminal
    assert "max in flight" in out
    assert "Limits held" in out


def test_command_exits_non_zero_when_a_limit_breaks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("slotwise._demo._limiter", loose)

    code = main(["demo", "--seconds", "1", "--seed", "3", "--no-compare"])

    assert code == 1
    assert "LIMIT EXCEEDED" in capsys.readouterr().out


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs slotwise[plot] (matplotlib)")
    path = tmp_path / "timeline.png"

    code = main(["demo", "--seconds", "1", "--seed", "3", "--plot", str(path)])

    assert code == 0
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 10_000
    assert f"Timeline written to {path}" in capsys.readouterr().out


def test_plot_without_matplotlib_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("slotwise._demo.plot_available", lambda: False)
    path = tmp_path / "timeline.png"

    code = main(["demo", "--seconds", "1", "--plot", str(path)])

    assert code == 2
    assert "slotwise[plot]" in capsys.readouterr().err
    assert not path.exists()


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        main(["demo", "--seconds", "0"])
    assert exc_info.value.code == 2
    assert "positive" in capsys.readouterr().err
