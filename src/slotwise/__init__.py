"""slotwise: how many requests to an LLM provider are in flight at once, and who goes first.

Example:
    ```python
    import slotwise

    claude = slotwise.MemoryLimiter(name="claude", max_concurrent=8)


    async def ask():
        async with claude.slot():
            ...  # one provider request, streaming included
    ```
"""

from contextlib import suppress as _suppress

from ._config import Adaptive as Adaptive
from ._config import Rate as Rate
from ._config import Workload as Workload
from ._errors import ConcurrencyConfigError as ConcurrencyConfigError
from ._errors import ConcurrencyError as ConcurrencyError
from ._errors import ConcurrencyLeaseLostError as ConcurrencyLeaseLostError
from ._errors import ConcurrencyLimiterError as ConcurrencyLimiterError
from ._errors import ConcurrencyQueueFullError as ConcurrencyQueueFullError
from ._errors import ConcurrencyTimeoutError as ConcurrencyTimeoutError
from ._errors import RunCancelledError as RunCancelledError
from ._events import AcquiredEvent as AcquiredEvent
from ._events import ConcurrencyEvent as ConcurrencyEvent
from ._events import ConfigErrorEvent as ConfigErrorEvent
from ._events import EventKind as EventKind
from ._events import LeaseLostEvent as LeaseLostEvent
from ._events import LimitChangedEvent as LimitChangedEvent
from ._events import LimiterErrorEvent as LimiterErrorEvent
from ._events import Outcome as Outcome
from ._events import PausedEvent as PausedEvent
from ._events import QueueFullEvent as QueueFullEvent
from ._events import ReclaimedEvent as ReclaimedEvent
from ._events import ReleasedEvent as ReleasedEvent
from ._events import ReleaseFailedEvent as ReleaseFailedEvent
from ._events import RenewalFailedEvent as RenewalFailedEvent
from ._events import TimedOutEvent as TimedOutEvent
from ._events import WaitCancelledEvent as WaitCancelledEvent
from ._events import WaitStartedEvent as WaitStartedEvent
from ._protocol import AcquireRequest as AcquireRequest
from ._protocol import Lease as Lease
from ._protocol import Limiter as Limiter
from ._protocol import SupportsLease as SupportsLease
from ._runtime.dispatch import subscribe as subscribe
from ._runtime.lifecycle import Slot as Slot
from ._runtime.lifecycle import SlotContext as SlotContext
from ._runtime.lifecycle import SyncSlotContext as SyncSlotContext
from ._runtime.lifecycle import acquire as acquire
from ._runtime.lifecycle import slot as slot
from ._runtime.lifecycle import sync_slot as sync_slot
from ._runtime.runs import Run as Run
from ._runtime.runs import RunContext as RunContext
from ._runtime.runs import current_run as current_run
from ._runtime.runs import run as run
from ._stats import BucketStats as BucketStats
from ._stats import LimiterStats as LimiterStats
from ._stats import WorkloadStats as WorkloadStats
from .memory import MemoryLimiter as MemoryLimiter

__version__ = "0.1.0.dev0"

__all__ = (
    "AcquireRequest",
    "AcquiredEvent",
    "Adaptive",
    "BucketStats",
    "ConcurrencyConfigError",
    "ConcurrencyError",
    "ConcurrencyEvent",
    "ConcurrencyLeaseLostError",
    "ConcurrencyLimiterError",
    "ConcurrencyQueueFullError",
    "ConcurrencyTimeoutError",
    "ConfigErrorEvent",
    "EventKind",
    "Lease",
    "LeaseLostEvent",
    "LimitChangedEvent",
    "Limiter",
    "LimiterErrorEvent",
    "LimiterStats",
    "MemoryLimiter",
    "Outcome",
    "PausedEvent",
    "QueueFullEvent",
    "Rate",
    "ReclaimedEvent",
    "ReleaseFailedEvent",
    "ReleasedEvent",
    "RenewalFailedEvent",
    "Run",
    "RunCancelledError",
    "RunContext",
    "Slot",
    "SlotContext",
    "SupportsLease",
    "SyncSlotContext",
    "TimedOutEvent",
    "WaitCancelledEvent",
    "WaitStartedEvent",
    "Workload",
    "WorkloadStats",
    "acquire",
    "current_run",
    "run",
    "slot",
    "subscribe",
    "sync_slot",
)

# Public classes say `slotwise.X` in reprs, tracebacks and docs, wherever they are defined.
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("slotwise."):
        with _suppress(AttributeError, TypeError):
            _obj.__module__ = __name__
del _name, _obj
