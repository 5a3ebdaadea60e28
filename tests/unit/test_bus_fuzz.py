"""The bus decoders under fuzzing (hypothesis): whatever arrives, ``decode`` either returns a
checked message or raises ``ProtocolError`` with a known reason, never anything else, and never
spends memory out of proportion to the bytes; a subscription counts what it drops by subject
kind and reason (``pdserve_bus_rejected_messages_total``) and keeps delivering."""

from __future__ import annotations

import asyncio
import tracemalloc

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.shared.bus.protocol import (
    MAX_CONTAINERS,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ProtocolError,
    decode,
    encode,
)
from pdserve.shared.bus.rejects import BusRejectCollector, subject_kind
from pdserve.shared.bus.request_messages import Cancel
from pdserve.shared.bus.stream_messages import TokenBatch, TokenItem
from pdserve.shared.bus.wire_check import REJECT_REASONS
from pdserve.shared.bus.wire_fields import MAX_BATCH_ITEMS
from pdserve.shared.config import BusConfig
from pdserve.shared.sampling import TokenLogprobs
from tests.bus_memory import MemoryBus, MemoryNetwork
from tests.unit.test_protocol import SAMPLES

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# msgpack-shaped values: what a hostile peer can encode without breaking the format
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=40),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=30,
)
field_names = st.sampled_from(
    sorted({f for cls in MESSAGE_TYPES.values() for f in cls.__dataclass_fields__})
)


def decodes_or_rejects(data: bytes, max_bytes: int = 1 << 20) -> None:
    try:
        decode(data, max_bytes)
    except ProtocolError as exc:
        assert exc.reason in REJECT_REASONS


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_are_rejected_cleanly(data: bytes) -> None:
    decodes_or_rejects(data)


@FUZZ
@given(
    kind=st.sampled_from(sorted(MESSAGE_TYPES)),
    body=st.dictionaries(field_names, values, max_size=12),
)
def test_wrong_types_in_known_messages_are_rejected_cleanly(kind: str, body: dict) -> None:
    """A real type name and real field names with values of any shape: the checker, not a
    handler, is where a wrong type stops."""
    decodes_or_rejects(msgpack.packb({**body, "v": PROTOCOL_VERSION, "type": kind}))


@FUZZ
@given(sample=st.sampled_from(SAMPLES), data=st.data())
def test_mutated_real_messages_are_rejected_cleanly(sample, data: st.DataObject) -> None:
    """Real encodings with bytes flipped, cut or inserted: the messages nearest to valid."""
    raw = bytearray(encode(sample))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw)))
        op = data.draw(st.sampled_from(("flip", "cut", "insert")))
        if op == "flip" and at < len(raw):
            raw[at] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del raw[at:]
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    decodes_or_rejects(bytes(raw))


@FUZZ
@given(depth=st.integers(9, 5000), kind=st.sampled_from((b"\x91", b"\x81\xa1a")))
def test_deep_nesting_is_rejected(depth: int, kind: bytes) -> None:
    """Past the checker's depth (8) or msgpack's stack (1024): one clear error either way."""
    head = b"\x83\xa1v" + bytes([PROTOCOL_VERSION]) + b"\xa4type\xa6cancel\xa6bus_id"
    data = head + kind * depth + b"\x00"  # bus_id nested ``depth`` deep
    try:
        decode(data)
    except ProtocolError as exc:
        assert exc.reason in ("malformed", "schema")
    else:
        raise AssertionError("a nested bus_id was accepted")


def test_huge_declared_sizes_are_rejected_before_allocating() -> None:
    """A header that announces 4 G items or a 4 GiB string, with no bytes behind it."""
    for head in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff"):
        try:
            decode(head + b"\x00" * 16)
        except ProtocolError as exc:
            assert exc.reason == "malformed"
        else:
            raise AssertionError(head)


def test_many_empty_containers_cost_no_memory() -> None:
    """8 MiB of empty maps would be half a GiB of dicts: the container budget stops it."""
    n = 1 << 20  # per array: msgpack's array limit is the token limit
    body = b"\xde\x00\x07" + b"".join(
        b"\xa1" + bytes([97 + i]) + b"\xdd" + (n - 1).to_bytes(4, "big") + b"\x80" * (n - 1)
        for i in range(7)
    )
    tracemalloc.start()
    try:
        decode(body)
    except ProtocolError as exc:
        assert exc.reason == "malformed" and str(MAX_CONTAINERS) in str(exc)
    else:
        raise AssertionError("accepted")
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 64 << 20, f"decoding 7 MiB took {peak >> 20} MiB"


def test_oversized_message_is_rejected_by_size() -> None:
    try:
        decode(encode(Cancel("r")), max_bytes=4)
    except ProtocolError as exc:
        assert exc.reason == "too_large"
    else:
        raise AssertionError("accepted")


def test_subject_kinds_are_a_fixed_set() -> None:
    assert subject_kind("pd.decode.w1", "pd") == "decode"
    assert subject_kind("pd.gw.g1", "pd") == "gw"
    assert subject_kind("pd.whatever.x", "pd") == "other"
    assert subject_kind("other.decode.w1", "pd") == "other"


async def test_a_subscription_counts_junk_by_reason_and_keeps_delivering() -> None:
    net = MemoryNetwork()
    a = MemoryBus(BusConfig(namespace="t"), "a", network=net)
    b = MemoryBus(BusConfig(namespace="t"), "b", network=net)
    await a.connect()
    await b.connect()
    got: list[Cancel] = []

    async def handler(msg, headers) -> None:
        got.append(msg)

    await b.subscribe("t.decode.w1", handler, (Cancel,))
    junk = [
        b"\xc1",  # never used in msgpack
        b"\x91" * 2000 + b"\x00",  # deeper than msgpack's stack
        msgpack.packb({"v": PROTOCOL_VERSION - 1, "type": "cancel", "bus_id": "r"}),
        msgpack.packb({"v": PROTOCOL_VERSION, "type": "nope"}),
        msgpack.packb({"v": PROTOCOL_VERSION, "type": "cancel", "bus_id": ["r"]}),
        encode(SAMPLES[-1]),  # a real message, but not one this subject takes
    ]
    for data in junk:
        await a.nc.publish("t.decode.w1", data)
    await a.publish("t.decode.w1", Cancel("real"))
    for _ in range(20):
        await asyncio.sleep(0)
    assert got == [Cancel("real")]
    assert b.stats.rejected_by == {
        ("decode", "malformed"): 2,
        ("decode", "version"): 1,
        ("decode", "unknown_type"): 1,
        ("decode", "schema"): 1,
        ("decode", "unexpected_type"): 1,
    }
    registry = CollectorRegistry()
    registry.register(BusRejectCollector(lambda: b.stats.rejected_by))
    text = generate_latest(registry).decode()
    assert (
        'pdserve_bus_rejected_messages_total{reason="malformed",subject_kind="decode"} 2.0' in text
    )
    await a.close()
    await b.close()


def test_the_largest_honest_message_fits_the_container_budget() -> None:
    """A full TokenBatch, every item with log-probs and prompt log-probs, still decodes."""
    lp = TokenLogprobs(
        top_k=1, token_logprobs=[-0.5], ranks=[1], top_token_ids=[3], top_logprobs=[-0.5]
    )
    item = TokenItem("r", [3], None, logprobs=lp, prompt_logprobs=lp)
    batch = TokenBatch([item] * MAX_BATCH_ITEMS)
    assert decode(encode(batch)) == batch
