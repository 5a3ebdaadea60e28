"""OpenAI's own Python client against pdserve's Responses API, run in the client's own venv (never
pdserve's): what its documentation writes, checked against what the client parsed.

    <openai venv>/bin/python perf/compat/openai_responses.py BASE_URL MODEL OUT.json

1. ``responses.create``: a text answer, stored; ``responses.retrieve`` returns the same.
2. ``responses.stream``: the SDK's own event parser and accumulator; its final response's text
   is the text deltas joined, and the events come in OpenAI's order (``order``: each run of
   deltas written once).
3. A function tool round trip: the first turn names the tool (``tool_choice``), so even a 135M
   model calls it; the call runs here; its result goes back as a ``function_call_output`` item
   with ``previous_response_id``, and the model answers in text.
4. ``responses.parse`` with a pydantic model (``text_format``): the answer parses as it.
5. ``input_items.list`` of the last turn: the whole conversation; ``responses.delete``, after
   which ``retrieve`` is a 404.

Writes what happened to OUT.json; exit 0 when every step held.
"""

import json
import sys
import time

# pyright: reportMissingImports=false
# (openai is in its own venv, never pdserve's, so pyright does not find it there.)
import openai
from pydantic import BaseModel

MULTIPLY = {
    "type": "function",
    "name": "multiply",
    "description": "Multiply two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "strict": True,
}


class City(BaseModel):
    name: str
    country: str


def created(client: openai.OpenAI, model: str) -> dict:
    first = client.responses.create(
        model=model, input="Say hello in one short sentence.", max_output_tokens=32, temperature=0
    )
    again = client.responses.retrieve(first.id)
    assert first.output_text and again.output_text == first.output_text, (first, again)
    assert first.status in ("completed", "incomplete") and first.store
    return {
        "id": first.id,
        "text": first.output_text,
        "status": first.status,
        "usage": first.usage.model_dump() if first.usage else None,
    }


def streamed(client: openai.OpenAI, model: str) -> dict:
    """The SDK's get_final_response() wants response.completed; a stream cut by
    max_output_tokens ends with response.incomplete instead (as OpenAI's does), whose event
    carries the response, so that one is read from its event."""
    kinds, deltas, last = [], [], None
    with client.responses.stream(
        model=model, input="Name one colour. One word.", max_output_tokens=128, temperature=0
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                last = event.response
        final = stream.get_final_response() if kinds[-1] == "response.completed" else last
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds[:4]
    assert final is not None and final.output_text == "".join(deltas), (final, deltas)
    order = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # runs of deltas
    return {"events": len(kinds), "order": order, "text": final.output_text}


def tool_round_trip(client: openai.OpenAI, model: str) -> dict:
    ask = client.responses.create(
        model=model,
        input="What is 12 times 34? Use the tool.",
        tools=[MULTIPLY],
        tool_choice={"type": "function", "name": "multiply"},
        temperature=0,
    )
    calls = [item for item in ask.output if item.type == "function_call"]
    assert calls, ask.output
    results = []
    for call in calls:
        args = json.loads(call.arguments)
        results.append(
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": str(args["a"] * args["b"]),
            }
        )
    answer = client.responses.create(
        model=model,
        previous_response_id=ask.id,
        input=results,
        tools=[MULTIPLY],
        tool_choice="none",
        max_output_tokens=48,
        temperature=0,
    )
    assert answer.output_text, answer.output
    return {
        "calls": [{"name": c.name, "arguments": c.arguments} for c in calls],
        "results": [r["output"] for r in results],
        "answer": answer.output_text,
        "first": ask.id,
        "second": answer.id,
    }


def parsed(client: openai.OpenAI, model: str) -> dict:
    out = client.responses.parse(
        model=model,
        input="Give a city and its country as JSON.",
        text_format=City,
        max_output_tokens=64,
        temperature=0,
    )
    city = out.output_parsed
    assert isinstance(city, City), out.output_text
    return city.model_dump()


def listed_and_deleted(client: openai.OpenAI, first: str, second: str) -> dict:
    items = list(client.responses.input_items.list(second, order="asc"))
    kinds = [item.type for item in items]
    assert (
        kinds[0] == "message" and "function_call" in kinds and kinds[-1] == "function_call_output"
    )
    deleted = client.responses.delete(first)
    try:
        client.responses.retrieve(first)
    except openai.NotFoundError:
        gone = True
    else:
        gone = False
    assert gone, f"{first} still there after {deleted}"
    return {"input_items": kinds, "deleted": first}


def main() -> int:
    base_url, model, out = sys.argv[1], sys.argv[2], sys.argv[3]
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
    steps: dict = {}
    t0 = time.monotonic()

    def run(name: str, step) -> dict:
        """One step's result; a failure is recorded and the later steps still run."""
        try:
            steps[name] = {"ok": True, **step()}
        except Exception as exc:
            steps[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return steps[name]

    run("create", lambda: created(client, model))
    run("stream", lambda: streamed(client, model))
    tools = run("tool_round_trip", lambda: tool_round_trip(client, model))
    run("parse", lambda: parsed(client, model))
    if tools["ok"]:
        run(
            "input_items_delete",
            lambda: listed_and_deleted(client, tools["first"], tools["second"]),
        )
    record = {"openai": openai.__version__, "steps": steps, "seconds": time.monotonic() - t0}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record, indent=1))
    return 0 if all(step["ok"] for step in steps.values()) and len(steps) == 5 else 1


if __name__ == "__main__":
    sys.exit(main())
