"""The store's dialect layer: each statement written once and said as SQLite and PostgreSQL say
it, built when the module is imported, plus what a sans-IO operation yields (``Query``).

A statement is written in PostgreSQL's words (``$1``, ``$2``... parameters; ``COLLATE "C"``
where text is ordered, so that PostgreSQL orders by bytes as SQLite does) and ``one`` makes the
pair ``(SQLite's, PostgreSQL's)``: ``$n`` becomes SQLite's ``?n`` (numbered, so a parameter may
stand twice) and the collation goes (SQLite orders text by bytes already). A statement the two
say differently (an array parameter, a data-modifying ``WITH``) is written twice, side by side,
with ``each``. An operation indexes the pair with its ``SqlDialect``: no text is built per call.

Each operation (``ops``, ``trust_ops``, ``usage_ops``) is a generator that yields its
statements and is sent each one's rows back; ``sqlite_ops.run`` runs it on a SQLite connection,
``postgres_io`` on a PostgreSQL one."""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
Row = tuple[Any, ...]
Sql = tuple[str, str]  # a statement as SQLite says it, then as PostgreSQL does


@dataclass(frozen=True, slots=True)
class Query:
    """One statement and its parameters (``$1``, ``$2``...: str, int, float, None, or a list,
    sent to PostgreSQL as an array)."""

    sql: str
    params: tuple[Any, ...] = ()


Op = Generator[Query, list[Row], T]  # yields statements, is sent their rows, returns its answer


class SqlDialect(enum.IntEnum):
    """Which database an operation speaks to: the index of its statements' pairs."""

    SQLITE = 0
    POSTGRES = 1


SQLITE = SqlDialect.SQLITE
POSTGRES = SqlDialect.POSTGRES

_PARAM = re.compile(r"\$(\d+)")
_COLLATE = ' COLLATE "C"'


def sqlite_text(text: str) -> str:
    """PostgreSQL's words as SQLite's: ``$n`` as ``?n``, no ``COLLATE "C"``."""
    return _PARAM.sub(r"?\1", text.replace(_COLLATE, ""))


def one(text: str) -> Sql:
    """A statement both databases say alike, but for parameters and collation."""
    return sqlite_text(text), text


def each(*, sqlite: str, postgres: str) -> Sql:
    """A statement the two say differently, each written in full (parameters as ``$n``)."""
    return sqlite_text(sqlite), postgres


# a write of several statements as one transaction (SQLite: the write lock taken at its start)
BEGIN: Sql = ("BEGIN IMMEDIATE", "BEGIN")
COMMIT = Query("COMMIT")

# a list of values as one parameter: JSON text for SQLite's ``json_each``, an array for
# PostgreSQL's ``ANY``
LIST: tuple[Callable[[list[Any]], Any], Callable[[list[Any]], Any]] = (json.dumps, list)
