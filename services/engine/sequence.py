"""A request's state inside the engine: its tokens, its blocks, how far its KV is computed, and
where it is in its lifecycle, ``SequenceStatus``.

Only the scheduler changes a status (``services/engine/scheduler.py``), on the engine thread:
workers post commands (``add_request``, ``kv_ready``, ``kv_failed``, ``abort``, ``release``) and
act on what each step returns (tokens, and ``KVPull``s for blocks just reserved)::

    add_request(remote_kv=True): the prompt's        add_request(): computed here (a decode
      KV is on a prefill worker (a KV handle)        worker's local prefill, a prefill worker)
                 |                                         |
                 v                                         |
              WAITING  <-----------------------------------'
                 |   one queue in arrival order; admission (Scheduler.schedule) takes the head
                 |   when its blocks fit, else everyone behind it waits too. A local one goes
                 |   straight to RUNNING; a remote one gets its blocks reserved and is handed
                 v   to the worker as a KVPull in that step's result
    WAITING_FOR_REMOTE_KV
                 |   the worker pulls the prefill worker's blocks over UCX straight into the
                 |   reserved ones, releases the prefill worker's lease, and answers once:
                 |-- kv_ready ----------------------------------> RUNNING
                 |-- kv_failed, --kv-failure-policy recompute --> WAITING (at the front: the
                 |                                                 prompt is computed here)
                 '-- kv_failed, --kv-failure-policy fail -------> FINISHED "error" (an error
                                                                   item, never text)
              RUNNING  --- one token per step for every running sequence (more when it
                 |             verifies a speculative draft: services/engine/spec)
                 |-- out of blocks: the newest is preempted ---> PREEMPTED -> WAITING's front,
                 |                                                re-admitted and recomputed
                 |-- stop token / max_tokens / context full ---> FINISHED "stop" / "length"
                 '-- prefill-only engine, prompt done ----------> PREFILLED: parked with its
                                                                   blocks (the prefill worker
                                                                   leases them for the pull)
                                                                   until release -> FINISHED

    abort (cancel, deadline before the first token, engine failure): FINISHED at once from
    any status but WAITING_FOR_REMOTE_KV, whose blocks the pull is still writing: it finishes
    when the pull answers. A pull handed out for a request the worker has already dropped is
    answered with kv_failed without pulling. A request whose first token already ends it
    finishes when it is added: nothing is pulled. A doctor probe's block is held as a
    PREFILLED sequence (``hold_block``) until release.

A request with ``sampling.n > 1`` runs as one sequence (choice 0) until its prompt's KV is
complete - computed here, or pulled - and then forks the other choices, which share the
prompt's blocks (``sequence_group.py``). Outputs name their choice (``index``); the request
ends when its last choice ends (``request_finished``), and an abort may end one choice only.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING

from pdserve.shared.kv.layout import chain_root, identity_keys
from pdserve.shared.sampling import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    import torch


class SequenceStatus(Enum):
    WAITING = auto()  # queued for admission (blocks not reserved yet)
    WAITING_FOR_REMOTE_KV = auto()  # blocks reserved, the prompt's KV is being pulled into them
    RUNNING = auto()  # in the continuous batch
    PREEMPTED = auto()  # blocks taken back; queued at the front to be recomputed
    PREFILLED = auto()  # holds its blocks, not scheduled: a prefill-only engine's parked KV
    FINISHED = auto()  # blocks freed; ``finish_reason`` says why


class Sequence:
    def __init__(
        self,
        bus_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        seed: int,
        arrival: float,
        index: int = 0,
    ) -> None:
        self.bus_id = bus_id
        # The choice this sequence generates (sampling.n > 1: choices 1.. are forked from
        # choice 0 once its prompt's KV is complete, see ``sequence_group.py``), and its name in the
        # engine: the request id for choice 0, "<request id>#<index>" for the others.
        self.index = index
        self.seq_id = bus_id if index == 0 else f"{bus_id}#{index}"
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        # the parent of its first block's hash: its cache salt's chain (shared/kv/layout.py)
        self.hash_root = chain_root(sampling.cache_salt)
        # Effective seed: the request's own, or one the engine drew. Sampling noise is a pure
        # function of (seed, output index), so preemption and batching never change results.
        self.seed = seed
        self.arrival = arrival
        self.status = SequenceStatus.WAITING
        # The prompt's KV comes from a prefill worker: admission reserves blocks for it and the
        # worker pulls into them instead of the engine computing it.
        self.remote_kv = False
        self.num_computed_tokens = 0
        self.num_prefix_hit_tokens = 0  # prompt tokens whose KV was reused from the prefix cache
        self.block_table: list[int] = []
        # Set when the sequence ends - or, while a pull writes into its blocks, when it is told to
        # end (abort): it finishes with this reason once the pull is over.
        self.finish_reason: str | None = None
        # Prompt log-probs gathered so far, chunk by chunk (entry j scores prompt token j+1);
        # they go out with the output that completes the prefill.
        self.prompt_logprobs_so_far = TokenLogprobs(top_k=sampling.prompt_logprobs or 0)
        # Speculative decoding (``services/engine/spec``): the tokens drafted to follow the
        # last one, verified in the coming step (empty: a plain decode), and their draft
        # distributions [k, V] when a draft model made them (None: point masses, n-gram).
        self.spec_token_ids: list[int] = []
        self.spec_probs: torch.Tensor | None = None
        # the LoRA adapter it runs under (None: the base model) and its slot once admission
        # pinned it (0 until then, and for the base model)
        self.lora_name: str | None = None
        self.lora_slot = 0

    @property
    def kv_identity(self) -> tuple[str, ...]:
        """What besides its tokens makes this sequence's KV its own: the LoRA adapter. It enters
        the first block's hash, so prefix hits never cross adapters."""
        return identity_keys(self.lora_name)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt log-probs are asked and not out yet. They go out with the first output token
        (or the end of the prefill when ``max_tokens`` is 0), from here or from the prefill
        worker that sampled it: a sequence holding output tokens never gathers them again."""
        return self.sampling.prompt_logprobs is not None and self.num_output_tokens == 0

    def prompt_logprobs_to_send(self) -> TokenLogprobs | None:
        """The prompt log-probs for the output that completes the prefill: None unless asked,
        not out yet and all gathered here (a sequence forked off another one gathers none)."""
        if not self.needs_prompt_logprobs:
            return None
        done = len(self.prompt_logprobs_so_far) == max(0, self.num_prompt_tokens - 1)
        return self.prompt_logprobs_so_far if done else None

    def cut_draft(self, k: int) -> None:
        """Keep the first ``k`` tokens of the speculative draft (none when ``k <= 0``)."""
        if k <= 0:
            self.spec_token_ids, self.spec_probs = [], None
        elif k < len(self.spec_token_ids):
            self.spec_token_ids = self.spec_token_ids[:k]
            if self.spec_probs is not None:
                self.spec_probs = self.spec_probs[:k]

    def append_tokens(
        self, tokens: list[int], eos_token_ids: tuple[int, ...], max_model_len: int
    ) -> tuple[list[int], str | None]:
        """Append a row's tokens up to the first that ends the sequence (a stop token or EOS
        among accepted drafts ends it there, as it would one token per step); returns those
        appended and why the sequence ended, if it did."""
        for count, token in enumerate(tokens, start=1):
            self.token_ids.append(token)
            reason = self.ended_by(eos_token_ids, max_model_len)
            if reason is not None:
                return tokens[:count], reason
        return tokens, None

    def ended_by(self, eos_token_ids: tuple[int, ...], max_model_len: int) -> str | None:
        """Why the sequence is done after its last token ("stop", "length"), or None."""
        if self.num_output_tokens == 0:
            return None
        sp = self.sampling
        last = self.last_token
        if last in sp.stop_token_ids or (not sp.ignore_eos and last in eos_token_ids):
            return "stop"
        if self.num_output_tokens >= sp.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.name})"
        )
