"""``python -m slotwise status`` without its extra: one line naming what to install.

The command itself is tested against a server in tests/postgres/test_status.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def status_without(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the command in a fresh interpreter where ``module`` cannot be imported."""
    code = (
        f"import sys; sys.modules[{module!r}] = None; "
        "from slotwise.__main__ import main; "
        f"sys.exit(main(['status', '--dsn', 'host=127.0.0.1 port=1', *{list(args)!r}]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("module", ["psycopg", "psycopg_pool"])
def test_without_psycopg_it_names_the_extra(module: str) -> None:
    result = status_without(module, "--json")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (f"slotwise status: needs {module}: pip install 'slotwise[status]'\n")


def test_without_rich_the_table_names_the_extra() -> None:
    result = status_without("rich")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (
        "slotwise status: the table view needs rich: pip install 'slotwise[status]' "
        "(or pass --json)\n"
    )


def test_json_needs_no_rich() -> None:
    result = status_without("rich", "--json")  # gets as far as connecting
    assert result.returncode == 1
    assert result.stderr.startswith("slotwise status: cannot connect to PostgreSQL: ")


def test_watch_takes_an_interval_of_at_least_a_tenth_of_a_second() -> None:
    result = status_without("rich", "--watch", "0.01")
    assert result.returncode == 2
    assert "--watch: must be at least 0.1 seconds, got 0.01" in result.stderr
