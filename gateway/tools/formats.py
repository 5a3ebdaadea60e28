"""How models write tool calls, one class per format: where a call may start in the generated
text, and where it ends and what it holds.

- ``hermes`` (Qwen2/2.5/3, Hermes, SmolLM3, pdserve's fallback prompt): each call is a block
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the text.
- ``llama3_json`` (Llama 3.1/3.2/3.3): ``{"name": ..., "parameters": {...}}`` at the start of
  the answer, or after ``<|python_tag|>`` (visible only when special tokens are kept); several
  calls are separated by ``;``.
- ``pythonic`` (Llama 3.2 pythonic, Llama 4): ``[f(a=1, b="x"), g()]`` at the start of the
  answer, or after ``<|python_start|>`` / ``<|python_tag|>``; read with ``ast``, never run.

The stream (``parsers.Segmenter``) asks a format two things. ``find_start(buf, ctx)``: where in
the undecided text a call region starts, or how much of its end to hold back because it may be
the start of one. ``scan(buf, final, memo)``: given text from a region's start, whether it is
still undecided (``None``), or a ``Region`` of ``end`` characters that holds calls or is plain
text. Every answer depends only on the text given, and a decided answer never changes when more
text follows, so the calls found do not depend on how the text was split into deltas. ``memo``
(one per region) lets a scan resume where the last one stopped: a long call streamed token by
token is read once, not once per token.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

Ctx = Literal["start", "after_call", "text"]  # what came before: nothing but space, a call, text


@dataclass(frozen=True)
class Candidate:
    """A call as written, before it is checked against the request's tools."""

    name: Any
    arguments: Any


@dataclass(frozen=True)
class Region:
    end: int  # characters of the scanned text it takes
    calls: list[Candidate] | None  # None: not calls; its text is content


def partial_suffix(buf: str, marker: str) -> int:
    """Length of the longest end of ``buf`` that is a proper start of ``marker``."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


def _find_markers(buf: str, markers: tuple[str, ...]) -> tuple[int | None, int]:
    found = [i for i in (buf.find(m) for m in markers) if i != -1]
    if found:
        return min(found), 0
    return None, max(partial_suffix(buf, m) for m in markers)


def _skip_space(buf: str, i: int) -> int:
    while i < len(buf) and buf[i].isspace():
        i += 1
    return i


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity would re-serialise as invalid JSON


def json_call(text: str) -> Candidate | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` (no arguments: an empty object)."""
    try:
        # strict=False: models write raw newlines and tabs inside strings (code, poems);
        # the arguments are re-serialised, so the client gets them escaped
        obj = json.loads(text, parse_constant=_reject_constant, strict=False)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in ("arguments", "parameters"):
        if key in obj:
            return Candidate(obj["name"], obj[key])
    return Candidate(obj["name"], {})


class BracketEnd:
    """Finds where the bracket opening at ``start`` closes, skipping strings (JSON's ``"``, or
    Python's ``'`` and ``"``), resuming from where the last call stopped as the text grows."""

    def __init__(self, start: int, python: bool) -> None:
        self.pos, self.depth, self.quote, self.escaped = start, 0, "", False
        self.quotes, self.opens, self.closes = (
            ("'\"", "([{", ")]}") if python else ('"', "[{", "]}")
        )
        self.end: int | None = None

    def __call__(self, buf: str) -> int | None:
        """The index after the closing bracket, or None while ``buf`` does not hold it."""
        i = self.pos
        while self.end is None and i < len(buf):
            c = buf[i]
            i += 1
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == self.quote:
                    self.quote = ""
            elif c in self.quotes:
                self.quote = c
            elif c in self.opens:
                self.depth += 1
            elif c in self.closes:
                self.depth -= 1
                if self.depth == 0:
                    self.end = i
        self.pos = i
        return self.end


def bracket_end(buf: str, start: int, memo: dict[str, Any], python: bool) -> int | None:
    """``BracketEnd`` kept in the region's ``memo`` between scans."""
    finder = memo.get("end")
    if finder is None:
        finder = memo["end"] = BracketEnd(start, python)
    return finder(buf)


class Hermes:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def find_start(self, buf: str, ctx: Ctx) -> tuple[int | None, int]:
        return _find_markers(buf, (self.OPEN,))

    def scan(self, buf: str, final: bool, memo: dict[str, Any]) -> Region | None:
        body = len(self.OPEN)
        first = _skip_space(buf, body)
        if first < len(buf) and buf[first] != "{":
            return Region(body, None)  # not a JSON call: the tag is text
        # from where the last scan stopped, less a tag's length (it may have been cut)
        since = max(body, memo.get("seen", body) - len(self.CLOSE))
        close = buf.find(self.CLOSE, since)
        memo["seen"] = len(buf)
        if close == -1:
            if not final:
                return None
            # The answer ended inside the block: a whole call in it still counts (a model may
            # stop right after the JSON); anything less is text.
            call = json_call(buf[body:]) if first < len(buf) else None
            return Region(len(buf), [call] if call else None)
        call = json_call(buf[body:close])
        return Region(close + len(self.CLOSE), [call] if call else None)


class Llama3Json:
    TAG = "<|python_tag|>"

    def find_start(self, buf: str, ctx: Ctx) -> tuple[int | None, int]:
        if ctx != "text":
            k = _skip_space(buf, 0)
            j = _skip_space(buf, k + 1) if ctx == "after_call" and buf[k : k + 1] == ";" else k
            if j == len(buf):
                return None, len(buf) - k  # only space so far, or a ';' that may join calls
            if buf[j] == "{":
                return k, 0  # the region takes the ';' between two calls
        return _find_markers(buf, (self.TAG,))

    def scan(self, buf: str, final: bool, memo: dict[str, Any]) -> Region | None:
        i = len(self.TAG) if buf.startswith(self.TAG) else 0
        i = _skip_space(buf, i)
        if buf[i : i + 1] == ";":
            i = _skip_space(buf, i + 1)
        if i == len(buf):
            return Region(i, None) if final else None
        if buf[i] != "{":
            return Region(i, None)
        key = _skip_space(buf, i + 1)
        if key < len(buf) and buf[key] not in '"}':
            return Region(i + 1, None)  # not a JSON object: plain text
        end = bracket_end(buf, i, memo, python=False)
        if end is None:
            return Region(len(buf), None) if final else None
        call = json_call(buf[i:end])
        return Region(end, [call] if call else None)


_CALL_START = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
_MAY_START = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?")  # every proper start of _CALL_START


class Pythonic:
    TAGS = ("<|python_start|>", "<|python_tag|>")

    def find_start(self, buf: str, ctx: Ctx) -> tuple[int | None, int]:
        if ctx != "text":
            k = _skip_space(buf, 0)
            if k == len(buf):
                return None, 0
            if buf[k] == "[":
                return k, 0
        return _find_markers(buf, self.TAGS)

    def scan(self, buf: str, final: bool, memo: dict[str, Any]) -> Region | None:
        i = next((len(t) for t in self.TAGS if buf.startswith(t)), 0)
        i = _skip_space(buf, i)
        if i == len(buf):
            return Region(i, None) if final else None
        if buf[i] != "[":
            return Region(i, None)
        if not _CALL_START.match(buf, i):
            if _MAY_START.fullmatch(buf, i) and not final:
                return None
            return Region(i + 1, None)  # '[' not followed by a call: plain text
        end = bracket_end(buf, i, memo, python=True)
        if end is None:
            return Region(len(buf), None) if final else None
        return Region(end, pythonic_calls(buf[i:end]))


def pythonic_calls(source: str) -> list[Candidate] | None:
    """``[f(a=1), g()]`` as calls, or None when it is anything else."""
    try:
        tree = ast.parse(source, mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
                return None
            if any(kw.arg is None for kw in node.keywords):  # **kwargs
                return None
            args = {kw.arg: literal(kw.value) for kw in node.keywords}
            calls.append(Candidate(node.func.id, args))
        return calls
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


_JSON_NAMES = {"true": True, "false": False, "null": None}  # models sometimes write JSON's


def literal(node: ast.AST) -> Any:
    """A Python literal as the JSON value it stands for; ValueError for anything else."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            key = literal(k) if k is not None else None
            if not isinstance(key, str):
                raise ValueError("dict keys must be strings")
            out[key] = literal(v)
        return out
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")


Format = Hermes | Llama3Json | Pythonic
FORMATS: dict[str, Format] = {
    "hermes": Hermes(),
    "llama3_json": Llama3Json(),
    "pythonic": Pythonic(),
}
