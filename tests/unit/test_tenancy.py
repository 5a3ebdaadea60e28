"""Tenants kept apart (``gateway/tenancy.py``): the cache salt names the root of a request's
chain of block hashes, so a different salt shares no cached block - in the hash itself, in a
worker's prefix cache, in the gateway's prefix index - and vLLM's ``cache_salt`` and
``priority`` fields are parsed and refused as vLLM does, on every generation endpoint.
(Through a P/D stack: tests/integration/test_tenancy_e2e.py.)"""

from __future__ import annotations

import time

import pytest

from pdserve.gateway.anthropic.lowering import parse_messages
from pdserve.gateway.api_models import parse_chat, parse_completion, validated
from pdserve.gateway.errors import APIError
from pdserve.gateway.responses.bodies import ResponsesBody
from pdserve.gateway.router import Router
from pdserve.gateway.tenancy import check_priority, request_salt
from pdserve.services.engine.block_manager import BlockManager
from pdserve.services.engine.sequence import Sequence
from pdserve.shared.bus.discovery_messages import WorkerLoad
from pdserve.shared.bus.protocol import ProtocolError, decode, encode
from pdserve.shared.bus.request_messages import PrefillRequest
from pdserve.shared.kv.layout import ROOT_HASH, chain_root, hash_block, prefix_block_hashes
from pdserve.shared.sampling import SamplingParams
from tests.unit.test_api_schemas import CHAT, COMPLETION, error_of

BS = 4
PROMPT = list(range(100, 100 + 4 * BS + 1))  # four full blocks and a token to compute


def test_the_salt_enters_the_first_blocks_hash_and_so_every_later_one():
    plain = prefix_block_hashes(PROMPT, BS)
    a = prefix_block_hashes(PROMPT, BS, chain_root("tenant-a"))
    b = prefix_block_hashes(PROMPT, BS, chain_root("tenant-b"))
    assert chain_root(None) == ROOT_HASH and plain == prefix_block_hashes(PROMPT, BS, ROOT_HASH)
    assert a[0] == hash_block(chain_root("tenant-a"), PROMPT[:BS]) != plain[0]
    assert not (set(a) & set(b)) and not (set(a) & set(plain)) and not (set(b) & set(plain))
    assert a == prefix_block_hashes(PROMPT, BS, chain_root("tenant-a"))  # stable
    assert chain_root("") != ROOT_HASH  # no salt can name the unsalted chain


def seq(bus_id: str, salt: str | None) -> Sequence:
    return Sequence(bus_id, PROMPT, SamplingParams(cache_salt=salt), 0, time.monotonic())


def cached_tokens(bm: BlockManager, s: Sequence) -> int:
    return bm.find_prefix(s).num_tokens


def test_a_worker_shares_cached_blocks_only_within_one_salt():
    bm = BlockManager(num_blocks=32, block_size=BS)
    first = seq("a1", "tenant-a")
    bm.allocate(first, len(PROMPT))
    first.num_computed_tokens = len(PROMPT)
    bm.commit(first)
    assert bm.take_lineage(bm.stored_events)[bm.seq_hashes["a1"][0]][0] == chain_root("tenant-a")
    assert cached_tokens(bm, seq("a2", "tenant-a")) == 4 * BS
    assert cached_tokens(bm, seq("b", "tenant-b")) == 0
    assert cached_tokens(bm, seq("plain", None)) == 0


def load(wid: str) -> WorkerLoad:
    return WorkerLoad(wid, "prefill", "m", 100, 100, 0, 0, ts=time.time(), block_size=BS)


def test_the_routers_prefix_index_counts_only_the_requests_own_salt():
    held = set(prefix_block_hashes(PROMPT, BS, chain_root("tenant-a")))

    def hits(worker_id: str, hashes: list[int]) -> int:
        n = 0
        while n < len(hashes) and worker_id == "p1" and hashes[n] in held:
            n += 1
        return n

    router = Router(lambda role: [load("p0"), load("p1")], BS, model="m", cached_hits=hits)
    own = router.prefill_costs(PROMPT, chain_root("tenant-a"))
    assert own["p1"] < own["p0"]
    for other in (chain_root("tenant-b"), ROOT_HASH):
        costs = router.prefill_costs(PROMPT, other)
        assert costs["p1"] == costs["p0"]
    assert router.pick_prefill(PROMPT, root=chain_root("tenant-a")) == "p1"


def test_the_gateway_salts_by_key_unless_the_scope_is_global():
    assert request_salt("key", "", None) is None  # keys off, no salt: the shared chain
    assert request_salt("key", "k1", None) != request_salt("key", "k2", None)
    assert request_salt("key", "k1", "s") != request_salt("key", "k2", "s")
    assert request_salt("key", "k1", "s") == request_salt("key", "k1", "s")
    assert request_salt("key", "k1", "s") != request_salt("key", "k1", None)
    assert request_salt("global", "k1", "s") == request_salt("global", "k2", "s")
    assert request_salt("global", "k1", None) is None
    assert request_salt("key", "ab", "c") != request_salt("key", "a", "bc")
    assert request_salt("key", "", "") != request_salt("key", "", None)
    salt = request_salt("key", "sk-secret", "x")
    assert salt is not None and len(salt) == 32 and "secret" not in salt  # a digest only


MESSAGES = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "m", "input": "hi"}


def parse_anthropic(body):
    return parse_messages(body, "hermes", ())


@pytest.mark.parametrize(
    "parse, base", [(parse_completion, COMPLETION), (parse_chat, CHAT), (parse_anthropic, MESSAGES)]
)
def test_cache_salt_and_priority_are_read_on_every_endpoint(parse, base):
    params = parse({**base, "cache_salt": "t1", "priority": -3}).params
    assert (params.cache_salt, params.priority) == ("t1", -3)
    params = parse({**base, "cache_salt": None}).params
    assert (params.cache_salt, params.priority) == (None, 0)
    assert error_of(parse, {**base, "cache_salt": ""}).param == "cache_salt"
    assert error_of(parse, {**base, "cache_salt": 5}).param == "cache_salt"
    assert error_of(parse, {**base, "priority": "1"}).param == "priority"
    assert error_of(parse, {**base, "priority": 1.5}).param == "priority"
    assert error_of(parse, {**base, "priority": 2**40}).param == "priority"


def test_the_responses_body_takes_them_too():
    body = validated(ResponsesBody, {**RESPONSES, "cache_salt": "t1", "priority": 2})
    assert (body.cache_salt, body.priority) == ("t1", 2)
    with pytest.raises(APIError) as info:
        validated(ResponsesBody, {**RESPONSES, "cache_salt": ""})
    assert info.value.param == "cache_salt"


def test_fcfs_refuses_a_priority_it_cannot_honour():
    check_priority("fcfs", 0)
    check_priority("priority", 7)
    with pytest.raises(APIError) as info:
        check_priority("fcfs", 1)
    assert info.value.status == 400 and info.value.param == "priority"


def test_salt_and_priority_cross_the_bus_and_are_bounded():
    sp = SamplingParams(priority=-5, cache_salt="ab" * 16)
    msg = PrefillRequest(
        bus_id="r1", prompt_token_ids=[1, 2], sampling=sp, reply_to="t.gw.g", deadline=1.0
    )
    back = decode(encode(msg))
    assert back.sampling.priority == -5 and back.sampling.cache_salt == "ab" * 16
    msg.sampling.cache_salt = "x" * 257
    with pytest.raises(ProtocolError):
        decode(encode(msg))
    with pytest.raises(ValueError):
        SamplingParams(cache_salt="")
