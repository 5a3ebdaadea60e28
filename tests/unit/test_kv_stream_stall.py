"""A layer-streamed pull fails once no piece arrives for its stall bound (--kv-pull-timeout):
every piece still pending is cancelled and awaited before it says so, so no receive is left to
write into the blocks; pieces that keep arriving are waited for however long the whole takes."""

from __future__ import annotations

import asyncio

from pdserve.shared.kv.transfer.stream import _unless_stalled


async def test_a_stall_cancels_every_pending_piece():
    cancelled = []

    async def never(i: int) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def quick() -> str:
        return "piece"

    tasks = [asyncio.ensure_future(quick()), *(asyncio.ensure_future(never(i)) for i in (1, 2))]
    assert await _unless_stalled(tasks, 0.05) is None
    assert sorted(cancelled) == [1, 2] and all(t.done() for t in tasks)


async def test_pieces_that_keep_coming_are_waited_for_past_the_bound():
    async def after(delay: float) -> float:
        await asyncio.sleep(delay)
        return delay

    delays = [0.3, 0.6, 0.9, 1.2]  # 1.2 s in all, never 1 s without a piece
    tasks = [asyncio.ensure_future(after(d)) for d in delays]
    assert await _unless_stalled(tasks, 1.0) == delays


async def test_an_error_is_returned_not_raised():
    async def bad() -> None:
        raise ValueError("refused")

    (result,) = await _unless_stalled([asyncio.ensure_future(bad())], None)
    assert isinstance(result, ValueError)
