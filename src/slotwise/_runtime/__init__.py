"""The async shell around the pure core: slot lifecycle, runs, renewal, event dispatch.

Uses anyio only, so everything here runs on asyncio and trio.
"""
