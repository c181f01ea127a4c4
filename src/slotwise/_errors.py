"""The exception family of slotwise.

Every error that slotwise raises for a slot derives from `ConcurrencyError` and carries the
limiter, the workload and the lineage of the request that failed. A run that ends early
raises `RunCancelledError` (cancelled) or `TimeoutError` (its budget ran out).
"""

from __future__ import annotations

__all__ = (
    "ConcurrencyConfigError",
    "ConcurrencyError",
    "ConcurrencyLeaseLostError",
    "ConcurrencyLimiterError",
    "ConcurrencyQueueFullError",
    "ConcurrencyTimeoutError",
    "RunCancelledError",
)

_CONTEXT_FIELDS = (
    "limiter",
    "workload",
    "run_id",
    "root_run_id",
    "parent_run_id",
    "request_id",
)


class ConcurrencyError(Exception):
    """Base class of every error slotwise raises about a slot.

    Attributes:
        limiter: The name of the limiter, or None when it is not known.
        workload: The workload of the request, or None when it is not known.
        run_id: The run that made the request, or None outside a run.
        root_run_id: The root of that run's tree.
        parent_run_id: The parent of that run, None for a root run.
        request_id: The id of the slot request.
    """

    limiter: str | None
    workload: str | None
    run_id: str | None
    root_run_id: str | None
    parent_run_id: str | None
    request_id: str | None

    def __init__(
        self,
        message: str,
        *,
        limiter: str | None = None,
        workload: str | None = None,
        run_id: str | None = None,
        root_run_id: str | None = None,
        parent_run_id: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.limiter = limiter
        self.workload = workload
        self.run_id = run_id
        self.root_run_id = root_run_id
        self.parent_run_id = parent_run_id
        self.request_id = request_id

    def _fill(self, **context: str | None) -> None:
        """Set the context fields that the raiser left empty (the runtime knows the lineage)."""
        for field in _CONTEXT_FIELDS:
            if getattr(self, field, None) is None:
                setattr(self, field, context.get(field))

    def __str__(self) -> str:
        message = super().__str__()
        if self.limiter is None:
            return message
        where = f"limiter {self.limiter!r}"
        if self.workload is not None:
            where += f", workload {self.workload!r}"
        return f"{message} ({where})"


class ConcurrencyConfigError(ConcurrencyError, ValueError):
    """A setting is invalid, or a request names a workload the limiter does not have."""


class ConcurrencyTimeoutError(ConcurrencyError, TimeoutError):
    """No slot was granted before the workload's ``max_wait`` or the run's budget ran out.

    The request has left the queue; the body never ran.
    """


class ConcurrencyQueueFullError(ConcurrencyError):
    """The limiter already had ``max_queued`` waiting requests; this one was refused at once."""


class ConcurrencyLimiterError(ConcurrencyError):
    """The limiter (or its database) failed while a slot was being acquired.

    slotwise fails closed: the body never ran. The original error is the ``__cause__``.
    """


class ConcurrencyLeaseLostError(ConcurrencyError):
    """The slot's lease expired or was taken away while the body ran; the body was cancelled.

    Attributes:
        lease_id: The id of the lease that was lost.
    """

    lease_id: str | None

    def __init__(self, message: str, *, lease_id: str | None = None, **context: str | None):
        super().__init__(message, **context)
        self.lease_id = lease_id


class RunCancelledError(Exception):
    """The run was cancelled while its body ran: raised as its `async with` block exits.

    `Run.cancel()` (called on this run or an ancestor) stops the body at its next `await`,
    releases its slots, and this error then leaves the block, so the code after the block
    runs only when the body ran to its end, and a function that returns from inside a run
    returns nothing else. Catch it where a cancelled run has something to do:

    ```python
    try:
        async with slotwise.run(limiter=claude) as run:
            return await agent(task)
    except slotwise.RunCancelledError:
        return "stopped"
    ```

    It is raised by the outermost cancelled run of the task (inner runs of the same task
    let the cancellation reach it), and by each cancelled child run that runs in a task of
    its own. It is not a `ConcurrencyError`: no slot request failed.

    Attributes:
        run_id: The run that was cancelled.
        root_run_id: The root of its tree.
        parent_run_id: Its parent, None for a root run.
    """

    run_id: str | None
    root_run_id: str | None
    parent_run_id: str | None

    def __init__(
        self,
        message: str,
        *,
        run_id: str | None = None,
        root_run_id: str | None = None,
        parent_run_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.root_run_id = root_run_id
        self.parent_run_id = parent_run_id
