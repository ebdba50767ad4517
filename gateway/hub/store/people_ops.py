"""The store's statements about people (issue 34): who signed in, the API keys each owns, their
page sessions, and usage per person; sans-IO, one text for both databases.

Each operation is a generator that yields its statements (``sql.Query``, ``$1``-style
parameters) and is sent each one's rows back, as ``ops``' are: PostgreSQL runs them on its
pool, SQLite through ``run_sqlite`` (``sql.sqlite_text``: ``$n`` is SQLite's ``?n``). Only the
hash of a page session's token is kept, never the token."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from gateway.hub.store.records import hour_of, utc_now
from gateway.hub.store.sql import Op, Query, T, sqlite_text


@dataclass(frozen=True, slots=True)
class PageSession:
    """A signed-in person's session of the status page (``role``: "admin" or "member")."""

    sub: str
    email: str | None
    name: str | None
    role: str
    expires: float


@dataclass(frozen=True, slots=True)
class PersonUsage:
    """One person's use of one model in one hour (``sub`` None: keys no person owns, the
    admin's)."""

    hour: int
    sub: str | None
    email: str | None
    model: str
    turns: int
    prompt_tokens: int
    completion_tokens: int
    errors: int
    estimated: int


# -- people and their sessions ----------------------------------------------------------------


def start_session(
    id_hash: str, sub: str, email: str | None, name: str | None, role: str, now: float, until: float
) -> Op[None]:
    """A person signed in: their row kept up to date, a session made (expired ones dropped)."""
    stamp = utc_now()
    yield Query(
        "INSERT INTO people (sub, email, name, role, first_seen, last_seen)"
        " VALUES ($1, $2, $3, $4, $5, $5) ON CONFLICT (sub) DO UPDATE SET"
        " email = excluded.email, name = excluded.name, role = excluded.role,"
        " last_seen = excluded.last_seen",
        (sub, email, name, role, stamp),
    )
    yield Query("DELETE FROM page_sessions WHERE expires < $1", (now,))
    yield Query(
        "INSERT INTO page_sessions (id_hash, sub, email, name, role, created, expires)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7)",
        (id_hash, sub, email, name, role, now, until),
    )


def page_session(id_hash: str, now: float) -> Op[PageSession | None]:
    rows = yield Query(
        "SELECT sub, email, name, role, expires FROM page_sessions"
        " WHERE id_hash = $1 AND expires > $2",
        (id_hash, now),
    )
    return PageSession(*rows[0]) if rows else None


def end_session(id_hash: str) -> Op[None]:
    yield Query("DELETE FROM page_sessions WHERE id_hash = $1", (id_hash,))


def people() -> Op[list[dict[str, Any]]]:
    """Everyone who signed in, with the projects the admin allowed them (None: the hub's
    ``--oidc-member-projects``) and how many active keys each owns."""
    rows = yield Query(
        "SELECT p.sub, p.email, p.name, p.role, p.first_seen, p.last_seen, p.projects,"
        " (SELECT COUNT(*) FROM key_owners o JOIN api_keys k ON k.key_hash = o.key_hash"
        "  WHERE o.sub = p.sub AND k.revoked = 0)"
        " FROM people p ORDER BY p.sub"
    )
    return [
        {
            "sub": r[0],
            "email": r[1],
            "name": r[2],
            "role": r[3],
            "firstSeen": r[4],
            "lastSeen": r[5],
            "projects": None if r[6] is None else json.loads(r[6]),
            "activeKeys": int(r[7]),
        }
        for r in rows
    ]


def set_projects(sub: str, projects: list[str] | None) -> Op[bool]:
    """The projects ``sub`` may make keys for (None: the hub's default); False when no one
    with that ``sub`` has signed in."""
    rows = yield Query(
        "UPDATE people SET projects = $1 WHERE sub = $2 RETURNING sub",
        (None if projects is None else json.dumps(projects), sub),
    )
    return bool(rows)


def projects_of(sub: str) -> Op[list[str] | None]:
    """The projects the admin allowed ``sub`` (None: the hub's default)."""
    rows = yield Query("SELECT projects FROM people WHERE sub = $1", (sub,))
    return None if not rows or rows[0][0] is None else list(json.loads(rows[0][0]))


# -- the keys people own ----------------------------------------------------------------------


def add_key_owner(key_hash: str, key_id: str, name: str, sub: str, email: str | None) -> Op[None]:
    yield Query(
        "INSERT INTO key_owners (key_hash, key_id, key_name, sub, email, created_at)"
        " VALUES ($1, $2, $3, $4, $5, $6)",
        (key_hash, key_id, name, sub, email, utc_now()),
    )


def owner_of_active(name: str) -> Op[str | None]:
    """The ``sub`` owning the active key named ``name`` (None: no such key, or no owner)."""
    rows = yield Query(
        "SELECT o.sub FROM api_keys k JOIN key_owners o ON o.key_hash = k.key_hash"
        " WHERE k.name = $1 AND k.revoked = 0",
        (name,),
    )
    return rows[0][0] if rows else None


def key_owners() -> Op[dict[tuple[str, str], tuple[str, str | None]]]:
    """Every owned key's (name, created_at), as ``list_api_keys`` says them -> (sub, email)."""
    rows = yield Query(
        "SELECT k.name, k.created_at, o.sub, o.email"
        " FROM key_owners o JOIN api_keys k ON k.key_hash = o.key_hash"
    )
    return {(r[0], r[1]): (r[2], r[3]) for r in rows}


# -- usage per person -------------------------------------------------------------------------


def person_usage(since: float, sub: str | None = None) -> Op[list[PersonUsage]]:
    """Hourly totals per person and model from the hour ``since`` falls in on (of ``sub``
    alone, if given), oldest first; the keys no person owns are one row per hour and model
    with ``sub`` None."""
    query = (
        "SELECT h.hour, o.sub, MAX(o.email), h.model, "
        + ", ".join(  # PostgreSQL sums BIGINTs as NUMERIC: said back as BIGINT (both dialects)
            f"CAST(SUM(h.{c}) AS BIGINT)"
            for c in ("turns", "prompt_tokens", "completion_tokens", "errors", "estimated")
        )
        + " FROM usage_hourly h LEFT JOIN key_owners o ON o.key_id = h.key_id WHERE h.hour >= $1"
    )
    params: tuple[Any, ...] = (hour_of(since),)
    if sub is not None:
        query += " AND o.sub = $2"
        params = (*params, sub)
    query += " GROUP BY h.hour, o.sub, h.model ORDER BY h.hour, o.sub, h.model"
    rows = yield Query(query, params)
    return [PersonUsage(int(r[0]), r[1], r[2], r[3], *(int(v or 0) for v in r[4:9])) for r in rows]


# -- SQLite ------------------------------------------------------------------------------------


def run_sqlite(db: sqlite3.Connection, op: Op[T]) -> T:
    """``op`` on a SQLite connection (autocommit: each statement its own transaction)."""
    try:
        query = next(op)
        while True:
            rows = db.execute(sqlite_text(query.sql), query.params).fetchall()
            query = op.send(rows)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
