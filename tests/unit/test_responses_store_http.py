"""Stored responses through the real app, against the store's interface (a store in memory: this
tier starts no nats-server; JetStream's own store is tests/integration/test_responses_store.py):
what is stored and read back (GET, input_items with its paging, DELETE), ``store: false``, a
conversation continued over several turns, and what a gateway without a usable store does -
plain requests answered unstored, explicit ones refused (400 without JetStream, 503 while the
store fails) - including the default JetStream store on a bus that has none."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pdserve.gateway.openapi import openapi_spec
from tests.unit.conftest import ids_of
from tests.unit.gateway_fixtures import serving
from tests.unit.memory_store import MemoryResponseStore
from tests.unit.responses_support import ask, published, read_events, responded, types

NO_JETSTREAM = "NATS at nats://x has no JetStream"


async def error_of(response, status: int) -> dict:
    assert response.status == status, await response.text()
    return (await response.json())["error"]


async def test_stored_read_back_and_deleted(model_dir, tok):
    store = MemoryResponseStore()
    async with serving(model_dir, response_store=store) as (client, d0):
        said = [{"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
        _, out = await responded(client, d0, ask(said), ids_of(tok, "Hello."))
        assert out["store"] is True and store.puts == 1
        got = await client.get(f"/v1/responses/{out['id']}")
        assert got.status == 200 and await got.json() == out
        listed = await (await client.get(f"/v1/responses/{out['id']}/input_items")).json()
        published(listed, "ResponseInputItemList")
        assert listed["object"] == "list" and listed["has_more"] is False
        items = listed["data"]  # newest first by default
        assert [(i["role"], i["content"]) for i in items] == [
            ("user", [{"type": "input_text", "text": "Hi"}]),
            ("developer", [{"type": "input_text", "text": "Be kind."}]),
        ]
        assert all(i["id"].startswith("msg_") and i["type"] == "message" for i in items)
        assert (listed["first_id"], listed["last_id"]) == (items[0]["id"], items[1]["id"])
        page = await client.get(
            f"/v1/responses/{out['id']}/input_items",
            params={"order": "asc", "limit": "1"},
        )
        page = await page.json()
        assert [i["id"] for i in page["data"]] == [items[1]["id"]] and page["has_more"] is True
        rest = await client.get(
            f"/v1/responses/{out['id']}/input_items",
            params={"order": "asc", "after": items[1]["id"]},
        )
        assert [i["id"] for i in (await rest.json())["data"]] == [items[0]["id"]]
        bad = await client.get(f"/v1/responses/{out['id']}/input_items", params={"limit": "0"})
        assert (await error_of(bad, 400))["param"] == "limit"

        deleted = await client.delete(f"/v1/responses/{out['id']}")
        published(await deleted.json(), "DeletedResponse")
        assert await deleted.json() == {"id": out["id"], "object": "response", "deleted": True}
        for response in (
            await client.get(f"/v1/responses/{out['id']}"),
            await client.delete(f"/v1/responses/{out['id']}"),
            await client.get("/v1/responses/not-an-id"),
        ):
            assert (await error_of(response, 404))["type"] == "invalid_request_error"
        again = await client.get(f"/v1/responses/{out['id']}", params={"stream": "true"})
        assert (await error_of(again, 400))["param"] == "stream"


async def test_store_false_stores_nothing(model_dir, tok):
    store = MemoryResponseStore()
    async with serving(model_dir, response_store=store) as (client, d0):
        _, out = await responded(client, d0, ask(store=False), ids_of(tok, "Hello."))
        _, events = await responded(client, d0, ask(store=False, stream=True), ids_of(tok, "Hi"))
        assert out["store"] is False and events[-1]["response"]["store"] is False
        assert store.puts == 0
        await error_of(await client.get(f"/v1/responses/{out['id']}"), 404)
        follow = await client.post("/v1/responses", json=ask(previous_response_id=out["id"]))
        assert (await error_of(follow, 404))["param"] == "previous_response_id"


async def test_a_conversation_over_three_turns(model_dir, tok):
    async with serving(model_dir, response_store=MemoryResponseStore()) as (client, d0):
        _, one = await responded(client, d0, ask("One?"), ids_of(tok, "Uno."))
        _, two = await responded(
            client, d0, ask("Two?", previous_response_id=one["id"]), ids_of(tok, "Dos.")
        )
        request, three = await responded(
            client, d0, ask("Three?", previous_response_id=two["id"], stream=True), [1, 2]
        )
        final = three[-1]["response"]
        listed = await client.get(
            f"/v1/responses/{final['id']}/input_items", params={"order": "asc"}
        )
        items = (await listed.json())["data"]
    prompt = tok.decode(request.prompt_token_ids, skip_special_tokens=False)
    assert prompt == (
        "<s><|user|>\nOne?</s>\n<|assistant|>\nUno.</s>\n<|user|>\nTwo?</s>\n"
        "<|assistant|>\nDos.</s>\n<|user|>\nThree?</s>\n<|assistant|>\n"
    )
    texts = [i["content"][0]["text"] for i in items]
    assert texts == ["One?", "Uno.", "Two?", "Dos.", "Three?"]
    # earlier outputs keep their ids: they are the items the earlier responses returned
    assert items[1] == one["output"][0] and items[3] == two["output"][0]


async def test_without_jetstream_plain_requests_are_answered_and_explicit_ones_refused(
    model_dir, tok
):
    store = MemoryResponseStore(problem=NO_JETSTREAM, permanent=True)
    async with serving(model_dir, response_store=store) as (client, d0):
        _, out = await responded(client, d0, ask(), ids_of(tok, "Hello."))
        assert out["status"] == "completed" and out["store"] is False and store.puts == 0
        refused = [
            ("store", await client.post("/v1/responses", json=ask(store=True))),
            (
                "previous_response_id",
                await client.post("/v1/responses", json=ask(previous_response_id="resp_1")),
            ),
            (None, await client.get("/v1/responses/resp_1")),
            (None, await client.delete("/v1/responses/resp_1")),
            (None, await client.get("/v1/responses/resp_1/input_items")),
        ]
        for param, response in refused:
            error = await error_of(response, 400)
            assert error["code"] == "response_store_unavailable" and error["param"] == param
            assert error["message"] == NO_JETSTREAM


async def test_a_failing_store_fails_the_answer_instead_of_promising_it(model_dir, tok):
    store = MemoryResponseStore()
    async with serving(model_dir, response_store=store) as (client, d0):
        store.failing = True
        reply = asyncio.create_task(client.post("/v1/responses", json=ask()))
        await d0.tokens(await d0.next_request(), ids_of(tok, "Hello."), "stop")
        response = await asyncio.wait_for(reply, 10)
        error = await error_of(response, 503)
        assert error["code"] == "response_store_unavailable" and "Retry-After" in response.headers
        reply = asyncio.create_task(client.post("/v1/responses", json=ask(stream=True)))
        await d0.tokens(await d0.next_request(), ids_of(tok, "Hello."), "stop")
        events = read_events(await (await asyncio.wait_for(reply, 10)).text())
        assert types(events)[-2:] == ["output_item.done", "failed"]
        await error_of(await client.get("/v1/responses/resp_1"), 503)
    waiting = MemoryResponseStore(problem="JetStream is not ready", permanent=False)
    async with serving(model_dir, response_store=waiting) as (client, d0):
        await error_of(await client.post("/v1/responses", json=ask(store=True)), 503)


async def test_the_default_store_on_a_bus_without_jetstream_says_so_once(model_dir, tok, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.gateway.responses")
    async with serving(model_dir) as (client, d0):  # JetStream's store, on the memory bus
        _, out = await responded(client, d0, ask(), ids_of(tok, "Hello."))
        assert out["store"] is False
        error = await error_of(await client.post("/v1/responses", json=ask(store=True)), 400)
        assert "has no JetStream" in error["message"]
    said = [r.getMessage() for r in caplog.records if "JetStream" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0] and "-js" in said[0]


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"seed": 1}, "seed"),
        ({"truncation": "auto"}, "truncation"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"tools": [{"type": "function", "name": "f"}] * 2}, "tools[1].name"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
async def test_what_is_not_served_is_a_400_naming_it(model_dir, patch, param):
    async with serving(model_dir, response_store=MemoryResponseStore()) as (client, _):
        response = await client.post("/v1/responses", json={**ask(), **patch})
        assert (await error_of(response, 400))["param"] == param


def test_openapi_publishes_the_endpoints_under_names_of_their_own():
    document = openapi_spec("m")
    assert {"post"} == set(document["paths"]["/v1/responses"])
    assert {"get", "delete"} == set(document["paths"]["/v1/responses/{response_id}"])
    assert "get" in document["paths"]["/v1/responses/{response_id}/input_items"]
    schemas = document["components"]["schemas"]
    # two models of one name would be published under their module paths instead
    assert [name for name in schemas if "__" in name] == []
    assert set(schemas["ResponsesRequest"]["properties"]) >= {"input", "previous_response_id"}


async def test_a_conversation_too_long_names_this_apis_fields(model_dir):
    async with serving(model_dir, response_store=MemoryResponseStore()) as (client, _):
        too_many = await client.post("/v1/responses", json=ask(max_output_tokens=5000))
        error = await error_of(too_many, 400)
        assert (
            error["param"] == "max_output_tokens" and "max_output_tokens (5000)" in error["message"]
        )
        too_long = await client.post("/v1/responses", json=ask("word " * 5000))
        assert (await error_of(too_long, 400))["param"] == "input"


async def test_a_stored_response_is_seen_only_under_the_key_that_made_it(model_dir, tok):
    """Tenants apart: another key can neither read, list, continue nor delete a response, and
    is told it does not exist (404), not that it is someone else's; its own key still can."""
    store = MemoryResponseStore()
    alice, bob = "key-alice", "key-bob"
    async with serving(model_dir, response_store=store, api_key=[alice, bob]) as (client, d0):
        client.session.headers["Authorization"] = f"Bearer {alice}"
        _, out = await responded(client, d0, ask("Hi"), ids_of(tok, "Hello."))
        path = f"/v1/responses/{out['id']}"
        as_bob = {"Authorization": f"Bearer {bob}"}
        for response in (
            await client.get(path, headers=as_bob),
            await client.get(path + "/input_items", headers=as_bob),
            await client.delete(path, headers=as_bob),
            await client.post(
                "/v1/responses", json=ask("More", previous_response_id=out["id"]), headers=as_bob
            ),
        ):
            assert (await error_of(response, 404))["type"] == "invalid_request_error"
        assert (await client.get(path)).status == 200  # alice's, untouched
        assert (await client.delete(path)).status == 200
