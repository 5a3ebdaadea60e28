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

from collections.abc import Callable
from itertools import accumulate

import torch

from pdserve.kernels import ops
from pdserve.services.engine.decode_graph import DecodeGraphs
from pdserve.services.engine.guided import GuidedDecoder
from pdserve.services.engine.logprobs import (
    PROMPT_SLICE,
    PromptLogprobsPlan,
    gather_prompt_logprobs,
    token_logprobs,
)
from pdserve.services.engine.model import AttentionMetadata, ChunkGroup, LlamaForCausalLM
from pdserve.services.engine.outputs import RunnerOutput, ScheduledBatch, StepInputs
from pdserve.services.engine.sampler import (
    SamplerOutput,
    SamplingTensors,
    build_logit_bias,
    build_min_tokens_mask,
    build_penalties,
    sample,
)
from pdserve.services.engine.sequence import Sequence
from pdserve.services.engine.spec import verify
from pdserve.services.engine.spec.rejection import DraftDistributions
from pdserve.services.engine.spec.verify import DraftPosition

VERIFY_IN_DECODE = True


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
        # where speculative verification rows are attended: with the decodes (the multi-query
        # decode op) or as their own varlen group (prefill attention over the pages)
        self.verify_in_decode = VERIFY_IN_DECODE
        # A quantized cache: prompt chunks too attend over the keys as stored (written first,
        # read back through the pages), not the fresh float ones, so a token sees the same keys
        # whether they came from this chunk, an earlier one, a prefix hit, a fork or a prefill
        # worker. Otherwise a greedy request's n choices could disagree on their first token.
        self.prefill_reads_cache = model.kv_spec is not None and model.kv_spec.quantized
        model.bind_kv_cache(kv_cache)
        # TP > 1: rank 0's link to the other ranks (parallel/group.py), which gets each step's
        # inputs; fork copies wait in ``block_copies`` to travel with the next step
        self.ranks = None
        self.block_copies: list[tuple[int, int]] = []
        # the compiled decode step (decode_graph.py), where the engine made one
        self.graphs: DecodeGraphs | None = None
        # LoRA adapters are served (services/engine/lora): each row carries its slot
        self.serves_lora = False
        # TP > 1 with adapters: the slot loads the other ranks have yet to make (AdapterCache)
        self.lora_loads: Callable[[], list[tuple[int, str, str]]] | None = None

    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        if not self.pinned:
            return torch.tensor(data, dtype=dtype)
        if not len(data):  # e.g. no position read in a middle prompt chunk: nothing to pin
            return torch.empty(0, dtype=dtype, device=self.device)
        host = torch.tensor(data, dtype=dtype, pin_memory=True)
        return host.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        """Runs the batch; the sequences whose last token was computed sample (partial prefill
        chunks sample nothing; a verification row samples at its every position), and the
        log-probs asked are gathered."""
        seqs, counts = batch.seqs, batch.num_new_tokens
        starts_list = [s.num_computed_tokens for s in seqs]
        input_ids = [
            t
            for s, c, st in zip(seqs, counts, starts_list, strict=True)
            for t in _row_tokens(s, st, c)
        ]
        offsets = list(accumulate(counts, initial=0))
        drafts = [len(s.spec_token_ids) for s in seqs]
        sampling_rows = [
            i for i, s in enumerate(seqs) if starts_list[i] + counts[i] - drafts[i] == s.num_tokens
        ]
        prompt_plan = PromptLogprobsPlan.build(seqs, counts, starts_list, offsets)
        # every position of a verification row samples: its last token's, then each draft's
        read = [
            p for i in sampling_rows for p in range(offsets[i + 1] - 1 - drafts[i], offsets[i + 1])
        ]
        num_sampled = len(read)
        read += prompt_plan.flat_indices if prompt_plan else []
        inputs = StepInputs(
            input_ids=input_ids,
            counts=counts,
            starts=starts_list,
            block_tables=[s.block_table for s in seqs],
            num_decodes=batch.num_decodes,
            num_verifies=batch.num_verifies,
            read=read,
            num_sampled=num_sampled,
            lora_slots=[s.lora_slot for s in seqs] if self.serves_lora else [],
        )
        if self.ranks is not None:
            inputs.block_copies, self.block_copies = self.block_copies, []
            if self.lora_loads is not None:
                inputs.lora_loads = self.lora_loads()
            self.ranks.send_step(inputs)
        try:
            hidden = self.forward(inputs)
        except RuntimeError as exc:  # gloo/NCCL's error when a rank dies mid-step: say which
            if self.ranks is not None:
                self.ranks.raise_if_lost(exc)
            raise

        sampler_out = None
        sampling_seqs = [seqs[i] for i in sampling_rows]
        if sampling_rows:
            rows = verify.sampling_rows(sampling_seqs)
            st = self._sampling_tensors(rows, sampling_seqs)
            sampler_out = sample(self.model.compute_logits(hidden[:num_sampled]), st)
        prompt_lp = None
        if prompt_plan:
            prompt_lp = gather_prompt_logprobs(
                self.model.compute_logits,
                hidden[num_sampled:],
                self._tensor(prompt_plan.next_token_ids),
                prompt_plan.k,
            )
        # Everything is queued; the first read-back waits for it, the others only copy.
        run = RunnerOutput(inputs=inputs)
        if sampler_out is not None:
            self._emitted(run, sampling_rows, sampling_seqs, sampler_out)
        if prompt_plan is not None and prompt_lp is not None:
            host = prompt_lp.cpu()
            run.prompt_logprobs = {
                i: token_logprobs(host, first, stop, k) for i, first, stop, k in prompt_plan.spans
            }
        return run

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over the step's flat batch: the final hidden states at ``inputs.read``.
        Every rank runs this (the other ranks from the inputs rank 0 sent them)."""
        if self.graphs is not None and self.graphs.serves(inputs):
            return self.graphs.run(inputs)
        meta, positions = self._metadata(inputs)
        return self.model(
            self._tensor(inputs.input_ids), positions, meta, self._tensor(inputs.read)
        )

    def follow_logits(self, inputs: StepInputs, hidden: torch.Tensor) -> None:
        """A rank other than 0 with a vocab-parallel LM head: the head calls rank 0 makes in
        ``run`` (the sampled rows, then the prompt log-probs' slices), for its gathers."""
        if not self.model.vocab_parallel:
            return
        n = inputs.num_sampled
        if n:
            self.model.compute_logits(hidden[:n])
        rest = hidden[n:]
        for s in range(0, rest.shape[0], PROMPT_SLICE):
            self.model.compute_logits(rest[s : s + PROMPT_SLICE])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked choices: block ``dst`` becomes a copy of ``src``."""
        if copies:
            src, dst = zip(*copies, strict=True)
            self.kv_cache[list(dst)] = self.kv_cache[list(src)]
            if self.ranks is not None:
                self.block_copies += copies

    def _metadata(self, inputs: StepInputs) -> tuple[AttentionMetadata, torch.Tensor]:
        """The attention metadata of the flat token batch, and each token's position."""
        counts, starts_list, tables = inputs.counts, inputs.starts, inputs.block_tables
        nd, nv, num_rows = inputs.num_decodes, inputs.num_verifies, len(inputs.counts)
        num_tokens = len(inputs.input_ids)
        q_lens = self._tensor(counts)
        starts = self._tensor(starts_list)
        ctx_lens = starts + q_lens
        cu_q = torch.zeros(num_rows + 1, dtype=torch.int64, device=self.device)
        cu_q[1:] = q_lens.cumsum(0)
        seq_of_token = torch.repeat_interleave(
            torch.arange(num_rows, device=self.device), q_lens, output_size=num_tokens
        )
        positions = (
            starts[seq_of_token] + torch.arange(num_tokens, device=self.device) - cu_q[seq_of_token]
        )

        max_blocks = max(len(t) for t in tables)
        block_tables = self._tensor([t + [0] * (max_blocks - len(t)) for t in tables], torch.int32)
        block_of_token = block_tables[seq_of_token, positions // self.block_size].to(torch.int64)
        slot_mapping = block_of_token * self.block_size + positions % self.block_size
        # each token's LoRA slot; none when no row of the step uses an adapter
        lora_slots = None
        if any(inputs.lora_slots):
            lora_slots = self._tensor(inputs.lora_slots)[seq_of_token]

        def group(lo: int, hi: int) -> ChunkGroup | None:
            if lo == hi:
                return None
            paged = self.prefill_reads_cache or any(st > 0 for st in starts_list[lo:hi])
            return ChunkGroup(
                num_tokens=sum(counts[lo:hi]),
                cu_seqlens_q=_cumsum0(q_lens[lo:hi]),
                cu_seqlens_k=_cumsum0(ctx_lens[lo:hi]),
                max_seqlen_q=max(counts[lo:hi]),
                max_seqlen_k=max(starts_list[j] + counts[j] for j in range(lo, hi)),
                block_tables=block_tables[lo:hi] if paged else None,
            )

        if self.verify_in_decode and nv:
            # verification rows join decode attention as several queries per sequence
            nq = nd + nv
            tables, lens = block_tables[:nq], ctx_lens[:nq].to(torch.int32)
            cu, longest = _cumsum0(q_lens[:nq]), max(counts[:nq])
            meta = AttentionMetadata(
                slot_mapping=slot_mapping,
                num_decodes=nq,
                decode_block_tables=tables,
                decode_context_lens=lens,
                decode_plan=ops.decode_plan(tables, lens, cu, longest),
                verify=None,
                prefill=group(nq, num_rows),
                num_decode_tokens=sum(counts[:nq]),
                decode_cu_seqlens_q=cu,
                decode_max_seqlen_q=longest,
                lora_slots=lora_slots,
            )
            return meta, positions
        decode_tables, decode_lens = block_tables[:nd], ctx_lens[:nd].to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decodes=nd,
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            decode_plan=ops.decode_plan(decode_tables, decode_lens) if nd else None,
            verify=group(nd, nd + nv),
            prefill=group(nd + nv, num_rows),
            lora_slots=lora_slots,
        )
        return meta, positions

    def _emitted(
        self,
        run: RunnerOutput,
        sampling_rows: list[int],
        seqs: list[Sequence],
        out: SamplerOutput,
    ) -> None:
        """Read the sampled tokens back (the step's one sync) and keep, per sequence, what it
        emits: a verified draft's accepted prefix and the token after it."""
        drafts = [s.spec_token_ids for s in seqs]
        emitted = verify.emitted_tokens(out.tokens.cpu(), drafts)
        host_lp = out.logprobs.cpu() if out.logprobs is not None else None
        lp_first = 0  # log-probs come for the rows of sequences that ask, in order
        for i, seq, draft, tokens in zip(sampling_rows, seqs, drafts, emitted, strict=True):
            run.sampled[i] = tokens
            if draft:
                run.drafted[i] = len(draft)
            k = seq.sampling.logprobs
            if k is not None and host_lp is not None:
                run.logprobs[i] = token_logprobs(host_lp, lp_first, lp_first + len(tokens), k)
                lp_first += 1 + len(draft)

    def _sampling_tensors(
        self, rows: list[Sequence | DraftPosition], seqs: list[Sequence] | None = None
    ) -> SamplingTensors:
        """The tensors of the step's sampling ``rows``: ``seqs`` and their drafts' rows
        (``spec/verify.py``; without ``seqs``, ``rows`` are sequences with no draft)."""
        vocab = self.model.cfg.vocab_size
        temps = [s.sampling.temperature for s in rows]
        top_ks = [s.sampling.top_k if s.sampling.top_k > 0 else vocab for s in rows]
        top_ps = [s.sampling.top_p for s in rows]
        logprob_rows = [i for i, s in enumerate(rows) if s.sampling.logprobs is not None]
        return SamplingTensors(
            temperatures=self._tensor(temps, torch.float32),
            top_ks=self._tensor(top_ks),
            top_ps=self._tensor(top_ps, torch.float32),
            seeds=self._tensor([s.seed for s in rows]),
            steps=self._tensor([s.num_output_tokens for s in rows]),
            needs_filter=any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps),
            all_greedy=all(t == 0 for t in temps),
            penalties=build_penalties(rows, vocab, self._tensor),
            logit_bias=build_logit_bias(rows, self._tensor),
            min_tokens_mask=build_min_tokens_mask(
                rows, self.model.cfg.eos_token_ids, vocab, self._tensor
            ),
            token_bitmask=self.guided.bitmask(rows, self.device) if self.guided else None,
            logprob_rows=self._tensor(logprob_rows) if logprob_rows else None,
            num_logprobs=max((rows[i].sampling.logprobs or 0 for i in logprob_rows), default=0),
            draft=self._draft_distributions(seqs, len(rows), vocab) if seqs else None,
        )

    def _draft_distributions(
        self, seqs: list[Sequence], num_rows: int, vocab: int
    ) -> DraftDistributions | None:
        """The drafts' tokens and q of a step where some draft came with q (a draft model);
        an n-gram draft in the same step is a point mass. Host lists, then three copies."""
        if all(s.spec_probs is None for s in seqs):
            return None
        token_ids = [-1] * num_rows
        q_rows: list[int] = []  # rows whose q a draft model gave
        point_rows: list[int] = []  # rows of point-mass drafts
        row = 0
        for seq in seqs:
            k = len(seq.spec_token_ids)
            token_ids[row : row + k] = seq.spec_token_ids
            (q_rows if seq.spec_probs is not None else point_rows).extend(range(row, row + k))
            row += k + 1
        probs = torch.zeros(num_rows, vocab, dtype=torch.float32, device=self.device)
        given = [s.spec_probs for s in seqs if s.spec_probs is not None and len(s.spec_token_ids)]
        probs[self._tensor(q_rows)] = torch.cat(given).to(torch.float32)
        if point_rows:
            point_tokens = [token_ids[r] for r in point_rows]
            probs[self._tensor(point_rows), self._tensor(point_tokens)] = 1.0
        return DraftDistributions(self._tensor(token_ids), probs)


def _row_tokens(seq: Sequence, start: int, count: int) -> list[int]:
    """The tokens a row computes: the next ``count`` of ``seq``, its draft last."""
    draft = seq.spec_token_ids
    if not draft:
        return seq.token_ids[start : start + count]
    return seq.token_ids[start : start + count - len(draft)] + draft


def _cumsum0(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(len(x) + 1, dtype=torch.int32, device=x.device)
    out[1:] = x.cumsum(0)
    return out
