"""PostgreSQL's statements of the hub's store, sans-IO: each operation is a generator that yields
its statements (``Query``) and is sent each one's rows back; ``postgres_io`` runs it on a
connection (from trio, or blocking at open).

Written for several hubs on one database: a write of several rows is one statement where it can
be (a data-modifying ``WITH``, ``unnest`` of arrays), a check-then-write is one ``INSERT ... ON
CONFLICT`` (never a read, then a write another replica could slip between), and the migrations
hold an advisory lock so that replicas starting together apply them once. Text is ordered as
SQLite orders it (``COLLATE "C"``: by bytes), whatever the database's locale."""

from __future__ import annotations

import hmac
import json
import uuid
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.config import split_project
from gateway.hub.store.credentials import (
    API_KEY_PREFIX,
    RUNNER_TOKEN_PREFIX,
    key_id_of,
    new_token,
    token_hash,
)
from gateway.hub.store.records import (
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
from gateway.hub.store.schema import (
    LATEST,
    MIGRATIONS,
    VERSION_TABLE,
    SchemaTooNew,
    for_postgres,
    too_new,
)

T = TypeVar("T")
Row = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Query:
    """One statement and its parameters (``$1``, ``$2``...: str, int, float, None, or a list,
    sent as an array)."""

    sql: str
    params: tuple[Any, ...] = ()


Op = Generator[Query, list[Row], T]  # yields statements, is sent their rows, returns its answer

BEGIN = Query("BEGIN")
COMMIT = Query("COMMIT")
ROLLBACK = Query("ROLLBACK")
MIGRATION_LOCK = 0x616C_7067_6875_6221  # pg_advisory_xact_lock's key: the hub's migrations
ADMIN = "admin"  # the admin credential's row in ``credentials``
REPORT_TRIES = 8  # a job's report numbered again when another took its number meanwhile

_JOB_COLUMNS = (
    "id, owner, project, needs, agent_definition, origin, run_id, claimed_by,"
    " runner_name, status, conclusion, final_reported, cancelled, cancel_reason"
)
_RUNNER_COLUMNS = "id, name, owner, project, labels, registered_at, token_hash"


# -- the schema -----------------------------------------------------------------------------


def has_schema() -> Op[bool]:
    """Whether the database holds a hub store (its version table)."""
    rows = yield Query("SELECT to_regclass('schema_version')::text")
    return rows[0][0] is not None


def migrate(where: str) -> Op[int]:
    """Apply the migrations this store lacks, in one transaction, one hub at a time; its
    version after them. SchemaTooNew when its version is newer than any this code knows."""
    yield BEGIN
    yield Query(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})::text")
    yield Query(for_postgres(VERSION_TABLE))
    rows = yield Query("SELECT MAX(version) FROM schema_version")
    current = int(rows[0][0] or 0)
    if current > LATEST:
        yield ROLLBACK
        raise SchemaTooNew(too_new(where, current))
    for migration in MIGRATIONS:
        if migration.version <= current:
            continue
        for statement in migration.statements:
            yield Query(for_postgres(statement))
        for table, column, declaration in migration.columns:
            yield Query(
                f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {for_postgres(declaration)}"
            )
        for statement in migration.postgres:
            yield Query(statement)
        yield Query(
            "INSERT INTO schema_version (version, applied_at) VALUES ($1, $2)",
            (migration.version, utc_now()),
        )
        current = migration.version
    yield COMMIT
    return current


def schema_versions() -> Op[list[int]]:
    rows = yield Query("SELECT version FROM schema_version ORDER BY version")
    return [r[0] for r in rows]


# -- the admin credential -------------------------------------------------------------------


def claim_admin(digest: str) -> Op[tuple[str, bool]]:
    """The admin credential's hash: ``digest``, stored now if the store had none (True), or
    the one another hub stored first (False)."""
    rows = yield Query(
        "INSERT INTO credentials (name, hash, created_at) VALUES ($1, $2, $3)"
        " ON CONFLICT (name) DO NOTHING RETURNING hash",
        (ADMIN, digest, utc_now()),
    )
    if rows:
        return rows[0][0], True
    rows = yield Query("SELECT hash FROM credentials WHERE name = $1", (ADMIN,))
    return rows[0][0], False


# -- jobs -----------------------------------------------------------------------------------


def save_job(job: StoredJob) -> Op[None]:
    now = utc_now()
    yield Query(
        "INSERT INTO jobs (id, run_id, owner, project, needs, agent_definition, origin,"
        " claimed_by, runner_name, status, conclusion, final_reported, cancelled,"
        " cancel_reason, created_at, updated_at)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)"
        " ON CONFLICT (id) DO UPDATE SET run_id = excluded.run_id,"
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


def delete_job(job_id: str) -> Op[None]:
    yield Query(
        "WITH gone_reports AS (DELETE FROM job_reports WHERE job_id = $1),"
        " gone_sessions AS (DELETE FROM sessions WHERE job_id = $1)"
        " DELETE FROM jobs WHERE id = $1",
        (job_id,),
    )


def add_job_report(job_id: str, body: dict[str, Any]) -> Op[None]:
    text = json.dumps(body)
    for _ in range(REPORT_TRIES):
        rows = yield Query(
            "INSERT INTO job_reports (job_id, seq, body, received_at)"
            " SELECT $1, COALESCE(MAX(seq), 0) + 1, $2, $3 FROM job_reports WHERE job_id = $1"
            " ON CONFLICT (job_id, seq) DO NOTHING RETURNING seq",
            (job_id, text, utc_now()),
        )
        if rows:
            return
    raise ValueError(f"job {job_id}'s report could not be numbered (too many at once)")


def load_jobs(live_only: bool = False) -> Op[list[StoredJob]]:
    where = " WHERE status <> 'completed'" if live_only else ""
    reports: dict[str, list[dict[str, Any]]] = {}
    query = "SELECT job_id, body FROM job_reports ORDER BY job_id, seq"
    if live_only:
        query = (
            "SELECT job_id, body FROM job_reports WHERE job_id IN"
            f" (SELECT id FROM jobs{where}) ORDER BY job_id, seq"
        )
    for job_id, body in (yield Query(query)):
        reports.setdefault(job_id, []).append(json.loads(body))
    rows = yield Query(f"SELECT {_JOB_COLUMNS} FROM jobs{where} ORDER BY created_at, seq")
    return [job_of(r, reports.get(r[0], [])) for r in rows]


def load_job(job_id: str) -> Op[StoredJob | None]:
    rows = yield Query(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = $1", (job_id,))
    if not rows:
        return None
    bodies = yield Query("SELECT body FROM job_reports WHERE job_id = $1 ORDER BY seq", (job_id,))
    return job_of(rows[0], [json.loads(body) for (body,) in bodies])


def job_ids() -> Op[list[str]]:
    rows = yield Query("SELECT id FROM jobs ORDER BY created_at, seq")
    return [r[0] for r in rows]


def count_jobs() -> Op[int]:
    rows = yield Query("SELECT COUNT(*) FROM jobs")
    return int(rows[0][0])


# -- front-door sessions --------------------------------------------------------------------


def save_session(session: StoredSession) -> Op[None]:
    yield Query(
        "INSERT INTO sessions (key_name, session_id, owner, project, job_id, key_id)"
        " VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (key_name, session_id) DO UPDATE SET"
        " owner = excluded.owner, project = excluded.project, job_id = excluded.job_id,"
        " key_id = excluded.key_id",
        (
            session.key_name,
            session.session_id,
            session.owner,
            session.project,
            session.job_id,
            session.key_id,
        ),
    )


def delete_session(key_name: str, session_id: str, job_id: str | None = None) -> Op[None]:
    if job_id is None:
        yield Query(
            "DELETE FROM sessions WHERE key_name = $1 AND session_id = $2", (key_name, session_id)
        )
    else:
        yield Query(
            "DELETE FROM sessions WHERE key_name = $1 AND session_id = $2 AND job_id = $3",
            (key_name, session_id, job_id),
        )


def load_sessions() -> Op[list[StoredSession]]:
    rows = yield Query(
        "SELECT key_name, session_id, owner, project, job_id, key_id FROM sessions"
        ' ORDER BY key_name COLLATE "C", session_id COLLATE "C"'
    )
    return [StoredSession(*row) for row in rows]


# -- model lists ----------------------------------------------------------------------------


def save_models(models: ModelList) -> Op[None]:
    yield Query(
        "INSERT INTO runner_models (runner_id, owner, project, models, answered_at)"
        " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (runner_id) DO UPDATE SET"
        " owner = excluded.owner, project = excluded.project, models = excluded.models,"
        " answered_at = excluded.answered_at",
        (
            models.runner_id,
            models.owner,
            models.project,
            json.dumps(list(models.models)),
            models.answered_at,
        ),
    )


def load_models(owner: str, project: str) -> Op[list[ModelList]]:
    rows = yield Query(
        "SELECT runner_id, owner, project, models, answered_at FROM runner_models"
        " WHERE owner = $1 AND project = $2 ORDER BY answered_at DESC",
        (owner, project),
    )
    return [ModelList(r[0], r[1], r[2], tuple(json.loads(r[3])), r[4]) for r in rows]


# -- registrations --------------------------------------------------------------------------


def add_registration(
    owner: str, project: str, name: str, labels: list[str], enrollment: str | None = None
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
        "INSERT INTO runners (id, name, owner, project, labels, token_hash, registered_at,"
        " enrollment_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
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


def registration_by_token(token: str) -> Op[Registration | None]:
    """Found by its token's digest in one statement (as SQLite's: not a walk over every
    runner's row per request)."""
    rows = yield Query(
        f"SELECT {_RUNNER_COLUMNS} FROM runners WHERE token_hash = $1 AND revoked_at IS NULL",
        (token_hash(token),),
    )
    return registration_of(rows[0]) if rows else None


def registration(runner_id: str) -> Op[Registration | None]:
    rows = yield Query(f"SELECT {_RUNNER_COLUMNS} FROM runners WHERE id = $1", (runner_id,))
    return registration_of(rows[0]) if rows else None


# -- API keys -------------------------------------------------------------------------------


def create_api_key(name: str, project: str, limits: KeyLimits | None) -> Op[str]:
    if not name or not name.strip():
        raise ValueError("an API key needs a name")
    owner, proj = split_project(project)
    key = new_token(API_KEY_PREFIX)
    # one statement: a new name, or a revoked key's, is taken; an active key's is not
    rows = yield Query(
        "INSERT INTO api_keys (name, owner, project, key_hash, created_at, revoked,"
        " rpm, tpm, tokens_per_day, max_streams) VALUES ($1, $2, $3, $4, $5, 0, $6, $7, $8, $9)"
        " ON CONFLICT (name) DO UPDATE SET owner = excluded.owner,"
        " project = excluded.project, key_hash = excluded.key_hash,"
        " created_at = excluded.created_at, revoked = 0, rpm = excluded.rpm,"
        " tpm = excluded.tpm, tokens_per_day = excluded.tokens_per_day,"
        " max_streams = excluded.max_streams WHERE api_keys.revoked <> 0 RETURNING name",
        (name, owner, proj, token_hash(key), utc_now(), *(limits or KeyLimits()).values()),
    )
    if not rows:
        raise ValueError(f"an API key named {name!r} already exists")
    return key


def list_api_keys() -> Op[list[dict[str, object]]]:
    rows = yield Query(
        "SELECT name, owner, project, created_at, revoked, rpm, tpm, tokens_per_day,"
        ' max_streams FROM api_keys ORDER BY created_at, name COLLATE "C"'
    )
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


def key_limits(name: str) -> Op[tuple[str, KeyLimits] | None]:
    rows = yield Query(
        "SELECT key_hash, rpm, tpm, tokens_per_day, max_streams FROM api_keys"
        " WHERE name = $1 AND revoked = 0",
        (name,),
    )
    return None if not rows else (key_id_of(rows[0][0]), KeyLimits(*rows[0][1:5]))


def set_key_limits(name: str, limits: KeyLimits) -> Op[bool]:
    rows = yield Query(
        "UPDATE api_keys SET rpm = $1, tpm = $2, tokens_per_day = $3, max_streams = $4"
        " WHERE name = $5 AND revoked = 0 RETURNING name",
        (*limits.values(), name),
    )
    return bool(rows)


def revoke_api_key(name: str) -> Op[bool]:
    rows = yield Query(
        "UPDATE api_keys SET revoked = 1 WHERE name = $1 AND revoked = 0 RETURNING name",
        (name,),
    )
    return bool(rows)


def check_api_key(key: str) -> Op[ApiKey | None]:
    digest = token_hash(key)
    rows = yield Query("SELECT name, owner, project, key_hash FROM api_keys WHERE revoked = 0")
    found: ApiKey | None = None
    for name, owner, project, stored in rows:
        if hmac.compare_digest(stored, digest):
            found = ApiKey(name, owner, project, key_id_of(stored))
    return found


def active_key_ids() -> Op[set[str]]:
    rows = yield Query("SELECT key_hash FROM api_keys WHERE revoked = 0")
    return {key_id_of(stored) for (stored,) in rows}


def active_key_id(name: str) -> Op[str | None]:
    rows = yield Query("SELECT key_hash FROM api_keys WHERE name = $1 AND revoked = 0", (name,))
    return key_id_of(rows[0][0]) if rows else None
