"""Wire protocol: every message round-trips; anything that does not fit is rejected."""

from __future__ import annotations

import math

import msgpack
import pytest

from pdserve.shared.bus.discovery_messages import KVEvents, WorkerGone, WorkerLoad
from pdserve.shared.bus.lease_messages import KVHandle, ReleaseLease
from pdserve.shared.bus.protocol import PROTOCOL_VERSION, ProtocolError, decode, decode_as, encode
from pdserve.shared.bus.request_messages import Cancel, DecodeRequest, PrefillRequest, PrefillResult
from pdserve.shared.bus.stream_messages import StreamCheck, TokenBatch, TokenItem
from pdserve.shared.bus.subjects import Subjects
from pdserve.shared.bus.wire_fields import MAX_KV_EVENT_HASHES, MAX_TOKEN_ID, UINT64_MAX
from pdserve.shared.sampling import SamplingParams

FINGERPRINT = {
    "model": "tiny",
    "dtype": "float32",
    "block_size": 16,
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
}


def handle() -> KVHandle:
    address = "ucx1:8000000000000001:" + "QUJD" * 100  # a UCX worker address is binary: base64
    return KVHandle("prefill-0", address, [3, 4, 5, 9], 57, FINGERPRINT, 1e9, "s3cr3t")


SAMPLES = [
    PrefillRequest(
        "req-1",
        [1, 2, 3],
        SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=7, stop_token_ids=[1]),
        "pdserve.gw.g1",
        1.7e9,
    ),
    PrefillResult("req-1", "prefill-0", 42, None, handle(), None, 16),
    PrefillResult.failure("req-1", "prefill-0", "internal", "boom"),
    DecodeRequest(
        "req-1", [1, 2, 3], [42], SamplingParams(temperature=0.0), handle(), "pdserve.gw.g1", 1.0
    ),
    DecodeRequest("req-2", [1], [], SamplingParams(max_tokens=3), None, "pdserve.gw.g1", 1.0),
    TokenBatch(
        [TokenItem("req-1", [5, 6], None), TokenItem("req-2", [], "error", "kv pull failed")]
    ),
    ReleaseLease("req-1"),
    Cancel("req-1"),
    WorkerLoad("decode-0", "decode", "tiny", 10, 64, 2, 1, False, "", None, 1.5),
    WorkerGone("decode-0", "decode"),
    # appended, so the index-based tests above keep their samples
    KVEvents("prefill-0", "a1b2", 16, 7, [0, 5, UINT64_MAX], [1 << 63]),
    KVEvents("prefill-0", "a1b2", 16, 8, [9, 10], [], snapshot=True, part=1, parts=3),
    PrefillRequest("bus-1", [1], SamplingParams(), "pdserve.gw.g1", 1.0, "client:7"),
    TokenBatch([TokenItem("req-3", [7], None, cached_tokens=32)]),
    TokenBatch([TokenItem("req-4", [8, 9], None, index=1, position=12)]),
    StreamCheck("req-4", "pdserve.gw.g1"),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.TYPE)
def test_round_trip(msg) -> None:
    data = encode(msg)
    assert decode(data) == msg
    assert decode_as(data, type(msg)) == msg
    # maps with version and type on the wire, nothing else exotic
    raw = msgpack.unpackb(data, raw=False)
    assert raw["v"] == PROTOCOL_VERSION and raw["type"] == msg.TYPE


def body(msg) -> dict:
    return msgpack.unpackb(encode(msg), raw=False)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_decode_as_rejects_other_types() -> None:
    with pytest.raises(ProtocolError, match="expected prefill_request"):
        decode_as(encode(Cancel("x")), PrefillRequest)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b.update(v=PROTOCOL_VERSION + 1), "version"),
        (lambda b: b.pop("v"), "version"),
        (lambda b: b.update(v=True), "version"),
        (lambda b: b.update(type="launch_missiles"), "unknown message type"),
        (lambda b: b.update(type=["decode_request"]), "unknown message type"),
        (lambda b: b.pop("bus_id"), "missing"),
        (lambda b: b.update(extra=1), "unknown fields"),
        (lambda b: b.update(bus_id="a.b"), "identifier"),  # would escape its subject
        (lambda b: b.update(bus_id="*"), "identifier"),
        (lambda b: b.update(bus_id="x" * 500), "longer"),
        (lambda b: b.update(bus_id=5), "expected str"),
        (lambda b: b.update(reply_to="pdserve.gw.>"), "identifier"),
        (lambda b: b.update(prompt_token_ids=[1, -2]), "ints in"),
        (lambda b: b.update(prompt_token_ids=[1, MAX_TOKEN_ID + 1]), "ints in"),
        (lambda b: b.update(prompt_token_ids=[1, True]), "ints in"),
        (lambda b: b.update(prompt_token_ids=[1, 2.0]), "ints in"),
        (lambda b: b.update(prompt_token_ids="123"), "expected list"),
        (lambda b: b.update(deadline=math.nan), "not finite"),
        (lambda b: b.update(deadline=math.inf), "not finite"),
        (lambda b: b.update(deadline="soon"), "expected number"),
        (lambda b: b.update(kv=[1, 2]), "expected map"),
        (lambda b: b["kv"].update(block_ids=[1, -1]), "ints in"),
        (lambda b: b["kv"].update(ucx_address="x" * 20000), "longer than"),
        (lambda b: b["kv"].update(ucx_address=7), "expected str"),
        (lambda b: b["kv"].update(block_ids=None), "null"),
        (lambda b: b["kv"].update(fingerprint={"model": [1]}), "scalars"),
        (lambda b: b["sampling"].update(temperature=5.0), "outside"),
        (lambda b: b["sampling"].update(top_p=0.0), "top_p"),
        (lambda b: b["sampling"].update(top_k=0), "top_k"),
        (lambda b: b["sampling"].update(max_tokens=-1), "outside"),
        (lambda b: b["sampling"].update(n=17), "outside"),
        (lambda b: b["sampling"].update(logprobs=21), "outside"),
        (lambda b: b["sampling"].update(logit_bias_values=[1.0]), "differ in length"),
        (lambda b: b["sampling"].update(guided={"kind": "sql", "spec": ""}), "not one of"),
        (lambda b: b["sampling"].update(ignore_eos=1), "expected bool"),
        (lambda b: b["sampling"].update(evil=1), "unknown fields"),
        (lambda b: b["sampling"].update(stop_token_ids=list(range(2000))), "more than"),
    ],
)
def test_rejects_malformed_fields(mutate, match) -> None:
    b = body(SAMPLES[3])  # DecodeRequest with a KV handle: the richest message
    mutate(b)
    with pytest.raises(ProtocolError, match=match):
        decode(pack(b))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x92\x01\x02",  # a list, not a map
        b"\xc4\x03abc",  # binary blob
        b"\xd4\x01\x00",  # ext type: msgpack must not build custom objects
        pack({1: 2}),  # non-string keys
        b"\x81\xa1v" + b"\x91" * 100_000 + b"\xc0",  # absurd nesting
        pack({"v": 1, "type": "cancel", "bus_id": "ok"}) + b"trailing",
    ],
)
def test_rejects_garbage(data) -> None:
    with pytest.raises(ProtocolError):
        decode(data)


def test_rejects_oversized_message_before_parsing() -> None:
    big = encode(PrefillRequest("r", list(range(50_000)), SamplingParams(), "pdserve.gw.g", 1.0))
    assert decode(big, max_bytes=len(big)).prompt_token_ids[-1] == 49_999
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(big, max_bytes=len(big) - 1)


def test_token_batch_items_are_checked() -> None:
    b = body(SAMPLES[5])
    b["items"][1]["finish_reason"] = "exploded"
    with pytest.raises(ProtocolError, match=r"items\[1\].finish_reason"):
        decode(pack(b))


def test_floats_accept_ints_but_not_bools() -> None:
    b = body(SAMPLES[0])
    b["sampling"]["temperature"] = 1
    assert decode(pack(b)).sampling.temperature == 1.0
    b["sampling"]["temperature"] = True
    with pytest.raises(ProtocolError):
        decode(pack(b))


def test_subjects() -> None:
    s = Subjects("acme")
    assert s.prefill("p0") == "acme.prefill.p0"
    assert s.decode("d0") == "acme.decode.d0"
    assert s.lease("p0") == "acme.lease.p0"
    assert s.cancel == "acme.cancel"
    assert s.load("decode", "d0") == "acme.load.decode.d0"
    assert s.all_loads == "acme.load.>"
    assert s.gateway("g1") == "acme.gw.g1"
    assert s.gateway("g1").startswith(s.gateway_prefix)
    assert s.kv("p0") == "acme.kv.p0" and s.all_kv == "acme.kv.>"
    assert s.ping("p0") == "acme.ping.p0"
    for bad in ("a.b", "*", ">", "", "a b"):
        with pytest.raises(ValueError):
            s.prefill(bad)
    with pytest.raises(ValueError):
        Subjects("bad ns")


def kv_body(**changes) -> dict:
    b = body(KVEvents("prefill-0", "a1b2", 16, 1, [1, 2], [3]))
    b.update(changes)
    return b


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"stored": [-1]}, "ints in"),  # hashes are unsigned 64-bit
        ({"removed": [True]}, "ints in"),
        ({"stored": [1.5]}, "ints in"),
        ({"stored": list(range(MAX_KV_EVENT_HASHES + 1))}, "more than"),
        ({"removed": list(range(MAX_KV_EVENT_HASHES + 1))}, "more than"),
        ({"block_size": 0}, "outside"),
        ({"worker_id": "p.0"}, "identifier"),
        ({"instance": "x" * 65}, "longer"),
        ({"snapshot": True, "part": 3, "parts": 3}, "part 3 of 3"),
        ({"parts": 2}, "a delta is one message"),
        ({"parts": 0}, "outside"),
    ],
)
def test_kv_events_are_bounded(changes, match) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(pack(kv_body(**changes)))


def test_kv_events_at_the_size_limit_fit_a_nats_payload() -> None:
    full = KVEvents("p0", "i", 16, 1, [UINT64_MAX] * MAX_KV_EVENT_HASHES, [])
    data = encode(full)
    assert len(data) < 1024 * 1024  # NATS's default max_payload
    assert decode(data) == full


def test_client_request_id_is_optional_and_checked() -> None:
    b = body(SAMPLES[0])
    assert b["client_id"] is None and decode(pack(b)) == SAMPLES[0]
    b["client_id"] = "a.b"  # could not name a subject token either
    with pytest.raises(ProtocolError, match="identifier"):
        decode(pack(b))
    b = body(SAMPLES[5])
    b["items"][0]["cached_tokens"] = -1
    with pytest.raises(ProtocolError, match="outside"):
        decode(pack(b))
