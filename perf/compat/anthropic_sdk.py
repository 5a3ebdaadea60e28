"""Anthropic's own Python SDK against pdserve's ``/v1/messages``, run in the SDK's venv (never
pdserve's), as a client writes it: ``messages.create``, ``messages.stream`` (the SDK's event
parser and accumulator), a tool call round trip (a named tool, its ``tool_use`` input checked
against the tool's schema, the result sent back as a ``tool_result``, a text answer),
``messages.count_tokens``, and two errors the SDK must raise as its own exception classes.

    <anthropic venv>/bin/python perf/compat/anthropic_sdk.py BASE_URL MODEL OUT.json

Writes what happened to OUT.json; exit 0 when every check passed.
"""

import json
import sys
import time

# pyright: reportMissingImports=false
# (the SDK is in its own venv, never pdserve's, so pyright does not find it there.)
import anthropic

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# Greedy answers. The SDK's 2.x signatures no longer take temperature (Anthropic's newer models
# take no sampling knobs); a client sends it as an extra body field, which pdserve reads.
GREEDY = {"extra_body": {"temperature": 0}}


class Checks:
    def __init__(self) -> None:
        self.results: list[dict] = []

    def __call__(self, name: str, ok: bool, detail: object = None) -> None:
        self.results.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)


def plain(client: anthropic.Anthropic, model: str, check: Checks) -> None:
    reply = client.messages.create(
        model=model,
        max_tokens=40,
        **GREEDY,
        system="You are a helpful assistant. Answer in one sentence.",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    text = "".join(b.text for b in reply.content if b.type == "text")
    check("create: a message", reply.type == "message" and reply.role == "assistant", text)
    check("create: stop_reason", reply.stop_reason in ("end_turn", "max_tokens"), reply.stop_reason)
    usage = reply.usage
    check("create: usage", usage.input_tokens > 0 and usage.output_tokens > 0, usage.to_dict())
    counted = client.messages.count_tokens(
        model=model,
        system="You are a helpful assistant. Answer in one sentence.",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    check("count_tokens = the prompt served", counted.input_tokens == prompt, counted.input_tokens)


def streamed(client: anthropic.Anthropic, model: str, check: Checks) -> None:
    kinds: list[str] = []
    texts: list[str] = []
    with client.messages.stream(
        model=model,
        max_tokens=48,
        **GREEDY,
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "text":
                texts.append(event.text)
        final = stream.get_final_message()
    text = "".join(b.text for b in final.content if b.type == "text")
    check("stream: text deltas join to the final message", "".join(texts) == text, text)
    check("stream: events", kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds)
    check("stream: final usage", final.usage.output_tokens > 0, final.usage.to_dict())


def tool_round_trip(client: anthropic.Anthropic, model: str, check: Checks) -> None:
    first = client.messages.create(
        model=model,
        max_tokens=80,
        **GREEDY,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    calls = [b for b in first.content if b.type == "tool_use"]
    check("tool: stop_reason tool_use", first.stop_reason == "tool_use", first.stop_reason)
    call = calls[0] if calls else None
    args = call.input if call is not None else {}
    schema_ok = (
        call is not None
        and call.name == "get_weather"
        and set(args) == {"city", "unit"}
        and isinstance(args["city"], str)
        and len(args["city"]) <= 30
        and args["unit"] in ("celsius", "fahrenheit")
    )
    check("tool: input follows the schema", schema_ok, args)
    with client.messages.stream(
        model=model,
        max_tokens=80,
        **GREEDY,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:
        final = stream.get_final_message()
    streamed_calls = [b for b in final.content if b.type == "tool_use"]
    check(
        "tool: streamed input_json_delta parsed by the SDK",
        len(streamed_calls) == 1 and set(streamed_calls[0].input) == {"city", "unit"},
        [b.input for b in streamed_calls],
    )
    if call is None:
        return
    result = {"city": args["city"], "temperature": 18, "unit": args["unit"], "sky": "sunny"}
    messages = [
        *ASK,
        {"role": "assistant", "content": [b.to_dict() for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": json.dumps(result)}
            ],
        },
    ]
    final = client.messages.create(
        model=model,
        max_tokens=40,
        **GREEDY,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "none"},
    )
    text = "".join(b.text for b in final.content if b.type == "text")
    ok = final.stop_reason in ("end_turn", "max_tokens") and bool(text)
    check("tool: the result sent back, a text answer", ok, text)


def errors(client: anthropic.Anthropic, model: str, check: Checks) -> None:
    try:
        client.messages.create(model="claude-nonexistent", max_tokens=8, messages=ASK)
        check("error: unknown model is NotFoundError", False, "no error")
    except anthropic.NotFoundError as exc:
        check(
            "error: unknown model is NotFoundError",
            exc.body["error"]["type"] == "not_found_error",
            exc.message,
        )
    try:
        client.messages.create(
            model=model, max_tokens=8, extra_body={"temperature": 1.5}, messages=ASK
        )
        check("error: temperature 1.5 is BadRequestError", False, "no error")
    except anthropic.BadRequestError as exc:
        kind = exc.body["error"]["type"]
        check(
            "error: temperature 1.5 is BadRequestError",
            kind == "invalid_request_error",
            exc.message,
        )


def main() -> int:
    base_url, model, out = sys.argv[1], sys.argv[2], sys.argv[3]
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", timeout=180, max_retries=0)
    check, t0 = Checks(), time.monotonic()
    for part in (plain, streamed, tool_round_trip, errors):
        try:
            part(client, model, check)
        except Exception as exc:  # a failure of one part is reported, the others still run
            check(f"{part.__name__}: raised", False, repr(exc))
    record = {
        "sdk": anthropic.__version__,
        "checks": check.results,
        "seconds": time.monotonic() - t0,
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    return 0 if all(r["ok"] for r in check.results) else 1


if __name__ == "__main__":
    sys.exit(main())
