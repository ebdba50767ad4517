"""The usage rows of a team's turns on PostgreSQL, sans-IO (as ``ops``): each turn's row kept
as its record from its admission, written once, by its replica as the turn ends (``settle``)
or by a survivor for a dead replica (``settle_rows``, in ``ops.retire``)."""

from __future__ import annotations

import msgspec

from gateway.hub.store.postgres_ops import Op, Query
from gateway.hub.store.postgres_usage import (
    USAGE_PARAMS,
    WRITE_USAGE,
    usage_columns,
    write_usage,
)
from gateway.hub.store.records import UsageRecord
from gateway.hub.store.replica_schema import MONTH, NOW

# a turn settled by its replica as it ends, in one statement: its release (as ``release``) and
# its usage row and hourly totals (as ``postgres_usage.write_usage``), only when the turn's
# record is still there (no survivor settled it meanwhile), which the same statement clears
_SETTLE_FROM = WRITE_USAGE.replace(
    "WITH turns AS (",
    f"WITH n AS (SELECT {NOW} AS t),"
    f" ended AS (UPDATE team_turns f SET ended_at = COALESCE(f.ended_at, n.t),"
    f" tokens = ${USAGE_PARAMS + 1}::int8, record = NULL FROM n"
    f" WHERE f.id = ${USAGE_PARAMS + 2} AND f.record IS NOT NULL RETURNING f.key_id),"
    f" days AS (UPDATE team_keys k SET day_tokens = k.day_tokens + CASE WHEN"
    f" k.day = (floor(n.t / 86400) * 86400)::int8 THEN ${USAGE_PARAMS + 1}::int8 ELSE 0 END,"
    " day_cost = k.day_cost + CASE WHEN"
    f" k.cost_day = (floor(n.t / 86400) * 86400)::int8 THEN ${USAGE_PARAMS + 5}::float8"
    " ELSE 0 END,"
    f" month_cost = k.month_cost + CASE WHEN k.cost_month = {MONTH.format(t='n.t')}"
    f" THEN ${USAGE_PARAMS + 5}::float8 ELSE 0 END"
    " FROM ended, n WHERE k.key_id = ended.key_id),"
    f" used AS (UPDATE sessions s SET last_used = n.t FROM n, ended"
    f" WHERE s.key_name = ${USAGE_PARAMS + 3} AND s.session_id = ${USAGE_PARAMS + 4}),"
    " turns AS (",
    1,
)
assert _SETTLE_FROM.count(")) INSERT INTO usage_hourly") == 1
assert _SETTLE_FROM.count(") ON CONFLICT (hour, key_id, model)") == 1
_SETTLE = (
    _SETTLE_FROM.replace(
        ")) INSERT INTO usage_hourly",
        ") WHERE EXISTS (SELECT 1 FROM ended)), hourly AS (INSERT INTO usage_hourly",
    ).replace(
        ") ON CONFLICT (hour, key_id, model)",
        ") WHERE EXISTS (SELECT 1 FROM ended) ON CONFLICT (hour, key_id, model)",
    )
    + ") SELECT COUNT(*) FROM ended"
)


def settle(
    turn_id: str,
    tokens: int,
    key_name: str,
    session: str,
    record: UsageRecord,
    at: float,
    cost: float = 0.0,
) -> Op[bool]:
    """A turn of this replica ended: released (its tokens and ``cost`` counted to its key's day
    and month) and its usage row written, one statement; False when it was settled already (a
    survivor took this replica for dead: its row is there)."""
    columns = usage_columns([(record, at)])
    rows = yield Query(_SETTLE, (*columns, tokens, turn_id, key_name, session, cost))
    return bool(rows[0][0])


def settle_rows(replica: str) -> Op[int]:
    """The turns ``replica`` left unsettled (it is dead, or stopping, or this is its new life):
    each one's row as its record has it (cut, with what was known at its admission), ended at
    the database's time, in the caller's transaction (``ops.retire``); how many."""
    rows = yield Query(  # RETURNING gives the new row: the record is read before it goes
        "WITH old AS (SELECT id, record FROM team_turns WHERE replica = $1"
        " AND record IS NOT NULL FOR UPDATE)"
        f" UPDATE team_turns t SET ended_at = COALESCE(t.ended_at, {NOW}),"
        " tokens = COALESCE(t.tokens, 0), record = NULL FROM old WHERE t.id = old.id"
        f" RETURNING old.record, ({NOW})::float8",
        (replica,),
    )
    found = []
    for text, at in rows:
        try:
            found.append((_record(text), float(at)))
        except (ValueError, TypeError, msgspec.DecodeError):
            continue  # not ours: nothing to write
    if found:
        yield from write_usage(found)
    return len(found)


_record = msgspec.json.Decoder(UsageRecord).decode
