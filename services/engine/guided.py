"""Structured output in the engine: each guided sequence's grammar state, and a step's token mask.

A sequence's state follows its *output tokens*, never forward passes: it records how many of them
its matcher has consumed and catches up with the rest before each mask. So a decode worker that
continues after a prefill worker's first token (``AddRequest.output_token_ids``) replays it, a
preempted or recomputed sequence (its output tokens unchanged) is not advanced twice, and a
forked choice, a new ``Sequence``, replays its own output tokens into a fresh matcher.

The mask is llguidance's bitmask, int32 [B, ceil(V/32)]: bit j of word w allows token 32*w+j.
Rows without a grammar allow everything. A finished grammar allows only EOS, so its sequence ends
with "stop"; padded logits (ids past the tokenizer's vocabulary) are never allowed.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch

from pdserve.services.engine.sequence import Sequence
from pdserve.shared.structured_output import GrammarCompiler, compiler_for

log = logging.getLogger(__name__)

_ALL_ALLOWED = -1  # an int32 word with every bit set
_MAX_MASK_THREADS = 8


@dataclass
class GrammarState:
    matcher: llguidance.LLMatcher
    num_consumed: int = 0  # output tokens the matcher has consumed
    # A token the grammar refused (only tokens that did not come through this engine's masks
    # can be): the sequence is let end, with EOS only from then on.
    failed: bool = False


class GuidedDecoder:
    """The grammar states of one engine's guided sequences, and the masks they make.

    ``vocab_size`` is the width of the model's logits; the tokenizer is ``tokenizer.json`` in
    ``model_dir`` (GGUF models have theirs in the converted directory the engine loads)."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer_path = Path(model_dir) / "tokenizer.json"
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        # Built on the first guided sequence: the tokenizer's conversion takes ~0.3 s on a
        # 50k-token vocabulary, which engines that never see one should not pay.
        self._compiler: GrammarCompiler | None = None
        self._executor: llguidance.LLExecutor | None = None
        # Keyed by the sequence object: a state goes when its sequence does.
        self._states: weakref.WeakKeyDictionary[Sequence, GrammarState] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = compiler_for(self.tokenizer_path, self.vocab_size, self.eos_token_ids)
        return self._compiler

    def start(self, seq: Sequence) -> None:
        """Give a guided sequence its grammar state, caught up with the output tokens it already
        has. ValueError if its spec does not compile."""
        guided = seq.sampling.guided
        if guided is None:
            return
        state = GrammarState(self.compiler.new_matcher(guided))
        self._states[seq] = state
        self._catch_up(seq, state)

    def state(self, seq: Sequence) -> GrammarState | None:
        return self._states.get(seq)

    def _state_for(self, seq: Sequence) -> GrammarState:
        state = self._states.get(seq)
        if state is None:  # a forked choice, or a sequence added without start()
            self.start(seq)
            state = self._states[seq]
        else:
            self._catch_up(seq, state)
        return state

    def _catch_up(self, seq: Sequence, state: GrammarState) -> None:
        new = seq.token_ids[seq.num_prompt_tokens + state.num_consumed :]
        if not new:
            return
        state.num_consumed += len(new)
        matcher = state.matcher
        for token in new:
            if state.failed:
                return
            if matcher.is_stopped() and token in self.eos_token_ids:
                continue  # EOS after the end (ignore_eos): what the finished grammar allows
            if not matcher.consume_token(token):
                state.failed = True
                error = matcher.get_error().strip().splitlines()[:1]  # (then a state dump)
                log.warning(
                    "%s: output token %d broke its grammar (%s); only EOS from here",
                    seq.bus_id,
                    token,
                    error[0] if error else "?",
                )

    def bitmask(
        self, seqs: list[Sequence], device: torch.device | None = None
    ) -> torch.Tensor | None:
        """The next-token mask of each row, on ``device`` (a non-blocking copy from pinned
        memory to a GPU), or None when no row is guided. Each guided sequence's state first
        catches up with its output tokens."""
        mask = self._host_bitmask(seqs)
        if mask is None or device is None or device.type == "cpu":
            return mask
        if device.type == "cuda":
            mask = mask.pin_memory()
        return mask.to(device, non_blocking=True)

    def _host_bitmask(self, seqs: list[Sequence]) -> torch.Tensor | None:
        rows = [(i, s) for i, s in enumerate(seqs) if s.sampling.guided is not None]
        if not rows:
            return None
        words = (self.compiler.vocab_size + 31) // 32
        mask = torch.full((len(seqs), words), _ALL_ALLOWED, dtype=torch.int32)
        matchers, failed = [], []
        for i, seq in rows:
            state = self._state_for(seq)
            if state.failed:
                failed.append(i)
            else:
                matchers.append((state.matcher, i))
        if len(matchers) == 1:  # the executor's thread hand-off costs more than one mask
            matcher, i = matchers[0]
            matcher.unsafe_compute_mask_ptr(mask[i].data_ptr(), words * 4)
        elif matchers:
            self.executor.unsafe_compute_mask_ptr(matchers, mask.data_ptr(), words * 4, len(seqs))
        mask = self._fit_to_logits(mask)
        self._hold_back_enders(mask, rows)
        # A row with nothing allowed (a failed grammar; a grammar whose only way on is an id
        # the logits lack) would sample from all -inf: it gets EOS, and ends.
        dead = ~(mask != 0).any(dim=1)
        if failed:
            dead[failed] = True
        if bool(dead.any()):
            mask[dead] = self._eos_row
        return mask

    def _hold_back_enders(self, mask: torch.Tensor, rows: list[tuple[int, Sequence]]) -> None:
        """``min_tokens`` for guided rows (the sampler's own mask skips them): their EOS and
        stop ids are cleared while they are short of it, unless the grammar allows nothing
        else. Then the grammar wins: a finished output ends, rather than sampling from all
        -inf."""
        for i, seq in rows:
            sp = seq.sampling
            if seq.num_output_tokens >= sp.min_tokens:
                continue
            enders = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids))
            held = mask[i].clone()
            for t in enders:
                if 0 <= t < self.vocab_size:
                    held[t // 32] &= ~(1 << (t % 32))
            if bool((held != 0).any()):
                mask[i] = held

    def _fit_to_logits(self, mask: torch.Tensor) -> torch.Tensor:
        """Cut the mask to the logits' words and clear the bits past their last id."""
        words, tail = divmod(self.vocab_size, 32)
        if tail:
            mask = mask[:, : words + 1].contiguous()
            mask[:, words] &= (1 << tail) - 1
        else:
            mask = mask[:, :words].contiguous()
        return mask

    @property
    def _eos_row(self) -> torch.Tensor:
        row = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int64)
        for eos in self.eos_token_ids:
            if eos < self.vocab_size:
                row[eos // 32] |= 1 << (eos % 32)
        return _as_int32_words(row)

    @property
    def executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            threads = min(len(os.sched_getaffinity(0)), _MAX_MASK_THREADS)
            self._executor = llguidance.LLExecutor(num_threads=threads)
        return self._executor


def _as_int32_words(row: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (held in int64) as the int32 the mask stores, bit for bit."""
    return torch.where(row >= 1 << 31, row - (1 << 32), row).to(torch.int32)
