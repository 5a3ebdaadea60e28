"""A streamed lease (issue 29 item 3) as bookkeeping: no UCX. Its time runs from when its prompt
is complete, never while prefill still writes it; a stream says which layers are ready."""

from __future__ import annotations

import pytest

from pdserve.shared.config import WorkerConfig
from pdserve.shared.errors import StartupError
from pdserve.shared.kv.transfer import LeaseTable
from pdserve.shared.kv.transfer.stream import (
    AUTO_THRESHOLD_CUDA,
    FINISHED,
    LayerStream,
    parse_layers,
    plan,
    stream_threshold,
    when_ready,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_streamed_lease_expires_only_once_its_prompt_is_complete() -> None:
    clock, freed = Clock(), []
    table = LeaseTable(freed.append, clock=clock)
    stream = LayerStream(num_layers=4)
    lease = table.add("r1", [1, 2], 32, ttl=30.0, stream=stream)
    clock.now += 100  # a long last pass: far past the ttl, still being written
    assert table.expire() == [] and table.get("r1") is lease
    stream.finish(first_token=5)
    table.restart(lease, 30.0)
    clock.now += 29
    assert table.expire() == []
    clock.now += 2
    assert table.expire() == ["r1"] and freed == ["r1"]


def test_an_ended_stream_no_longer_holds_its_lease() -> None:
    clock = Clock()
    table = LeaseTable(lambda _: None, clock=clock)
    stream = LayerStream(num_layers=4)
    table.add("r1", [1], 16, ttl=30.0, stream=stream)
    stream.end(FINISHED)
    clock.now += 31
    assert table.expire() == ["r1"]


def test_pieces_are_ready_as_layers_are_written_and_the_last_with_the_token() -> None:
    stream = LayerStream(num_layers=8)
    assert not stream.ready((0, 4), final=False)
    stream.advance(5)
    assert stream.ready((0, 4), final=False) and not stream.ready((4, 8), final=False)
    stream.advance(3)  # never backwards
    assert stream.ready_layers == 5
    stream.advance(8)
    assert stream.ready((4, 8), final=False) and not stream.ready((4, 8), final=True)
    stream.finish(first_token=9)
    assert stream.ready((4, 8), final=True) and stream.first_token == 9


def test_a_held_piece_goes_when_ready_or_is_refused_when_the_lease_goes() -> None:
    table = LeaseTable(lambda _: None)
    stream = LayerStream(num_layers=2)
    lease = table.add("r1", [1], 16, ttl=30.0, stream=stream)
    went, refused = [], []
    when_ready(lease, lambda: stream.ready((0, 1), False), lambda: went.append(1), refused.append)
    when_ready(lease, lambda: stream.ready((1, 2), True), lambda: went.append(2), refused.append)
    stream.advance(1)
    assert went == [1] and refused == []
    table.release("r1")
    assert went == [1] and refused == ["prefill of r1 was let go"]
    stream.finish(first_token=3)  # too late: answered once
    assert went == [1] and len(refused) == 1


def test_malformed_layer_requests_are_refused() -> None:
    assert parse_layers(None, False, 4) is None
    assert parse_layers((0, 2), True, 4) == ((0, 2), True)
    for bad in ((2, 2), (0, 5), (-1, 1), (3, 1)):
        try:
            parse_layers(bad, False, 4)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad!r}")


def test_a_streamed_pull_takes_the_blocks_complete_when_leased_at_once() -> None:
    # 10 blocks, the first 6 computed by earlier passes: all their layers in one piece, then
    # the last pass's 4 blocks by layer group
    assert plan(8, 2, 6, 10) == [((0, 8), (0, 6)), ((0, 4), (6, 10)), ((4, 8), (6, 10))]
    assert plan(8, 2, 0, 10) == [((0, 4), (0, 10)), ((4, 8), (0, 10))]
    assert plan(8, 1, 10, 10)[-1] == ((0, 8), (9, 10))  # the pass writes the last block at least
    stream = LayerStream(num_layers=8, done_blocks=frozenset({3, 4}))
    assert stream.ready((0, 8), final=False, done=True)  # blocks done when leased
    assert not stream.ready((0, 8), final=True, done=True)  # the token is not


def test_the_auto_threshold_streams_on_gpus_only() -> None:
    assert stream_threshold(-1, "cuda") == AUTO_THRESHOLD_CUDA
    assert stream_threshold(-1, "cpu") == 0  # measured not to pay on CPUs (perf/README.md)
    assert stream_threshold(0, "cuda") == 0 and stream_threshold(300, "cpu") == 300
    with pytest.raises(StartupError, match="kv-stream-threshold"):
        WorkerConfig(kv_stream_threshold=-2)
    with pytest.raises(StartupError, match="kv-stream-layer-groups"):
        WorkerConfig(kv_stream_layer_groups=0)
