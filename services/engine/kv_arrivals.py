"""The scheduler's answers to KV that arrives from elsewhere into blocks it reserved: a pull from
a prefill worker (``kv_ready``, ``kv_failed``) and a prefix's load from the disk tier
(``kv_loaded``). Until the answer the sequence is WAITING_FOR_REMOTE_KV: something writes into
its blocks, so an abort only marks it and it finishes here.

A part of ``Scheduler`` (``scheduler.py``), kept apart so each file reads in a sitting; every
status change is still the scheduler's, on the engine thread. ``kv_ready`` and ``kv_failed``
are the decode side's ``KVPullAnswers`` (``shared/kv/contract.py``), as ``LLMEngine``'s are.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pdserve.services.engine.outputs import StepOutput
from pdserve.services.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from pdserve.services.engine.block_manager import BlockManager

log = logging.getLogger(__name__)


class KVArrivals:
    if TYPE_CHECKING:  # the scheduler's own state and steps
        bm: BlockManager
        seqs: dict[str, Sequence]
        pulling: dict[str, Sequence]
        kv_failure_policy: str

        def _choice_0(self, bus_id: str) -> Sequence | None: ...
        def _finish(self, seq: Sequence, reason: str | None) -> bool: ...
        def _run(self, seq: Sequence) -> None: ...
        def _wait_first(self, seq: Sequence) -> None: ...
        def _fork(self, seq: Sequence) -> bool: ...

    def kv_ready(self, bus_id: str, first_token: int | None = None) -> None:
        """The pull into a sequence's reserved blocks completed: it joins the batch. A streamed
        pull brings the prefill worker's first token with it (the request came without)."""
        seq = self._answered_pull(self._choice_0(bus_id), "KVReady")
        if seq is None:
            return
        if first_token is not None and not seq.output_token_ids:
            seq.token_ids.append(first_token)
        seq.remote_kv = False
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.bm.commit(seq)
        del self.pulling[seq.seq_id]
        self._run(seq)
        self._fork(seq)  # the prefill worker sampled choice 0's first token: the others now

    def kv_failed(self, bus_id: str, error: str) -> StepOutput | None:
        """The pull failed: the error output ends the request (policy "fail"), or the prompt
        goes to the front of the queue to be computed here (its choices fork after that)."""
        seq = self._answered_pull(self._choice_0(bus_id), "KVFailed")
        if seq is None:
            return None
        if self.kv_failure_policy == "fail":  # the whole request: no choice was forked yet
            self._finish(seq, "error")
            text = f"KV transfer failed: {error}"
            return StepOutput(
                bus_id=seq.bus_id,
                new_token_ids=[],
                finish_reason="error",
                error=text,
                request_finished=True,
            )
        log.info("recomputing the prefill of %s here: %s", seq.bus_id, error)
        del self.pulling[seq.seq_id]
        self.bm.free_sequence(seq)  # the pull is over: nothing writes into them
        seq.remote_kv = False
        seq.num_computed_tokens = 0
        self._wait_first(seq)
        return None

    def kv_loaded(self, seq_id: str, ok: bool) -> None:
        """A prefix's load from the disk tier into its reserved blocks is over: the sequence
        runs on from it (its blocks now registered in the prefix cache), or, when a block
        failed its check, goes back to the front of the queue to be computed here (the bad
        file is gone: the lookup stops before it now)."""
        seq = self._answered_pull(self.seqs.get(seq_id), "KV load")
        if seq is None:
            return
        del self.pulling[seq_id]
        if ok:
            self.bm.commit(seq)
            self._run(seq)
            return
        self.bm.free_sequence(seq)
        seq.num_computed_tokens = seq.num_prefix_hit_tokens = 0
        self._wait_first(seq)

    def _answered_pull(self, seq: Sequence | None, answer: str) -> Sequence | None:
        """The sequence whose pull (or load) just answered, when it goes on (None: unknown or
        ended, or aborted meanwhile, which finishes it now that nothing writes into its
        blocks)."""
        if seq is None:
            return None
        if seq.status is not SequenceStatus.WAITING_FOR_REMOTE_KV:
            log.warning("%s for %s, which is %s", answer, seq, seq.status.name)
            return None
        if seq.finish_reason is not None:
            self._finish(seq, seq.finish_reason)
            return None
        return seq
