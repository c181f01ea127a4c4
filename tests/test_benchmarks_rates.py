"""The rates benchmark runs at a tiny size, every variant, and prints every row.

Only the shape of the output is checked (no timing, no figure): each variant has a row with
figures, or, for the PostgresLimiter variants, figures or the reason they could not run; every
goal gets a verdict.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.fake_provider import Provider

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = os.environ.get("SLOTWISE_REQUIRE_SERVICES") == "1"

LABELS = {
    "no limiter, retry-after": False,
    "no limiter, SDK backoff": False,
    "asyncio.Semaphore(4) per process": False,
    "aiolimiter RPM+TPM per process": False,
    "LiteLLM-style cooldown per process": False,
    "slotwise PostgresLimiter, provider's limits": True,
    "slotwise PostgresLimiter, 2x limits + adaptive": True,
    "slotwise MemoryLimiter, provider's limits [1 process stand-in]": False,
    "slotwise MemoryLimiter, 2x limits + adaptive [1 process stand-in]": False,
}


@pytest.fixture(scope="module")
def output() -> str:
    result = subprocess.run(
        [sys.executable, "-W", "error", "-m", "benchmarks.rates", "--tiny", "--variant", "all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def rows(output: str) -> dict[str, list[str]]:
    block = output.split("## rates:", 1)[1].split("\n## ", 1)[0]
    table = [line for line in block.strip().splitlines()[1:] if line.strip()]
    assert set(table[1]) <= {"-", " "}, table[:2]
    cells = [re.split(r"\s{2,}", line.strip()) for line in table[2:]]
    return {row[0]: row for row in cells}


def test_header_names_the_machine_the_command_and_the_provider(output: str) -> None:
    assert output.startswith("slotwise rates benchmark: Python ")
    assert "CPUs, load average" in output.splitlines()[0]
    assert "command: python -m benchmarks.rates --tiny --variant all" in output
    assert "provider: 600 RPM, 100,000 TPM, 16 in flight" in output


def test_every_variant_has_a_row(output: str) -> None:
    table = rows(output)
    assert set(table) == set(LABELS)
    for label, postgres in LABELS.items():
        row = table[label]
        shape = "1 x 20" if "stand-in" in label else "2 x 10"
        assert row[1] == shape, row
        if postgres and row[2] == "-":
            # Could not run here: the row says why.
            assert re.search(r"not supported by this PostgresLimiter|unreachable", row[-1]), row
            assert not (REQUIRED and "unreachable" in row[-1]), row
            continue
        sent, refused, share, ok, capacity = row[2:7]
        assert int(sent.replace(",", "")) > 0, row
        assert int(refused.replace(",", "")) <= int(sent.replace(",", "")), row
        assert re.fullmatch(r"\d+\.\d%", share), row
        assert float(ok) > 0, row
        assert re.fullmatch(r"\d+\.\d%", capacity), row
        assert row[7] in {"requests", "tokens", "concurrency"}, row


def test_every_goal_gets_a_verdict(output: str) -> None:
    verdicts = output.split("## targets", 1)[1].strip().splitlines()
    verdicts = [line for line in verdicts if line.startswith(("MET", "MISSED", "NOT RUN"))]
    targets = [re.sub(r"^(MET|MISSED|NOT RUN)\s+", "", line).split(":")[0] for line in verdicts]
    assert targets == [label for label in LABELS if label.startswith("slotwise")]


def test_the_provider_states_its_limits_unless_told_not_to() -> None:
    """The fake provider sends OpenAI's limit headers by default, as the real providers do,
    and leaves them out with --no-limit-headers while enforcing the same limits."""

    async def answer(provider: Provider) -> tuple[int, dict[str, str]]:
        provider.reset()
        status, headers, _ = await provider.complete(
            {"messages": [{"content": "x" * 40}], "max_tokens": 100}
        )
        return status, headers

    stating = asyncio.run(answer(Provider(rpm=60, tpm=1_000, concurrency=2)))
    assert stating[0] == 200
    assert stating[1]["x-ratelimit-limit-requests"] == "60"
    assert stating[1]["x-ratelimit-limit-tokens"] == "1000"
    silent = Provider(rpm=1, tpm=1_000, concurrency=2, limit_headers=False)
    status, headers = asyncio.run(answer(silent))
    assert status == 200
    assert not any(name.startswith("x-ratelimit-limit-") for name in headers)
    assert "x-ratelimit-remaining-tokens" in headers
    status, headers, _ = asyncio.run(silent.complete({"messages": [], "max_tokens": 1}))
    assert status == 429  # one request a minute: the second is refused all the same
    assert not any(name.startswith("x-ratelimit-limit-") for name in headers)


def test_without_limit_headers_the_run_says_so() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            "-m",
            "benchmarks.rates",
            "--tiny",
            "--no-limit-headers",
            "--variant",
            "pushback-memory",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "limits NOT stated in x-ratelimit-limit-*" in result.stdout
    label = "slotwise MemoryLimiter, 2x limits + adaptive [1 process stand-in], no limit headers"
    assert label in rows(result.stdout)
