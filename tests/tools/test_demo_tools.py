"""``python -m slotwise demo tools``: the pools fill, a payment is refused, the limits hold.

On trio the demo runs on a MockClock (virtual time), so every outcome is known; on asyncio it
runs in real time through the command line, and only what no timing can change is checked.
"""

from __future__ import annotations

import io
import os
import re
import shutil

import pytest
from trio.testing import MockClock

from slotwise.__main__ import main
from slotwise._demo import WIDTH
from slotwise._demo_tools import MAX_CONCURRENT, ceilings, run_demo, summary

pytestmark = pytest.mark.anyio


VIRTUAL_TIME = [
    pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock")
]


@pytest.mark.parametrize("anyio_backend", VIRTUAL_TIME)
async def test_the_pools_fill_and_a_payment_is_refused() -> None:
    out = io.StringIO()
    result = await run_demo(out=out)
    outcomes = {
        call.id: res.error or "done"
        for agent in result.calls
        for batch, results in zip(result.calls[agent], result.results[agent], strict=True)
        for call, res in zip(batch, results, strict=True)
    }
    refused = {"c2.1", "b1.5"}  # a refund while another payment runs; two refunds at once
    assert {call for call, outcome in outcomes.items() if outcome != "done"} == refused | {"b2.3"}
    assert {outcomes[call] for call in refused} == {"concurrency-limit"}
    assert outcomes["b2.3"] == "timed-out"
    board = result.board
    assert board.peak_total == MAX_CONCURRENT
    assert (board.peak["search"], board.peak["customers"], board.peak["payments"]) == (1, 2, 1)
    assert result.held
    log = out.getvalue()
    assert "REFUSED: concurrency-limit" in log
    text = summary(result)
    assert "Limits held." in text
    assert "default 2/3." in text  # the global 4 less the slot kept for payments
    assert all(len(line) <= WIDTH for line in (log + text).splitlines())


class Terminal(io.StringIO):
    """Output that says it is a terminal, so the view redraws itself in place."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("anyio_backend", VIRTUAL_TIME)
async def test_the_live_view_fits_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    # A wide terminal, so that the view's cut to a narrow one hides no long line.
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *_: os.terminal_size((200, 50)))
    out = Terminal()

    await run_demo(out=out)

    frames = re.sub(r"\x1b\[\d*[A-Za-z]", "", out.getvalue())
    assert all(len(line) <= WIDTH for line in frames.splitlines())
    assert "      running   waiting  done  refused" in frames  # each header over its column
    assert "  default    0/3 ...         0" in frames
    assert ceilings() == {"search": 1, "customers": 2, "payments": 1, "default": 3}


def test_the_command_runs_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "tools"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("slotwise demo tools:")
    assert "b1.5  refund          payments  concurrency-limit  0.0 s      -" in out
    assert "b2.3  export_report   default   timed-out          0.0 s  1.0 s" in out
    assert "Limits held." in out
    assert all(len(line) <= 80 for line in out.splitlines())
