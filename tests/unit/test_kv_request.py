"""The pull request's wire form (KV wire version 4, ``transfer/request.py``) and the replies a
puller reads (``wire.read_reply``): what the puller packs is what the server reads; a request
that does not say who asks is never answered, one that does is refused with a reason."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.shared.kv.transfer.request import (
    CHECKSUM,
    FINAL,
    PIECE,
    SLICED,
    WHOLE,
    decode_request,
    encode_request,
    request_prefix,
)
from pdserve.shared.kv.transfer.wire import (
    KV_WIRE_VERSION,
    REPLY_REFUSED_2,
    pack_reply,
    pull_tag,
    read_reply,
    reply_leaves_posted,
)

FP = {"model": "m", "dtype": "bfloat16", "block_size": 16, "num_layers": 4, "num_kv_heads": 8}


def body(message: bytes) -> memoryview:
    assert int.from_bytes(message[:4], "little") == len(message) - 4
    return memoryview(message)[4:]


def test_a_request_reads_back_as_it_was_packed() -> None:
    prefix = request_prefix(b"\x00puller address", FP)
    runs = [(7, 0, 1), (2, 1, 3), (40_000, 4, 128)]
    flags = WHOLE | CHECKSUM | PIECE | FINAL
    req = decode_request(
        body(encode_request(prefix, "r1", "tok", 1 << 62, flags, (2, 6), (1, 3), runs))
    )
    assert (req.version, req.bus_id, req.token, req.reply_to, req.tag) == (
        KV_WIRE_VERSION,
        "r1",
        "tok",
        b"\x00puller address",
        1 << 62,
    )
    assert msgpack.unpackb(req.fingerprint) == FP
    assert req.runs is None  # the pull is read once the puller is authenticated
    req.parse()
    assert req.runs == [(7, 1), (2, 3), (40_000, 128)]
    assert req.heads == (2, 6) and req.layers == (1, 3) and req.flags == flags
    assert req.checksum and req.final

    bulk = decode_request(
        body(encode_request(prefix, "r1", "tok", 8, SLICED, (0, 8), (0, 0), runs))
    )
    bulk.parse()
    assert bulk.layers is None and not bulk.checksum and bulk.flags == SLICED


def test_the_lease_epoch_travels_and_must_be_shown() -> None:
    prefix = request_prefix(b"a", FP)
    message = encode_request(prefix, "r1", "tok", 8, WHOLE, (0, 8), (0, 0), [(3, 0, 2)], epoch=41)
    req = decode_request(body(message))
    req.parse()
    assert req.epoch == 41
    entries = {"v": KV_WIRE_VERSION, "bus_id": "r1", "token": "t", "reply_to": b"a", "tag": 8}
    pull = msgpack.unpackb(body(message))["pull"]
    for epoch in (None, -1, "41"):  # an epoch not shown (an older puller's), or not a count
        bad = decode_request(msgpack.packb({**entries, "pull": pull, "epoch": epoch}))
        with pytest.raises(ValueError, match="no lease epoch"):
            bad.parse()


def test_a_block_beyond_the_format_is_not_sent() -> None:
    prefix = request_prefix(b"a", FP)
    with pytest.raises(ValueError, match="cannot encode"):
        encode_request(prefix, "r1", "tok", 8, WHOLE, (0, 8), (0, 0), [(-1, 0, 1)])


def test_a_request_that_does_not_say_who_asks_is_dropped() -> None:
    good = {"v": KV_WIRE_VERSION, "bus_id": "r1", "token": "t", "reply_to": b"a", "tag": 8}
    decode_request(msgpack.packb(good))
    for bad in (
        {"bus_id": 3},
        {"token": None},
        {"reply_to": "text"},
        {"reply_to": b""},
        {"tag": -1},
        {"tag": 1 << 63},
        {"tag": "8"},
    ):
        with pytest.raises(ValueError):
            decode_request(msgpack.packb({**good, **bad}))
    for junk in (b"", b"\x93\x01\x02\x03", b"\xc1", msgpack.packb([good])):
        with pytest.raises(Exception):  # noqa: B017 - msgpack's own errors, or not a map
            decode_request(junk)


@pytest.mark.parametrize(
    "pull, why",
    [(None, "no runs"), (b"\x01\x00", "no runs"), (b"\x01" + bytes(8) + bytes(11), "cut short")],
)
def test_a_malformed_pull_says_why(pull, why) -> None:
    entries = {"v": KV_WIRE_VERSION, "bus_id": "r1", "token": "t", "reply_to": b"a", "tag": 8}
    entries["epoch"] = 0
    req = decode_request(msgpack.packb({**entries, "pull": pull}))
    with pytest.raises(ValueError, match=why):
        req.parse()


def test_replies_read_at_once() -> None:
    assert read_reply(pack_reply(None)) == (None, KV_WIRE_VERSION, False, 0, None)
    assert read_reply(pack_reply(None, True, 3, 17)) == (None, KV_WIRE_VERSION, True, 3, 17)
    refusal = pack_reply("no lease for r1")
    assert read_reply(refusal) == ("no lease for r1", KV_WIRE_VERSION, False, 0, None)
    assert not reply_leaves_posted(refusal)  # its empties follow
    refusal[0] = REPLY_REFUSED_2  # a version-2 server: no empties for a version-3 puller
    assert read_reply(refusal)[:2] == ("no lease for r1", 2) and reply_leaves_posted(refusal)


def test_pull_tags_are_random_even_and_leave_room_for_their_messages() -> None:
    tags = [pull_tag() for _ in range(600)]  # drawn 256 at a time: past two refills
    assert len(set(tags)) == len(tags)
    assert all(t % 2 == 0 and 0 <= t and t + 3 < 1 << 63 for t in tags)  # T+1..T+3, top bit 0
