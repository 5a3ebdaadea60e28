"""A LangChain agent loop, as LangChain's docs write one, run in LangChain's own venv (never
pdserve's): ``ChatOpenAI(...).bind_tools([multiply])`` against pdserve, the tool's calls run
locally, their results sent back as ``ToolMessage``s until the model answers in text.

    <langchain venv>/bin/python perf/compat/langchain_agent.py BASE_URL MODEL OUT.json

The first turn names the tool (``tool_choice``), so even a 135M model calls it; later turns are
``auto``, and after ``MAX_TURNS`` the tool is withdrawn (``tool_choice: none``) so the loop
always ends. Every call's arguments are checked against the tool's schema by LangChain itself
(its ``tool.invoke`` validates them). Writes what happened to OUT.json; exit 0 when the loop
ended with a text answer after at least one tool result.
"""

import json
import sys
import time

# pyright: reportMissingImports=false
# (LangChain is in its own venv, never pdserve's, so pyright does not find it there.)
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

MAX_TURNS = 3


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def main() -> int:
    base_url, model, out = sys.argv[1], sys.argv[2], sys.argv[3]
    llm = ChatOpenAI(
        base_url=base_url,
        api_key="unused",
        model=model,
        temperature=0,
        max_tokens=96,
        timeout=120,
        max_retries=0,
    )
    messages = [HumanMessage("What is 12 times 34? Use the multiply tool.")]
    calls, t0 = [], time.monotonic()
    for turn in range(MAX_TURNS + 1):
        choice = "multiply" if turn == 0 else "auto" if turn < MAX_TURNS else "none"
        reply = llm.bind_tools([multiply], tool_choice=choice).invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            result = multiply.invoke(call["args"])  # validates the arguments
            calls.append({"turn": turn, "args": call["args"], "result": result})
            messages.append(ToolMessage(str(result), tool_call_id=call["id"]))
    answer = messages[-1].content if not messages[-1].tool_calls else None
    record = {"calls": calls, "answer": answer, "turns": turn + 1, "seconds": time.monotonic() - t0}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record))
    return 0 if calls and isinstance(answer, str) else 1


if __name__ == "__main__":
    sys.exit(main())
