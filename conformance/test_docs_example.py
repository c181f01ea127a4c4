"""The how-to on the conformance suite: its worked example passes the suite as the page says.

The page's ``small_limiter.py`` block is loaded as the module ``small_limiter`` and its
``test_conformance.py`` block runs here as written: every case, on asyncio and on trio. The
two edits the page says the suite catches are made to the example and must fail the cases
the page names. Both blocks are type-checked with ``mypy --strict`` and lint-clean.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from slotwise.conformance import ConformanceCase, ConformanceFailure, conformance_cases

PAGE = Path(__file__).parent.parent / "docs" / "how-to" / "conformance.md"
FENCE = re.compile(r'^```python title="(?P<title>[^"]+)"\n(?P<body>.*?)^```$', re.M | re.S)


def block(title: str) -> str:
    [body] = [m["body"] for m in FENCE.finditer(PAGE.read_text("utf-8")) if m["title"] == title]
    return body


def load(source: str) -> types.ModuleType:
    module = types.ModuleType("small_limiter")
    exec(compile(source, f"{PAGE}:small_limiter.py", "exec"), module.__dict__)
    return module


# Run the page's test module here, importing the page's limiter.
sys.modules["small_limiter"] = load(block("small_limiter.py"))
try:
    exec(compile(block("test_conformance.py"), f"{PAGE}:test_conformance.py", "exec"), globals())
finally:
    del sys.modules["small_limiter"]

GIVE_BACK = "                self._drop(waiter.lease.lease_id)\n"
GRANT = "            waiter.lease = self._grant()  # no await between the check and the grant\n"
EDITS = {
    "no-give-back": (GIVE_BACK, "                pass\n", "cancel_at_every_await", "leaked"),
    "await-before-grant": (
        GRANT,
        "            await checkpoint()\n" + GRANT,
        "atomic_allocation",
        "held at once with max_concurrent",
    ),
}


def test_the_example_declares_one_missing_capability() -> None:
    cases: list[ConformanceCase] = globals()["CASES"]  # defined by the page's test module
    skipped = {case.name for case in cases if case.skip_reason is not None}
    # blocked_storage needs a storage to block: the example keeps its leases in memory. It
    # declares none of the capabilities a limiter must declare to have.
    later = {"workload_max_queued", "rates", "pushback"}
    assert skipped == {"blocked_storage"} | {
        case.name
        for case in conformance_cases(object)
        if "workloads" in case.requires or case.requires & later
    }


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("edit", list(EDITS))
async def test_the_edits_the_page_describes_are_caught(edit: str, anyio_backend: Any) -> None:
    old, new, name, says = EDITS[edit]
    source = block("small_limiter.py")
    assert source.count(old) == 1
    broken = load(source.replace(old, new))
    cases: list[ConformanceCase] = conformance_cases(broken.SmallLimiter, time_scale=0.5)
    [case] = [case for case in cases if case.name == name]
    with pytest.raises(ConformanceFailure, match=says):
        await case.run()


def test_the_example_type_checks(tmp_path: Path) -> None:
    mypy_api = pytest.importorskip("mypy.api", reason="mypy is part of the test extra")
    for title in ("small_limiter.py", "test_conformance.py"):
        (tmp_path / title).write_text(block(title), encoding="utf-8")
    out, err, status = mypy_api.run(
        [
            "--strict",
            "--python-version=3.11",
            "--config-file=",
            f"--cache-dir={tmp_path / 'cache'}",
            "--no-error-summary",
            str(tmp_path / "small_limiter.py"),
            str(tmp_path / "test_conformance.py"),
        ]
    )
    assert status == 0, out + err


def test_the_example_is_lint_clean(tmp_path: Path) -> None:
    pytest.importorskip("ruff", reason="ruff is part of the test extra")
    config = str(PAGE.parent.parent.parent / "pyproject.toml")
    # To the reader, small_limiter is their own module and slotwise a dependency.
    settings = ["--config", config]
    settings += ["--config", "lint.isort.known-first-party=['small_limiter']"]
    settings += ["--config", "lint.isort.known-third-party=['slotwise']"]
    for title in ("small_limiter.py", "test_conformance.py"):
        source = tmp_path / title
        source.write_text(block(title), encoding="utf-8")
        for command in (["check"], ["format", "--diff"]):
            result = subprocess.run(
                [sys.executable, "-m", "ruff", *command, *settings, str(source)],
                capture_output=True,
                text=True,
                check=False,
            )
            assert result.returncode == 0, result.stdout + result.stderr
