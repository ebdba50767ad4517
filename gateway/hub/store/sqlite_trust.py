"""SQLite's statements of who may register and run runners: enrollment tokens (made, listed,
used, revoked) and runner registrations listed, revoked and marked seen."""

from __future__ import annotations

import hmac
import json
import sqlite3

from gateway.config import split_project
from gateway.hub.store.credentials import (
    ENROLLMENT_TOKEN_PREFIX,
    key_id_of,
    new_token,
    token_hash,
)
from gateway.hub.store.records import Enrollment, RunnerRecord, enrollment_of, utc_now

Db = sqlite3.Connection
_ENROLLMENT_COLUMNS = "id, owner, project, created_at, expires_at, uses_left, used, revoked"


def create_enrollment(
    db: Db, project: str, expires_at: float | None, uses: int | None
) -> tuple[Enrollment, str]:
    owner, proj = split_project(project)
    token = new_token(ENROLLMENT_TOKEN_PREFIX)
    digest = token_hash(token)
    found = Enrollment(key_id_of(digest), owner, proj, utc_now(), expires_at, uses, 0, False)
    db.execute(
        "INSERT INTO enrollment_tokens (id, owner, project, token_hash, created_at, expires_at,"
        " uses_left) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (found.id, owner, proj, digest, found.created_at, expires_at, uses),
    )
    return found, token


def list_enrollments(db: Db) -> list[Enrollment]:
    rows = db.execute(
        f"SELECT {_ENROLLMENT_COLUMNS} FROM enrollment_tokens ORDER BY created_at, id"
    ).fetchall()
    return [enrollment_of(r) for r in rows]


def enrollment_by_token(db: Db, token: str) -> Enrollment | None:
    digest = token_hash(token)
    found: str | None = None
    for found_id, stored in db.execute("SELECT id, token_hash FROM enrollment_tokens"):
        if hmac.compare_digest(stored, digest):
            found = found_id
    if found is None:
        return None
    row = db.execute(
        f"SELECT {_ENROLLMENT_COLUMNS} FROM enrollment_tokens WHERE id = ?", (found,)
    ).fetchone()
    return enrollment_of(row) if row is not None else None


def use_enrollment(db: Db, enrollment_id: str, now: float) -> bool:
    cur = db.execute(
        "UPDATE enrollment_tokens SET used = used + 1,"
        " uses_left = CASE WHEN uses_left IS NULL THEN NULL ELSE uses_left - 1 END"
        " WHERE id = ? AND revoked = 0 AND (expires_at IS NULL OR expires_at > ?)"
        " AND (uses_left IS NULL OR uses_left > 0)",
        (enrollment_id, now),
    )
    return cur.rowcount > 0


def revoke_enrollment(db: Db, enrollment_id: str) -> bool:
    cur = db.execute(
        "UPDATE enrollment_tokens SET revoked = 1 WHERE id = ? AND revoked = 0", (enrollment_id,)
    )
    return cur.rowcount > 0


def list_runners(db: Db) -> list[RunnerRecord]:
    rows = db.execute(
        "SELECT r.id, r.name, r.owner, r.project, r.registered_at, r.revoked_at, r.last_seen,"
        " m.models, (SELECT COUNT(*) FROM sessions s JOIN jobs j ON j.id = s.job_id"
        "  WHERE j.claimed_by = r.id AND j.status <> 'completed')"
        " FROM runners r LEFT JOIN runner_models m ON m.runner_id = r.id"
        " ORDER BY r.registered_at, r.id"
    ).fetchall()
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


def revoke_runner(db: Db, runner_id: str) -> bool:
    cur = db.execute(
        "UPDATE runners SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
        (utc_now(), runner_id),
    )
    return cur.rowcount > 0


def revoked_runners(db: Db) -> set[str]:
    return {r[0] for r in db.execute("SELECT id FROM runners WHERE revoked_at IS NOT NULL")}


def runners_seen(db: Db, runner_ids: list[str], at: float) -> None:
    db.executemany("UPDATE runners SET last_seen = ? WHERE id = ?", [(at, i) for i in runner_ids])
