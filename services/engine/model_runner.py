"""Turns a scheduled batch into tensors, runs the model and samples, all without per-sequence
Python work beyond gathering each sequence's token ids and block table.

A step makes one device-to-host sync: reading the sampled tokens (log-probs, when a sequence
asks for them, are read right after: their work is done by then, so reading them only copies).
The LM head runs only over the positions that are read: the last of each sequence whose next
token is sampled, and the prompt positions whose log-probs are asked (in bounded slices,
``services/engine/logprobs.py``). Everything the host needs to
know (which sequences have cached prefixes, the longest query and key) comes from the host
lists the batch is built from, never from device tensors, and step inputs go up from pinned
buffers with non-blocking copies so the host keeps building while they travel."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from kernels import ops
from services.engine.guided import GuidedDecoder
from services.engine.logits_processing import (
    build_logit_bias,
    build_min_tokens_mask,
    build_penalties,
)
from services.engine.logprobs import (
    LogprobsTensors,
    PromptLogprobsPlan,
    gather_prompt_logprobs,
    token_logprobs,
)
from services.engine.model import AttentionMetadata, LlamaForCausalLM
from services.engine.sampler import SamplingTensors, sample
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import Sequence
from shared.logprobs import TokenLogprobs


@dataclass
class StepRun:
    """What one forward pass produced, keyed by index in ``batch.seqs``."""

    # the sequences whose last token was computed, and the tokens they drew (a host tensor)
    sampling_rows: list[int] = field(default_factory=list)
    tokens: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # of it, where asked
    # prompt log-probs this chunk gathered (to append to the sequence's), where asked
    prompt_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        device: torch.device,
        guided: GuidedDecoder | None = None,
    ) -> None:
        self.model = model
        self.guided = guided  # structured output: the token masks of guided sequences
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.pinned = device.type == "cuda"
        model.bind_kv_cache(kv_cache)

    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        if not self.pinned:
            return torch.tensor(data, dtype=dtype)
        if not len(data):  # e.g. no position read in a middle prompt chunk: nothing to pin
            return torch.empty(0, dtype=dtype, device=self.device)
        host = torch.tensor(data, dtype=dtype, pin_memory=True)
        return host.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepRun:
        """Runs the batch; the sequences whose last token was computed sample (partial prefill
        chunks sample nothing), and the log-probs asked are gathered."""
        seqs, counts, nd = batch.seqs, batch.num_new_tokens, batch.num_decodes
        starts_list = [s.num_computed_tokens for s in seqs]
        input_ids = [
            t
            for s, c, st in zip(seqs, counts, starts_list, strict=True)
            for t in s.token_ids[st : st + c]
        ]
        q_lens = self._tensor(counts)
        starts = self._tensor(starts_list)
        ctx_lens = starts + q_lens
        num_tokens = len(input_ids)
        cu_q = torch.zeros(len(seqs) + 1, dtype=torch.int64, device=self.device)
        cu_q[1:] = q_lens.cumsum(0)
        seq_of_token = torch.repeat_interleave(
            torch.arange(len(seqs), device=self.device), q_lens, output_size=num_tokens
        )
        positions = (
            starts[seq_of_token] + torch.arange(num_tokens, device=self.device) - cu_q[seq_of_token]
        )

        max_blocks = max(len(s.block_table) for s in seqs)
        block_tables = self._tensor(
            [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs], torch.int32
        )
        block_of_token = block_tables[seq_of_token, positions // self.block_size].to(torch.int64)
        slot_mapping = block_of_token * self.block_size + positions % self.block_size

        pre_q = q_lens[nd:]
        pre_k = ctx_lens[nd:]
        has_prefix = any(st > 0 for st in starts_list[nd:])
        decode_tables, decode_lens = block_tables[:nd], ctx_lens[:nd].to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decodes=nd,
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            decode_plan=ops.decode_plan(decode_tables, decode_lens) if nd else None,
            cu_seqlens_q=_cumsum0(pre_q),
            cu_seqlens_k=_cumsum0(pre_k),
            max_seqlen_q=max(counts[nd:], default=0),
            max_seqlen_k=max(
                (st + c for st, c in zip(starts_list[nd:], counts[nd:], strict=True)), default=0
            ),
            prefill_block_tables=block_tables[nd:] if has_prefix else None,
        )
        offsets = list(accumulate(counts, initial=0))
        sampling_rows = [
            i for i, s in enumerate(seqs) if starts_list[i] + counts[i] == s.num_tokens
        ]
        prompt_plan = PromptLogprobsPlan.build(seqs, counts, starts_list, offsets)
        read = [offsets[i + 1] - 1 for i in sampling_rows]
        read += prompt_plan.flat_indices if prompt_plan else []
        hidden = self.model(self._tensor(input_ids), positions, meta, self._tensor(read))

        sampler_out = None
        if sampling_rows:
            st = self._sampling_tensors([seqs[i] for i in sampling_rows])
            sampler_out = sample(self.model.compute_logits(hidden[: len(sampling_rows)]), st)
        prompt_lp = None
        if prompt_plan:
            prompt_lp = gather_prompt_logprobs(
                self.model.compute_logits,
                hidden[len(sampling_rows) :],
                self._tensor(prompt_plan.next_token_ids),
                prompt_plan.k,
            )
        # Everything is queued; the first read-back waits for it, the others only copy.
        run = StepRun()
        if sampler_out is not None:
            run.sampling_rows, run.tokens = sampling_rows, sampler_out.tokens.cpu()
            if sampler_out.logprobs is not None:
                run.logprobs = self._sampled_logprobs(seqs, sampling_rows, sampler_out.logprobs)
        if prompt_plan is not None and prompt_lp is not None:
            host = prompt_lp.cpu()
            run.prompt_logprobs = {
                i: token_logprobs(host, first, stop, k) for i, first, stop, k in prompt_plan.spans
            }
        return run

    def _sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        vocab = self.model.cfg.vocab_size
        temps = [s.sampling.temperature for s in seqs]
        top_ks = [s.sampling.top_k if s.sampling.top_k > 0 else vocab for s in seqs]
        top_ps = [s.sampling.top_p for s in seqs]
        logprob_rows = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
        return SamplingTensors(
            temperatures=self._tensor(temps, torch.float32),
            top_ks=self._tensor(top_ks),
            top_ps=self._tensor(top_ps, torch.float32),
            seeds=self._tensor([s.seed for s in seqs]),
            steps=self._tensor([s.num_output_tokens for s in seqs]),
            needs_filter=any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps),
            all_greedy=all(t == 0 for t in temps),
            penalties=build_penalties(seqs, vocab, self._tensor),
            logit_bias=build_logit_bias(seqs, self._tensor),
            min_tokens_mask=build_min_tokens_mask(
                seqs, self.model.cfg.eos_token_ids, vocab, self._tensor
            ),
            token_bitmask=self.guided.bitmask(seqs, self.device) if self.guided else None,
            logprob_rows=self._tensor(logprob_rows) if logprob_rows else None,
            num_logprobs=max((seqs[i].sampling.logprobs or 0 for i in logprob_rows), default=0),
        )

    @staticmethod
    def _sampled_logprobs(
        seqs: list[Sequence], sampling_rows: list[int], gathered: LogprobsTensors
    ) -> dict[int, TokenLogprobs]:
        """Split the step's log-probs per sequence (rows asking for them, in sampling order)."""
        host = gathered.cpu()
        asking = [i for i in sampling_rows if seqs[i].sampling.logprobs is not None]
        return {
            i: token_logprobs(host, row, row + 1, seqs[i].sampling.logprobs or 0)
            for row, i in enumerate(asking)
        }


def _cumsum0(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(len(x) + 1, dtype=torch.int32, device=x.device)
    out[1:] = x.cumsum(0)
    return out
