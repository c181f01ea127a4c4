"""The conformance suite: prove that a limiter, built-in or custom, keeps every duty of one.

A custom limiter backs `slotwise.slot(limiter=obj)` and gets the runtime's lifecycle, but
the runtime trusts it to allocate atomically, expire leases, renew and release idempotently,
never reuse a lease id, and survive cancellation at any await point. These cases check each
of those duties, and the allocation rules of the built-in limiters, under your own pytest
(anyio plugin, asyncio and trio):

```python
import pytest
from slotwise.conformance import conformance_cases


@pytest.mark.anyio
@pytest.mark.parametrize(
    "case", conformance_cases(create_limiter), ids=lambda case: case.name
)
async def test_conformance(case):
    await case.run()
```

A limiter declares the capabilities that came with rates and provider pushback, and names
those it lacks among the others: `conformance_cases(create_limiter, supports=["rates",
"pushback"], skip={"stats": "counts live elsewhere"})`. The cases that need a capability it
does not have are skipped, with the reason.

Importing this package needs only slotwise and anyio.
"""

from __future__ import annotations

from ._harness import ConformanceFailure as ConformanceFailure
from ._suite import CAPABILITIES as CAPABILITIES
from ._suite import ConformanceCase as ConformanceCase
from ._suite import conformance_cases as conformance_cases

__all__ = ("CAPABILITIES", "ConformanceCase", "ConformanceFailure", "conformance_cases")

ConformanceFailure.__module__ = __name__
ConformanceCase.__module__ = __name__
