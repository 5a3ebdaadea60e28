"""How an option becomes a flag and an environment variable.

``opt`` declares a config field (default, help, choices, whether it repeats); ``add_options``
turns the fields of config dataclasses into ``--field-name`` flags whose defaults come from
``PDSERVE_FIELD_NAME``; ``build`` makes a config object from the parsed arguments. The option
classes themselves live in ``pdserve.shared.config``, which re-exports these names.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import field
from typing import Any, TypeVar

ENV_PREFIX = "PDSERVE_"

T = TypeVar("T")


def opt(
    default: Any, help: str, *, choices: tuple[str, ...] | None = None, multiple: bool = False
) -> Any:
    """A config field: its default, help text, allowed choices, and whether it may repeat."""
    meta = {"help": help, "choices": choices, "multiple": multiple}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin is list:
        return _base_type(typing.get_args(tp)[0])
    return tp


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _convert(kind: Any, raw: str) -> Any:
    if kind is bool:
        return _parse_bool(raw)
    return kind(raw)


def env_default(f: dataclasses.Field, kind: Any) -> Any:
    raw = os.environ.get(env_name(f.name))
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if raw is None:
        return default
    try:
        if f.metadata.get("multiple"):
            return [_convert(kind, part) for part in raw.split(",") if part.strip()]
        return _convert(kind, raw)
    except ValueError as exc:
        raise SystemExit(f"invalid {env_name(f.name)}={raw!r}: {exc}") from None


def add_options(
    parser: argparse.ArgumentParser, *classes: type, skip: tuple[str, ...] = ()
) -> None:
    """Add one flag per field of each config class, defaulting to its env var."""
    hints: dict[str, Any] = {}
    for cls in classes:
        hints.update(typing.get_type_hints(cls))
    seen: set[str] = set()
    for cls in classes:
        group = parser.add_argument_group(cls.__name__.removesuffix("Config").lower())
        for f in dataclasses.fields(cls):
            if f.name in seen or f.name in skip:
                continue
            seen.add(f.name)
            kind = _base_type(hints[f.name])
            flag = "--" + f.name.replace("_", "-")
            help_text = f"{f.metadata['help']} [env {env_name(f.name)}]"
            default = env_default(f, kind)
            if kind is bool:
                group.add_argument(
                    flag,
                    dest=f.name,
                    default=default,
                    help=help_text,
                    action=argparse.BooleanOptionalAction,
                )
            elif f.metadata.get("multiple"):
                # A flag given on the command line replaces the env list rather than extending it.
                group.add_argument(
                    flag, dest=f.name, default=None, help=help_text, type=kind, action="append"
                )
                parser.set_defaults(**{f"_env_{f.name}": default})
            else:
                group.add_argument(
                    flag,
                    dest=f.name,
                    default=default,
                    help=help_text,
                    type=kind,
                    choices=f.metadata.get("choices"),
                )


def build(cls: type[T], ns: argparse.Namespace | dict[str, Any]) -> T:
    """Make a config object from parsed arguments, ignoring options of other classes."""
    values = vars(ns) if isinstance(ns, argparse.Namespace) else ns
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value = values[f.name]
        if value is None and f.metadata.get("multiple"):
            value = values.get(f"_env_{f.name}", [])
        kwargs[f.name] = value
    return cls(**kwargs)


def service_env(values: dict[str, object], base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment that hands option values to a child ``pdserve`` command (the other way
    round from ``env_default``: ``None`` unsets, a list joins with commas)."""
    env = dict(os.environ if base is None else base)
    for name, value in values.items():
        key = env_name(name)
        if value is None:
            env.pop(key, None)
        elif isinstance(value, bool):
            env[key] = "true" if value else "false"
        elif isinstance(value, list):
            env[key] = ",".join(str(v) for v in value)
        else:
            env[key] = str(value)
    return env


def option_values(*configs: object) -> dict[str, object]:
    """Every field of these config objects by name, later ones winning."""
    out: dict[str, object] = {}
    for cfg in configs:
        out.update(dataclasses.asdict(cfg))
    return out
