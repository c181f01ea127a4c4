"""``python -m slotwise demo``: the summary shows the limits held, and would show them broken;
every line fits 80 columns, with numbers a person reads at a glance.

The async tests run on asyncio in real time and on trio with a MockClock (in virtual time).
"""

from __future__ import annotations

import io
import os
import re
import shutil
from pathlib import Path

import pytest
import trio.testing

import slotwise
from slotwise import MemoryLimiter, Workload
from slotwise.__main__ import main
from slotwise._demo import (
    MAX_CONCURRENT,
    WIDTH,
    Tool,
    Variant,
    figure,
    fmt_duration,
    fmt_seconds,
    intro,
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
VIRTUAL_TIME = BACKENDS[1:]

# Cursor moves and line erases of the redrawn view.
ESCAPES = re.compile(r"\x1b\[\d*[A-Za-z]")
# What a person should not have to read: 2.66667, 1e-05, nan, None.
UNREADABLE = re.compile(r"\d\.\d{3,}|\d[eE][+-]?\d|\b(?:nan|inf|None)\b")


class Terminal(io.StringIO):
    """Output that says it is a terminal, so the view redraws itself in place."""

    def isatty(self) -> bool:
        return True


def assert_fits_and_reads(text: str) -> None:
    lines = text.splitlines()
    assert lines
    for line in lines:
        assert len(line) <= WIDTH, f"{len(line)} columns: {line!r}"
        assert not UNREADABLE.search(line), f"a number for no person: {line!r}"


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
    assert "   time  workload     in use  queued" in out  # a log, as stdout is not a terminal
    # The line of the first second (drawn a little late on a loaded machine).
    assert re.search(r"^  1\.[0-4] s  interactive", out, re.MULTILINE)
    assert "             served  in flight  p50 wait  p95 wait  timed out  refused" in out
    assert "Limits held" in out
    assert "these 1.5 s are 1 min of traffic" in out
    assert_fits_and_reads(out)


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
    err = capsys.readouterr().err
    assert "pip install 'slotwise[plot]'" in err
    assert_fits_and_reads(err)
    assert not path.exists()


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        main(["demo", "--seconds", "0"])
    assert exc_info.value.code == 2
    assert "positive" in capsys.readouterr().err


@pytest.mark.parametrize("anyio_backend", VIRTUAL_TIME)
@pytest.mark.parametrize(
    ("seconds", "tty"),
    [
        pytest.param(15.0, True, id="15s-terminal"),
        pytest.param(15.0, False, id="15s-log"),
        pytest.param(4.0, True, id="4s-terminal"),
        pytest.param(7 / 3, False, id="2.33s-log"),
    ],
)
async def test_every_line_fits_80_columns_with_numbers_for_people(
    seconds: float, tty: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A wide terminal, so that the view's cut to a narrow one hides no long line.
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *_: os.terminal_size((200, 50)))
    out = Terminal() if tty else io.StringIO()

    result = await run_demo(seconds=seconds, seed=1, out=out)

    live = ESCAPES.sub("", out.getvalue())
    text = intro(seconds) + live + "\n" + summary(result)
    assert_fits_and_reads(text)
    assert ("\x1b[" in out.getvalue()) is tty
    if tty:
        assert "  priority only  " in live  # the replays, in the same columns
    else:
        assert live.count("workload") == 1  # the log's header, once
    assert "What the reservation bought" in text
    assert "no reservation, one first-come queue" in text
    example = result.fleets[0].workloads
    assert sum(w.queue_full for w in example.values()) > 0  # the refused column is filled


def test_the_intro_says_durations_as_people_do() -> None:
    text = intro(4.0)

    assert "these 4 s are 2 min 40 s of traffic" in text
    assert "max_wait 1 min" in text
    assert "lasts 1.50 s" in text
    assert "arrives at 1.6 s" in text
    assert_fits_and_reads(text)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (15.0, "15 s"),
        (2.5, "2.5 s"),
        (7 / 3, "2.3 s"),
        (59.99, "1 min"),
        (160.0, "2 min 40 s"),
        (600.0, "10 min"),
        (3900.0, "1 h 5 min"),
    ],
)
def test_durations(seconds: float, text: str) -> None:
    assert fmt_duration(seconds) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "-"),
        (0.0, "0 ms"),
        (0.0004, "0 ms"),
        (0.012, "12 ms"),
        (0.9996, "1.00 s"),
        (1.5, "1.50 s"),
    ],
)
def test_waits(seconds: float | None, text: str) -> None:
    assert fmt_seconds(seconds) == text


@pytest.mark.parametrize("anyio_backend", VIRTUAL_TIME)
async def test_the_picture_shows_every_outcome_on_a_scale_that_fits() -> None:
    pytest.importorskip("matplotlib", reason="--plot needs slotwise[plot] (matplotlib)")
    result = await run_demo(seconds=15.0, seed=1, out=io.StringIO())

    _, queued, interactive_queued, *waits = figure(result).axes

    # The interactive queue has a scale of its own, with zero clear of the axis.
    deepest = max(s.queued["interactive"] for s in result.samples)
    bottom, top = interactive_queued.get_ylim()
    assert bottom < 0 < deepest < top <= 2 * max(2, deepest)
    assert queued.get_ylim()[1] < 2 * 200
    # One panel of waits for each limiter, so that no comparison hides another.
    assert len(waits) == len(result.fleets) == 3
    longest = max(p.wait for f in result.fleets for p in f.points if p.workload == "interactive")
    assert 1.0 < longest < 2.0  # the interactive max_wait, 1.5 s
    refused = 0
    for ax, fleet in zip(waits, result.fleets, strict=True):
        assert ax.get_ylim()[1] <= 20 * longest  # room for the refusals' row, not 10**3 s
        labels = [label.get_text() for label in ax.get_yticklabels()]
        assert labels == ["0", "10 ms", "100 ms", fmt_seconds(longest), "refused"]
        drawn = {c.get_label(): len(c.get_offsets()) for c in ax.collections}
        w = fleet.workloads["interactive"]
        assert drawn["refused"] == w.queue_full
        assert drawn["timed out"] == w.timeouts
        refused += w.queue_full
    # Background's own max_queued keeps places in the queue for interactive requests, in
    # every comparison: only background requests are refused.
    assert refused == 0
    assert all(f.workloads["background"].queue_full > 0 for f in result.fleets)
    # Refusals on the queue panels too, each workload's on its own.
    for ax, name in ((queued, "background"), (interactive_queued, "interactive")):
        count = result.fleets[0].workloads[name].queue_full
        (ticks,) = [line for line in ax.get_lines() if line.get_label().startswith("refused")]
        assert len(ticks.get_xdata()) == count
