"""A KV server's answer to one authentic pull request: a yes, with what it sends, or why not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdserve.shared.kv.transfer.heads import Heads
from pdserve.shared.kv.transfer.lease import Lease
from pdserve.shared.kv.transfer.stream import Layers


class Refusal(Exception):
    """Why an authentic pull request is answered no."""


@dataclass
class Answer:
    """A yes: the pinned lease, the heads sent, the form, the messages (UCX-sendable) and the
    staging copies among them."""

    lease: Lease
    heads: Heads
    sliced: bool
    views: list[Any]
    staged: list[torch.Tensor]
    layers: Layers = (0, 0)  # a streamed piece's layer group (a bulk pull: all)
    final: bool = True  # a streamed lease's last piece: sent with the first token

    done: bool = False  # every block sent was complete in every layer when leased

    def ready(self) -> bool:
        """Whether prefill has written what this answer sends (always, unless streamed)."""
        stream = self.lease.stream
        return stream is None or stream.ready(self.layers, self.final, self.done)

    @property
    def event(self) -> Any:
        """CUDA: what the layers' kernels must have reached before UCX reads them."""
        return self.lease.stream.event if self.lease.stream is not None else None

    def waits_for_device(self) -> bool:
        return self.event is not None or bool(self.staged) and any(t.is_cuda for t in self.staged)
