"""The store's operations on jobs, front-door sessions, model lists, runner registrations and
API keys, sans-IO and written once for both databases (``sql``: each statement a pair, the
operation given its ``SqlDialect``).

Written for several hubs on one PostgreSQL database: a check-then-write is one statement
(``INSERT ... ON CONFLICT``, ``UPDATE ... RETURNING``: never a read, then a write another
replica could slip between); a write of several rows is one statement where PostgreSQL can
(a data-modifying ``WITH``), one SQLite transaction where it cannot."""

from __future__ import annotations

import hmac
import json
import uuid
from typing import Any

from gateway.config import split_project
from gateway.hub.store.credentials import (
    API_KEY_PREFIX,
    RUNNER_TOKEN_PREFIX,
    key_id_of,
    new_token,
    token_hash,
)
from gateway.hub.store.records import (
    LIMIT_NAMES,
    ApiKey,
    KeyLimits,
    ModelList,
    Registration,
    StoredJob,
    StoredSession,
    job_of,
    job_values,
    registration_of,
    utc_now,
)
from gateway.hub.store.sql import BEGIN, COMMIT, POSTGRES, Op, Query, SqlDialect, each, one

REPORT_TRIES = 8  # a job's report numbered again when another took its number meanwhile

_JOB_COLUMNS = (
    "id, owner, project, needs, agent_definition, origin, run_id, claimed_by,"
    " runner_name, status, conclusion, final_reported, cancelled, cancel_reason"
)
_RUNNER_COLUMNS = "id, name, owner, project, labels, registered_at, token_hash"
_KEY_LIMIT_COLUMNS = ", ".join(LIMIT_NAMES)


# -- jobs -----------------------------------------------------------------------------------


def _in_creation_order(text: str) -> tuple[str, str]:
    """``text`` ending ``ORDER BY created_at, %s``: ties in the order the jobs were made
    (SQLite's ``rowid``, PostgreSQL's identity column ``seq``)."""
    return each(sqlite=text % "rowid", postgres=text % "seq")


SAVE_JOB = one(
    "INSERT INTO jobs (id, run_id, owner, project, needs, agent_definition, origin,"
    " claimed_by, runner_name, status, conclusion, final_reported, cancelled,"
    " cancel_reason, created_at, updated_at)"
    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)"
    " ON CONFLICT (id) DO UPDATE SET run_id = excluded.run_id,"
    " claimed_by = excluded.claimed_by, runner_name = excluded.runner_name,"
    " status = excluded.status, conclusion = excluded.conclusion,"
    " final_reported = excluded.final_reported, cancelled = excluded.cancelled,"
    " cancel_reason = excluded.cancel_reason, updated_at = excluded.updated_at"
)
# a job, its reports and its sessions: PostgreSQL in one statement, SQLite in one transaction
DELETE_JOB_AT_ONCE = (
    "WITH gone_reports AS (DELETE FROM job_reports WHERE job_id = $1),"
    " gone_sessions AS (DELETE FROM sessions WHERE job_id = $1)"
    " DELETE FROM jobs WHERE id = $1"
)
DELETE_JOB = (
    one("DELETE FROM job_reports WHERE job_id = $1"),
    one("DELETE FROM sessions WHERE job_id = $1"),
    one("DELETE FROM jobs WHERE id = $1"),
)
ADD_JOB_REPORT = one(
    "INSERT INTO job_reports (job_id, seq, body, received_at)"
    " SELECT $1, COALESCE(MAX(seq), 0) + 1, $2, $3 FROM job_reports WHERE job_id = $1"
    " ON CONFLICT (job_id, seq) DO NOTHING RETURNING seq"
)
ALL_REPORTS = one("SELECT job_id, body FROM job_reports ORDER BY job_id, seq")
LIVE_REPORTS = one(
    "SELECT job_id, body FROM job_reports WHERE job_id IN"
    " (SELECT id FROM jobs WHERE status <> 'completed') ORDER BY job_id, seq"
)
ALL_JOBS = _in_creation_order(f"SELECT {_JOB_COLUMNS} FROM jobs ORDER BY created_at, %s")
LIVE_JOBS = _in_creation_order(
    f"SELECT {_JOB_COLUMNS} FROM jobs WHERE status <> 'completed' ORDER BY created_at, %s"
)
JOB = one(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = $1")
JOB_REPORTS = one("SELECT body FROM job_reports WHERE job_id = $1 ORDER BY seq")
JOB_IDS = _in_creation_order("SELECT id FROM jobs ORDER BY created_at, %s")
COUNT_JOBS = one("SELECT COUNT(*) FROM jobs")


def save_job(d: SqlDialect, job: StoredJob) -> Op[None]:
    now = utc_now()
    yield Query(SAVE_JOB[d], (*job_values(job), now, now))


def delete_job(d: SqlDialect, job_id: str) -> Op[None]:
    if d is POSTGRES:
        yield Query(DELETE_JOB_AT_ONCE, (job_id,))
        return
    yield Query(BEGIN[d])
    for statement in DELETE_JOB:
        yield Query(statement[d], (job_id,))
    yield COMMIT


def add_job_report(d: SqlDialect, job_id: str, body: dict[str, Any]) -> Op[None]:
    """The report numbered after the job's last, in one statement; numbered again when
    another hub took that number meanwhile (SQLite, one writer: never)."""
    text = json.dumps(body)
    for _ in range(REPORT_TRIES):
        rows = yield Query(ADD_JOB_REPORT[d], (job_id, text, utc_now()))
        if rows:
            return
    raise ValueError(f"job {job_id}'s report could not be numbered (too many at once)")


def load_jobs(d: SqlDialect, live_only: bool = False) -> Op[list[StoredJob]]:
    reports: dict[str, list[dict[str, Any]]] = {}
    for job_id, body in (yield Query((LIVE_REPORTS if live_only else ALL_REPORTS)[d])):
        reports.setdefault(job_id, []).append(json.loads(body))
    rows = yield Query((LIVE_JOBS if live_only else ALL_JOBS)[d])
    return [job_of(r, reports.get(r[0], [])) for r in rows]


def load_job(d: SqlDialect, job_id: str) -> Op[StoredJob | None]:
    rows = yield Query(JOB[d], (job_id,))
    if not rows:
        return None
    bodies = yield Query(JOB_REPORTS[d], (job_id,))
    return job_of(rows[0], [json.loads(body) for (body,) in bodies])


def job_ids(d: SqlDialect) -> Op[list[str]]:
    rows = yield Query(JOB_IDS[d])
    return [r[0] for r in rows]


def count_jobs(d: SqlDialect) -> Op[int]:
    rows = yield Query(COUNT_JOBS[d])
    return int(rows[0][0])


# -- front-door sessions --------------------------------------------------------------------

SAVE_SESSION = one(
    "INSERT INTO sessions (key_name, session_id, owner, project, job_id, key_id)"
    " VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (key_name, session_id) DO UPDATE SET"
    " owner = excluded.owner, project = excluded.project, job_id = excluded.job_id,"
    " key_id = excluded.key_id"
)
DELETE_SESSION = one("DELETE FROM sessions WHERE key_name = $1 AND session_id = $2")
DELETE_SESSION_ON_JOB = one(
    "DELETE FROM sessions WHERE key_name = $1 AND session_id = $2 AND job_id = $3"
)
SESSIONS = one(
    "SELECT key_name, session_id, owner, project, job_id, key_id FROM sessions"
    ' ORDER BY key_name COLLATE "C", session_id COLLATE "C"'
)


def save_session(d: SqlDialect, session: StoredSession) -> Op[None]:
    yield Query(
        SAVE_SESSION[d],
        (
            session.key_name,
            session.session_id,
            session.owner,
            session.project,
            session.job_id,
            session.key_id,
        ),
    )


def delete_session(
    d: SqlDialect, key_name: str, session_id: str, job_id: str | None = None
) -> Op[None]:
    if job_id is None:
        yield Query(DELETE_SESSION[d], (key_name, session_id))
    else:
        yield Query(DELETE_SESSION_ON_JOB[d], (key_name, session_id, job_id))


def load_sessions(d: SqlDialect) -> Op[list[StoredSession]]:
    rows = yield Query(SESSIONS[d])
    return [StoredSession(*row) for row in rows]


# -- model lists ----------------------------------------------------------------------------

SAVE_MODELS = one(
    "INSERT INTO runner_models (runner_id, owner, project, models, answered_at)"
    " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (runner_id) DO UPDATE SET"
    " owner = excluded.owner, project = excluded.project, models = excluded.models,"
    " answered_at = excluded.answered_at"
)
MODELS = one(
    "SELECT runner_id, owner, project, models, answered_at FROM runner_models"
    " WHERE owner = $1 AND project = $2 ORDER BY answered_at DESC"
)


def save_models(d: SqlDialect, models: ModelList) -> Op[None]:
    yield Query(
        SAVE_MODELS[d],
        (
            models.runner_id,
            models.owner,
            models.project,
            json.dumps(list(models.models)),
            models.answered_at,
        ),
    )


def load_models(d: SqlDialect, owner: str, project: str) -> Op[list[ModelList]]:
    rows = yield Query(MODELS[d], (owner, project))
    return [ModelList(r[0], r[1], r[2], tuple(json.loads(r[3])), r[4]) for r in rows]


# -- registrations --------------------------------------------------------------------------

ADD_REGISTRATION = one(
    "INSERT INTO runners (id, name, owner, project, labels, token_hash, registered_at,"
    " enrollment_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
)
REGISTRATION_BY_TOKEN = one(
    f"SELECT {_RUNNER_COLUMNS} FROM runners WHERE token_hash = $1 AND revoked_at IS NULL"
)
REGISTRATION = one(f"SELECT {_RUNNER_COLUMNS} FROM runners WHERE id = $1")


def add_registration(
    d: SqlDialect,
    owner: str,
    project: str,
    name: str,
    labels: list[str],
    enrollment: str | None = None,
) -> Op[tuple[Registration, str]]:
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
    yield Query(
        ADD_REGISTRATION[d],
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


def registration_by_token(d: SqlDialect, token: str) -> Op[Registration | None]:
    """Found by its token's digest, one indexed statement: every poll, heartbeat and report
    of every runner asks (a walk over every runner's row in Python cost O(runners) per
    request). The digest of a 256-bit token tells a timing observer nothing to steer by."""
    rows = yield Query(REGISTRATION_BY_TOKEN[d], (token_hash(token),))
    return registration_of(rows[0]) if rows else None


def registration(d: SqlDialect, runner_id: str) -> Op[Registration | None]:
    rows = yield Query(REGISTRATION[d], (runner_id,))
    return registration_of(rows[0]) if rows else None


# -- API keys -------------------------------------------------------------------------------

_CREATE_API_KEY = (
    f"INSERT INTO api_keys (name, owner, project, key_hash, created_at, revoked,"
    f" {_KEY_LIMIT_COLUMNS}) VALUES ($1, $2, $3, $4, $5, 0, $6, $7, $8, $9)"
    " ON CONFLICT (name) DO UPDATE SET owner = excluded.owner,"
    " project = excluded.project, key_hash = excluded.key_hash,"
    " created_at = excluded.created_at, revoked = 0, rpm = excluded.rpm,"
    " tpm = excluded.tpm, tokens_per_day = excluded.tokens_per_day,"
    " max_streams = excluded.max_streams%s WHERE api_keys.revoked <> 0 RETURNING name"
)
# one statement: a new name, or a revoked key's, is taken; an active key's is not. The new key
# starts as a new one does, on either database: without the revoked key's budgets and priority
CREATE_API_KEY = one(
    _CREATE_API_KEY % ", budget_daily = NULL, budget_monthly = NULL, priority = 'standard'"
)
API_KEYS = one(
    f"SELECT name, owner, project, created_at, revoked, {_KEY_LIMIT_COLUMNS}"
    ' FROM api_keys ORDER BY created_at, name COLLATE "C"'
)
KEY_LIMITS = one(
    f"SELECT key_hash, {_KEY_LIMIT_COLUMNS} FROM api_keys WHERE name = $1 AND revoked = 0"
)
SET_KEY_LIMITS = one(
    "UPDATE api_keys SET rpm = $1, tpm = $2, tokens_per_day = $3, max_streams = $4"
    " WHERE name = $5 AND revoked = 0 RETURNING name"
)
REVOKE_API_KEY = one(
    "UPDATE api_keys SET revoked = 1 WHERE name = $1 AND revoked = 0 RETURNING name"
)
ACTIVE_KEYS = one("SELECT name, owner, project, key_hash FROM api_keys WHERE revoked = 0")
ACTIVE_KEY_HASHES = one("SELECT key_hash FROM api_keys WHERE revoked = 0")
ACTIVE_KEY_HASH = one("SELECT key_hash FROM api_keys WHERE name = $1 AND revoked = 0")


def create_api_key(d: SqlDialect, name: str, project: str, limits: KeyLimits | None) -> Op[str]:
    if not name or not name.strip():
        raise ValueError("an API key needs a name")
    owner, proj = split_project(project)
    key = new_token(API_KEY_PREFIX)
    rows = yield Query(
        CREATE_API_KEY[d],
        (name, owner, proj, token_hash(key), utc_now(), *(limits or KeyLimits()).values()),
    )
    if not rows:
        raise ValueError(f"an API key named {name!r} already exists")
    return key


def list_api_keys(d: SqlDialect) -> Op[list[dict[str, object]]]:
    rows = yield Query(API_KEYS[d])
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


def key_limits(d: SqlDialect, name: str) -> Op[tuple[str, KeyLimits] | None]:
    rows = yield Query(KEY_LIMITS[d], (name,))
    return None if not rows else (key_id_of(rows[0][0]), KeyLimits(*rows[0][1:5]))


def set_key_limits(d: SqlDialect, name: str, limits: KeyLimits) -> Op[bool]:
    rows = yield Query(SET_KEY_LIMITS[d], (*limits.values(), name))
    return bool(rows)


def revoke_api_key(d: SqlDialect, name: str) -> Op[bool]:
    rows = yield Query(REVOKE_API_KEY[d], (name,))
    return bool(rows)


def check_api_key(d: SqlDialect, key: str) -> Op[ApiKey | None]:
    digest = token_hash(key)
    rows = yield Query(ACTIVE_KEYS[d])
    found: ApiKey | None = None
    for name, owner, project, stored in rows:
        if hmac.compare_digest(stored, digest):
            found = ApiKey(name, owner, project, key_id_of(stored))
    return found


def active_key_ids(d: SqlDialect) -> Op[set[str]]:
    rows = yield Query(ACTIVE_KEY_HASHES[d])
    return {key_id_of(stored) for (stored,) in rows}


def active_key_id(d: SqlDialect, name: str) -> Op[str | None]:
    rows = yield Query(ACTIVE_KEY_HASH[d], (name,))
    return key_id_of(rows[0][0]) if rows else None
