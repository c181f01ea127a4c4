"""The conformance suite against MemoryLimiter: it must pass every case, skipping none."""

from __future__ import annotations

import pytest

from slotwise import MemoryLimiter
from slotwise.conformance import ConformanceCase, conformance_cases

pytestmark = pytest.mark.anyio

CASES = conformance_cases(MemoryLimiter)


def test_memory_limiter_declares_every_capability() -> None:
    assert [case.name for case in CASES if case.skip_reason is not None] == []


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
async def test_conformance(case: ConformanceCase) -> None:
    await case.run()
