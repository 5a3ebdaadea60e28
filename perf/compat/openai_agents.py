"""An OpenAI Agents SDK agent with one function tool over pdserve's Responses API, run in the SDK's
own venv (never pdserve's), written as its documentation writes one: ``@function_tool``,
``Agent(tools=[...])``, ``Runner.run``; the model is ``OpenAIResponsesModel`` on an
``AsyncOpenAI`` client pointed at pdserve, tracing off (it would upload to OpenAI).

    <openai-agents venv>/bin/python perf/compat/openai_agents.py BASE_URL MODEL OUT.json

The first turn must call the tool (``tool_choice`` names it), so even a 135M model does; the SDK
runs the call, sends its output back and asks again with ``tool_choice`` reset to ``auto``
(``reset_tool_choice``, its default), and ``max_turns`` bounds the loop. Writes what happened to
OUT.json; exit 0 when the tool ran with the arguments the model gave and the run ended with a
text answer.
"""

import asyncio
import json
import sys
import time

# pyright: reportMissingImports=false
# (the Agents SDK is in its own venv, never pdserve's, so pyright does not find it there.)
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents import __version__ as agents_version
from openai import AsyncOpenAI

CALLS: list[dict] = []


@function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    CALLS.append({"a": a, "b": b})
    return a * b


async def main() -> int:
    base_url, model, out = sys.argv[1], sys.argv[2], sys.argv[3]
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
    agent = Agent(
        name="calculator",
        instructions="You multiply numbers with the multiply tool, then say the result.",
        tools=[multiply],
        model=OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=ModelSettings(tool_choice="multiply", temperature=0, max_tokens=96),
    )
    t0 = time.monotonic()
    result = await Runner.run(agent, "What is 12 times 34?", max_turns=4)
    items = [item.type for item in result.new_items]
    record = {
        "openai_agents": agents_version,
        "calls": CALLS,
        "items": items,
        "answer": result.final_output,
        "responses": [r.response_id for r in result.raw_responses],
        "seconds": time.monotonic() - t0,
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record, indent=1))
    ran = CALLS == [{"a": 12, "b": 34}] and "tool_call_output_item" in items
    return 0 if ran and isinstance(result.final_output, str) and result.final_output else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
