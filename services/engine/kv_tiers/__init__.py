"""KV offload tiers below a worker's device pool: host memory, then disk (kept across restarts).

A prefix-cached block that the pool evicts (no sequence uses it) is copied to host memory
(``host.py``); host memory evicts to disk (``disk.py``, one checked file per block,
``block_file.py``); each tier is least recently used first out. A prefix lookup that ends in the
pool continues here, and what it finds is loaded back into new pool blocks instead of being
recomputed: from host memory at once, from disk on the disk tier's thread while the sequence
waits (``tiers.py``; the engine side is ``services/engine/offload.py``).

Nothing here imports the engine: the engine hands in tensors and block hashes.
"""

from pdserve.services.engine.kv_tiers.tiers import DISK, HOST, Claim, KVTiers, TierStats

__all__ = ["DISK", "HOST", "Claim", "KVTiers", "TierStats"]
