"""The pure core of slotwise: allocation rules, the wait queue and the lease table.

Nothing in this package reads a clock, does I/O, logs, or imports an async library: ``now`` is
always an argument. Every backend (memory, PostgreSQL) asks this code which requests to grant.
"""
