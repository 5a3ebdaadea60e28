"""The arguments of a ``pythonic`` tool call as a Lark grammar: ``get_weather(city="Paris",
days=3)`` with each keyword's value a Python literal that, read back (``ast.literal_eval``),
validates against the function's JSON schema.

llguidance's ``%json`` writes JSON (``true``, ``null``), not Python (``True``, ``None``), so the
schema is translated here, for the subset whose every instance a grammar can describe exactly:

- ``type`` (one or a list): ``string`` (``minLength`` / ``maxLength``), ``integer``, ``number``,
  ``boolean``, ``null``, ``array`` (``items``, ``minItems`` / ``maxItems``), ``object``
  (``properties`` in their order, ``required``, ``additionalProperties``);
- ``enum``, ``const``, ``anyOf``; annotations (``description``, ``title``, ...) are ignored.

Any other keyword (``pattern``, ``minimum``, ``$ref``, ``oneOf``, ...) raises ``Unenforceable``:
the request is refused rather than given a grammar that would let invalid arguments through.
Written values are a subset of what the schema allows: declared properties only, in the
schema's order; strings without ``\\u`` escapes (raw characters instead).
"""

from __future__ import annotations

import json
import keyword
from typing import Any

IGNORED = frozenset(
    {
        "description",
        "title",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$schema",
        "$id",
    }
)
BY_TYPE = {
    "string": frozenset({"minLength", "maxLength"}),
    "integer": frozenset(),
    "number": frozenset(),
    "boolean": frozenset(),
    "null": frozenset(),
    "array": frozenset({"items", "minItems", "maxItems"}),
    "object": frozenset({"properties", "required", "additionalProperties"}),
}
KNOWN = frozenset().union(*BY_TYPE.values(), {"type", "enum", "const", "anyOf"}, IGNORED)
MAX_REPEAT = 1024  # largest minLength / maxItems written as a bounded repetition

# Python literals a JSON value reads back as (strings: JSON's escapes less \/ and \u, which
# Python reads differently or not at all for surrogate pairs).
TERMINALS = r"""
PY_CHAR: /[^"\\\x00-\x1f]|\\["\\bfnrt]/
PY_STR: "\"" PY_CHAR* "\""
PY_INT: /-?(0|[1-9][0-9]*)/
PY_NUM: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
PY_KW: /[A-Za-z_][A-Za-z0-9_]*/
py_any: PY_STR | PY_NUM | "True" | "False" | "None" | py_any_list | py_any_dict
py_any_list: "[" (py_any (", " py_any)*)? "]"
py_any_dict: "{" (PY_STR ": " py_any (", " PY_STR ": " py_any)*)? "}"
"""


class Unenforceable(ValueError):
    """A schema the pythonic grammar cannot describe exactly; ``where`` is the path in it."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


def python_literal(value: Any) -> str:
    """A JSON value as Python source that reads back as the same value."""
    if value is True:
        return "True"
    if value is False:
        return "False"
    if value is None:
        return "None"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # raw characters: no surrogate escapes
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    items = (f"{json.dumps(k, ensure_ascii=False)}: {python_literal(v)}" for k, v in value.items())
    return "{" + ", ".join(items) + "}"


def _lark(text: str) -> str:
    return json.dumps(text)  # Lark string literals take JSON's escapes


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


class PythonicGrammar:
    """Lark rules for pythonic calls; ``rules`` gathers every rule the calls need."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.rules: list[str] = []
        self._count = 0

    def _rule(self, body: str) -> str:
        self._count += 1
        name = f"{self.prefix}_{self._count}"
        self.rules.append(f"{name}: {body}")
        return name

    def call(self, name: str, schema: dict[str, Any]) -> str:
        """A rule for one call of ``name`` with the keyword arguments ``schema`` allows."""
        self._check_keys(schema, "parameters")
        if schema.get("type", "object") != "object" or not _object_like(schema):
            raise Unenforceable("must be an object schema for keyword arguments", "parameters")
        for prop in schema.get("properties", {}):
            if not prop.isidentifier() or keyword.iskeyword(prop):
                raise Unenforceable(
                    f"has property {prop!r}, which is not a Python keyword argument name",
                    "parameters.properties",
                )
        args = self._members(schema, "parameters", lambda key: _lark(f"{key}="), 'PY_KW "="')
        return self._rule(" ".join([_lark(name + "("), *([args] if args else []), '")"']))

    def value(self, schema: Any, where: str) -> str:
        """A Lark expression for the Python literals ``schema`` allows."""
        if schema is True or schema == {}:
            return "py_any"
        if not isinstance(schema, dict):
            raise Unenforceable("must be a schema object", where)
        self._check_keys(schema, where)
        if "const" in schema:
            return _lark(python_literal(schema["const"]))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list):
                raise Unenforceable("has an enum that is not an array", where)
            kinds = self._types(schema, where)
            if kinds is not None:  # "integer" also holds floats with no fraction
                values = [
                    v
                    for v in values
                    if _json_type(v) in kinds or (_json_type(v) == "integer" and "number" in kinds)
                ]
            if not values:
                raise Unenforceable("has an enum no value satisfies", where)
            return "(" + " | ".join(_lark(python_literal(v)) for v in values) + ")"
        if "anyOf" in schema:
            if set(schema) - IGNORED != {"anyOf"}:
                raise Unenforceable("anyOf beside other keywords cannot be enforced", where)
            options = [self.value(s, f"{where}.anyOf[{i}]") for i, s in enumerate(schema["anyOf"])]
            return "(" + " | ".join(options) + ")"
        kinds = self._types(schema, where)
        if kinds is None:  # no type: what the keywords describe, else any value
            if _object_like(schema) and ({"properties", "required"} & schema.keys()):
                kinds = ["object"]
            elif "items" in schema:
                kinds = ["array"]
            else:
                return "py_any"
        return "(" + " | ".join(self._typed(kind, schema, where) for kind in kinds) + ")"

    def _check_keys(self, schema: dict[str, Any], where: str) -> None:
        for key in schema:
            if key not in KNOWN:
                raise Unenforceable(
                    f"uses {key!r}, which the pythonic format cannot enforce", where
                )

    def _types(self, schema: dict[str, Any], where: str) -> list[str] | None:
        kind = schema.get("type")
        if kind is None:
            return None
        kinds = [kind] if isinstance(kind, str) else kind
        if not isinstance(kinds, list) or not all(k in BY_TYPE for k in kinds) or not kinds:
            raise Unenforceable(f"has a type the pythonic format does not know: {kind!r}", where)
        return kinds

    def _typed(self, kind: str, schema: dict[str, Any], where: str) -> str:
        if kind == "string":
            low, high = _bounds(schema, "minLength", "maxLength", where)
            if low == 0 and high is None:
                return "PY_STR"
            return f'"\\"" PY_CHAR{{{low},{"" if high is None else high}}} "\\""'
        if kind == "integer":
            return "PY_INT"
        if kind == "number":
            return "PY_NUM"
        if kind == "boolean":
            return '("True" | "False")'
        if kind == "null":
            return '"None"'
        if kind == "array":
            item = self.value(schema.get("items", True), f"{where}.items")
            low, high = _bounds(schema, "minItems", "maxItems", where)
            return self._rule(_repeat(item, low, high))
        body = self._members(
            schema, where, lambda key: _lark(python_literal(key) + ": "), 'PY_STR ": "'
        )
        return self._rule(" ".join(['"{"', *([body] if body else []), '"}"']))

    def _members(self, schema: dict[str, Any], where: str, label, any_label: str) -> str | None:
        """The members of an object (keyword arguments, or a dict's entries) in the schema's
        order, required ones always there, joined by ", "; None when there can be none."""
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise Unenforceable("has properties or required of the wrong type", where)
        missing = [r for r in required if r not in properties]
        if missing:
            raise Unenforceable(f"requires {missing[0]!r}, which it does not declare", where)
        extra = schema.get("additionalProperties", True)
        if not properties:
            if extra is False:
                return None
            value = self.value(extra, f"{where}.additionalProperties")
            member = f"{any_label} {value}"
            return self._rule(f'({member} (", " {member})*)?')
        items = [
            (f"{label(key)} {self.value(sub, f'{where}.properties.{key}')}", key in required)
            for key, sub in properties.items()
        ]
        return self._sequence(items)

    def _sequence(self, items: list[tuple[str, bool]]) -> str | None:
        """The items in order, the optional ones possibly left out, joined by ", ": rules
        ``rest`` (from item i, after something was written) and ``first`` (nothing yet)."""
        rest: str | None = None
        first: str | None = None
        for i in range(len(items) - 1, -1, -1):
            expr, needed = items[i]
            tail = f" {rest}" if rest else ""
            if needed:
                new_first = f"{expr}{tail}"
            elif first:
                new_first = f"{expr}{tail} | {first}"
            else:
                new_first = f"({expr}{tail})?"
            if i > 0:  # nothing comes before the first item: its rest would go unused
                rest = self._rule(f'", " {expr}{tail}' if needed else f'(", " {expr})?{tail}')
            first = self._rule(new_first)
        return first


def _object_like(schema: dict[str, Any]) -> bool:
    extra = schema.get("additionalProperties", True)
    return extra is True or extra is False or isinstance(extra, dict)


def _bounds(
    schema: dict[str, Any], low_key: str, high_key: str, where: str
) -> tuple[int, int | None]:
    low, high = schema.get(low_key, 0), schema.get(high_key)
    for value in (low, high):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_REPEAT
        ):
            raise Unenforceable(
                f"{low_key}/{high_key} must be integers in [0, {MAX_REPEAT}]", where
            )
    if high is not None and high < low:
        raise Unenforceable(f"has {high_key} below {low_key}: no value fits", where)
    return low, high


def _repeat(item: str, low: int, high: int | None) -> str:
    """``[item, item, ...]`` with low..high items."""
    if high == 0:
        return '"[]"'
    more_low, more_high = max(low - 1, 0), None if high is None else high - 1
    span = f"{{{more_low},{'' if more_high is None else more_high}}}"
    inner = f'{item} (", " {item}){span}'
    return f'"[" {inner} "]"' if low >= 1 else f'"[" ({inner})? "]"'
