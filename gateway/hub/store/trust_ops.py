"""The store's operations on who may register and run runners, sans-IO and written once for
both databases (as ``ops``): enrollment tokens made, listed, used (one conditional statement, so
replicas enrolling at once never use a token past its count) and revoked; registrations listed,
revoked and marked seen."""

from __future__ import annotations

import hmac
import json

from gateway.config import split_project
from gateway.hub.store.credentials import (
    ENROLLMENT_TOKEN_PREFIX,
    key_id_of,
    new_token,
    token_hash,
)
from gateway.hub.store.records import Enrollment, RunnerRecord, enrollment_of, utc_now
from gateway.hub.store.sql import LIST, Op, Query, SqlDialect, each, one

_ENROLLMENT_COLUMNS = "id, owner, project, created_at, expires_at, uses_left, used, revoked"

CREATE_ENROLLMENT = one(
    "INSERT INTO enrollment_tokens (id, owner, project, token_hash, created_at, expires_at,"
    " uses_left) VALUES ($1, $2, $3, $4, $5, $6, $7)"
)
ENROLLMENTS = one(
    f'SELECT {_ENROLLMENT_COLUMNS} FROM enrollment_tokens ORDER BY created_at, id COLLATE "C"'
)
ENROLLMENT_HASHES = one("SELECT id, token_hash FROM enrollment_tokens")
ENROLLMENT = one(f"SELECT {_ENROLLMENT_COLUMNS} FROM enrollment_tokens WHERE id = $1")
USE_ENROLLMENT = one(
    "UPDATE enrollment_tokens SET used = used + 1,"
    " uses_left = CASE WHEN uses_left IS NULL THEN NULL ELSE uses_left - 1 END"
    " WHERE id = $1 AND revoked = 0 AND (expires_at IS NULL OR expires_at > $2)"
    " AND (uses_left IS NULL OR uses_left > 0) RETURNING id"
)
REVOKE_ENROLLMENT = one(
    "UPDATE enrollment_tokens SET revoked = 1 WHERE id = $1 AND revoked = 0 RETURNING id"
)
RUNNERS = one(
    "SELECT r.id, r.name, r.owner, r.project, r.registered_at, r.revoked_at, r.last_seen,"
    " m.models, (SELECT COUNT(*) FROM sessions s JOIN jobs j ON j.id = s.job_id"
    "  WHERE j.claimed_by = r.id AND j.status <> 'completed')"
    " FROM runners r LEFT JOIN runner_models m ON m.runner_id = r.id"
    ' ORDER BY r.registered_at, r.id COLLATE "C"'
)
REVOKE_RUNNER = one(
    "UPDATE runners SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL RETURNING id"
)
REVOKED_RUNNERS = one("SELECT id FROM runners WHERE revoked_at IS NOT NULL")
RUNNERS_SEEN = each(  # the ids as one parameter (``LIST``)
    sqlite="UPDATE runners SET last_seen = $1 WHERE id IN (SELECT value FROM json_each($2))",
    postgres="UPDATE runners SET last_seen = $1 WHERE id = ANY($2::text[])",
)


def create_enrollment(
    d: SqlDialect, project: str, expires_at: float | None, uses: int | None
) -> Op[tuple[Enrollment, str]]:
    owner, proj = split_project(project)
    token = new_token(ENROLLMENT_TOKEN_PREFIX)
    digest = token_hash(token)
    found = Enrollment(key_id_of(digest), owner, proj, utc_now(), expires_at, uses, 0, False)
    yield Query(
        CREATE_ENROLLMENT[d], (found.id, owner, proj, digest, found.created_at, expires_at, uses)
    )
    return found, token


def list_enrollments(d: SqlDialect) -> Op[list[Enrollment]]:
    rows = yield Query(ENROLLMENTS[d])
    return [enrollment_of(r) for r in rows]


def enrollment_by_token(d: SqlDialect, token: str) -> Op[Enrollment | None]:
    digest = token_hash(token)
    found: str | None = None
    for found_id, stored in (yield Query(ENROLLMENT_HASHES[d])):
        if hmac.compare_digest(stored, digest):
            found = found_id
    if found is None:
        return None
    rows = yield Query(ENROLLMENT[d], (found,))
    return enrollment_of(rows[0]) if rows else None


def use_enrollment(d: SqlDialect, enrollment_id: str, now: float) -> Op[bool]:
    rows = yield Query(USE_ENROLLMENT[d], (enrollment_id, now))
    return bool(rows)


def revoke_enrollment(d: SqlDialect, enrollment_id: str) -> Op[bool]:
    rows = yield Query(REVOKE_ENROLLMENT[d], (enrollment_id,))
    return bool(rows)


def list_runners(d: SqlDialect) -> Op[list[RunnerRecord]]:
    rows = yield Query(RUNNERS[d])
    return [
        RunnerRecord(
            r[0],
            r[1],
            r[2],
            r[3],
            r[4],
            r[5],
            r[6],
            None if r[7] is None else tuple(json.loads(r[7])),
            int(r[8]),
        )
        for r in rows
    ]


def revoke_runner(d: SqlDialect, runner_id: str) -> Op[bool]:
    rows = yield Query(REVOKE_RUNNER[d], (utc_now(), runner_id))
    return bool(rows)


def revoked_runners(d: SqlDialect) -> Op[set[str]]:
    rows = yield Query(REVOKED_RUNNERS[d])
    return {r[0] for r in rows}


def runners_seen(d: SqlDialect, runner_ids: list[str], at: float) -> Op[None]:
    yield Query(RUNNERS_SEEN[d], (at, LIST[d](list(runner_ids))))
