"""The settings' documentation, made from ``gateway.config.SETTINGS``: the README table and the example TOML.

python -m gateway.settings_doc          # rewrite both files from the table
python -m gateway.settings_doc --check  # exit 1 when either is out of date (the tests check it)
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.config import GROUPS, SETTINGS, Setting

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
EXAMPLE = ROOT / "config" / "alp-gateway.example.toml"
BEGIN = (
    "<!-- settings table: generated from gateway/config.py by `python -m gateway.settings_doc` -->"
)
END = "<!-- end of the settings table -->"
WIDTH = 100


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


def readme_table() -> str:
    """The README's settings table, every setting in the order of the table."""
    lines = [
        BEGIN,
        "",
        "| flag (TOML key) | environment | default | what it does |",
        "|---|---|---|---|",
    ]
    for s in SETTINGS:
        flag = f"`{s.flag}`" if s.is_flag else f"`{s.flag} {s.metavar or s.key.upper()}`"
        env = " or ".join(f"`{e}`" for e in s.env)
        lines.append(
            f"| {_cell(flag)} (`{s.key}`) | {env} | {_cell(s.default_text)} | {_cell(s.help)} |"
        )
    lines += ["", END]
    return "\n".join(lines)


_HEAD = """\
# alp-gateway: an annotated example configuration (generated from gateway/config.py by
# `python -m gateway.settings_doc`: edit the settings there, not here).
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
    return textwrap.wrap(text, WIDTH, initial_indent="# ", subsequent_indent="# ")


def _entry(s: Setting) -> list[str]:
    what = s.help[0].upper() + s.help[1:] + "."
    lines = _comment(f"{what} {s.note}".strip())
    lines += _comment(f"env {' or '.join(s.env)}; default {s.default_text}")
    if s.example is not None:
        lines.append(f"{s.key} = {toml_value(s.example)}")
    elif s.default is not None:
        lines.append(f"# {s.key} = {toml_value(s.default)}")
    else:
        lines.append(f"# {s.key} = {toml_value(s.sample if s.sample is not None else '…')}")
    return lines


def example_toml() -> str:
    """The example configuration: every setting, group by group, then the tables."""
    out = [_HEAD]
    for group, title in GROUPS.items():
        out.append(f"# == {title} ".ljust(WIDTH, "="))
        out.append("")
        for s in SETTINGS:
            if s.group == group:
                out += [*_entry(s), ""]
    out.append(_TABLES)
    return "\n".join(out)


def readme_with_table(text: str) -> str:
    """``text`` (the README) with the part between the markers replaced by ``readme_table()``."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + readme_table() + text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.settings_doc", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only say whether they are current")
    args = parser.parse_args(argv)
    wanted = {README: readme_with_table(README.read_text()), EXAMPLE: example_toml()}
    stale = [path for path, text in wanted.items() if path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path} is out of date: run python -m gateway.settings_doc", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
