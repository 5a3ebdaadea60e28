"""docs/flags.md lists every flag of every ``pdserve`` command, as the parser builds them: this
test keeps it true. After adding or changing a flag, rewrite the page with
``python -m tests.unit.test_docs_flags`` and commit it.

The options of a config class (``shared/config.py``) appear once, under their group, with the
commands that take them; a tool's own flags appear under the tool. Defaults are the built-in
ones: the page is rendered with no ``PDSERVE_*`` variable set."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from unittest import mock

from pdserve import cli

PAGE = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
HEADER = """# Every flag

Generated from the parser by `python -m tests.unit.test_docs_flags` (tests/unit checks that it
is current). Every option of a server command also reads `PDSERVE_<FLAG>` (`--kv-cache-gib` is
`PDSERVE_KV_CACHE_GIB`); a flag beats its variable, which beats the default. What the options
do together: [configuration.md](configuration.md).
"""


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value == "" or value is argparse.SUPPRESS:
        return ""
    return f"`{value}`"


def _flag(action: argparse.Action) -> str:
    names = " ".join(f"`{name}`" for name in action.option_strings)
    if not action.option_strings:  # a positional argument
        names = f"`{(action.metavar or action.dest).upper()}`"
    if action.choices:
        names += " {" + ", ".join(str(c) for c in action.choices) + "}"
    return names


def _help(action: argparse.Action) -> tuple[str, str]:
    """The help text and the variable that add_options appended to it, apart."""
    text = action.help or ""
    if text.endswith("]") and " [env PDSERVE_" in text and text.count("[env ") == 1:
        text, env = text[:-1].split(" [env ", 1)
        name, _, rest = env.partition(",")  # "PDSERVE_SIZES_MIB, comma separated"
        return text, f"`{name}`" + (f",{rest}" if rest else "")
    return text, ""


def _table(actions: list[argparse.Action]) -> list[str]:
    with_env = any(_help(a)[1] for a in actions)
    if with_env:
        rows = ["| flag | variable | default | what |", "|---|---|---|---|"]
    else:
        rows = ["| flag | default | what |", "|---|---|---|"]
    for action in actions:
        text, env = _help(action)
        cells = [_flag(action), *([env] if with_env else []), _default(action), _cell(text)]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    """Each argument group's title and arguments (help left out); positional arguments and
    ungrouped options together, first."""
    groups: list[tuple[str, list[argparse.Action]]] = [("", [])]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.dest != "help"]
        if group.title in ("positional arguments", "options"):
            groups[0][1].extend(actions)
        elif actions:
            groups.append((group.title or "", actions))
    return [(title, actions) for title, actions in groups if actions]


def _config_group(cls: type) -> str:
    return cls.__name__.removesuffix("Config").lower()


def render() -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    with mock.patch.dict(os.environ, clean, clear=True):
        parser = cli.make_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    takers: dict[str, list[str]] = {}
    for name, cmd in cli.COMMANDS.items():
        for cls in cmd.options:
            takers.setdefault(_config_group(cls), []).append(name)
    out = [HEADER, "## Server options", ""]
    seen: set[str] = set()
    for name in cli.COMMANDS:
        for title, actions in _groups(sub.choices[name]):
            if title in takers and title not in seen:
                seen.add(title)
                commands = ", ".join(f"`pdserve {c}`" for c in takers[title])
                out += [f"### {title}", "", f"Taken by {commands}.", ""]
                out += [*_table(actions), ""]
    out += ["## Tools", ""]
    for name, cmd in cli.COMMANDS.items():
        if cmd.add_arguments is None:
            continue
        out += [f"### pdserve {name}", "", cmd.help[0].upper() + cmd.help[1:] + ".", ""]
        for title, actions in _groups(sub.choices[name]):
            if title in takers:
                flags = ", ".join(f"`{a.option_strings[0]}`" for a in actions)
                out += [f"And these [{title}](#{title}) options: {flags}.", ""]
                continue
            out += [*([f"**{title}**", ""] if title else []), *_table(actions), ""]
    return "\n".join(out).rstrip() + "\n"


def test_the_flag_page_lists_every_flag_as_the_parser_builds_it() -> None:
    assert PAGE.read_text(encoding="utf-8") == render(), (
        "docs/flags.md is out of date: python -m tests.unit.test_docs_flags"
    )


if __name__ == "__main__":
    PAGE.write_text(render(), encoding="utf-8")
    print(f"wrote {PAGE}")
