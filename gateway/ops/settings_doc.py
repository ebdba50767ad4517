"""The settings' documentation, made from ``gateway.config``'s declarations: the README tables and the example TOML files.

The README's two settings tables (the runner's and the hub's), ``config/alp-gateway.example.toml``
and ``config/hub.example.toml`` are written here; the flags and their help come from the same
declarations (``gateway.config.add_flags``).

python -m gateway.ops.settings_doc          # rewrite the README's tables and both example files
python -m gateway.ops.settings_doc --check  # exit 1 when one is out of date (the tests check it)
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.config import GROUPS, HUB_GROUPS, HUB_SETTINGS, SETTINGS, Setting

ROOT = Path(__file__).resolve().parent.parent.parent
README = ROOT / "README.md"
EXAMPLE = ROOT / "config" / "alp-gateway.example.toml"
HUB_EXAMPLE = ROOT / "config" / "hub.example.toml"
COMMAND = "python -m gateway.ops.settings_doc"
WIDTH = 100


# -- the documents ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Table:
    """One generated settings table of the README: which settings, between which markers."""

    settings: tuple[Setting, ...]
    begin: str
    end: str


RUNNER_TABLE = Table(
    SETTINGS,
    f"<!-- settings table: generated from gateway/config.py by `{COMMAND}` -->",
    "<!-- end of the settings table -->",
)
HUB_TABLE = Table(
    HUB_SETTINGS,
    f"<!-- hub settings table: generated from gateway/config.py by `{COMMAND}` -->",
    "<!-- end of the hub settings table -->",
)
BEGIN, END = RUNNER_TABLE.begin, RUNNER_TABLE.end


def toml_value(value: Any) -> str:
    """``value`` written as TOML (the settings only hold strings, numbers, booleans and lists)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def readme_table(table: Table = RUNNER_TABLE) -> str:
    """A README settings table, every setting in the order of the declarations."""
    lines = [
        table.begin,
        "",
        "| flag (TOML key) | environment | default | what it does |",
        "|---|---|---|---|",
    ]
    for s in table.settings:
        flag = f"`{s.flag}`" if s.is_flag else f"`{s.flag} {s.metavar or s.key.upper()}`"
        env = " or ".join(f"`{e}`" for e in s.env)
        lines.append(
            f"| {_cell(flag)} (`{s.key}`) | {env} | {_cell(s.default_text)} | {_cell(s.help)} |"
        )
    lines += ["", table.end]
    return "\n".join(lines)


_HEAD = f"""\
# alp-gateway: an annotated example configuration (generated from gateway/config.py by
# `{COMMAND}`: edit the settings there, not here).
#
#   alp-gateway run    --config alp-gateway.toml
#   alp-gateway doctor --config alp-gateway.toml [--deep]
#
# Precedence: command-line flags > environment variables > this file > defaults.
# Each setting's flag is --the-key-with-dashes. A commented-out line shows the default, or an
# example where there is none. TOML puts every key written after a [table] header into that
# table, so the plain settings come first and the [[backend]] and [aliases] tables last.
# An unknown key or table is refused, with this file and the key named.
"""

_TABLES = """\
# Any number of backends. Each table:
#   name            unique; appears in logs and errors ("backend gpu is busy (…)")
#   url             the base URL including /v1
#   key / key_env   its API key, or the name of an environment variable holding it
#                   (a key_env naming an unset variable stops the runner at start)
#   models          the model ids it serves; leave it out to discover them (GET {url}/models,
#                   Ollama's /api/tags where /v1/models is missing)
#   max_concurrency turns in flight at once; leave it out for no limit
#   queue           turns that may wait for a slot beyond that, first come first served
#                   (default 16); past it a turn gets "backend NAME is busy (N in flight, M waiting)"
# A turn goes to an up backend serving its model, the least loaded one first.

[[backend]]
name = "gpu"                      # vLLM on the GPU box
url = "http://127.0.0.1:8000/v1"
key_env = "VLLM_API_KEY"          # vLLM started with --api-key "$VLLM_API_KEY"
models = ["qwen2.5:7b"]           # vLLM serves the name given by --served-model-name
max_concurrency = 8
queue = 32

[[backend]]
name = "ollama"                   # Ollama on the same machine: a fallback for qwen2.5:7b, and llama3.2:3b
url = "http://127.0.0.1:11434/v1"
max_concurrency = 2               # no key: Ollama needs none; no models: discovered
queue = 4

# Caller's model name = local model name. The backend receives the local name; chat.models.response
# lists an alias while its target is servable. One level only: a target may not itself be an alias.
[aliases]
"gpt-4o-mini" = "qwen2.5:7b"
"gpt-4o" = "llama3.2:3b"
"""


def _comment(text: str) -> list[str]:
    return textwrap.wrap(
        text, WIDTH, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False
    )


def shown_line(s: Setting) -> str:
    """The line an example file has for ``s``: its example set, else commented out, the value
    the docs show (``sample``), else its default."""
    if s.example is not None:
        return f"{s.key} = {toml_value(s.example)}"
    if s.sample is not None:
        return f"# {s.key} = {toml_value(s.sample)}"
    if s.default is not None:
        return f"# {s.key} = {toml_value(s.default)}"
    return f"# {s.key} = {toml_value('…')}"


def _entry(s: Setting) -> list[str]:
    what = s.help[0].upper() + s.help[1:] + "."
    lines = _comment(f"{what} {s.note}".strip())
    lines += _comment(f"env {' or '.join(s.env)}; default {s.default_text}")
    lines.append(shown_line(s))
    return lines


def _groups(groups: dict[str, str], settings: tuple[Setting, ...]) -> list[str]:
    out = []
    for group, title in groups.items():
        out.append(f"# == {title} ".ljust(WIDTH, "="))
        out.append("")
        for s in settings:
            if s.group == group:
                out += [*_entry(s), ""]
    return out


def example_toml() -> str:
    """The runner's example configuration: every setting, group by group, then the tables."""
    return "\n".join([_HEAD, *_groups(GROUPS, SETTINGS), _TABLES])


_HUB_HEAD = f"""\
# alp-gateway hub: an annotated example configuration (generated from gateway/config.py by
# `{COMMAND}`: edit the settings there, not here).
#
#   alp-gateway hub --config hub.toml
#   alp-gateway hub keys list --config hub.toml     # keys and usage read its data directory
#
# Precedence: command-line flags > environment variables > this file > defaults.
# Each setting's flag is --the-key-with-dashes. A commented-out line shows the default, or an
# example where there is none. An unknown key, or any table, is refused with this file and the key
# named.
"""


def hub_example_toml() -> str:
    """The hub's example configuration: every setting, group by group."""
    return "\n".join([_HUB_HEAD, *_groups(HUB_GROUPS, HUB_SETTINGS)]).rstrip("\n") + "\n"


def readme_with_tables(text: str) -> str:
    """``text`` (the README) with each table's part between its markers generated again."""
    for table in (RUNNER_TABLE, HUB_TABLE):
        start, end = text.index(table.begin), text.index(table.end) + len(table.end)
        text = text[:start] + readme_table(table) + text[end:]
    return text


def wanted() -> dict[Path, str]:
    """Every generated file and what it should hold."""
    return {
        README: readme_with_tables(README.read_text()),
        EXAMPLE: example_toml(),
        HUB_EXAMPLE: hub_example_toml(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__)
    parser.add_argument("--check", action="store_true", help="only say whether they are current")
    args = parser.parse_args(argv)
    files = wanted()
    stale = [p for p, text in files.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path} is out of date: run {COMMAND}", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(files[path])
        print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
