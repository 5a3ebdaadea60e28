"""Tool calls out of generated text: the calls, and the text around them (the message's
``content``).

One machine (``Segmenter``) reads the text as it streams in and says, in order, what is content
and what is a call; a whole answer (``parse``) is the same machine fed the whole text at once.
So the streamed ``tool_calls`` and content join to exactly the whole answer's, however the text
was split into deltas (the formats' scanners decide nothing that more text could change).

What counts as a call: a region the format (``formats.py``) reads as calls, every call naming
one of the request's functions with an object of arguments. Anything else - bad JSON, an unknown
name, arguments that are not an object, a call cut off by ``max_tokens`` - stays content, as
written. With ``parallel_tool_calls: false`` only the first call is returned.

Content is the text outside the calls, with the space around calls trimmed: space before the
first call and after the last one is dropped, and between two pieces of text only the space
that preceded the calls is kept (``"Sure.\\n<call>\\n<call>\\nDone."`` -> ``"Sure.\\nDone."``).
An answer without calls is its text unchanged.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pdserve.gateway.tools.formats import FORMATS, Candidate, Ctx
from pdserve.gateway.tools.setup import ToolSetup


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object, as the API sends it

    def json(self, call_id: str) -> dict[str, object]:
        """As a message's ``tool_calls`` entry."""
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Parsed:
    content: str | None  # None: the answer is only calls
    calls: list[Call] = field(default_factory=list)


Event = tuple[str, str] | tuple[str, Call]  # ("content", text) or ("call", call)


class Segmenter:
    """Generated text in, content and calls out, in order; holds back only what may still be
    (part of) a call."""

    def __init__(self, setup: ToolSetup) -> None:
        self.setup = setup
        self.format = FORMATS.get(setup.parser, FORMATS["hermes"])
        self._names = set(setup.names)
        self._buf = ""  # text not decided yet
        self._in_region = False  # _buf starts with a call region the format is reading
        self._memo: dict[str, Any] = {}  # the format's notes on that region, between scans
        self._ctx: Ctx = "start"
        self._space = ""  # space at the end of the content so far, held until text follows
        self._after_call = False  # drop space until the next text
        self._emitted = False  # any content sent
        self.calls_found = 0  # calls written, returned or not (parallel_tool_calls: false)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        """The text has ended: decide everything held."""
        out = self._run(final=True)
        if self._space and not self.calls_found:
            out.append(("content", self._space))  # trailing space of an answer without calls
        self._space = ""
        return out

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._buf:
            if self._in_region:
                region = self.format.scan(self._buf, final, self._memo)
                if region is None:
                    break
                self._in_region = False
                end = max(region.end, 1)  # always progress
                taken, self._buf = self._buf[:end], self._buf[end:]
                calls = self._checked(region.calls)
                if calls is None:
                    self._content(taken, out)
                    self._ctx = "text"
                else:
                    self._calls(calls, out)
                continue
            at, hold = self.format.find_start(self._buf, self._ctx)
            if at is not None:
                self._content(self._buf[:at], out)
                self._buf = self._buf[at:]
                self._in_region, self._memo = True, {}
                continue
            cut = len(self._buf) if final else len(self._buf) - hold
            if cut == 0:
                break
            self._content(self._buf[:cut], out)
            self._buf = self._buf[cut:]
        return out

    def _checked(self, candidates: list[Candidate] | None) -> list[Call] | None:
        """The region's calls, or None when any of them is not a call of the request's tools
        (then the whole region is content)."""
        if not candidates:
            return None
        calls = []
        for c in candidates:
            if c.name not in self._names or not isinstance(c.arguments, dict):
                return None
            calls.append(Call(c.name, json.dumps(c.arguments, ensure_ascii=False)))
        return calls

    def _calls(self, calls: list[Call], out: list[Event]) -> None:
        if not self._emitted:
            self._space = ""  # space before the first call
        for call in calls:
            if self.setup.parallel or self.calls_found == 0:
                out.append(("call", call))
            self.calls_found += 1
        self._after_call = True
        self._ctx = "after_call"

    def _content(self, text: str, out: list[Event]) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._space += text
            return
        out.append(("content", self._space + body))
        self._space = text[len(body) :]
        self._emitted = True
        self._ctx = "text"


def parse(text: str, setup: ToolSetup) -> Parsed:
    """A whole answer's content and calls (``setup.parses_calls``: otherwise all content)."""
    if not setup.parses_calls:
        return Parsed(text)
    seg = Segmenter(setup)
    events = seg.feed(text) + seg.finish()
    content = "".join(v for _, v in events if isinstance(v, str))
    calls = [v for _, v in events if isinstance(v, Call)]
    return Parsed(content or None if seg.calls_found else content, calls)


# A template describing calls as a Python list: Llama 3.2's pythonic and Llama 4's write
# "[func_name1(params_name1=params_value1, ...), func_name2(params)]".
_PYTHONIC_EXAMPLE = re.compile(r"\[\s*[A-Za-z_]\w*\(\s*[A-Za-z_]\w*\s*=")


def parser_for_template(source: str | None) -> str:
    """The format a chat template asks its model to write calls in (``--tool-call-parser
    auto``); hermes when it says nothing, as pdserve's fallback prompt asks for hermes."""
    if not source:
        return "hermes"
    if "<tool_call>" in source:
        return "hermes"
    if "<|python_start|>" in source or _PYTHONIC_EXAMPLE.search(source):
        return "pythonic"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3_json"
    return "hermes"
