"""Roofline accounting: which bound a forward pass hit, against this machine's own peaks.

A step's FLOPs and bytes moved are computed analytically (no profiler, no sync); with its wall
time they give achieved FLOP/s and bytes/s, and against the measured peaks (``peaks.py``) the
fraction of each roof and the bound: a step whose arithmetic intensity (FLOPs per byte) sits
below the machine's ridge point (peak FLOP/s / peak bytes/s) is memory-bound, above it
compute-bound.

What a forward pass of a Llama-family decoder costs (``ModelCost.cost``), counted for what one
rank computes (at tensor parallelism N, rank 0's shard: its query and KV heads, its MLP channels,
its vocabulary rows of a vocab-parallel LM head, the whole LM head if replicated):

- FLOPs: 2 x the weights of every linear layer (q, k, v, o, gate, up, down) x the tokens the
  pass computes; attention (QK^T and PV, 2 FLOPs per multiply-add each) 4 x query heads x
  head_dim x the (query, key) pairs, i.e. the sum over new tokens of the positions each attends
  to (causal: a token at position p sees p + 1), in every layer; the LM head 2 x hidden x its
  vocabulary rows x the rows whose logits are computed.
- Bytes: every layer's linear weights once per pass, as stored (INT8: 1 byte each plus their
  scales); the LM head once per call that computes logits (none in a middle prompt chunk); the
  embedding rows gathered (one per token); the KV cache read through the pages (all layers, K and
  V, at the cache's dtype with a quantized cache's per-token scales) and the new tokens' K and V
  written.

Ignored, because each is a small fraction of one of the terms above: activations (hidden states
in and out of each layer are ``tokens x hidden`` against the weights' ``hidden x hidden``: they
matter only for prefill chunks, which are compute-bound anyway), norm weights and biases
(``hidden``-sized vectors), rotary tables, softmax/SiLU/norm arithmetic (a few FLOPs per element
against ``2 x hidden`` per weight row), and the sampler. A draft model's passes (``spec/draft``)
run outside the timed forward pass and are not counted.

The FLOPs and bytes are lower bounds of what the hardware does: a kernel that reads a weight
twice or pads a batch moves more. That is the point: the fraction of the roof they reach is what
the engine could still gain.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import mul
from typing import NamedTuple

PHASES = ("prefill", "decode")  # a step with any prefill rows is "prefill", else "decode"
BOUNDS = ("compute", "memory")
NEAR_ROOF = 0.5  # advice: a step at this fraction of its roof or more is limited by that roof


@dataclass(frozen=True)
class Peaks:
    """What this device can do, measured where pdserve runs (``shared/telemetry/peaks.py``)."""

    flops_per_s: float  # dense GEMM at the model's dtype
    bytes_per_s: float  # sustained memory read
    device: str  # what was measured, e.g. "cpu: AMD EPYC 7B13, 2 threads" or "cuda: NVIDIA H200"
    dtype: str  # the GEMM's dtype, e.g. "float32", "bfloat16"
    threads: int  # torch threads on a CPU; 0 on a GPU
    measured_at: float  # unix time

    @property
    def ridge(self) -> float:
        """The arithmetic intensity (FLOP/byte) where the two roofs meet."""
        return self.flops_per_s / self.bytes_per_s


class Cost(NamedTuple):
    """What a forward pass (or several) computed and moved."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved (infinite when nothing was moved)."""
        return self.flops / self.bytes if self.bytes > 0 else math.inf


@dataclass(frozen=True)
class Roofline:
    """Where a step (or a span of steps) sat against the two roofs."""

    intensity: float  # FLOP/byte
    flops_per_s: float  # achieved
    bytes_per_s: float  # achieved
    compute_fraction: float  # of the peak FLOP/s
    bandwidth_fraction: float  # of the peak bytes/s
    bound: str  # "compute" or "memory": the side of the ridge the intensity sits on


def roofline(cost: Cost, seconds: float, peaks: Peaks) -> Roofline:
    """The roofline of ``cost`` done in ``seconds`` against ``peaks``."""
    if seconds <= 0:
        raise ValueError(f"a step takes time: {seconds} s")
    flops_per_s, bytes_per_s = cost.flops / seconds, cost.bytes / seconds
    intensity = cost.intensity
    return Roofline(
        intensity=intensity,
        flops_per_s=flops_per_s,
        bytes_per_s=bytes_per_s,
        compute_fraction=flops_per_s / peaks.flops_per_s,
        bandwidth_fraction=bytes_per_s / peaks.bytes_per_s,
        bound="compute" if intensity >= peaks.ridge else "memory",
    )


def advice(phase: str, r: Roofline) -> str:
    """One line on what would raise ``phase``'s throughput, from where its steps sat."""
    if r.bound == "memory":
        where, fraction = (
            f"{phase} at {r.bandwidth_fraction:.0%} of memory bandwidth",
            r.bandwidth_fraction,
        )
    else:
        where, fraction = f"{phase} at {r.compute_fraction:.0%} of peak compute", r.compute_fraction
    if fraction < NEAR_ROOF:
        return (
            f"{where} ({r.bound}-bound, far below the roof): the engine, not the hardware, is "
            f"the limit: per-step overhead (Python, kernel launches) or slow kernels; bigger "
            f"batches amortise the overhead, faster kernels close the rest"
        )
    if r.bound == "memory":
        return (
            f"{where} (memory-bound): fewer bytes per token raise throughput: INT8 weights or KV "
            f"cache, a bigger batch (one weight read serves more rows), or more {phase} "
            f"workers; faster arithmetic will not"
        )
    return (
        f"{where} (compute-bound): only more compute raises throughput: more {phase} workers "
        f"or tensor parallelism; INT8 weights or a bigger batch will not"
    )


# ---- what a forward pass costs -----------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """One rank's share of the model (all of it at TP 1)."""

    num_layers: int
    hidden_size: int
    num_heads: int  # query heads of this rank
    num_kv_heads: int  # KV heads of this rank
    head_dim: int
    intermediate_size: int  # MLP channels of this rank
    lm_head_rows: int  # vocabulary rows this rank's LM head computes

    @property
    def linear_params(self) -> int:
        """Weights of every decoder layer's q, k, v, o, gate, up and down projections."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp)


@dataclass(frozen=True)
class Storage:
    """What the weights and the KV cache take as stored (INT8 weights: 1 byte each plus their
    scales; a quantized KV cache: 1 byte per value plus a float32 scale per token and head)."""

    layer_weight_bytes: float  # every decoder layer's linear weights (and their scales)
    lm_head_bytes: float  # the LM head's weight (and scales): read once per logits call
    embedding_row_bytes: float  # one token's embedding row
    kv_token_bytes: float  # one token's K and V over all layers and this rank's KV heads


@dataclass(frozen=True)
class StepShape:
    """What one forward pass computes, summed over its rows."""

    tokens: int  # new tokens computed (each row's)
    attended: int  # (query, key) pairs: per new token, the positions it attends to
    kv_read_tokens: int  # token positions read from the paged cache, over all rows
    logit_rows: int  # rows the LM head computes logits for
    lm_head_calls: int  # times the LM head's weight is read (the runner's logits calls)
    prefill: bool  # any prefill rows

    @property
    def phase(self) -> str:
        return "prefill" if self.prefill else "decode"


def step_shape(
    counts: Sequence[int],
    starts: Sequence[int],
    num_paged: int,
    prefill_paged: bool,
    logit_rows: int,
    lm_head_calls: int,
) -> StepShape:
    """The shape of a pass over rows that compute ``counts[i]`` new tokens after ``starts[i]``
    cached ones. The first ``num_paged`` rows (decodes, verifications) attend through the pages,
    reading their whole context there (the new tokens' K/V is stored first); the rest are
    prefill chunks, which do so too when ``prefill_paged`` and otherwise attend over their fresh
    K/V, reading nothing from the cache. Row ``i``'s new tokens sit at positions
    ``starts[i] .. starts[i] + counts[i] - 1``, so they attend to ``counts[i] * starts[i] +
    counts[i] * (counts[i] + 1) / 2`` positions in all. Sums over host lists, no per-row objects."""
    tokens = sum(counts)
    squares = sum(map(mul, counts, counts))
    attended = sum(map(mul, counts, starts)) + (squares + tokens) // 2
    paged_rows = len(counts) if prefill_paged else num_paged
    kv_read = sum(counts[:paged_rows]) + sum(starts[:paged_rows])
    return StepShape(
        tokens=tokens,
        attended=attended,
        kv_read_tokens=kv_read,
        logit_rows=logit_rows,
        lm_head_calls=lm_head_calls,
        prefill=len(counts) > num_paged,
    )


@dataclass(frozen=True)
class ModelCost:
    """One rank's model as the roofline counts it: its shape and how it is stored."""

    shape: ModelShape
    storage: Storage

    def cost(self, step: StepShape) -> Cost:
        """FLOPs and bytes of one forward pass of ``step``'s shape (see the module docstring)."""
        m, s = self.shape, self.storage
        flops = (
            2.0 * m.linear_params * step.tokens
            + 4.0 * m.num_layers * m.num_heads * m.head_dim * step.attended
            + 2.0 * m.hidden_size * m.lm_head_rows * step.logit_rows
        )
        moved = (
            s.layer_weight_bytes
            + s.lm_head_bytes * step.lm_head_calls
            + s.embedding_row_bytes * step.tokens
            + s.kv_token_bytes * (step.kv_read_tokens + step.tokens)  # read, then written
        )
        return Cost(flops, moved)
