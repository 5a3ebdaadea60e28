"""Draft-model speculation (``--speculative draft --draft-model PATH``): a smaller model with the
target's tokenizer drafts up to K tokens for every speculating sequence, one batched forward
pass per draft position.

The draft keeps a paged KV cache of its own (its own ``BlockManager``, as many blocks as the
target's cache, each smaller), filled here on the decode worker: a sequence's first proposal
computes its whole context into the draft cache, later ones only what the draft has not seen.
Pulling the draft's KV from the prefill worker instead would make every prefill worker run the
draft too and move a second cache over UCX for a prompt the draft computes in a fraction of a
target step (measured: ``perf/spec_bench.py``, perf/README.md).

What the draft cache holds is tracked as positions of the sequence's tokens: after a step the
drafts the target accepted are still valid, the rest is overwritten by the next proposal, which
starts at the first position where the sequence and the draft's tokens differ. Blocks are freed
when the sequence leaves the engine (``release``).

Each draft token is drawn from q = softmax(draft logits / T) at the request's temperature (a
point mass on the argmax for greedy requests) with counter-based noise of its own purpose
(``noise.DRAFT``), so a seeded request drafts - and therefore emits - the same tokens every
run; the target's rejection sampler (``rejection.py``) keeps the output distribution exact.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.kernels import ops
from pdserve.services.engine.block_manager import BlockManager
from pdserve.services.engine.loader import load_model
from pdserve.services.engine.model import AttentionMetadata, ChunkGroup, LlamaForCausalLM
from pdserve.services.engine.model_config import ModelConfig
from pdserve.services.engine.noise import DRAFT, purpose_seeds, uniform_noise
from pdserve.services.engine.quant.kv_cache import kv_cache_spec
from pdserve.services.engine.sequence import Sequence
from pdserve.services.engine.spec.proposer import Proposal, Proposer
from pdserve.shared.errors import StartupError
from pdserve.shared.models.resolve import resolve

SHORT_ROWS = 8  # rows of at most this many tokens use decode attention (several queries each)


@dataclass
class _DraftSeq:
    """One sequence's slice of the draft cache (what ``BlockManager`` needs of a sequence)."""

    seq_id: str
    block_table: list[int] = field(default_factory=list)
    base: int = 0  # the sequence's length when it last drafted: positions < base were its own
    drafted: list[int] = field(default_factory=list)  # then at base.. the drafts fed (k - 1)


class DraftModelProposer(Proposer):
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.device = device
        spec = kv_cache_spec(
            "auto", dtype, cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim
        )
        self.kv_cache = spec.allocate(num_blocks, device)
        self.bytes_per_block = spec.bytes_per_block
        model.bind_kv_cache(self.kv_cache)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_cache=False)
        self.seqs: dict[str, _DraftSeq] = {}
        self.step_seconds: float | None = None  # one draft pass over the batch, last propose
        # passes that computed a context into the draft cache (a row of more than a few tokens:
        # a new sequence's prompt), cumulative: what filling the cache here costs
        self.fill_tokens = 0
        self.fill_seconds = 0.0

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Proposal | None]:
        self.step_seconds = None  # measured again below, if anything is drafted
        states, starts, limits, chosen = [], [], [], []
        for i, (seq, limit) in enumerate(zip(seqs, max_tokens, strict=True)):
            state = self.seqs.get(seq.seq_id) or _DraftSeq(seq.seq_id)
            # the draft's KV ends with our last token's (k - 1 drafts need k - 1 more positions)
            if not self.blocks.can_allocate(state, seq.num_tokens + limit - 1):
                continue  # no room in the draft cache: this sequence decodes plainly
            self.seqs[seq.seq_id] = state
            self.blocks.allocate(state, seq.num_tokens + limit - 1)
            states.append(state)
            starts.append(min(_valid(state, seq), seq.num_tokens - 1))
            limits.append(limit)
            chosen.append(i)
        out: list[Proposal | None] = [None] * len(seqs)
        if not chosen:
            return out
        active = [seqs[i] for i in chosen]
        t0 = time.perf_counter()
        width = max(len(s.block_table) for s in states)
        tables = self._tensor(
            [s.block_table + [0] * (width - len(s.block_table)) for s in states], torch.int32
        )
        feeds = [seq.token_ids[start:] for seq, start in zip(active, starts, strict=True)]
        counts = [len(f) for f in feeds]
        ids = self._tensor([t for f in feeds for t in f])
        logits = self._forward(ids, counts, self._tensor(starts), tables, any(starts))
        t1 = time.perf_counter()
        if max(counts) > SHORT_ROWS:
            self.fill_tokens += len(ids)
            self.fill_seconds += t1 - t0
        k_max = max(limits)
        vocab = logits.shape[-1]
        probs = torch.zeros(len(active), k_max, vocab, dtype=torch.float32, device=self.device)
        tokens = torch.zeros(len(active), k_max, dtype=torch.int64, device=self.device)
        temps = self._tensor([s.sampling.temperature for s in active], torch.float32)
        seeds = self._tensor([s.seed for s in active])
        steps = self._tensor([s.num_output_tokens for s in active])
        lengths = self._tensor([s.num_tokens for s in active])
        rows = torch.arange(len(active), device=self.device)
        for j in range(k_max):
            tokens[rows, j], probs[rows, j] = _draw(
                logits, temps[rows], seeds[rows], steps[rows] + j
            )
            # rows that need draft j + 2, from the host's limits (a device nonzero would sync)
            live = [r for r, limit in enumerate(limits) if limit > j + 1]
            if not live:
                break
            rows = self._tensor(live)
            # draft j goes in at the position after the sequence's last token and drafts < j
            logits = self._forward(
                tokens[rows, j], [1] * len(live), lengths[rows] + j, tables[rows]
            )
        drafted = tokens.tolist()  # the one sync of the drafting
        # k drafts take k passes (the catch-up pass drafts the first): what one draft token
        # costs the step, for adaptive K (``cost.py``)
        self.step_seconds = (time.perf_counter() - t0) / k_max
        for r, (i, seq, state, limit) in enumerate(
            zip(chosen, active, states, limits, strict=True)
        ):
            state.base, state.drafted = seq.num_tokens, drafted[r][: limit - 1]
            out[i] = Proposal(drafted[r][:limit], probs[r, :limit])
        return out

    def release(self, seq: Sequence) -> None:
        state = self.seqs.pop(seq.seq_id, None)
        if state is not None:
            self.blocks.free_sequence(state)

    def _forward(
        self,
        ids: torch.Tensor,
        counts: list[int],
        starts: torch.Tensor,
        tables: torch.Tensor,
        has_prefix: bool = True,
    ) -> torch.Tensor:
        """Compute rows of ``counts[i]`` tokens (``ids``, flat) at positions ``starts[i]``..
        into the draft cache (``tables``: each row's blocks); the logits [rows, vocab] at each
        row's last position."""
        q_lens = self._tensor(counts)
        num_tokens = len(ids)
        cu_q = torch.zeros(len(counts) + 1, dtype=torch.int64, device=self.device)
        cu_q[1:] = q_lens.cumsum(0)
        row_of = torch.repeat_interleave(
            torch.arange(len(counts), device=self.device), q_lens, output_size=num_tokens
        )
        positions = starts[row_of] + torch.arange(num_tokens, device=self.device) - cu_q[row_of]
        blocks = tables[row_of, positions // self.block_size].to(torch.int64)
        slots = blocks * self.block_size + positions % self.block_size
        ctx_lens = (starts + q_lens).to(torch.int32)
        cu32 = cu_q.to(torch.int32)
        longest = max(counts)
        if longest <= SHORT_ROWS:  # short rows: paged decode attention, several queries per row
            meta = AttentionMetadata(
                slot_mapping=slots,
                num_decodes=len(counts),
                decode_block_tables=tables,
                decode_context_lens=ctx_lens,
                decode_plan=ops.decode_plan(tables, ctx_lens, cu32, longest),
                verify=None,
                prefill=None,
                num_decode_tokens=num_tokens,
                decode_cu_seqlens_q=cu32,
                decode_max_seqlen_q=longest,
            )
        else:  # a context computed into the cache: varlen causal attention over the pages
            cu_k = torch.zeros_like(cu32)
            cu_k[1:] = ctx_lens.cumsum(0)
            # the longest context bounded by the tables' width (a host int: no device read);
            # rows that all start at 0 attend over their own keys, not gathered pages
            longest_k = int(tables.shape[1]) * self.block_size
            paged = tables if has_prefix else None
            group = ChunkGroup(
                num_tokens=num_tokens,
                cu_seqlens_q=cu32,
                cu_seqlens_k=cu_k,
                max_seqlen_q=longest,
                max_seqlen_k=longest_k,
                block_tables=paged,
            )
            meta = AttentionMetadata(
                slot_mapping=slots,
                num_decodes=0,
                decode_block_tables=tables[:0],
                decode_context_lens=ctx_lens[:0],
                decode_plan=None,
                verify=None,
                prefill=group,
            )
        hidden = self.model(ids, positions, meta, cu_q[1:] - 1)
        return self.model.compute_logits(hidden)

    def _tensor(self, data: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)


def _valid(state: _DraftSeq, seq: Sequence) -> int:
    """How many of ``seq``'s leading tokens the draft cache holds the KV of: its tokens when it
    last drafted, then as many of the drafts fed as the sequence kept."""
    kept = 0
    for token, drafted in zip(seq.token_ids[state.base :], state.drafted, strict=False):
        if token != drafted:
            break
        kept += 1
    return state.base + kept


def _draw(
    logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft tokens [rows] and the distributions q [rows, vocab] they were drawn from."""
    greedy = temps == 0
    scaled = logits / torch.where(greedy, 1.0, temps)[:, None]
    q = torch.softmax(scaled, dim=-1)
    race = -torch.log(uniform_noise(purpose_seeds(seeds, DRAFT), steps, q.shape[-1]))
    token = torch.where(greedy, logits.argmax(dim=-1), (q / race).argmax(dim=-1))
    point = torch.zeros_like(q).scatter_(1, token[:, None], 1.0)
    return token, torch.where(greedy[:, None], point, q)


def load_draft(
    path: str,
    target_dir: Path,
    target: ModelConfig,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> DraftModelProposer:
    """The draft model at ``path``, refused at start-up unless it speaks the target's
    vocabulary (same token ids for the same strings, same logits width)."""
    try:
        resolved = resolve(path)
    except Exception as exc:  # its one-line reason, about the flag that named it
        raise StartupError(str(exc).replace("--model ", "--draft-model ", 1)) from None
    cfg = ModelConfig.from_dir(resolved.path)
    problem = vocabulary_mismatch(resolved.path, cfg, target_dir, target)
    if problem is not None:
        raise StartupError(f"--draft-model {path} cannot draft for this model: {problem}")
    model = load_model(resolved.path, cfg, device, dtype)
    model.init_rope(num_blocks * block_size, device)
    return DraftModelProposer(model, num_blocks, block_size, device, dtype)


def vocabulary_mismatch(
    draft_dir: Path, draft: ModelConfig, target_dir: Path, target: ModelConfig
) -> str | None:
    """Why the draft's token ids do not mean the target's, or None."""
    if draft.vocab_size != target.vocab_size:
        return f"its vocabulary has {draft.vocab_size} entries, the model's {target.vocab_size}"
    mine, theirs = _vocab(draft_dir), _vocab(target_dir)
    if (mine is None) != (theirs is None):
        return "one of the two has no tokenizer.json to compare"
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()))[:2]
        return f"its tokenizer maps tokens to other ids (e.g. {differ})"
    return None


def _vocab(model_dir: Path) -> dict[str, int] | None:
    """Token string -> id of the tokenizer (None without a tokenizer.json: token ids only)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    vocab = dict(raw.get("model", {}).get("vocab", {}))
    vocab.update({t["content"]: t["id"] for t in raw.get("added_tokens", [])})
    return vocab
