"""The ``hub`` command line's parser: argparse that says a mistake in one line, as the user made
it (an unknown flag by name, with the flag meant where one is close; a word that is no command)."""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Sequence
from typing import Any, NoReturn

from gateway import logsafe


class UsageError(Exception):
    """A command-line mistake: reported as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """A parser that raises ``UsageError`` and remembers its flags and commands, so that a flag
    it does not know can be named with a "did you mean" (``unknown_flag``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.flags: dict[str, argparse.Action] = {}
        self.commands: dict[str, Parser] = {}
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        for name in action.option_strings:
            self.flags[name] = action
        return action

    def command(self, sub: argparse._SubParsersAction[Any], name: str, **kwargs: Any) -> Parser:
        """``sub.add_parser(name, ...)``, remembered as one of this parser's commands."""
        parser = sub.add_parser(name, **kwargs)
        self.commands[name] = parser
        self.add_common(parser)
        return parser

    def add_common(self, parser: argparse.ArgumentParser) -> None:
        """The flags every command of this parser takes (none here; a subclass adds them)."""

    def find(self, flag: str) -> argparse.Action | None:
        """The action ``flag`` names here (a unique abbreviation too, as argparse allows)."""
        if flag in self.flags:
            return self.flags[flag]
        if not flag.startswith("--"):
            return None
        started = {self.flags[f] for f in self.flags if f.startswith(flag)}
        return next(iter(started)) if started else None

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


# A flag a new user may reach for, and the one that does its job.
_MEANT = {
    "--port": "--listen HOST:PORT",
    "--host": "--listen HOST:PORT",
    "--bind": "--listen HOST:PORT",
    "--address": "--listen HOST:PORT",
    "--state-dir": "--data DIR",
    "--data-dir": "--data DIR",
    "--config-file": "--config FILE",
}


def unknown_flag(parser: Parser, argv: Sequence[str]) -> str | None:
    """The first flag of ``argv`` that the command it is given to does not know, said in one line
    with the flag meant where one is close; None when every flag is known."""
    current = parser
    takes_value = False
    for token in argv:
        if token == "--":
            return None
        if takes_value:
            takes_value = False
            continue
        if token.startswith("-") and len(token) > 1 and not token[1:2].isdigit():
            flag, eq, _ = token.partition("=")
            action = current.find(flag)
            if action is None:
                return _did_you_mean(flag, current, parser)
            takes_value = not eq and action.nargs != 0
        elif token in current.commands:
            current = current.commands[token]
    return None


def _did_you_mean(flag: str, current: Parser, top: Parser) -> str:
    where = "" if current is top else f" of `{current.prog}`"
    meant = _MEANT.get(flag)
    if meant is None or meant.split()[0] not in current.flags:
        close = difflib.get_close_matches(flag, [f for f in current.flags if f != "--help"], 1)
        meant = close[0] if close else None
    hint = f" (did you mean {meant}?)" if meant else f" (see `{current.prog} --help`)"
    return f"unknown flag {logsafe.safe(flag)}{where}{hint}"


_INVALID_COMMAND = re.compile(r"argument command: invalid choice: (.*) \(choose from ")


def parse(parser: Parser, argv: Sequence[str], prog: str) -> argparse.Namespace:
    """``parser.parse_args(argv)``; a mistake said as the user made it: an unknown flag by name
    (argparse takes a value after an unknown flag for the command's name) and a word that is no
    command as such."""
    try:
        return parser.parse_args(argv)
    except UsageError as exc:
        unknown = unknown_flag(parser, argv)
        if unknown is not None:
            raise UsageError(unknown) from None
        found = _INVALID_COMMAND.match(str(exc))
        if found is not None:
            raise UsageError(
                f"{found[1]} is not a command of `{prog}` "
                f"({', '.join(parser.commands)}); to serve, give flags only, such as "
                "--listen HOST:PORT"
            ) from None
        raise
