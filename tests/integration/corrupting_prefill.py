"""A real ``pdserve prefill`` worker whose KV server damages every pull's bytes on the wire.

``tests/integration/test_kv_checksum.py`` runs it as a process (``python -m`` this module, the
worker's usual ``PDSERVE_*`` environment) to damage KV in flight, which no real fault on
loopback would do on demand. Only the copies that are sent change: the worker's own cache, and
so the hashes it took at lease time, stay right.
"""

from __future__ import annotations

import sys

import torch

from pdserve.shared.kv.transfer import KVServer

_start = KVServer.start


def _damage(views: list[torch.Tensor]) -> list[torch.Tensor]:
    # 0x7F in every byte of the first run: a float is ~1e306 or NaN, an int8 code is 127; enough
    # to change every greedy token that attends to it
    first = views[0].clone()
    first.view(torch.uint8).fill_(0x7F)
    return [first, *views[1:]]


async def _damaging_start(self: KVServer) -> None:
    self.fault = _damage
    await _start(self)


if __name__ == "__main__":
    KVServer.start = _damaging_start  # type: ignore[method-assign]
    from pdserve.cli import main

    sys.exit(main(["prefill"]))
