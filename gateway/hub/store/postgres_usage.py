"""PostgreSQL's own write of the usage ledger, sans-IO (as ``sql``'s operations): a batch of
turns' rows and their hourly totals per key and model in one statement, each column an array
(SQLite's is ``sqlite_ops.write_usage``; reading and pruning are ``usage_ops``, shared)."""

from __future__ import annotations

from typing import Any

from gateway.hub.store.records import UsageRecord, hourly_totals
from gateway.hub.store.sql import Op, Query
from gateway.hub.store.usage_ops import USAGE_COLUMNS as _USAGE_COLUMNS

_USAGE_TYPES = (
    "float8 text text text text text text text int8 int8 int8 float8 float8 text int8 int8"
    " float8 float8"
).split()


# -- usage ----------------------------------------------------------------------------------


def _turn(record: UsageRecord, at: float) -> tuple[Any, ...]:
    """A turn's row in ``_USAGE_COLUMNS`` order (its flags as 0 or 1)."""
    values = (getattr(record, column) for column in _USAGE_COLUMNS[1:])
    return (at, *(int(v) if isinstance(v, bool) else v for v in values))


_WRITE_USAGE = (
    f"WITH turns AS (INSERT INTO usage_turns ({', '.join(_USAGE_COLUMNS)}) SELECT * FROM unnest("
    + ", ".join(f"${n}::{kind}[]" for n, kind in enumerate(_USAGE_TYPES, 1))
    + ")) INSERT INTO usage_hourly (hour, key_id, key_name, model, turns, prompt_tokens,"
    " completion_tokens, errors, estimated, cost, ref_cost, unpriced) SELECT * FROM unnest("
    + ", ".join(
        f"${n}::{kind}[]"
        for n, kind in enumerate(
            "int8 text text text int8 int8 int8 int8 int8 float8 float8 int8".split(),
            len(_USAGE_TYPES) + 1,
        )
    )
    + ") ON CONFLICT (hour, key_id, model) DO UPDATE SET"
    " turns = usage_hourly.turns + excluded.turns,"
    " prompt_tokens = usage_hourly.prompt_tokens + excluded.prompt_tokens,"
    " completion_tokens = usage_hourly.completion_tokens + excluded.completion_tokens,"
    " errors = usage_hourly.errors + excluded.errors,"
    " estimated = usage_hourly.estimated + excluded.estimated,"
    " cost = usage_hourly.cost + excluded.cost,"
    " ref_cost = usage_hourly.ref_cost + excluded.ref_cost,"
    " unpriced = usage_hourly.unpriced + excluded.unpriced, key_name = excluded.key_name"
)


WRITE_USAGE = _WRITE_USAGE  # rows and hourly totals, one statement (``usage_columns``)
USAGE_PARAMS = _N = len(_USAGE_TYPES) + 12  # WRITE_USAGE's parameters; then a journal's mark
_WRITE_USAGE_MARKED = _WRITE_USAGE.replace(
    "WITH turns AS",
    f"WITH meta AS (INSERT INTO usage_meta (name, value) VALUES (${_N + 1}, ${_N + 2})"
    " ON CONFLICT (name) DO UPDATE SET value = excluded.value), turns AS",
)


def write_usage(
    rows: list[tuple[UsageRecord, float]], mark: tuple[str, int] | None = None
) -> Op[None]:
    """The turns' rows and their keys' hourly totals, in one statement (so one transaction and
    one round trip, however many rows): each column sent as an array. ``mark``: a usage
    journal's name and the segment these rows complete, kept with them."""
    columns = usage_columns(rows)
    if mark is None:
        yield Query(_WRITE_USAGE, columns)
    else:
        yield Query(_WRITE_USAGE_MARKED, (*columns, mark[0], float(mark[1])))


def usage_columns(rows: list[tuple[UsageRecord, float]]) -> tuple[list[Any], ...]:
    """The parameters of ``WRITE_USAGE`` for ``rows``: the turns' columns, then their keys'
    hourly totals' (each a list, sent as an array)."""
    turns = [_turn(record, at) for record, at in rows]
    hourly = [
        (hour, key_id, t[0], model, *t[1:])
        for (hour, key_id, model), t in hourly_totals(rows).items()
    ]
    return (*_columns(turns, len(_USAGE_COLUMNS)), *_columns(hourly, 12))


def _columns(rows: list[tuple[Any, ...]], width: int) -> tuple[list[Any], ...]:
    """Rows as columns (each a list, sent as an array)."""
    if not rows:
        return tuple([] for _ in range(width))
    return tuple(list(column) for column in zip(*rows, strict=True))
