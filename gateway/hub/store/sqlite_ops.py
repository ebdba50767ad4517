"""SQLite's statements of the hub's store: one blocking function per operation, on a connection
in autocommit mode (``sqlite.py`` opens it, migrates it and runs these).

A write of one statement is its own transaction; a write of several takes the write lock first
(``BEGIN IMMEDIATE``) and commits them together."""

from __future__ import annotations

import contextlib
import hmac
import json
import sqlite3
import uuid
from collections.abc import Iterator
from typing import Any

from gateway.config import split_project
from gateway.hub.money import KeyBudget, Price
from gateway.hub.store.credentials import (
    API_KEY_PREFIX,
    RUNNER_TOKEN_PREFIX,
    key_id_of,
    new_token,
    token_hash,
)
from gateway.hub.store.records import (
    ERROR_OUTCOMES,
    LIMIT_NAMES,
    ApiKey,
    HourlyUsage,
    KeyLimits,
    ModelList,
    Registration,
    StoredJob,
    StoredSession,
    UsageRecord,
    UsageTotal,
    hour_of,
    hourly_totals,
    job_of,
    job_values,
    price_values,
    rates,
    registration_of,
    utc_now,
)
from gateway.hub.store.schema import MIGRATIONS, VERSION_TABLE, SchemaTooNew, too_new

Db = sqlite3.Connection
_KEY_LIMIT_COLUMNS = ", ".join(LIMIT_NAMES)
_PRICE_COLUMNS = "model, input, output, reference, ref_input, ref_output, watts, kwh_price"
_JOB_COLUMNS = (
    "id, owner, project, needs, agent_definition, origin, run_id, claimed_by,"
    " runner_name, status, conclusion, final_reported, cancelled, cancel_reason"
)
_RUNNER_COLUMNS = "id, name, owner, project, labels, registered_at, token_hash"
_USAGE_COLUMNS = (
    "at key_id key_name session runner_id job_id model api stream prompt_tokens"
    " completion_tokens ttft duration outcome estimated continued cost ref_cost"
).split()


@contextlib.contextmanager
def transaction(db: Db) -> Iterator[None]:
    """The statements of the block as one transaction, the write lock taken at its start."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


# -- the schema ---------------------------------------------------------------------------


def migrate(db: Db, where: str) -> int:
    """Apply the migrations this store lacks, in one transaction; its version after them.
    SchemaTooNew when its version is newer than any this code knows."""
    with transaction(db):
        db.execute(VERSION_TABLE)
        row = db.execute("SELECT MAX(version) FROM schema_version").fetchone()
        current = int(row[0] or 0)
        if current > MIGRATIONS[-1].version:
            raise SchemaTooNew(too_new(where, current))
        for migration in MIGRATIONS:
            if migration.version <= current:
                continue
            for statement in migration.statements:
                db.execute(statement)
            for table, column, declaration in migration.columns:
                present = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
                if column not in present:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
            db.execute(
                "INSERT INTO schema_version (version, applied_at) VALUES (?, ?)",
                (migration.version, utc_now()),
            )
            current = migration.version
    return current


# -- jobs -----------------------------------------------------------------------------------


def save_job(db: Db, job: StoredJob) -> None:
    now = utc_now()
    db.execute(
        "INSERT INTO jobs (id, run_id, owner, project, needs, agent_definition, origin,"
        " claimed_by, runner_name, status, conclusion, final_reported, cancelled,"
        " cancel_reason, created_at, updated_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT(id) DO UPDATE SET run_id = excluded.run_id,"
        " claimed_by = excluded.claimed_by, runner_name = excluded.runner_name,"
        " status = excluded.status, conclusion = excluded.conclusion,"
        " final_reported = excluded.final_reported, cancelled = excluded.cancelled,"
        " cancel_reason = excluded.cancel_reason, updated_at = excluded.updated_at",
        (
            *job_values(job),
            now,
            now,
        ),
    )


def delete_job(db: Db, job_id: str) -> None:
    with transaction(db):
        db.execute("DELETE FROM job_reports WHERE job_id = ?", (job_id,))
        db.execute("DELETE FROM sessions WHERE job_id = ?", (job_id,))
        db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))


def add_job_report(db: Db, job_id: str, body: dict[str, Any]) -> None:
    db.execute(
        "INSERT INTO job_reports (job_id, seq, body, received_at) VALUES (?,"
        " (SELECT COALESCE(MAX(seq), 0) + 1 FROM job_reports WHERE job_id = ?), ?, ?)",
        (job_id, job_id, json.dumps(body), utc_now()),
    )


def load_jobs(db: Db, live_only: bool = False) -> list[StoredJob]:
    where = " WHERE status != 'completed'" if live_only else ""
    reports: dict[str, list[dict[str, Any]]] = {}
    query = "SELECT job_id, body FROM job_reports ORDER BY job_id, seq"
    if live_only:
        query = (
            "SELECT job_id, body FROM job_reports WHERE job_id IN"
            f" (SELECT id FROM jobs{where}) ORDER BY job_id, seq"
        )
    for job_id, body in db.execute(query):
        reports.setdefault(job_id, []).append(json.loads(body))
    rows = db.execute(
        f"SELECT {_JOB_COLUMNS} FROM jobs{where} ORDER BY created_at, rowid"
    ).fetchall()
    return [job_of(r, reports.get(r[0], [])) for r in rows]


def load_job(db: Db, job_id: str) -> StoredJob | None:
    row = db.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
    if row is None:
        return None
    reports = [
        json.loads(body)
        for (body,) in db.execute(
            "SELECT body FROM job_reports WHERE job_id = ? ORDER BY seq", (job_id,)
        )
    ]
    return job_of(row, reports)


def job_ids(db: Db) -> list[str]:
    return [r[0] for r in db.execute("SELECT id FROM jobs ORDER BY created_at, rowid")]


def count_jobs(db: Db) -> int:
    return int(db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])


# -- front-door sessions --------------------------------------------------------------------


def save_session(db: Db, session: StoredSession) -> None:
    db.execute(
        "INSERT OR REPLACE INTO sessions"
        " (key_name, session_id, owner, project, job_id, key_id) VALUES (?, ?, ?, ?, ?, ?)",
        (
            session.key_name,
            session.session_id,
            session.owner,
            session.project,
            session.job_id,
            session.key_id,
        ),
    )


def delete_session(db: Db, key_name: str, session_id: str, job_id: str | None = None) -> None:
    query = "DELETE FROM sessions WHERE key_name = ? AND session_id = ?"
    args: tuple[str, ...] = (key_name, session_id)
    if job_id is not None:
        query += " AND job_id = ?"
        args = (*args, job_id)
    db.execute(query, args)


def load_sessions(db: Db) -> list[StoredSession]:
    rows = db.execute(
        "SELECT key_name, session_id, owner, project, job_id, key_id FROM sessions"
        " ORDER BY key_name, session_id"
    ).fetchall()
    return [StoredSession(*row) for row in rows]


# -- model lists ----------------------------------------------------------------------------


def save_models(db: Db, models: ModelList) -> None:
    db.execute(
        "INSERT OR REPLACE INTO runner_models"
        " (runner_id, owner, project, models, answered_at) VALUES (?, ?, ?, ?, ?)",
        (
            models.runner_id,
            models.owner,
            models.project,
            json.dumps(list(models.models)),
            models.answered_at,
        ),
    )


def load_models(db: Db, owner: str, project: str) -> list[ModelList]:
    rows = db.execute(
        "SELECT runner_id, owner, project, models, answered_at FROM runner_models"
        " WHERE owner = ? AND project = ? ORDER BY answered_at DESC",
        (owner, project),
    ).fetchall()
    return [ModelList(r[0], r[1], r[2], tuple(json.loads(r[3])), r[4]) for r in rows]


# -- registrations --------------------------------------------------------------------------


def add_registration(
    db: Db, owner: str, project: str, name: str, labels: list[str], enrollment: str | None = None
) -> tuple[Registration, str]:
    token = new_token(RUNNER_TOKEN_PREFIX)
    runner = Registration(
        id=str(uuid.uuid4()),
        name=name,
        owner=owner,
        project=project,
        labels=tuple(labels),
        registered_at=utc_now(),
        token_hash=token_hash(token),
    )
    db.execute(
        "INSERT INTO runners (id, name, owner, project, labels, token_hash, registered_at,"
        " enrollment_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (
            runner.id,
            runner.name,
            runner.owner,
            runner.project,
            json.dumps(list(runner.labels)),
            runner.token_hash,
            runner.registered_at,
            enrollment,
        ),
    )
    return runner, token


def registration_by_token(db: Db, token: str) -> Registration | None:
    """Found by its token's digest, one indexed-or-C-scanned statement: every poll, heartbeat and
    report of every runner asks (a walk over every runner's row in Python cost O(runners) per
    request). The digest of a 256-bit token tells a timing observer nothing to steer by."""
    row = db.execute(
        f"SELECT {_RUNNER_COLUMNS} FROM runners WHERE token_hash = ? AND revoked_at IS NULL",
        (token_hash(token),),
    ).fetchone()
    return registration_of(row) if row is not None else None


def registration(db: Db, runner_id: str) -> Registration | None:
    row = db.execute(f"SELECT {_RUNNER_COLUMNS} FROM runners WHERE id = ?", (runner_id,)).fetchone()
    return registration_of(row) if row is not None else None


# -- API keys -------------------------------------------------------------------------------


def create_api_key(db: Db, name: str, project: str, limits: KeyLimits | None) -> str:
    if not name or not name.strip():
        raise ValueError("an API key needs a name")
    owner, proj = split_project(project)
    key = new_token(API_KEY_PREFIX)
    with transaction(db):
        row = db.execute("SELECT revoked FROM api_keys WHERE name = ?", (name,)).fetchone()
        if row is not None and not row[0]:
            raise ValueError(f"an API key named {name!r} already exists")
        db.execute(
            "INSERT OR REPLACE INTO api_keys (name, owner, project, key_hash, created_at,"
            f" revoked, {_KEY_LIMIT_COLUMNS}) VALUES (?, ?, ?, ?, ?, 0, ?, ?, ?, ?)",
            (name, owner, proj, token_hash(key), utc_now(), *(limits or KeyLimits()).values()),
        )
    return key


def list_api_keys(db: Db) -> list[dict[str, object]]:
    rows = db.execute(
        f"SELECT name, owner, project, created_at, revoked, {_KEY_LIMIT_COLUMNS}"
        " FROM api_keys ORDER BY created_at, name"
    ).fetchall()
    return [
        {
            "name": r[0],
            "owner": r[1],
            "project": r[2],
            "createdAt": r[3],
            "revoked": bool(r[4]),
            "limits": KeyLimits(*r[5:9]),
        }
        for r in rows
    ]


def key_limits(db: Db, name: str) -> tuple[str, KeyLimits] | None:
    row = db.execute(
        f"SELECT key_hash, {_KEY_LIMIT_COLUMNS} FROM api_keys WHERE name = ? AND revoked = 0",
        (name,),
    ).fetchone()
    return None if row is None else (key_id_of(row[0]), KeyLimits(*row[1:5]))


def set_key_limits(db: Db, name: str, limits: KeyLimits) -> bool:
    cur = db.execute(
        "UPDATE api_keys SET rpm = ?, tpm = ?, tokens_per_day = ?, max_streams = ?"
        " WHERE name = ? AND revoked = 0",
        (*limits.values(), name),
    )
    return cur.rowcount > 0


def revoke_api_key(db: Db, name: str) -> bool:
    cur = db.execute("UPDATE api_keys SET revoked = 1 WHERE name = ? AND revoked = 0", (name,))
    return cur.rowcount > 0


def check_api_key(db: Db, key: str) -> ApiKey | None:
    digest = token_hash(key)
    rows = db.execute(
        "SELECT name, owner, project, key_hash FROM api_keys WHERE revoked = 0"
    ).fetchall()
    found: ApiKey | None = None
    for name, owner, project, stored in rows:
        if hmac.compare_digest(stored, digest):
            found = ApiKey(name, owner, project, key_id_of(stored))
    return found


def active_key_ids(db: Db) -> set[str]:
    rows = db.execute("SELECT key_hash FROM api_keys WHERE revoked = 0")
    return {key_id_of(stored) for (stored,) in rows}


def active_key_id(db: Db, name: str) -> str | None:
    row = db.execute(
        "SELECT key_hash FROM api_keys WHERE name = ? AND revoked = 0", (name,)
    ).fetchone()
    return key_id_of(row[0]) if row is not None else None


# -- usage ----------------------------------------------------------------------------------


def write_usage(
    db: Db, rows: list[tuple[UsageRecord, float]], mark: tuple[str, int] | None = None
) -> None:
    """The turns' rows and their keys' hourly totals (summed per hour, key and model first);
    ``mark``: a usage journal's name and the segment these rows complete, kept with them."""
    hourly = hourly_totals(rows)
    with transaction(db):
        if mark is not None:
            db.execute(
                "INSERT INTO usage_meta (name, value) VALUES (?, ?)"
                " ON CONFLICT(name) DO UPDATE SET value = excluded.value",
                mark,
            )
        db.executemany(
            "INSERT INTO usage_turns (at, key_id, key_name, session, runner_id, job_id, model,"
            " api, stream, prompt_tokens, completion_tokens, ttft, duration, outcome, estimated,"
            " continued, cost, ref_cost)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    at,
                    record.key_id,
                    record.key_name,
                    record.session,
                    record.runner_id,
                    record.job_id,
                    record.model,
                    record.api,
                    int(record.stream),
                    record.prompt_tokens,
                    record.completion_tokens,
                    record.ttft,
                    record.duration,
                    record.outcome,
                    int(record.estimated),
                    int(record.continued),
                    record.cost,
                    record.ref_cost,
                )
                for record, at in rows
            ],
        )
        db.executemany(
            "INSERT INTO usage_hourly (hour, key_id, key_name, model, turns, prompt_tokens,"
            " completion_tokens, errors, estimated, cost, ref_cost, unpriced)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(hour, key_id, model) DO UPDATE SET turns = turns + excluded.turns,"
            " prompt_tokens = prompt_tokens + excluded.prompt_tokens,"
            " completion_tokens = completion_tokens + excluded.completion_tokens,"
            " errors = errors + excluded.errors, estimated = estimated + excluded.estimated,"
            " cost = cost + excluded.cost, ref_cost = ref_cost + excluded.ref_cost,"
            " unpriced = unpriced + excluded.unpriced, key_name = excluded.key_name",
            [(hour, key_id, t[0], model, *t[1:]) for (hour, key_id, model), t in hourly.items()],
        )


def prune_usage(db: Db, before: float, limit: int) -> int:
    with transaction(db):
        rows = db.execute(
            "SELECT id, at FROM usage_turns WHERE at < ? ORDER BY at LIMIT ?", (before, limit)
        ).fetchall()
        if rows:
            db.executemany("DELETE FROM usage_turns WHERE id = ?", [(r[0],) for r in rows])
        kept_from = before if len(rows) < limit else rows[-1][1]
        db.execute(
            "INSERT INTO usage_meta (name, value) VALUES ('turns_from', ?)"
            " ON CONFLICT(name) DO UPDATE SET value = MAX(value, excluded.value)",
            (kept_from,),
        )
    return len(rows)


def journal_mark(db: Db, name: str) -> int:
    row = db.execute("SELECT value FROM usage_meta WHERE name = ?", (name,)).fetchone()
    return int(row[0]) if row is not None else 0


def usage_turns_from(db: Db) -> float:
    row = db.execute("SELECT value FROM usage_meta WHERE name = 'turns_from'").fetchone()
    return float(row[0]) if row is not None else -float("inf")


def usage_rows(db: Db, since: float, key_name: str | None) -> list[dict[str, Any]]:
    query = f"SELECT {', '.join(_USAGE_COLUMNS)} FROM usage_turns WHERE at >= ?"
    args: tuple[Any, ...] = (since,)
    if key_name is not None:
        query += " AND key_name = ?"
        args = (*args, key_name)
    rows = db.execute(query + " ORDER BY at, id", args).fetchall()
    found = [dict(zip(_USAGE_COLUMNS, row, strict=True)) for row in rows]
    for row in found:
        for flag in ("stream", "estimated", "continued"):
            row[flag] = bool(row[flag])
    return found


def hourly_usage(db: Db, since: float, key_name: str | None) -> list[HourlyUsage]:
    query = (
        "SELECT hour, key_name, model, SUM(turns), SUM(prompt_tokens), SUM(completion_tokens),"
        " SUM(errors), SUM(estimated), SUM(cost), SUM(ref_cost), SUM(unpriced)"
        " FROM usage_hourly WHERE hour >= ?"
    )
    args: tuple[Any, ...] = (hour_of(since),)
    if key_name is not None:
        query += " AND key_name = ?"
        args = (*args, key_name)
    query += " GROUP BY hour, key_name, model ORDER BY hour, key_name, model"
    return [HourlyUsage(r[0], r[1], r[2] or None, *r[3:]) for r in db.execute(query, args)]


def usage_totals(db: Db, since: float, key_name: str | None) -> tuple[list[UsageTotal], bool]:
    exact = since >= usage_turns_from(db)
    if exact:
        query = (
            "SELECT key_name, model, COUNT(*), SUM(COALESCE(prompt_tokens, 0)),"
            " SUM(COALESCE(completion_tokens, 0)),"
            f" SUM(outcome IN ({', '.join('?' * len(ERROR_OUTCOMES))})), SUM(estimated),"
            " COALESCE(SUM(cost), 0), COALESCE(SUM(ref_cost), 0), SUM(cost IS NULL)"
            " FROM usage_turns WHERE at >= ?"
        )
        args: tuple[Any, ...] = (*ERROR_OUTCOMES, since)
    else:
        query = (
            "SELECT key_name, model, SUM(turns), SUM(prompt_tokens), SUM(completion_tokens),"
            " SUM(errors), SUM(estimated), SUM(cost), SUM(ref_cost), SUM(unpriced)"
            " FROM usage_hourly WHERE hour >= ?"
        )
        args = (hour_of(since),)
    if key_name is not None:
        query += " AND key_name = ?"
        args = (*args, key_name)
    query += " GROUP BY key_name, model ORDER BY key_name, model"
    return [UsageTotal(*row) for row in db.execute(query, args)], exact


def tokens_since(db: Db, key_id: str, hour: int) -> int:
    row = db.execute(
        "SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM usage_hourly"
        " WHERE key_id = ? AND hour >= ?",
        (key_id, hour),
    ).fetchone()
    return int(row[0])


def cost_since(db: Db, key_id: str, hour: int) -> float:
    row = db.execute(
        "SELECT COALESCE(SUM(cost), 0) FROM usage_hourly WHERE key_id = ? AND hour >= ?",
        (key_id, hour),
    ).fetchone()
    return float(row[0])


def throughput(db: Db, model: str, since: float) -> tuple[float, float]:
    row = db.execute(
        "SELECT COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(ttft), 0),"
        " COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(duration - ttft), 0)"
        " FROM usage_turns WHERE model = ? AND at >= ? AND estimated = 0"
        " AND ttft IS NOT NULL AND duration IS NOT NULL AND duration > ttft",
        (model, since),
    ).fetchone()
    return rates(*row)


# -- prices and budgets ---------------------------------------------------------------------


def set_price(db: Db, price: Price) -> None:
    with transaction(db):
        db.execute(
            f"INSERT OR REPLACE INTO prices ({_PRICE_COLUMNS}, updated_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (*price_values(price), utc_now()),
        )


def delete_price(db: Db, model: str) -> bool:
    with transaction(db):
        return db.execute("DELETE FROM prices WHERE model = ?", (model,)).rowcount > 0


def list_prices(db: Db) -> list[Price]:
    rows = db.execute(f"SELECT {_PRICE_COLUMNS} FROM prices ORDER BY model").fetchall()
    return [Price(*row) for row in rows]


def key_budgets(db: Db) -> dict[str, KeyBudget]:
    rows = db.execute(
        "SELECT name, budget_daily, budget_monthly, priority FROM api_keys WHERE revoked = 0"
    ).fetchall()
    return {r[0]: KeyBudget(*r[1:]) for r in rows}


def set_key_budget(db: Db, name: str, budget: KeyBudget) -> bool:
    with transaction(db):
        cur = db.execute(
            "UPDATE api_keys SET budget_daily = ?, budget_monthly = ?, priority = ?"
            " WHERE name = ? AND revoked = 0",
            (budget.daily, budget.monthly, budget.priority, name),
        )
    return cur.rowcount > 0
