"""The grammar that enforces tool calls: a Lark grammar for llguidance, carried as an ordinary
``GuidedDecoding(kind="grammar")`` on ``GenerationParams.guided``, so the engine applies it as
any structured output (on the prefill worker's first token, and replayed on a decode worker
after a KV pull or a migration).

When there is one:

- ``tool_choice: "required"``: the answer is one or more calls (exactly one when
  ``parallel_tool_calls`` is false) of the tools, then the end; a named function: exactly one
  call of that function (as OpenAI and vLLM answer it), then the end.
- ``auto`` with a ``strict`` function: text, or calls, where every call names a tool, a strict
  function's arguments follow its schema and another's are a JSON object.
- ``none``, and ``auto`` without a strict function: none.

The calls are written in the parser's format (``ToolSetup.parser``):

- ``hermes``: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, calls one per
  block, blocks separated by a newline. With ``auto``, text may come before, between and after
  the calls; a lazy lexeme ends the text at the first ``<tool_call>``, and the text after the
  last call never contains one (llguidance's ``~`` negation), so every call that the parser
  finds is one the grammar checked.
- ``llama3_json``: ``{"name": "f", "parameters": {...}}``, calls separated by ``"; "``; with
  ``auto``, an answer that does not start with ``{`` is text.
- ``pythonic``: ``[f(a=1, b="x"), g()]``; the schema is translated into Python literals
  (``pythonic_grammar.py``; a schema outside its subset is a 400); with ``auto``, an answer
  that does not start with ``[`` is text.

Arguments in JSON formats are llguidance's ``%json`` of the function's schema, with the same
bounded whitespace as ``response_format`` (``structured_output.JSON_MAX_WHITESPACE``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pdserve.gateway.errors import APIError, bad_request
from pdserve.gateway.tools.pythonic_grammar import TERMINALS, PythonicGrammar, Unenforceable
from pdserve.gateway.tools.setup import ToolSetup
from pdserve.shared import structured_output
from pdserve.shared.sampling import MAX_GUIDED_SPEC_CHARS, GuidedDecoding
from pdserve.shared.structured_output import JSON_MAX_WHITESPACE

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
WHITESPACE = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{JSON_MAX_WHITESPACE}}}"}

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


class ToolGrammarError(ValueError):
    """The tools cannot be enforced as asked: a 400 naming ``param``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param

    def api_error(self) -> APIError:
        return bad_request(str(self), self.param, "invalid_function_parameters")


def _lark(text: str) -> str:
    return json.dumps(text)  # Lark string literals take JSON's escapes


def _tag(setup: ToolSetup, text: str) -> str:
    """A format's tag as text, or as the one token the served tokenizer has for it
    (``ToolSetup.tag_tokens``): llguidance counts a tokenizer's added tokens (Qwen2.5's
    ``<tool_call>``) as special, which only a token reference matches, and a model writes its
    tag as that one token."""
    token = dict(setup.tag_tokens).get(text)
    return _lark(text) if token is None else f"({_lark(text)} | <[{token}]>)"


def tag_tokens(parser: str, encode: Callable[[str], list[int]]) -> tuple[tuple[str, int], ...]:
    """The tags of ``parser``'s format that ``encode`` (the served tokenizer, no special tokens
    added) turns into one token each."""
    tags = (HERMES_OPEN, HERMES_CLOSE) if parser == "hermes" else ()
    return tuple((tag, ids[0]) for tag in tags if len(ids := encode(tag)) == 1)


def enforced(setup: ToolSetup) -> list[tuple[int, dict[str, Any], bool]]:
    """(index in ``tools``, function, whether its schema is enforced) for every function the
    grammar may call; empty when there is no grammar."""
    if setup.choice == "none":
        return []
    if setup.forced:
        return [
            (i, f, True)
            for i, f in enumerate(setup.functions)
            if setup.choice == "required" or f["name"] == setup.named
        ]
    if not any(f.get("strict") for f in setup.functions):
        return []
    return [(i, f, bool(f.get("strict"))) for i, f in enumerate(setup.functions)]


def arguments_schema(function: dict[str, Any], strict: bool) -> dict[str, Any]:
    """The schema a call's arguments follow in the grammar."""
    if not strict:
        return ANY_OBJECT
    parameters = function.get("parameters")
    return NO_ARGUMENTS if parameters is None else parameters


def tool_guide(setup: ToolSetup | None) -> GuidedDecoding | None:
    """The grammar that enforces ``setup``'s calls, or None when nothing is enforced.
    Raises ToolGrammarError when the tools cannot be enforced (a schema outside the pythonic
    subset, a grammar longer than the wire carries)."""
    if setup is None:
        return None
    functions = enforced(setup)
    if not functions:
        return None
    if setup.parser == "pythonic":
        text = _pythonic(setup, functions)
    else:
        text = _json_format(setup, functions)
    if len(text) > MAX_GUIDED_SPEC_CHARS:
        raise ToolGrammarError(
            f"The tools' schemas make a grammar of {len(text)} characters; at most "
            f"{MAX_GUIDED_SPEC_CHARS} are accepted (send fewer or smaller tools)",
            "tools",
        )
    return GuidedDecoding("grammar", text)


def _several(setup: ToolSetup) -> bool:
    """Whether one answer may hold more than one call."""
    return setup.parallel and setup.choice != "function"


def _json_format(setup: ToolSetup, functions: list[tuple[int, dict[str, Any], bool]]) -> str:
    hermes = setup.parser == "hermes"
    key = "arguments" if hermes else "parameters"
    rules, bodies = [], []
    for i, function, strict in functions:
        schema = {**arguments_schema(function, strict), "x-guidance": WHITESPACE}
        head = _lark(f'{{"name": {json.dumps(function["name"])}, "{key}": ')
        rules.append(f'fn_{i}: {head} args_{i} "}}"')
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
        bodies.append(f"fn_{i}")
    body = " | ".join(bodies)
    if hermes:
        close = f'"\\n" {_tag(setup, HERMES_CLOSE)}'
        if setup.forced:
            rules.append(f'call: {_tag(setup, HERMES_OPEN)} "\\n" ({body}) {close}')
            start = 'call ("\\n" call)*' if _several(setup) else "call"
        else:
            # text up to and including the first marker (lazy: it ends there), then a call;
            # the text after the last call holds no marker
            rules.append(f'call: head "\\n" ({body}) {close}')
            token = dict(setup.tag_tokens).get(HERMES_OPEN)
            if token is None:
                rules.append("head: headtxt")
            else:  # or text without the marker, then the marker's own token
                rules.append(f"head: headtxt | PRE? <[{token}]>")
                rules.append(f"PRE: /(?s:.+)/ & ~/(?s:.*){HERMES_OPEN}(?s:.*)/")
            rules.append(f"headtxt[lazy]: ANY {_lark(HERMES_OPEN)}")
            rules.append("ANY: /(?s:.*)/")
            rules.append(f"TAIL: /(?s:.*)/ & ~/(?s:.*){HERMES_OPEN}(?s:.*)/")
            start = ("call*" if setup.parallel else "call?") + " TAIL"
    else:
        rules.append(f"call: {body}")
        calls = 'call ("; " call)*' if _several(setup) else "call"
        if setup.forced:
            start = calls
        else:
            rules.append("TEXT: /[^{](?s:.*)/")
            start = f"TEXT? | {calls}"
    return "\n".join([f"start: {start}", *rules]) + "\n"


def _pythonic(setup: ToolSetup, functions: list[tuple[int, dict[str, Any], bool]]) -> str:
    grammar = PythonicGrammar("py")
    calls = []
    for i, function, strict in functions:
        try:
            calls.append(grammar.call(function["name"], arguments_schema(function, strict)))
        except Unenforceable as exc:
            raise ToolGrammarError(
                f"Function {function['name']!r} cannot be enforced in the pythonic tool-call "
                f"format: its {exc.where} {exc}",
                f"tools[{i}].function.parameters",
            ) from None
    listed = '"[" call (", " call)* "]"' if _several(setup) else '"[" call "]"'
    rules = [f"call: {' | '.join(calls)}", *grammar.rules]
    if setup.forced:
        start = listed
    else:
        rules.append(r"TEXT: /[^\[](?s:.*)/")
        start = f"TEXT? | {listed}"
    return "\n".join([f"start: {start}", *rules, TERMINALS]) + "\n"


def check_schemas(setup: ToolSetup | None, tokenizer: Any) -> None:
    """Compile every enforced schema for ``tokenizer`` (a ``tokenizers.Tokenizer``): one that
    llguidance cannot compile is a 400 naming its tool, before the whole grammar is compiled
    (``structured_output.check``, which caches both). Blocking: call it off the event loop."""
    if setup is None or setup.parser == "pythonic":
        return  # pythonic schemas were translated (or refused) when the grammar was built
    for i, function, strict in enforced(setup):
        if not strict:
            continue
        schema = json.dumps(arguments_schema(function, strict))
        try:
            structured_output.check(GuidedDecoding("json_schema", schema), tokenizer)
        except ValueError as exc:
            raise bad_request(
                f"Invalid schema for function {function['name']!r}: {exc}",
                f"tools[{i}].function.parameters",
                "invalid_function_parameters",
            ) from None
