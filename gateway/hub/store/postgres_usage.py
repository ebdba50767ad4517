"""PostgreSQL's statements of the usage ledger, sans-IO (as ``postgres_ops``): each turn's row,
the hourly totals per key and model, written in one statement a batch, pruned, and read back."""

from __future__ import annotations

from typing import Any

from gateway.hub.money import KeyBudget, Price
from gateway.hub.store.postgres_ops import BEGIN, COMMIT, Op, Query
from gateway.hub.store.records import (
    ERROR_OUTCOMES,
    HourlyUsage,
    UsageRecord,
    UsageTotal,
    hour_of,
    hourly_totals,
    price_values,
    rates,
    utc_now,
)

_USAGE_COLUMNS = (
    "at key_id key_name session runner_id job_id model api stream prompt_tokens"
    " completion_tokens ttft duration outcome estimated continued cost ref_cost"
).split()
_USAGE_TYPES = (
    "float8 text text text text text text text int8 int8 int8 float8 float8 text int8 int8"
    " float8 float8"
).split()
_PRICE_COLUMNS = "model, input, output, reference, ref_input, ref_output, watts, kwh_price"
_ERRORS = ", ".join(f"'{outcome}'" for outcome in ERROR_OUTCOMES)  # our own constants


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


def prune_usage(before: float, limit: int) -> Op[int]:
    yield BEGIN
    rows = yield Query(
        "SELECT id, at FROM usage_turns WHERE at < $1 ORDER BY at, id LIMIT $2", (before, limit)
    )
    if rows:
        yield Query("DELETE FROM usage_turns WHERE id = ANY($1::int8[])", ([r[0] for r in rows],))
    kept_from = before if len(rows) < limit else rows[-1][1]
    yield Query(
        "INSERT INTO usage_meta (name, value) VALUES ('turns_from', $1)"
        " ON CONFLICT (name) DO UPDATE SET value = GREATEST(usage_meta.value, excluded.value)",
        (kept_from,),
    )
    yield COMMIT
    return len(rows)


def journal_mark(name: str) -> Op[int]:
    return int((yield from _meta(name, 0.0)))


def usage_turns_from() -> Op[float]:
    return (yield from _meta("turns_from", -float("inf")))


def _meta(name: str, default: float) -> Op[float]:
    rows = yield Query("SELECT value FROM usage_meta WHERE name = $1", (name,))
    return float(rows[0][0]) if rows else default


def usage_rows(since: float, key_name: str | None) -> Op[list[dict[str, Any]]]:
    query = f"SELECT {', '.join(_USAGE_COLUMNS)} FROM usage_turns WHERE at >= $1"
    args: tuple[Any, ...] = (since,)
    if key_name is not None:
        query += " AND key_name = $2"
        args = (*args, key_name)
    rows = yield Query(query + " ORDER BY at, id", args)
    found = [dict(zip(_USAGE_COLUMNS, row, strict=True)) for row in rows]
    for row in found:
        for flag in ("stream", "estimated", "continued"):
            row[flag] = bool(row[flag])
    return found


def hourly_usage(since: float, key_name: str | None) -> Op[list[HourlyUsage]]:
    query = (
        "SELECT hour, key_name, model, SUM(turns)::int8, SUM(prompt_tokens)::int8,"
        " SUM(completion_tokens)::int8, SUM(errors)::int8, SUM(estimated)::int8,"
        " SUM(cost), SUM(ref_cost), SUM(unpriced)::int8 FROM usage_hourly WHERE hour >= $1"
    )
    args: tuple[Any, ...] = (hour_of(since),)
    if key_name is not None:
        query += " AND key_name = $2"
        args = (*args, key_name)
    query += (
        ' GROUP BY hour, key_name, model ORDER BY hour, key_name COLLATE "C", model COLLATE "C"'
    )
    rows = yield Query(query, args)
    return [HourlyUsage(r[0], r[1], r[2] or None, *r[3:]) for r in rows]


def usage_totals(since: float, key_name: str | None) -> Op[tuple[list[UsageTotal], bool]]:
    exact = since >= (yield from usage_turns_from())
    if exact:
        query = (
            "SELECT key_name, model, COUNT(*), SUM(COALESCE(prompt_tokens, 0))::int8,"
            " SUM(COALESCE(completion_tokens, 0))::int8,"
            f" COUNT(*) FILTER (WHERE outcome IN ({_ERRORS})), SUM(estimated)::int8,"
            " COALESCE(SUM(cost), 0), COALESCE(SUM(ref_cost), 0),"
            " COUNT(*) FILTER (WHERE cost IS NULL) FROM usage_turns WHERE at >= $1"
        )
        args: tuple[Any, ...] = (since,)
    else:
        query = (
            "SELECT key_name, model, SUM(turns)::int8, SUM(prompt_tokens)::int8,"
            " SUM(completion_tokens)::int8, SUM(errors)::int8, SUM(estimated)::int8,"
            " SUM(cost), SUM(ref_cost), SUM(unpriced)::int8 FROM usage_hourly WHERE hour >= $1"
        )
        args = (hour_of(since),)
    if key_name is not None:
        query += " AND key_name = $2"
        args = (*args, key_name)
    query += ' GROUP BY key_name, model ORDER BY key_name COLLATE "C", model COLLATE "C"'
    rows = yield Query(query, args)
    return [UsageTotal(*row) for row in rows], exact


def tokens_since(key_id: str, hour: int) -> Op[int]:
    rows = yield Query(
        "SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0)::int8 FROM usage_hourly"
        " WHERE key_id = $1 AND hour >= $2",
        (key_id, hour),
    )
    return int(rows[0][0])


def cost_since(key_id: str, hour: int) -> Op[float]:
    rows = yield Query(
        "SELECT COALESCE(SUM(cost), 0)::float8 FROM usage_hourly WHERE key_id = $1 AND hour >= $2",
        (key_id, hour),
    )
    return float(rows[0][0])


def throughput(model: str, since: float) -> Op[tuple[float, float]]:
    rows = yield Query(
        "SELECT COALESCE(SUM(prompt_tokens), 0)::float8, COALESCE(SUM(ttft), 0)::float8,"
        " COALESCE(SUM(completion_tokens), 0)::float8, COALESCE(SUM(duration - ttft), 0)::float8"
        " FROM usage_turns WHERE model = $1 AND at >= $2 AND estimated = 0"
        " AND ttft IS NOT NULL AND duration IS NOT NULL AND duration > ttft",
        (model, since),
    )
    return rates(*rows[0])


# -- prices and budgets ---------------------------------------------------------------------


def set_price(price: Price) -> Op[None]:
    yield Query(
        f"INSERT INTO prices ({_PRICE_COLUMNS}, updated_at)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (model) DO UPDATE SET"
        " input = excluded.input, output = excluded.output, reference = excluded.reference,"
        " ref_input = excluded.ref_input, ref_output = excluded.ref_output,"
        " watts = excluded.watts, kwh_price = excluded.kwh_price,"
        " updated_at = excluded.updated_at",
        (*price_values(price), utc_now()),
    )


def delete_price(model: str) -> Op[bool]:
    rows = yield Query("DELETE FROM prices WHERE model = $1 RETURNING model", (model,))
    return bool(rows)


def list_prices() -> Op[list[Price]]:
    rows = yield Query(f'SELECT {_PRICE_COLUMNS} FROM prices ORDER BY model COLLATE "C"')
    return [Price(*row) for row in rows]


def key_budgets() -> Op[dict[str, KeyBudget]]:
    rows = yield Query(
        "SELECT name, budget_daily, budget_monthly, priority FROM api_keys WHERE revoked = 0"
    )
    return {r[0]: KeyBudget(*r[1:]) for r in rows}


def set_key_budget(name: str, budget: KeyBudget) -> Op[bool]:
    rows = yield Query(
        "UPDATE api_keys SET budget_daily = $1, budget_monthly = $2, priority = $3"
        " WHERE name = $4 AND revoked = 0 RETURNING name",
        (budget.daily, budget.monthly, budget.priority, name),
    )
    return bool(rows)
