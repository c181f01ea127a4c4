"""slotwise's benchmarks: ``python -m benchmarks`` measures slotwise beside its peers.

Every figure is compared with the peers measured in the same run, so the ratios hold on any
machine even though the absolute numbers do not.
"""
