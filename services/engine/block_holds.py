"""The scheduler's commands that wait for an answer: a block held on request (``HoldBlock``: the
KV checker's probe block, parked until ``release``) and a prefix-cache reset.

A part of ``Scheduler`` (``scheduler.py``), kept apart so each file reads in a sitting; every
status change is still the scheduler's, on the engine thread.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdserve.services.engine.commands import BlockHoldRefused, HoldBlock, ResetPrefixCache
from pdserve.services.engine.sequence import Sequence, SequenceStatus
from pdserve.shared.sampling import SamplingParams

if TYPE_CHECKING:
    from pdserve.services.engine.block_manager import BlockManager
    from pdserve.services.engine.sequence_group import SequenceGroup
    from pdserve.services.engine.wait_queue import WaitQueue

_HOLD_SAMPLING = SamplingParams(max_tokens=1)


class BlockHolds:
    if TYPE_CHECKING:  # the scheduler's own state and steps
        bm: BlockManager
        waiting: WaitQueue
        requests: dict[str, SequenceGroup]

        def _headroom(self) -> int: ...
        def _register(self, seq: Sequence, n: int) -> None: ...

    def answer(self, cmd: HoldBlock | ResetPrefixCache) -> None:
        """Answer a command that waits for its reply (unless the asker gave up)."""
        if not cmd.reply.set_running_or_notify_cancel():
            return
        if isinstance(cmd, ResetPrefixCache):
            cmd.reply.set_result(self.bm.reset_prefix_cache(cmd.external))
            return
        try:
            cmd.reply.set_result(self.hold_block(cmd.hold_id))
        except BlockHoldRefused as exc:
            cmd.reply.set_exception(exc)

    def hold_block(self, hold_id: str) -> int:
        """One free block held under ``hold_id`` (parked until ``release``), or
        ``BlockHoldRefused`` when requests wait or admission could not spare it."""
        waiting = len(self.waiting)
        if hold_id in self.requests:
            raise BlockHoldRefused(f"{hold_id} exists")
        if waiting:
            raise BlockHoldRefused(
                f"busy: {waiting} request(s) waiting; no block is taken from them"
            )
        seq = Sequence(hold_id, [0], _HOLD_SAMPLING, 0, time.monotonic())
        if not self.bm.can_allocate(seq, 1, headroom=self._headroom()):
            raise BlockHoldRefused("busy: no free KV block")
        self.bm.allocate(seq, 1)
        seq.status = SequenceStatus.PREFILLED
        self._register(seq, 1)
        return seq.block_table[0]
