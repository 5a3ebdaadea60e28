"""The KV contract (``shared/kv/contract.py``) holds for the classes that do each side's work
today: each has every member of its Protocol (``isinstance`` on the real objects, which the
Protocols' ``runtime_checkable`` allows), and each method takes the Protocol's parameters -
names, kinds, defaults, async or not - so a call written against the contract works on the
class. ``_as_contract`` says the same to a type checker, signatures and types included."""

from __future__ import annotations

import inspect
import signal
from collections.abc import Callable, Iterator

import pytest
import torch

from pdserve.services.decode.rank_pull import RankPuller
from pdserve.services.decode.worker import DecodeWorker
from pdserve.services.engine.engine import LLMEngine
from pdserve.services.engine.scheduler import Scheduler
from pdserve.services.prefill.worker import PrefillWorker
from pdserve.shared.kv import contract
from pdserve.shared.kv.transfer import KVClient, KVServer, LeaseTable
from pdserve.shared.kv.transfer.stream import LayerStream
from tests.bus_memory import MemoryBus

# which class does which part of the hand-off
IMPLEMENTATIONS = [
    (contract.KVLeases, LeaseTable),
    (contract.KVLayerFeed, LayerStream),
    (contract.KVPullServer, KVServer),
    (contract.KVPrefillSide, PrefillWorker),
    (contract.KVPiecePuller, KVClient),
    (contract.KVPuller, RankPuller),
    (contract.KVPullAnswers, LLMEngine),
    (contract.KVPullAnswers, Scheduler),
    (contract.KVDecodeSide, DecodeWorker),
]


def members(proto: type) -> dict[str, object]:
    """A Protocol's own methods and properties."""
    return {name: value for name, value in vars(proto).items() if not name.startswith("_")}


def parameters(fn: Callable[..., object]) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(
    ("proto", "cls"),
    IMPLEMENTATIONS,
    ids=[f"{c.__name__}-{p.__name__}" for p, c in IMPLEMENTATIONS],
)
def test_each_method_takes_the_contracts_parameters(proto: type, cls: type) -> None:
    methods = {n: m for n, m in members(proto).items() if inspect.isfunction(m)}
    assert methods or any(isinstance(m, property) for m in members(proto).values())
    for name, method in methods.items():
        ours = getattr(cls, name)
        assert parameters(ours) == parameters(method), f"{cls.__name__}.{name}"
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(method), name


@pytest.fixture
def workers() -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    """Both workers as built, before start (no model, no UCX); a worker built on the main
    thread takes SIGUSR1 for its standby promotion, which is given back here."""
    before = signal.getsignal(signal.SIGUSR1)
    try:
        yield PrefillWorker({}, bus=MemoryBus()), DecodeWorker({}, bus=MemoryBus())
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_the_real_objects_are_what_the_contract_names(workers) -> None:
    prefill, decode = workers
    cache = torch.zeros(4, 2, 2, 4, 1, 8)  # [blocks, layers, K/V, block size, KV heads, dim]
    layout = {"num_kv_heads": 1}
    server = KVServer(cache, layout, prefill.leases)
    client = KVClient(cache, layout, 4)
    for obj, proto in [
        (prefill.leases, contract.KVLeases),
        (LayerStream(num_layers=2), contract.KVLayerFeed),
        (server, contract.KVPullServer),
        (prefill, contract.KVPrefillSide),
        (client, contract.KVPiecePuller),
        (RankPuller(client, None, 1), contract.KVPuller),
        (decode, contract.KVDecodeSide),
    ]:
        assert isinstance(obj, proto), f"{type(obj).__name__} is no {proto.__name__}"
    # the engine's side can only be asked of its classes: building one loads a model
    assert issubclass(LLMEngine, contract.KVPullAnswers)
    assert issubclass(Scheduler, contract.KVPullAnswers)


def _as_contract(
    prefill: PrefillWorker,
    decode: DecodeWorker,
    engine: LLMEngine,
    scheduler: Scheduler,
    stream: LayerStream,
) -> list[object]:
    """Never called: a type checker holds each class to its Protocol here, types included."""
    assert prefill.kv_server is not None and decode.kv_client is not None
    sides: tuple[contract.KVPrefillSide, contract.KVDecodeSide] = (prefill, decode)
    answers: tuple[contract.KVPullAnswers, contract.KVPullAnswers] = (engine, scheduler)
    leases: contract.KVLeases = prefill.leases
    feed: contract.KVLayerFeed = stream
    server: contract.KVPullServer = prefill.kv_server
    client: contract.KVPiecePuller = decode.kv_client
    puller: contract.KVPuller = RankPuller(decode.kv_client, None, 1)
    return [sides, answers, leases, feed, server, client, puller]
