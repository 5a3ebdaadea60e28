"""The engine's half of layer-wise KV streaming (issue 29 item 3; the wire half is
``shared/kv/transfer/stream.py``).

A prefill worker's engine, before a forward pass, names the prompts this pass completes that are
long enough to stream (``StreamStart``: their block tables are final, every earlier chunk is in
the cache) and has the model report each layer it has written, so that the worker can lease the
blocks at once and its KV server send each layer group while later layers still compute. Called
on the engine thread; the worker's callbacks hand over to its event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.services.engine.outputs import ScheduledBatch


@dataclass(frozen=True)
class StreamStart:
    bus_id: str
    block_ids: list[int]
    num_tokens: int
    num_ready_tokens: int  # computed before this pass (earlier chunks, a cached prefix)


class StreamHooks:
    """``on_start(starts)`` before a pass that completes prompts of at least ``min_tokens``;
    ``on_layers(bus_ids, layers_written, event)`` after each layer of that pass (``event``: a
    CUDA event recorded behind the layer's kernels, None on a CPU)."""

    def __init__(
        self,
        min_tokens: int,
        on_start: Callable[[list[StreamStart]], None],
        on_layers: Callable[[list[str], int, Any], None],
    ) -> None:
        self.min_tokens = max(1, min_tokens)
        self.on_start = on_start
        self.on_layers = on_layers

    def before_forward(self, batch: ScheduledBatch, model: Any) -> None:
        """Hand over the prompts this pass completes and hook the model's layers for them
        (unhooked for a pass that completes none: every pass is announced here)."""
        starts = [
            StreamStart(
                bus_id=seq.bus_id,
                block_ids=list(seq.block_table),
                num_tokens=seq.num_prompt_tokens,
                num_ready_tokens=seq.num_computed_tokens,
            )
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
            if seq.num_prompt_tokens >= self.min_tokens
            and not seq.output_token_ids
            and seq.num_computed_tokens + n >= seq.num_prompt_tokens
        ]
        if not starts:
            model.layer_hook = None
            return
        self.on_start(starts)
        ids = [s.bus_id for s in starts]
        cuda = next(model.parameters()).is_cuda

        def written(layers: int) -> None:
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record()
            self.on_layers(ids, layers, event)

        model.layer_hook = written
