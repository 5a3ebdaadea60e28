"""The Responses API's conversion core, model-free: items lowered to the chat endpoint's messages
(calls merged into the assistant turn they belong to, results checked against the calls made,
reasoning handed to the next assistant message), items as they are stored, and the output
builder - its events well-formed (each item added, filled, done, never interleaved, indices in
order) and joined to the same items however the answer is cut into pieces (property-tested)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.gateway.api_models import ChatMessage
from pdserve.gateway.errors import APIError
from pdserve.gateway.response_choice import Piece
from pdserve.gateway.responses.bodies import ResponsesBody
from pdserve.gateway.responses.conversation import (
    chat_messages,
    chat_request,
    input_items,
    read_items,
    stored_items,
)
from pdserve.gateway.responses.output import OutputBuilder


def items(*raw: dict) -> list:
    return read_items(list(raw))


def call(call_id: str, city: str) -> dict:
    arguments = f'{{"city": "{city}"}}'
    return {"type": "function_call", "call_id": call_id, "name": "weather", "arguments": arguments}


def result(call_id: str, text: str) -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": text}


def template_call(call_id: str, city: str) -> dict:
    function = {"name": "weather", "arguments": {"city": city}}
    return {"id": call_id, "type": "function", "function": function}


def test_items_become_the_chat_messages_of_the_same_conversation():
    conversation = items(
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        call("c1", "Paris"),
        call("c2", "Rome"),
        result("c1", "sunny"),
        result("c2", [{"type": "input_text", "text": "rain"}]),
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Again"}]},
        call("c3", "Oslo"),
        {"role": "system", "content": "Late system note"},
    )
    got = chat_messages("Rules.", conversation, str)
    assert got == [
        ChatMessage(role="system", content="Rules."),
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Go"),
        ChatMessage(
            role="assistant",
            content="Checking.",
            reasoning_content="Hm",
            tool_calls=[template_call("c1", "Paris"), template_call("c2", "Rome")],
        ),
        ChatMessage(role="tool", content="sunny", tool_call_id="c1"),
        ChatMessage(role="tool", content="rain", tool_call_id="c2"),
        # reasoning before a call starts a new assistant turn carrying it
        ChatMessage(
            role="assistant",
            content="",
            reasoning_content="Again",
            tool_calls=[template_call("c3", "Oslo")],
        ),
        ChatMessage(role="system", content="Late system note"),
    ]


def test_a_result_must_answer_a_call_made_before_it():
    with pytest.raises(APIError) as caught:
        chat_messages(None, items(result("c1", "x"), call("c1", "Paris")), lambda i: f"at{i}")
    assert caught.value.status == 400 and caught.value.param == "at0.call_id"


def test_a_continued_conversation_names_the_requests_own_items():
    body = ResponsesBody.model_validate(
        {"model": "m", "input": [result("nope", "x")], "previous_response_id": "resp_1"}
    )
    history = items({"role": "user", "content": "Hi"}, call("c1", "Paris"))
    with pytest.raises(APIError) as caught:
        chat_request(body, history, "hermes", ())
    assert caught.value.param == "input[0].call_id"
    good = body.model_copy(update={"input": read_items([result("c1", "sunny")])})
    req = chat_request(good, history, "hermes", ())
    assert [m.role for m in req.messages] == ["user", "assistant", "tool"]
    assert req.add_generation_prompt and not req.continue_final_message


def test_items_are_stored_whole_with_ids():
    body = ResponsesBody.model_validate({"model": "m", "input": "Hi"})
    (user,) = stored_items(input_items(body))
    assert user["id"].startswith("msg_")
    assert {k: v for k, v in user.items() if k != "id"} == {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "Hi"}],
        "status": "completed",
    }
    kept = stored_items(items({"role": "assistant", "content": "Yes", "id": "msg_mine"}))
    assert kept[0]["id"] == "msg_mine" and kept[0]["content"][0]["type"] == "output_text"
    stored = stored_items(items(call("c1", "Paris"), result("c1", "ok")))
    assert [s["id"].split("_")[0] for s in stored] == ["fc", "fco"]
    assert read_items(stored) == items(*stored)  # read back as it was written


# ----------------------------------------------------------------------------- output items


def header(index: int, call_id: str) -> dict:
    function = {"name": "weather", "arguments": ""}
    return {
        "tool_calls": [{"index": index, "id": call_id, "type": "function", "function": function}]
    }


def arguments(index: int, text: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


# a streamed answer's chat deltas, as ResponseChoice makes them (tools/stream.py's shapes)
ANSWER = [
    {"reasoning_content": "Let me think."},
    {"content": "Checking the weather."},
    header(0, "call_a"),
    arguments(0, '{"city": "Paris"}'),
    {"content": "\n"},
    header(1, "call_b"),
    arguments(1, '{"city": "Rome"}'),
    {"content": "\n  "},
]


def built(pieces: list[list[dict]], incomplete: bool = False) -> tuple[list[dict], list[dict]]:
    builder = OutputBuilder()
    events = [e for deltas in pieces for e in builder.feed(Piece(text="", deltas=deltas))]
    return builder.items, events + builder.finish(incomplete)


def check_well_formed(items: list[dict], events: list[dict]) -> None:
    """Items open and close one at a time, in output order; every event names its open item;
    the deltas join to each item's text."""
    open_index, closed = None, []
    text: dict[int, str] = {}
    for event in events:
        kind, index = event["type"], event.get("output_index")
        if kind == "response.output_item.added":
            assert open_index is None and index == len(closed)
            open_index = index
            assert event["item"]["status"] == "in_progress"
        elif kind == "response.output_item.done":
            assert index == open_index
            closed.append(event["item"])
            open_index = None
        else:
            assert index == open_index and event["item_id"] == items[index]["id"]
            if kind.endswith(".delta"):
                text[index] = text.get(index, "") + event["delta"]
    assert open_index is None and closed == items
    for index, item in enumerate(items):
        whole = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        assert text.get(index, "") == whole


def test_the_answer_becomes_items_in_order():
    items, events = built([[d] for d in ANSWER])
    check_well_formed(items, events)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert items[1]["content"][0]["text"] == "Checking the weather."
    assert [(i["call_id"], i["arguments"]) for i in items[2:]] == [
        ("call_a", '{"city": "Paris"}'),
        ("call_b", '{"city": "Rome"}'),
    ]
    assert all(i["status"] == "completed" for i in items)  # the space after the calls: no message


def test_nothing_or_space_alone_is_still_one_message_and_a_cut_answer_is_incomplete():
    for answer in ([], [[{"content": " \n"}]]):
        items, events = built(answer)
        check_well_formed(items, events)
        assert [(i["type"], i["content"][0]["text"]) for i in items] == [
            ("message", answer[0][0]["content"] if answer else "")
        ]
    items, _ = built([[{"content": "Hel"}]], incomplete=True)
    assert items[0]["status"] == "incomplete"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(ANSWER)), max_size=6))
def test_any_grouping_of_the_deltas_builds_the_same_items(cuts):
    bounds = sorted({0, len(ANSWER), *cuts})
    pieces = [ANSWER[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    items, events = built(pieces)
    check_well_formed(items, events)
    whole, _ = built([ANSWER])
    strip = [{k: v for k, v in i.items() if k != "id"} for i in items]
    assert strip == [{k: v for k, v in i.items() if k != "id"} for i in whole]
