"""Log lines safe from what clients send: control characters escaped, each value and line capped.

Clients choose bytes that end up in log lines (a session header, a path, a model name). Written
raw, an ESC starts a terminal escape sequence and a CR, LF or NEL forges a line of its own. On
a handler, ``SafeFilter`` rewrites each record's message before it is formatted: every
non-printable character (C0 and C1 controls, DEL, line and paragraph separators, format
characters) becomes a backslash escape (``\\x1b``, ``\\n``, ``\\u2028``), each argument is cut
to ``max_value`` characters and the whole message to ``max_message``. A traceback
(``exc_info``, ``stack_info``) is the formatter's and stays as it is: it is our own code's.

A pure module: the standard library only, no trio.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping
from typing import Any

MAX_VALUE = 200  # characters of one argument of a record (a client-sent value), once escaped
MAX_MESSAGE = 2000  # characters of one record's whole message, once escaped

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape(text: str) -> str:
    """``text`` with every non-printable character as a backslash escape (a backslash already
    there is kept as it is, so escaping twice changes nothing)."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape_char(ch) for ch in text)


def _escape_char(ch: str) -> str:
    named = _NAMED.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def cap(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…({len(text)} chars)"


def safe(text: str, limit: int = MAX_VALUE) -> str:
    """``text`` escaped, then capped: how one client-sent value goes into a log line."""
    return cap(escape(text), limit)


class _Text(str):
    """A string argument, escaped and capped; its ``%r`` is the original's repr, escaped and
    capped (not the repr of the escaped text, which would double each backslash)."""

    _repr: str

    def __new__(cls, value: str, limit: int) -> _Text:
        text = super().__new__(cls, safe(value, limit))
        text._repr = safe(repr(value), limit)
        return text

    def __repr__(self) -> str:
        return self._repr


class _Shown:
    """An argument that is neither a string nor a number, shown escaped and capped (``%s``,
    ``%r``) however long its own ``str`` or ``repr`` is."""

    __slots__ = ("limit", "value")

    def __init__(self, value: Any, limit: int) -> None:
        self.value = value
        self.limit = limit

    def __str__(self) -> str:
        return safe(str(self.value), self.limit)

    def __repr__(self) -> str:
        return safe(repr(self.value), self.limit)


class SafeFilter(logging.Filter):
    """Escapes and caps each record's message (see the module); never drops a record."""

    def __init__(self, max_value: int = MAX_VALUE, max_message: int = MAX_MESSAGE) -> None:
        super().__init__()
        self.max_value = max_value
        self.max_message = max_message

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "logsafe", False):  # another handler's filter did it already
            return True
        args: Any = record.args
        if isinstance(args, tuple):
            record.args = tuple(self._arg(a) for a in args)
        elif isinstance(args, Mapping):
            record.args = {k: self._arg(v) for k, v in args.items()}
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging reports it as it always does
            record.args = args
            return True
        record.msg = cap(escape(message), self.max_message)
        record.args = None
        record.logsafe = True
        return True

    def _arg(self, value: Any) -> Any:
        if isinstance(value, str):
            return _Text(value, self.max_value)
        if value is None or isinstance(value, numbers.Number):
            return value  # %d, %x, %f and friends need the number itself
        return _Shown(value, self.max_value)


def install(handler: logging.Handler) -> SafeFilter:
    """Put a ``SafeFilter`` on ``handler`` (once); returns it."""
    for existing in handler.filters:
        if isinstance(existing, SafeFilter):
            return existing
    added = SafeFilter()
    handler.addFilter(added)
    return added


__all__ = ["MAX_MESSAGE", "MAX_VALUE", "SafeFilter", "cap", "escape", "install", "safe"]
