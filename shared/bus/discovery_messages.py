"""Discovery on the bus: what workers say about themselves to every gateway (and router).

``WorkerLoad`` heartbeats on ``{ns}.load.{role}.{worker}`` (also the answer to a ping on
``{ns}.ping.{worker}``), ``WorkerGone`` when a worker leaves or rejoins after a reconnect, and
``KVEvents`` on ``{ns}.kv.{worker}``: what each KV tier holds, for KV-aware routing. Read by
``shared/discovery/`` (the registry, the publishers) and by the decode workers, which keep
their KV endpoints to the prefill workers from the heartbeats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pdserve.shared.bus.wire_fields import (
    MAX_ADAPTER_CHARS,
    MAX_KV_EVENT_HASHES,
    MAX_KV_EVENT_TOKENS,
    MAX_TOKENS,
    MAX_UCX_ADDRESS_CHARS,
    UINT64_MAX,
    amount,
    bounded,
    count,
    ident,
    seconds,
    text,
    tokens,
)

ROLES = ("prefill", "decode")
# where a worker holds a KV block: its device pool, then the offload tiers (issue 33), fastest first
KV_TIERS = ("device", "host", "disk")


MAX_ADAPTERS = 256  # LoRA adapters a worker may advertise


@dataclass
class WorkerLoad:
    TYPE: ClassVar[str] = "worker_load"
    worker_id: str = ident()
    role: str = text(max_len=16, choices=ROLES)
    model: str = text(max_len=256)
    free_blocks: int = count()
    total_blocks: int = count()
    running: int = count()
    waiting: int = count()
    draining: bool = bounded(default=False)
    ucx_address: str = text(max_len=MAX_UCX_ADDRESS_CHARS, default="")  # prefill: KV server
    metrics_url: str | None = text(max_len=512, default=None)
    ts: float = seconds(default=0.0)
    # decode workers prefill prompts shorter than this themselves: the gateway then skips the
    # prefill hop and sends DecodeRequest(kv=None)
    local_prefill_threshold: int = count(hi=MAX_TOKENS, default=0)
    kv_stream: bool = bounded(default=False)  # a decode worker that pulls KV layer by layer
    block_size: int = count(hi=1 << 16, default=0)
    # prefill workers: highest lease count they accept; 0 = unknown
    max_queue: int = count(default=0)
    # random per process start: a worker restarted under the same id (compose restarts keep
    # hostname and often pid) is a new incarnation, and whatever the old one held is gone
    instance: str = text(max_len=64, default="")
    # decode workers running speculative decoding: totals since start (the gateway's /metrics
    # re-exports them, so a benchmark against the gateway can report acceptance)
    spec_drafts: int = count(default=0)
    spec_draft_tokens: int = count(default=0)
    spec_accepted_tokens: int = count(default=0)
    # shared.kv_layout.layout_id of the worker's KV fingerprint: the gateway pairs prefill and
    # decode workers whose blocks fit ("": unknown, pairs with anything)
    kv_layout: str = text(max_len=32, default="")
    # roofline (shared/telemetry/roofline.py): forward-pass totals since start per phase (a step
    # with any prefill rows is "prefill"), and the measured peaks of the worker's device (0: none)
    prefill_flops: float = amount()
    prefill_bytes: float = amount()
    prefill_busy_seconds: float = amount()
    decode_flops: float = amount()
    decode_bytes: float = amount()
    decode_busy_seconds: float = amount()
    peak_flops_per_second: float = amount()
    peak_bytes_per_second: float = amount()
    # KV offload tiers: loading one block from host memory / disk, as a fraction of computing
    # it (measured by the worker; 0: not measured, the router's defaults apply)
    kv_host_load_cost: float = amount()
    kv_disk_load_cost: float = amount()
    # services/standby.py: a warm-pool or unverified worker, never routed to until promoted
    standby: bool = bounded(default=False)
    model_version: str = text(max_len=128, default="")  # shown by /v1/models; rollouts use it
    # multi-LoRA: the adapters it serves (--lora-modules: /v1/models lists them) and those
    # resident now (the router prefers a worker that need not load the request's adapter)
    lora_adapters: list[str] = bounded(default=[], max_len=MAX_ADAPTERS)
    lora_resident: list[str] = bounded(default=[], max_len=MAX_ADAPTERS)


@dataclass
class KVEvents:
    """What entered and left one of a worker's KV tiers (``tier``, ``KV_TIERS``), for
    KV-aware routers. Deltas carry the net change since the previous message: ``stored`` hashes
    are in the tier now, ``removed`` ones are not (disjoint lists). Every few seconds a snapshot
    (the whole tier, over ``parts`` messages under one ``seq``) replaces what a gateway knew,
    so a late or lossy one converges. ``seq`` counts messages per worker incarnation.
    A delta's stored blocks may carry their lineage (BlockStored): ``parents[i]`` is the hash
    before ``stored[i]`` in its chain (ROOT_HASH, 0, for a first block), ``token_ids`` their
    tokens back to back; both empty when unknown. A block computed under a LoRA adapter names it
    (vLLM's ``lora_name``): ``lora_index[i]`` is 0 for the base model, else ``stored[i]``'s
    adapter is ``lora_names[lora_index[i] - 1]`` (an index, not the name, per block: one byte
    where a name may take 256); both empty when no block has lineage or an adapter.
    ``cleared``: every block of the tier went (AllBlocksCleared) before this message's lists
    apply."""

    TYPE: ClassVar[str] = "kv_events"
    worker_id: str = ident()
    instance: str = text(max_len=64)
    block_size: int = count(lo=1, hi=1 << 16)
    seq: int = count()
    stored: list[int] = bounded(lo=0, hi=UINT64_MAX, max_len=MAX_KV_EVENT_HASHES)
    removed: list[int] = bounded(lo=0, hi=UINT64_MAX, max_len=MAX_KV_EVENT_HASHES)
    snapshot: bool = bounded(default=False)
    part: int = count(hi=1 << 16, default=0)  # snapshots: this message's index among parts
    parts: int = count(lo=1, hi=1 << 16, default=1)
    tier: str = text(max_len=8, choices=KV_TIERS, default="device")
    parents: list[int] = bounded(default=[], lo=0, hi=UINT64_MAX, max_len=MAX_KV_EVENT_HASHES)
    token_ids: list[int] = tokens(max_len=MAX_KV_EVENT_TOKENS, default=[])
    cleared: bool = bounded(default=False)
    lora_names: list[str] = bounded(default=[], max_len=MAX_ADAPTERS)
    lora_index: list[int] = bounded(default=[], lo=0, hi=MAX_ADAPTERS, max_len=MAX_KV_EVENT_HASHES)

    def __post_init__(self) -> None:
        if self.part >= self.parts:
            raise ValueError(f"part {self.part} of {self.parts}")
        if not self.snapshot and self.parts != 1:
            raise ValueError("a delta is one message")
        n = len(self.stored)  # lineage: all of the stored blocks' (none in a snapshot), or none
        if (self.parents or self.token_ids) and (
            self.snapshot or len(self.parents) != n or len(self.token_ids) != n * self.block_size
        ):
            raise ValueError(f"lineage of {len(self.parents)}, {len(self.token_ids)} for {n}")
        if self.lora_index or self.lora_names:
            if len(self.lora_index) != len(self.parents) or not n:
                raise ValueError(f"{len(self.lora_index)} adapter indices for {n} blocks")
            if max(self.lora_index) > len(self.lora_names):
                raise ValueError(f"an adapter index past {len(self.lora_names)} names")
            if any(not name or len(name) > MAX_ADAPTER_CHARS for name in self.lora_names):
                raise ValueError(f"adapter names are 1 to {MAX_ADAPTER_CHARS} characters")


@dataclass
class WorkerGone:
    """A worker's last word when it leaves cleanly (drain finished): drop it from registries.
    ``rejoining``: not gone - its NATS connection broke and is back; it keeps its requests, but
    what it sent or was sent meanwhile may be lost (gateways check), and peers keep its UCX."""

    TYPE: ClassVar[str] = "worker_gone"
    worker_id: str = ident()
    role: str = text(max_len=16, choices=ROLES)
    rejoining: bool = bounded(default=False)
