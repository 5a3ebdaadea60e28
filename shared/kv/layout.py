"""A short, stable name for a KV-cache layout fingerprint (``LLMEngine.layout_fingerprint``).

Workers advertise theirs in every heartbeat (``WorkerLoad.kv_layout``); the gateway computes the
same name from a prefilled request's ``KVHandle.fingerprint``. So it pairs a prefill worker only
with decode workers that can pull its blocks - the same model, dtype, block size and KV-cache
element type - and a fleet in the middle of a change (say, to ``--kv-cache-dtype int8``) keeps
serving without failed pulls.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping


def layout_id(fingerprint: Mapping[str, object]) -> str:
    """16 hex digits naming ``fingerprint``; equal fingerprints give equal names on any host."""
    blob = json.dumps(dict(fingerprint), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()
