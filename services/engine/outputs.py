"""What a step passes along, as plain values: the scheduler's batch for the runner
(``ScheduledBatch``), the runner's output for the scheduler (``RunnerOutput``), and what the
engine hands out - each step's result, and a snapshot of its load for workers and metrics, made
on the engine thread and read anywhere."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.shared.sampling import TokenLogprobs
from pdserve.shared.telemetry.roofline import Roofline

if TYPE_CHECKING:  # the spec package loads models; the scheduler's tests import this module
    from pdserve.services.engine.sequence import Sequence
    from pdserve.services.engine.spec.speculator import SpecCounters


@dataclass
class ScheduledBatch:
    """What the scheduler picked for a step: rows to compute, and blocks reserved for pulls."""

    seqs: list[Sequence]  # decodes (one new token each) first, then prefill chunks
    num_new_tokens: list[int]
    num_decodes: int
    pulls: list[Sequence] = field(default_factory=list)  # blocks just reserved for remote KV
    # after the decodes: rows verifying a draft (1 + len(seq.spec_token_ids) tokens each)
    num_verifies: int = 0

    @classmethod
    def build(cls, rows: list[tuple[Sequence, int]], pulls: list[Sequence]) -> ScheduledBatch:
        """The batch of ``rows`` (sequence, tokens to compute). Decode attention serves
        q_len == 1 rows: they come first, then verification rows (attended as a group of
        their own), then prefill chunks."""
        rows = sorted(rows, key=lambda row: 1 if row[0].spec_token_ids else 0 if row[1] == 1 else 2)
        num_verifies = sum(1 for s, _ in rows if s.spec_token_ids)
        num_decodes = sum(1 for s, n in rows if n == 1 and not s.spec_token_ids)
        return cls([s for s, _ in rows], [n for _, n in rows], num_decodes, pulls, num_verifies)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass
class StepInputs:
    """What every rank needs for a step's forward pass, as plain host lists: rank 0 builds it
    from the batch and sends it to the other ranks once per step (``parallel/``)."""

    input_ids: list[int]  # the flat batch: each row's new tokens (a verification row's drafts last)
    counts: list[int]  # new tokens per row
    starts: list[int]  # tokens of each row already in the cache
    block_tables: list[list[int]]
    num_decodes: int
    num_verifies: int
    read: list[int]  # flat positions whose final hidden states are read (sampling, log-probs)
    num_sampled: int = 0  # the first of ``read`` that sample; the rest are prompt log-probs
    # fork copies (src, dst) made on rank 0 since the last step: the other ranks' caches make
    # them before this pass, which is the first that may write into those blocks
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # each row's LoRA slot (services/engine/lora), empty when the engine serves no adapters
    lora_slots: list[int] = field(default_factory=list)
    # TP > 1: adapters rank 0 loaded into slots since the last step, (slot, name, directory):
    # the other ranks load their cut of each before this pass (services/engine/lora/sharding.py)
    lora_loads: list[tuple[int, str, str]] = field(default_factory=list)


@dataclass
class RunnerOutput:
    """What one forward pass produced, keyed by index in ``ScheduledBatch.seqs``
    (``Scheduler.update_from_output`` applies it)."""

    # the tokens each sequence whose last token was computed emits: the one it sampled, or
    # for a verified draft the accepted drafts and the token after them (1 + accepted)
    sampled: dict[int, list[int]] = field(default_factory=dict)
    drafted: dict[int, int] = field(default_factory=dict)  # draft tokens verified, where any
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # of them, where asked
    # prompt log-probs this chunk gathered (to append to the sequence's), where asked
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    inputs: StepInputs | None = None  # what the pass ran on (the engine's step cost reads it)


@dataclass
class StepOutput:
    bus_id: str
    new_token_ids: list[int]
    # Of choice ``index``: "stop", "length", "error" (e.g. a failed KV pull under the fail
    # policy: it ends the whole request), or None while the choice goes on. Aborted choices
    # produce no output.
    finish_reason: str | None
    num_prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    error: str | None = None  # with finish_reason "error"
    # prefill-only engine: the sequence is parked holding these blocks, which hold the KV of
    # ``num_kv_tokens`` tokens, until ``release`` (with sampling.n > 1 even when its first token
    # ended choice 0: the decode worker forks the other choices from this KV)
    kv_block_ids: list[int] | None = None
    num_kv_tokens: int = 0
    index: int = 0  # the choice of a request with sampling.n > 1
    logprobs: TokenLogprobs | None = None  # of new_token_ids (sampling.logprobs is set)
    # of the prompt's tokens after the first (sampling.prompt_logprobs is set): on the output
    # that completes the prompt's prefill
    prompt_logprobs: TokenLogprobs | None = None
    # This output ends the request's last unfinished choice: the request is over (with n == 1,
    # exactly when finish_reason is set; aborted choices end without an output).
    request_finished: bool = False
    # speculative decoding: draft tokens this step verified for the choice, and how many of
    # them it accepted (new_token_ids holds those and the token after them)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class StepStats:
    num_seqs: int = 0  # 0: no forward pass ran (the step only applied commands or reserved)
    num_decodes: int = 0
    num_tokens: int = 0
    seconds: float = 0.0
    # the sequences that prefilled (a chunk) in this forward -> their prefix-cache hit tokens
    prefill_seqs: dict[str, int] = field(default_factory=dict)
    # speculative decoding: drafts verified, their tokens, and the tokens accepted
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # the roofline: what the pass computed and moved (the engine: step_cost.py), and where that
    # sat against the machine's peaks (the worker, on its event loop: roofline_metrics.py)
    flops: float = 0.0
    bytes: float = 0.0
    roofline: Roofline | None = None

    @property
    def phase(self) -> str:
        """The pass's phase: "prefill" when it computed any prompt chunk, else "decode"."""
        return "prefill" if self.prefill_seqs else "decode"

    @classmethod
    def of(cls, batch: ScheduledBatch) -> StepStats:
        """The counts of a forward pass over ``batch`` (``seconds`` and drafts: added later)."""
        prefills = batch.seqs[batch.num_decodes + batch.num_verifies :]
        return cls(
            num_seqs=len(batch.seqs),
            num_decodes=batch.num_decodes + batch.num_verifies,
            num_tokens=batch.num_tokens,
            prefill_seqs={s.bus_id: s.num_prefix_hit_tokens for s in prefills},
        )

    def count_draft(self, num_drafted: int, num_accepted: int) -> None:
        self.spec_drafts += 1
        self.spec_draft_tokens += num_drafted
        self.spec_accepted_tokens += num_accepted


@dataclass
class KVPull:
    """The engine reserved ``block_ids`` for a sequence whose prompt KV a prefill worker holds:
    the worker pulls into them and answers ``kv_ready`` or ``kv_failed`` (exactly once)."""

    bus_id: str
    block_ids: list[int]


@dataclass
class StepResult:
    outputs: list[StepOutput]
    pulls: list[KVPull]
    stats: StepStats
    start_ns: int  # wall clock, for spans
    end_ns: int


@dataclass(frozen=True)
class EngineStats:
    """The engine's load after its latest step: for heartbeats, metrics and probes."""

    total_blocks: int
    free_blocks: int
    running: int = 0
    waiting: int = 0  # queued for admission (including requests whose KV will be pulled)
    pulling: int = 0  # blocks reserved, KV being pulled
    preemptions: int = 0  # since start
    late_prompts: int = 0  # prompts that waited past --prompt-deadline-ms, since start
    prefix_queries: int = 0  # full prompt blocks looked up in the prefix cache, since start
    prefix_hits: int = 0  # ... and found there
    spec: SpecCounters | None = None  # speculative decoding since start (None: off)

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks
