from __future__ import annotations

import pytest

# A test that hangs ends the run, saying what it waits for (see hang_watch.py).
from hang_watch import pytest_configure, pytest_runtest_logfinish, pytest_runtest_logstart

__all__ = ["pytest_configure", "pytest_runtest_logfinish", "pytest_runtest_logstart"]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs on asyncio and on trio."""
    return str(request.param)
