"""The conformance suite against MemoryLimiter: it must pass every case it can run.

Its state lives in the process and no call waits for storage, so there is nothing to
block: ``blocked_storage`` is the one case skipped.
"""

from __future__ import annotations

import pytest

from slotwise import MemoryLimiter
from slotwise.conformance import ConformanceCase, conformance_cases

pytestmark = pytest.mark.anyio

CASES = conformance_cases(MemoryLimiter, supports=["workload_max_queued", "rates", "pushback"])


def test_memory_limiter_declares_every_capability() -> None:
    assert [case.name for case in CASES if case.skip_reason is not None] == ["blocked_storage"]


@pytest.mark.parametrize(
    ("anyio_backend", "case"),
    [
        pytest.param(backend, case, id=f"{backend}-{case.name}")
        for backend in ("asyncio", "trio")
        for case in CASES
    ],
)
async def test_conformance(case: ConformanceCase) -> None:
    await case.run()
