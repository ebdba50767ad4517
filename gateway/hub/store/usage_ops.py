"""The store's operations on the usage ledger, model prices and keys' budgets, sans-IO and
written once for both databases (as ``ops``): per-turn rows pruned and read back, hourly totals
per key and model, the sums admission asks for (tokens and cost since an hour).

Writing a batch of rows is each database's own (``sqlite_ops.write_usage``: one transaction
of ``executemany``; ``postgres_usage.write_usage``: one statement of arrays). Sums are said as
``BIGINT`` and ``DOUBLE PRECISION`` (PostgreSQL would sum integers as ``NUMERIC``)."""

from __future__ import annotations

from typing import Any

from gateway.hub.money import KeyBudget, Price
from gateway.hub.store.records import (
    ERROR_OUTCOMES,
    HourlyUsage,
    UsageTotal,
    hour_of,
    price_values,
    rates,
    utc_now,
)
from gateway.hub.store.sql import BEGIN, COMMIT, LIST, Op, Query, SqlDialect, each, one

USAGE_COLUMNS = (
    "at key_id key_name session runner_id job_id model api stream prompt_tokens"
    " completion_tokens ttft duration outcome estimated continued cost ref_cost"
).split()
_PRICE_COLUMNS = "model, input, output, reference, ref_input, ref_output, watts, kwh_price"
_ERRORS = ", ".join(f"'{outcome}'" for outcome in ERROR_OUTCOMES)  # our own constants
_FLAGS = ("stream", "estimated", "continued")


def _sum(column: str) -> str:
    return f"CAST(SUM({column}) AS BIGINT)"


# -- pruning and the ledger's marks ---------------------------------------------------------

OLDEST_TURNS = one("SELECT id, at FROM usage_turns WHERE at < $1 ORDER BY at, id LIMIT $2")
DELETE_TURNS = each(  # the ids as one parameter (``LIST``)
    sqlite="DELETE FROM usage_turns WHERE id IN (SELECT value FROM json_each($1))",
    postgres="DELETE FROM usage_turns WHERE id = ANY($1::int8[])",
)
KEEP_TURNS_FROM = one(  # the later of the two
    "INSERT INTO usage_meta (name, value) VALUES ('turns_from', $1)"
    " ON CONFLICT (name) DO UPDATE SET value = CASE WHEN excluded.value > usage_meta.value"
    " THEN excluded.value ELSE usage_meta.value END"
)
META = one("SELECT value FROM usage_meta WHERE name = $1")


def prune_usage(d: SqlDialect, before: float, limit: int) -> Op[int]:
    """At most ``limit`` per-turn rows older than ``before`` deleted, oldest first; the time
    from which every turn's row is still kept, remembered (``usage_turns_from``)."""
    yield Query(BEGIN[d])
    rows = yield Query(OLDEST_TURNS[d], (before, limit))
    if rows:
        yield Query(DELETE_TURNS[d], (LIST[d]([r[0] for r in rows]),))
    kept_from = before if len(rows) < limit else rows[-1][1]
    yield Query(KEEP_TURNS_FROM[d], (kept_from,))
    yield COMMIT
    return len(rows)


def journal_mark(d: SqlDialect, name: str) -> Op[int]:
    return int((yield from _meta(d, name, 0.0)))


def usage_turns_from(d: SqlDialect) -> Op[float]:
    return (yield from _meta(d, "turns_from", -float("inf")))


def _meta(d: SqlDialect, name: str, default: float) -> Op[float]:
    rows = yield Query(META[d], (name,))
    return float(rows[0][0]) if rows else default


# -- reading the ledger ---------------------------------------------------------------------

_ROWS = f"SELECT {', '.join(USAGE_COLUMNS)} FROM usage_turns WHERE at >= $1"
USAGE_ROWS = one(_ROWS + " ORDER BY at, id")
USAGE_ROWS_OF_KEY = one(_ROWS + " AND key_name = $2 ORDER BY at, id")

_HOURLY_SUMS = (
    f"{_sum('turns')}, {_sum('prompt_tokens')}, {_sum('completion_tokens')},"
    f" {_sum('errors')}, {_sum('estimated')}, SUM(cost), SUM(ref_cost), {_sum('unpriced')}"
    " FROM usage_hourly WHERE hour >= $1"
)
_HOURLY = "SELECT hour, key_name, model, " + _HOURLY_SUMS
_HOURLY_ORDER = (
    ' GROUP BY hour, key_name, model ORDER BY hour, key_name COLLATE "C", model COLLATE "C"'
)
HOURLY_USAGE = one(_HOURLY + _HOURLY_ORDER)
HOURLY_USAGE_OF_KEY = one(_HOURLY + " AND key_name = $2" + _HOURLY_ORDER)

_TOTALS_ORDER = ' GROUP BY key_name, model ORDER BY key_name COLLATE "C", model COLLATE "C"'
_EXACT = (  # from the per-turn rows
    f"SELECT key_name, model, COUNT(*), {_sum('COALESCE(prompt_tokens, 0)')},"
    f" {_sum('COALESCE(completion_tokens, 0)')},"
    f" COUNT(*) FILTER (WHERE outcome IN ({_ERRORS})), {_sum('estimated')},"
    " COALESCE(SUM(cost), 0), COALESCE(SUM(ref_cost), 0),"
    " COUNT(*) FILTER (WHERE cost IS NULL) FROM usage_turns WHERE at >= $1"
)
_BY_HOUR = "SELECT key_name, model, " + _HOURLY_SUMS  # from the hourly totals
TOTALS = one(_EXACT + _TOTALS_ORDER)
TOTALS_OF_KEY = one(_EXACT + " AND key_name = $2" + _TOTALS_ORDER)
TOTALS_BY_HOUR = one(_BY_HOUR + _TOTALS_ORDER)
TOTALS_BY_HOUR_OF_KEY = one(_BY_HOUR + " AND key_name = $2" + _TOTALS_ORDER)

TOKENS_SINCE = one(
    f"SELECT COALESCE({_sum('prompt_tokens + completion_tokens')}, 0) FROM usage_hourly"
    " WHERE key_id = $1 AND hour >= $2"
)
COST_SINCE = one(
    "SELECT CAST(COALESCE(SUM(cost), 0) AS DOUBLE PRECISION) FROM usage_hourly"
    " WHERE key_id = $1 AND hour >= $2"
)
THROUGHPUT = one(
    "SELECT "
    + ", ".join(
        f"CAST(COALESCE(SUM({c}), 0) AS DOUBLE PRECISION)"
        for c in ("prompt_tokens", "ttft", "completion_tokens", "duration - ttft")
    )
    + " FROM usage_turns WHERE model = $1 AND at >= $2 AND estimated = 0"
    " AND ttft IS NOT NULL AND duration IS NOT NULL AND duration > ttft"
)


def usage_rows(d: SqlDialect, since: float, key_name: str | None) -> Op[list[dict[str, Any]]]:
    if key_name is None:
        rows = yield Query(USAGE_ROWS[d], (since,))
    else:
        rows = yield Query(USAGE_ROWS_OF_KEY[d], (since, key_name))
    found = [dict(zip(USAGE_COLUMNS, row, strict=True)) for row in rows]
    for row in found:
        for flag in _FLAGS:
            row[flag] = bool(row[flag])
    return found


def hourly_usage(d: SqlDialect, since: float, key_name: str | None) -> Op[list[HourlyUsage]]:
    if key_name is None:
        rows = yield Query(HOURLY_USAGE[d], (hour_of(since),))
    else:
        rows = yield Query(HOURLY_USAGE_OF_KEY[d], (hour_of(since), key_name))
    return [HourlyUsage(r[0], r[1], r[2] or None, *r[3:]) for r in rows]


def usage_totals(
    d: SqlDialect, since: float, key_name: str | None
) -> Op[tuple[list[UsageTotal], bool]]:
    """Totals per key and model since ``since``: exact from the per-turn rows while they are
    all kept from then (True), else from the hourly totals of the hour it falls in (False)."""
    exact = since >= (yield from usage_turns_from(d))
    start: float = since if exact else hour_of(since)
    if key_name is None:
        rows = yield Query((TOTALS if exact else TOTALS_BY_HOUR)[d], (start,))
    else:
        query = TOTALS_OF_KEY if exact else TOTALS_BY_HOUR_OF_KEY
        rows = yield Query(query[d], (start, key_name))
    return [UsageTotal(*row) for row in rows], exact


def tokens_since(d: SqlDialect, key_id: str, hour: int) -> Op[int]:
    rows = yield Query(TOKENS_SINCE[d], (key_id, hour))
    return int(rows[0][0])


def cost_since(d: SqlDialect, key_id: str, hour: int) -> Op[float]:
    rows = yield Query(COST_SINCE[d], (key_id, hour))
    return float(rows[0][0])


def throughput(d: SqlDialect, model: str, since: float) -> Op[tuple[float, float]]:
    rows = yield Query(THROUGHPUT[d], (model, since))
    return rates(*rows[0])


# -- prices and budgets ---------------------------------------------------------------------

SET_PRICE = one(
    f"INSERT INTO prices ({_PRICE_COLUMNS}, updated_at)"
    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (model) DO UPDATE SET"
    " input = excluded.input, output = excluded.output, reference = excluded.reference,"
    " ref_input = excluded.ref_input, ref_output = excluded.ref_output,"
    " watts = excluded.watts, kwh_price = excluded.kwh_price,"
    " updated_at = excluded.updated_at"
)
DELETE_PRICE = one("DELETE FROM prices WHERE model = $1 RETURNING model")
PRICES = one(f'SELECT {_PRICE_COLUMNS} FROM prices ORDER BY model COLLATE "C"')
KEY_BUDGETS = one(
    "SELECT name, budget_daily, budget_monthly, priority FROM api_keys WHERE revoked = 0"
)
SET_KEY_BUDGET = one(
    "UPDATE api_keys SET budget_daily = $1, budget_monthly = $2, priority = $3"
    " WHERE name = $4 AND revoked = 0 RETURNING name"
)


def set_price(d: SqlDialect, price: Price) -> Op[None]:
    yield Query(SET_PRICE[d], (*price_values(price), utc_now()))


def delete_price(d: SqlDialect, model: str) -> Op[bool]:
    rows = yield Query(DELETE_PRICE[d], (model,))
    return bool(rows)


def list_prices(d: SqlDialect) -> Op[list[Price]]:
    rows = yield Query(PRICES[d])
    return [Price(*row) for row in rows]


def key_budgets(d: SqlDialect) -> Op[dict[str, KeyBudget]]:
    rows = yield Query(KEY_BUDGETS[d])
    return {r[0]: KeyBudget(*r[1:]) for r in rows}


def set_key_budget(d: SqlDialect, name: str, budget: KeyBudget) -> Op[bool]:
    rows = yield Query(SET_KEY_BUDGET[d], (budget.daily, budget.monthly, budget.priority, name))
    return bool(rows)
