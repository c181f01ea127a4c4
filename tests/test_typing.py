"""Typed workload names: mypy --strict on the snippets in ``typing_cases/``.

Each snippet marks the lines where mypy must report an error with a comment
``# E[code]: text``; the error must have that code and its message must contain ``text``
(for a typo, the public class of the limiter: ``MemoryLimiter``, ``PostgresLimiter``).
Every other line must type-check. mypy runs once, with explicit flags, independent of the
project's configuration.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import attrs
import pytest

mypy_api = pytest.importorskip("mypy.api", reason="mypy is part of the test extra")

CASES = Path(__file__).parent / "typing_cases"
FLAGS = [
    "--strict",
    "--python-version=3.11",
    "--config-file=",  # no configuration file: only the flags given here
    "--cache-dir=/dev/null",  # no cache written beside other runs
    "--no-error-summary",
    "--hide-error-context",
    "--no-pretty",
    "--show-error-codes",
]
MARKER = re.compile(r"# E\[(?P<code>[a-z-]+)\](?:: (?P<text>.+))?$")
REPORTED = re.compile(
    r"^(?P<path>[^:]+):(?P<line>\d+): error: (?P<message>.*)  \[(?P<code>[a-z-]+)\]$"
)


@attrs.frozen
class Expected:
    code: str
    text: str | None


@attrs.frozen
class Reported:
    code: str
    message: str


def expected_errors(path: Path) -> dict[int, Expected]:
    found: dict[int, Expected] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        marker = MARKER.search(line)
        if marker:
            found[number] = Expected(code=marker["code"], text=marker["text"])
    return found


@pytest.fixture(scope="module")
def mypy_output() -> tuple[str, str]:
    stdout, stderr, _ = mypy_api.run([*FLAGS, *map(str, sorted(CASES.glob("*.py")))])
    return stdout, stderr


@pytest.fixture(scope="module")
def reported(mypy_output: tuple[str, str]) -> Mapping[str, dict[int, Reported]]:
    """mypy's errors, by snippet file name and line."""
    stdout, stderr = mypy_output
    errors: dict[str, dict[int, Reported]] = {}
    for line in stdout.splitlines():
        match = REPORTED.match(line)
        if match is None:
            continue
        name = Path(match["path"]).name
        if Path(match["path"]).parent.name != CASES.name:
            continue  # an error inside slotwise itself is other tests' business
        errors.setdefault(name, {})[int(match["line"])] = Reported(
            code=match["code"], message=match["message"]
        )
    assert "error" not in stderr.lower(), stderr
    return errors


def check(name: str, reported: Mapping[str, dict[int, Reported]]) -> None:
    expected = expected_errors(CASES / name)
    actual = reported.get(name, {})
    unexpected = {line: e.message for line, e in actual.items() if line not in expected}
    assert not unexpected, f"{name}: mypy rejects correct code: {unexpected}"
    missing = sorted(line for line in expected if line not in actual)
    assert not missing, f"{name}: no mypy error on line(s) {missing}"
    for line, want in expected.items():
        got = actual[line]
        assert got.code == want.code, f"{name}:{line}: {got.message} [{got.code}]"
        if want.text is not None:
            assert want.text in got.message, f"{name}:{line}: {got.message}"


def test_the_snippets_mark_errors() -> None:
    for name, text in (
        ("literal_names.py", '"slot" of "MemoryLimiter"'),
        ("strenum_names.py", 'Argument "workload" to "slot"'),
        ("postgres_names.py", '"slot" of "PostgresLimiter"'),
        ("limiter_functions.py", "\"MemoryLimiter[Literal['interactive', 'background']]\""),
    ):
        expected = expected_errors(CASES / name)
        assert any(e.text is not None and text in e.text for e in expected.values()), name


def test_a_literal_workload_typo_is_a_type_error(
    reported: Mapping[str, dict[int, Reported]],
) -> None:
    check("literal_names.py", reported)


def test_a_str_enum_workload_typo_is_a_type_error(
    reported: Mapping[str, dict[int, Reported]],
) -> None:
    check("strenum_names.py", reported)


def test_a_limiter_without_typed_names_needs_no_annotation(
    reported: Mapping[str, dict[int, Reported]],
) -> None:
    check("untyped_names.py", reported)


def test_a_typo_in_any_function_that_takes_a_limiter_is_a_type_error(
    reported: Mapping[str, dict[int, Reported]],
) -> None:
    """`slotwise.slot`, `acquire`, `sync_slot`, `run`, `slotwise.httpx.client`, `sync_client`,
    `wrap`, `transport` and `ToolBox.tool`."""
    check("limiter_functions.py", reported)


def test_a_postgres_limiter_typo_is_a_type_error(
    reported: Mapping[str, dict[int, Reported]],
) -> None:
    check("postgres_names.py", reported)


def test_a_custom_limiter_takes_any_name(reported: Mapping[str, dict[int, Reported]]) -> None:
    check("custom_limiter.py", reported)


def test_no_message_names_a_private_class(mypy_output: tuple[str, str]) -> None:
    stdout, _ = mypy_output
    assert "error:" in stdout
    assert "BuiltinLimiter" not in stdout
