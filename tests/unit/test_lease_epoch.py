"""A lease's epoch (lease.py): the highest generation of its blocks when leased, and the check a
pull of them passes only while none of them has been taken again since."""

from __future__ import annotations

import numpy as np

from pdserve.shared.kv.transfer import LeaseTable


def test_a_lease_records_its_blocks_highest_generation() -> None:
    generations = np.array([3, 9, 4, 0, 7], dtype=np.int64)
    table = LeaseTable(on_free=lambda bus_id: None, generations=generations)
    lease = table.add("r1", [0, 2, 4], num_tokens=10, ttl=30.0)
    assert lease.epoch == 7
    assert not table.reused(lease.epoch, [(0, 1), (2, 3)])
    generations[2] = 12  # block 2 freed and taken again: its KV is someone else's now
    assert table.reused(lease.epoch, [(2, 1)])
    assert table.reused(lease.epoch, [(0, 3)])  # anywhere in a run
    assert not table.reused(lease.epoch, [(4, 1)])


def test_without_generations_nothing_is_recorded_or_refused() -> None:
    """A TP rank's mirror of rank 0's leases reads no engine: rank 0's server checks."""
    table = LeaseTable(on_free=lambda bus_id: None)
    lease = table.add("r1", [0, 1], num_tokens=4, ttl=30.0)
    assert lease.epoch is None
    assert not table.reused(0, [(0, 2)])
