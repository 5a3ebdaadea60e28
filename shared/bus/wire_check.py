"""The bus messages' checker: builds a message dataclass from a decoded msgpack map only after
every field's type and bounds fit, so code behind it can trust what it gets.

Generic over dataclasses: a field's type hint gives its type (int, float, bool, str, lists,
flat scalar maps, optional, nested dataclasses), its ``metadata`` its bounds (``lo``/``hi``,
``max_len``, ``pattern``, ``choices``). The message modules (``shared/bus/*_messages.py``) hold
the schema; ``pdserve.shared.bus.protocol`` configures one ``Checker`` for it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

INT64_MAX = (1 << 63) - 1


class ProtocolError(ValueError):
    """A bus message that does not fit the protocol; it is dropped, never half-used.

    ``reason`` is a short label, one of ``REJECT_REASONS``, for the rejected-messages counter
    (``pdserve_bus_rejected_messages_total``): too_large, malformed (not msgpack, or past the
    unpacker's limits), version, unknown_type, unexpected_type (a known type on the wrong
    subject) or schema (a field's type or bounds)."""

    def __init__(self, message: str, reason: str = "schema") -> None:
        super().__init__(message)
        self.reason = reason if reason in REJECT_REASONS else "schema"


REJECT_REASONS = ("too_large", "malformed", "version", "unknown_type", "unexpected_type", "schema")


def _fail(path: str, why: str) -> typing.NoReturn:
    raise ProtocolError(f"{path}: {why}")


def _check_int(value: Any, path: str, bounds: dict[str, Any]) -> int:
    if type(value) is not int:  # bool is an int subclass: reject it explicitly
        _fail(path, f"expected int, got {type(value).__name__}")
    lo, hi = bounds.get("lo", -INT64_MAX), bounds.get("hi", INT64_MAX)
    if not lo <= value <= hi:
        _fail(path, f"{value} outside [{lo}, {hi}]")
    return value


def _check_float(value: Any, path: str, bounds: dict[str, Any]) -> float:
    if type(value) not in (int, float):
        _fail(path, f"expected number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        _fail(path, "not finite")
    lo, hi = bounds.get("lo", -math.inf), bounds.get("hi", math.inf)
    if not lo <= value <= hi:
        _fail(path, f"{value} outside [{lo}, {hi}]")
    return value


def _check_str(value: Any, path: str, bounds: dict[str, Any], max_text: int) -> str:
    if type(value) is not str:
        _fail(path, f"expected str, got {type(value).__name__}")
    if len(value) > bounds.get("max_len", max_text):
        _fail(path, f"longer than {bounds.get('max_len', max_text)} chars")
    pattern = bounds.get("pattern")
    if pattern is not None and not pattern.match(value):
        _fail(path, f"{value[:40]!r} is not a valid identifier")
    choices = bounds.get("choices")
    if choices is not None and value not in choices:
        _fail(path, f"{value[:40]!r} not one of {choices}")
    return value


def _check_scalar_dict(value: Any, path: str, bounds: dict[str, Any]) -> dict[str, Any]:
    """A flat map of short strings to scalars (the KV layout fingerprint)."""
    if type(value) is not dict:
        _fail(path, f"expected map, got {type(value).__name__}")
    if len(value) > bounds.get("max_len", 32):
        _fail(path, "too many entries")
    for k, v in value.items():
        if type(k) is not str or len(k) > 64:
            _fail(path, "keys must be short strings")
        if type(v) not in (str, int, float, bool) or (type(v) is str and len(v) > 256):
            _fail(f"{path}.{k}", "values must be short scalars")
    return dict(value)


class Checker:
    """Checks maps against message dataclasses; ``nested`` are the dataclasses that may appear
    as field values, ``bounds`` per-class field bounds for classes that do not carry them in
    their field metadata."""

    def __init__(
        self,
        nested: tuple[type, ...],
        bounds: dict[type, dict[str, dict[str, Any]]],
        max_depth: int,
        max_text: int,
        max_list: int,
    ) -> None:
        self.nested = nested
        self.bounds = bounds
        self.max_depth = max_depth
        self.max_text = max_text
        self.max_list = max_list
        self._hint_cache: dict[type, dict[str, Any]] = {}

    def _hints(self, cls: type) -> dict[str, Any]:
        if cls not in self._hint_cache:
            self._hint_cache[cls] = typing.get_type_hints(cls)
        return self._hint_cache[cls]

    def check(self, value: Any, tp: Any, path: str, bounds: dict[str, Any], depth: int) -> Any:
        if depth > self.max_depth:
            _fail(path, "nested too deeply")
        origin = typing.get_origin(tp)
        if origin in (typing.Union, types.UnionType):
            args = typing.get_args(tp)
            if value is None:
                if type(None) in args:
                    return None
                _fail(path, "must not be null")
            (inner,) = [a for a in args if a is not type(None)]
            return self.check(value, inner, path, bounds, depth)
        if value is None:
            _fail(path, "must not be null")
        if origin is list:
            if type(value) is not list:
                _fail(path, f"expected list, got {type(value).__name__}")
            max_len = bounds.get("max_len", self.max_list)
            if len(value) > max_len:
                _fail(path, f"more than {max_len} items")
            (item_tp,) = typing.get_args(tp)
            if item_tp is int:  # the hot case (token ids): one pass, no per-item path strings
                lo, hi = bounds.get("lo", -INT64_MAX), bounds.get("hi", INT64_MAX)
                for v in value:
                    if type(v) is not int or not lo <= v <= hi:
                        _fail(path, f"items must be ints in [{lo}, {hi}]")
                return value
            if item_tp is float:  # log-probs: as above, and every item finite
                lo, hi = bounds.get("lo", -math.inf), bounds.get("hi", math.inf)
                for v in value:
                    if type(v) not in (int, float) or not lo <= v <= hi:
                        _fail(path, f"items must be numbers in [{lo}, {hi}]")
                return [float(v) for v in value]
            return [
                self.check(v, item_tp, f"{path}[{i}]", {}, depth + 1) for i, v in enumerate(value)
            ]
        if origin is dict:
            return _check_scalar_dict(value, path, bounds)
        if tp is bool:
            if type(value) is not bool:
                _fail(path, f"expected bool, got {type(value).__name__}")
            return value
        if tp is int:
            return _check_int(value, path, bounds)
        if tp is float:
            return _check_float(value, path, bounds)
        if tp is str:
            return _check_str(value, path, bounds, self.max_text)
        if tp in self.nested:
            return self.build(tp, value, path, depth + 1)
        raise TypeError(f"no checker for {tp!r}")  # a bug here, not bad input

    def build(
        self, cls: type, body: Any, path: str, depth: int = 0, skip: tuple[str, ...] = ()
    ) -> Any:
        if type(body) is not dict:
            _fail(path, f"expected map, got {type(body).__name__}")
        hints = self._hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(body) - set(fields) - set(skip)
        if unknown:
            _fail(path, f"unknown fields {sorted(map(str, unknown))[:5]}")
        kwargs: dict[str, Any] = {}
        for name, f in fields.items():
            if name not in body:
                required = (
                    f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                )
                if required:
                    _fail(f"{path}.{name}", "missing")
                continue
            bounds = self.bounds[cls][name] if cls in self.bounds else dict(f.metadata)
            kwargs[name] = self.check(body[name], hints[name], f"{path}.{name}", bounds, depth)
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as exc:  # the class's own invariants
            raise ProtocolError(f"{path}: {exc}") from None
