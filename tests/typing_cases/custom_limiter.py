"""A custom limiter written as the protocol shows it, and limiters with untyped names, take
any workload name everywhere; `slotwise.Limiter` written bare accepts them."""

import itertools

import slotwise
import slotwise.httpx
from slotwise import AcquireRequest, Lease, Limiter, MemoryLimiter, SupportsLease


class OneAtATime:
    name = "one"

    def __init__(self) -> None:
        self._ids = itertools.count()

    async def acquire(self, request: AcquireRequest) -> Lease:
        return Lease(lease_id=str(next(self._ids)), workload=request.workload, expires_at=0.0)

    async def renew(self, lease: SupportsLease) -> SupportsLease | None:
        return lease

    async def release(self, lease: SupportsLease) -> None:
        pass


custom = OneAtATime()
untyped = MemoryLimiter(max_concurrent=2)
as_protocol: Limiter = custom
also: Limiter = untyped


async def correct() -> None:
    for limiter in (custom, untyped, as_protocol):
        async with slotwise.slot(workload="anything", limiter=limiter):
            pass
        async with slotwise.run(limiter=limiter, workload="anything"):
            pass
        slotwise.httpx.client(limiter=limiter, workload="anything")


def not_a_limiter() -> None:
    slotwise.slot(limiter=object())  # E[call-overload]: "slot" matches argument type "object"
