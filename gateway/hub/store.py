"""The hub's SQLite store: registrations, API keys (and their limits), jobs and reports, sessions,
model lists, usage (a row per front-door turn, kept a while; hourly totals per key and model)."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import json
import os
import pathlib
import secrets
import sqlite3
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.config import split_project

StoreError = sqlite3.Error  # what a store that fails raises (busy, broken, gone)
HOUR = 3600
ERROR_OUTCOMES = ("error", "lost", "refused", "cut")  # counted as errors in the totals
LIMIT_NAMES = ("rpm", "tpm", "tokens_per_day", "max_streams")


@dataclass(frozen=True)
class KeyLimits:
    """An API key's limits (None: none): requests and tokens a minute, tokens a day (UTC),
    turns in flight at once."""

    rpm: int | None = None
    tpm: int | None = None
    tokens_per_day: int | None = None
    max_streams: int | None = None

    def describe(self) -> str:
        """``rpm=3 tpm=1000 tokens/day=50000 streams=2`` (only the limits set), or ``-``."""
        parts = [
            f"{label}={value}"
            for label, value in (
                ("rpm", self.rpm),
                ("tpm", self.tpm),
                ("tokens/day", self.tokens_per_day),
                ("streams", self.max_streams),
            )
            if value is not None
        ]
        return " ".join(parts) or "-"

    def as_json(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in LIMIT_NAMES}


def limits_of(
    rpm: int | None = None,
    tpm: int | None = None,
    tokens_per_day: int | None = None,
    max_streams: int | None = None,
) -> KeyLimits:
    """KeyLimits from given values, 0 (or None) meaning no limit; ValueError on a negative or
    non-integer value."""
    values: dict[str, int | None] = {}
    for name, value in zip(LIMIT_NAMES, (rpm, tpm, tokens_per_day, max_streams), strict=True):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise ValueError(f"the limit {name} must be a whole number, 0 for none, not {value!r}")
        values[name] = value or None
    return KeyLimits(**values)


@dataclass(frozen=True)
class HourlyUsage:
    """One key's use in one hour (UTC, the hour's start as a Unix time)."""

    hour: int
    key_name: str
    model: str | None
    turns: int
    prompt_tokens: int
    completion_tokens: int
    errors: int = 0  # turns that ended in error, lost, refused or cut (by the hub, not limits)


class UsageRow(Protocol):
    """What the ledger records of an ended turn (``gateway.hub.turn.Turn`` is one)."""

    key_id: str
    key_name: str
    session: str
    runner_id: str | None
    job_id: str | None
    model_label: str
    api: str
    stream: bool
    prompt_tokens: int | None
    completion_tokens: int | None
    estimated: bool

    @property
    def ttft(self) -> float | None: ...

    @property
    def duration(self) -> float | None: ...

    @property
    def outcome(self) -> str | None: ...

RUNNER_TOKEN_PREFIX = "alpr_"
API_KEY_PREFIX = "alpk_"
ADMIN_TOKEN_PREFIX = "alpa_"
DEFAULT_KEY_PROJECT = "local/chat"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runners (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    owner TEXT NOT NULL,
    project TEXT NOT NULL,
    labels TEXT NOT NULL,
    token_hash TEXT NOT NULL,
    registered_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    name TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    project TEXT NOT NULL,
    key_hash TEXT NOT NULL,
    created_at TEXT NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0,
    rpm INTEGER,
    tpm INTEGER,
    tokens_per_day INTEGER,
    max_streams INTEGER
);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    run_id TEXT,
    owner TEXT NOT NULL,
    project TEXT NOT NULL,
    needs TEXT NOT NULL,
    agent_definition TEXT NOT NULL,
    origin TEXT NOT NULL,
    claimed_by TEXT,
    runner_name TEXT,
    status TEXT NOT NULL,
    conclusion TEXT,
    final_reported INTEGER NOT NULL DEFAULT 0,
    cancelled INTEGER NOT NULL DEFAULT 0,
    cancel_reason TEXT,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS job_reports (
    job_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    body TEXT NOT NULL,
    received_at TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
);
CREATE TABLE IF NOT EXISTS runner_models (
    runner_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    project TEXT NOT NULL,
    models TEXT NOT NULL,
    answered_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS sessions (
    key_name TEXT NOT NULL,
    session_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    project TEXT NOT NULL,
    job_id TEXT NOT NULL,
    key_id TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (key_name, session_id)
);
CREATE TABLE IF NOT EXISTS usage_turns (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    key_id TEXT NOT NULL,
    key_name TEXT NOT NULL,
    session TEXT NOT NULL,
    runner_id TEXT,
    job_id TEXT,
    model TEXT NOT NULL,
    api TEXT NOT NULL,
    stream INTEGER NOT NULL,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    ttft REAL,
    duration REAL,
    outcome TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_turns_at ON usage_turns (at);
CREATE TABLE IF NOT EXISTS usage_hourly (
    hour INTEGER NOT NULL,
    key_id TEXT NOT NULL,
    key_name TEXT NOT NULL,
    model TEXT NOT NULL,
    turns INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    errors INTEGER NOT NULL,
    PRIMARY KEY (hour, key_id, model)
);
CREATE TABLE IF NOT EXISTS usage_meta (
    name TEXT PRIMARY KEY,
    value REAL NOT NULL
);
"""
_KEY_LIMIT_COLUMNS = ", ".join(LIMIT_NAMES)


def new_token(prefix: str) -> str:
    """A fresh bearer secret with a readable prefix (``alpr_``, ``alpk_``, ``alpa_``)."""
    return prefix + secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    """The SHA-256 hex digest under which a secret is stored."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def utc_now() -> str:
    """The current time as an ISO 8601 UTC string (``...Z``)."""
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    return now.isoformat().replace("+00:00", "Z")


def key_id_of(key_hash: str) -> str:
    """An API key's id: the start of its hash, unique per key (a new key with a revoked key's
    name has another), not a secret, never the key itself."""
    return key_hash[:16]


@dataclass(frozen=True, slots=True)
class Registration:
    """A runner's registration as the hub keeps it (the token itself never, only its hash)."""

    id: str
    name: str
    owner: str
    project: str
    labels: tuple[str, ...]
    registered_at: str
    token_hash: str


@dataclass(frozen=True, slots=True)
class ApiKey:
    """An active front-door API key: who may chat, and in which project."""

    name: str
    owner: str
    project: str
    id: str = ""  # ``key_id_of`` its hash: what its chat sessions are keyed by


@dataclass(frozen=True, slots=True)
class UsageTotal:
    """One key's use of one model over a span: turns, tokens, errors (``model`` "" when the
    runner's default served)."""

    key_name: str
    model: str
    turns: int
    prompt_tokens: int
    completion_tokens: int
    errors: int


@dataclass(slots=True)
class StoredJob:
    """A Chat Job as the database keeps it (``reports``: every status report received, in order)."""

    id: str
    owner: str
    project: str
    needs: list[str]
    agent_definition: dict[str, Any]
    origin: str = "api"  # "api" (enqueue_job) or "frontdoor" (a /v1 chat session)
    run_id: str | None = None
    claimed_by: str | None = None
    runner_name: str | None = None
    status: str = "queued"
    conclusion: str | None = None
    final_reported: bool = False  # a runner's "completed" report was accepted
    cancelled: bool = False
    cancel_reason: str | None = None
    reports: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ModelList:
    """The last ``chat.models.response`` a runner gave, and when (Unix time)."""

    runner_id: str
    owner: str
    project: str
    models: tuple[str, ...]
    answered_at: float


@dataclass(frozen=True, slots=True)
class StoredSession:
    """A front-door chat session: (API key, X-Chat-Session) -> its Chat Job. ``key_id``: the
    key's id (empty in rows stored before keys had one: then the key is found by name)."""

    key_name: str
    session_id: str
    owner: str
    project: str
    job_id: str
    key_id: str = ""


class Store:
    """The hub's SQLite database: ``data_dir/hub.sqlite3``, or in memory when ``data_dir`` is None."""

    def __init__(self, data_dir: pathlib.Path | None = None) -> None:
        self.path: pathlib.Path | None
        if data_dir is None:
            self.path = None
            self._db = sqlite3.connect(":memory:", check_same_thread=False)
        else:
            ensure_private_dir(data_dir)
            self.path = data_dir / "hub.sqlite3"
            self._db = sqlite3.connect(self.path, timeout=10.0, check_same_thread=False)
            with contextlib.suppress(OSError):
                os.chmod(self.path, 0o600)
            # the hub writes on its event loop (a usage row per turn, jobs, sessions): in WAL
            # mode with synchronous=NORMAL a commit does not wait for the disk (only the
            # occasional checkpoint does), so no write holds up the streams being relayed;
            # the -wal and -shm files sit in the owner-only data directory
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(sessions)")}
        if "key_id" not in columns:  # a store from before sessions were keyed by the key's id
            self._db.execute("ALTER TABLE sessions ADD COLUMN key_id TEXT NOT NULL DEFAULT ''")
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(api_keys)")}
        for name in LIMIT_NAMES:  # a store from before keys had limits
            if name not in columns:
                self._db.execute(f"ALTER TABLE api_keys ADD COLUMN {name} INTEGER")
        self._db.commit()

    def close(self) -> None:
        self._db.close()

    # -- jobs --------------------------------------------------------------

    def save_job(self, job: StoredJob) -> None:
        """Insert or update a job's row (its reports are kept apart: ``add_job_report``)."""
        now = utc_now()
        with self._db:
            self._db.execute(
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
                    job.id,
                    job.run_id,
                    job.owner,
                    job.project,
                    json.dumps(job.needs),
                    json.dumps(job.agent_definition),
                    job.origin,
                    job.claimed_by,
                    job.runner_name,
                    job.status,
                    job.conclusion,
                    int(job.final_reported),
                    int(job.cancelled),
                    job.cancel_reason,
                    now,
                    now,
                ),
            )

    def delete_job(self, job_id: str) -> None:
        """Forget a job (a queued job withdrawn before any runner claimed it)."""
        with self._db:
            self._db.execute("DELETE FROM job_reports WHERE job_id = ?", (job_id,))
            self._db.execute("DELETE FROM sessions WHERE job_id = ?", (job_id,))
            self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    def add_job_report(self, job_id: str, body: dict[str, Any]) -> None:
        """Append one status report received for ``job_id`` (accepted or not)."""
        with self._db:
            self._db.execute(
                "INSERT INTO job_reports (job_id, seq, body, received_at) VALUES (?,"
                " (SELECT COALESCE(MAX(seq), 0) + 1 FROM job_reports WHERE job_id = ?), ?, ?)",
                (job_id, job_id, json.dumps(body), utc_now()),
            )

    _JOB_COLUMNS = (
        "id, owner, project, needs, agent_definition, origin, run_id, claimed_by,"
        " runner_name, status, conclusion, final_reported, cancelled, cancel_reason"
    )

    def load_jobs(self, *, live_only: bool = False) -> list[StoredJob]:
        """Every stored job with its reports, oldest first (``live_only``: not completed)."""
        where = " WHERE status != 'completed'" if live_only else ""
        reports: dict[str, list[dict[str, Any]]] = {}
        query = "SELECT job_id, body FROM job_reports ORDER BY job_id, seq"
        if live_only:
            query = (
                "SELECT job_id, body FROM job_reports WHERE job_id IN"
                f" (SELECT id FROM jobs{where}) ORDER BY job_id, seq"
            )
        for job_id, body in self._db.execute(query):
            reports.setdefault(job_id, []).append(json.loads(body))
        rows = self._db.execute(
            f"SELECT {self._JOB_COLUMNS} FROM jobs{where} ORDER BY created_at, rowid"
        ).fetchall()
        return [self._stored_job(r, reports.get(r[0], [])) for r in rows]

    def load_job(self, job_id: str) -> StoredJob | None:
        """One stored job with its reports, or None."""
        row = self._db.execute(
            f"SELECT {self._JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)
        ).fetchone()
        if row is None:
            return None
        reports = [
            json.loads(body)
            for (body,) in self._db.execute(
                "SELECT body FROM job_reports WHERE job_id = ? ORDER BY seq", (job_id,)
            )
        ]
        return self._stored_job(row, reports)

    def job_ids(self) -> list[str]:
        """The id of every stored job, oldest first."""
        return [r[0] for r in self._db.execute("SELECT id FROM jobs ORDER BY created_at, rowid")]

    def count_jobs(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])

    @staticmethod
    def _stored_job(r: Any, reports: list[dict[str, Any]]) -> StoredJob:
        return StoredJob(
            id=r[0],
            owner=r[1],
            project=r[2],
            needs=json.loads(r[3]),
            agent_definition=json.loads(r[4]),
            origin=r[5],
            run_id=r[6],
            claimed_by=r[7],
            runner_name=r[8],
            status=r[9],
            conclusion=r[10],
            final_reported=bool(r[11]),
            cancelled=bool(r[12]),
            cancel_reason=r[13],
            reports=reports,
        )

    # -- front-door sessions -------------------------------------------------

    def save_session(self, session: StoredSession) -> None:
        with self._db:
            self._db.execute(
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

    def delete_session(self, key_name: str, session_id: str, job_id: str | None = None) -> None:
        """Forget a session's row (with ``job_id``: only while it still points at that job, so
        a revoked key's ending session does not take a new same-named key's row with it)."""
        query = "DELETE FROM sessions WHERE key_name = ? AND session_id = ?"
        args: tuple[str, ...] = (key_name, session_id)
        if job_id is not None:
            query += " AND job_id = ?"
            args = (*args, job_id)
        with self._db:
            self._db.execute(query, args)

    def load_sessions(self) -> list[StoredSession]:
        rows = self._db.execute(
            "SELECT key_name, session_id, owner, project, job_id, key_id FROM sessions"
            " ORDER BY key_name, session_id"
        ).fetchall()
        return [StoredSession(*row) for row in rows]

    # -- model lists -------------------------------------------------------

    def save_models(self, models: ModelList) -> None:
        """Keep a runner's latest model list (replacing the one before)."""
        with self._db:
            self._db.execute(
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

    def load_models(self, owner: str, project: str) -> list[ModelList]:
        """Every runner's last model list in ``owner/project``, newest first."""
        rows = self._db.execute(
            "SELECT runner_id, owner, project, models, answered_at FROM runner_models"
            " WHERE owner = ? AND project = ? ORDER BY answered_at DESC",
            (owner, project),
        ).fetchall()
        return [ModelList(r[0], r[1], r[2], tuple(json.loads(r[3])), r[4]) for r in rows]

    # -- registrations -----------------------------------------------------

    def add_registration(
        self, owner: str, project: str, name: str, labels: list[str]
    ) -> tuple[Registration, str]:
        """Register a runner; returns its registration and token (shown once, stored hashed)."""
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
        with self._db:
            self._db.execute(
                "INSERT INTO runners (id, name, owner, project, labels, token_hash, registered_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    runner.id,
                    runner.name,
                    runner.owner,
                    runner.project,
                    json.dumps(list(runner.labels)),
                    runner.token_hash,
                    runner.registered_at,
                ),
            )
        return runner, token

    _RUNNER_COLUMNS = "id, name, owner, project, labels, registered_at, token_hash"

    @staticmethod
    def _registration(row: tuple[str, str, str, str, str, str, str]) -> Registration:
        labels = tuple(json.loads(row[4]))
        return Registration(row[0], row[1], row[2], row[3], labels, row[5], row[6])

    def registration_by_token(self, token: str) -> Registration | None:
        """The registration whose token this is (constant-time comparison against every hash)."""
        digest = token_hash(token)
        found: str | None = None
        for runner_id, stored in self._db.execute("SELECT id, token_hash FROM runners"):
            if hmac.compare_digest(stored, digest):
                found = runner_id
        return self.registration(found) if found is not None else None

    def registration(self, runner_id: str) -> Registration | None:
        """The registration of runner ``runner_id``, or None."""
        row = self._db.execute(
            f"SELECT {self._RUNNER_COLUMNS} FROM runners WHERE id = ?", (runner_id,)
        ).fetchone()
        return self._registration(row) if row is not None else None

    def list_registrations(self) -> list[Registration]:
        rows = self._db.execute(
            f"SELECT {self._RUNNER_COLUMNS} FROM runners ORDER BY registered_at, id"
        ).fetchall()
        return [self._registration(row) for row in rows]

    # -- API keys --------------------------------------------------------

    def create_api_key(
        self, name: str, project: str = DEFAULT_KEY_PROJECT, limits: KeyLimits | None = None
    ) -> str:
        """Create an API key for ``project`` ("owner/project") with ``limits`` (none by
        default); returns the key (shown once).

        ValueError when the name is empty, the project malformed, or an active key
        already has this name (a revoked name may be reused).
        """
        if not name or not name.strip():
            raise ValueError("an API key needs a name")
        owner, proj = split_project(project)
        key = new_token(API_KEY_PREFIX)
        with self._db:
            row = self._db.execute(
                "SELECT revoked FROM api_keys WHERE name = ?", (name,)
            ).fetchone()
            if row is not None and not row[0]:
                raise ValueError(f"an API key named {name!r} already exists")
            self._db.execute(
                "INSERT OR REPLACE INTO api_keys (name, owner, project, key_hash, created_at,"
                f" revoked, {_KEY_LIMIT_COLUMNS}) VALUES (?, ?, ?, ?, ?, 0, ?, ?, ?, ?)",
                (name, owner, proj, token_hash(key), utc_now(), *_limit_values(limits)),
            )
        return key

    def list_api_keys(self) -> list[dict[str, object]]:
        """Every key (revoked ones too), oldest first, with its limits (a KeyLimits)."""
        rows = self._db.execute(
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

    def key_limits(self, name: str) -> tuple[str, KeyLimits] | None:
        """The id and limits of the active key named ``name``, or None."""
        row = self._db.execute(
            f"SELECT key_hash, {_KEY_LIMIT_COLUMNS} FROM api_keys WHERE name = ? AND revoked = 0",
            (name,),
        ).fetchone()
        return None if row is None else (key_id_of(row[0]), KeyLimits(*row[1:5]))

    def set_key_limits(self, name: str, limits: KeyLimits) -> bool:
        """Replace the limits of the active key named ``name``; False when there is none."""
        with self._db:
            cur = self._db.execute(
                "UPDATE api_keys SET rpm = ?, tpm = ?, tokens_per_day = ?, max_streams = ?"
                " WHERE name = ? AND revoked = 0",
                (*_limit_values(limits), name),
            )
        return cur.rowcount > 0

    def revoke_api_key(self, name: str) -> bool:
        """Revoke the active key named ``name``; False when there is none."""
        with self._db:
            cur = self._db.execute(
                "UPDATE api_keys SET revoked = 1 WHERE name = ? AND revoked = 0", (name,)
            )
        return cur.rowcount > 0

    def check_api_key(self, key: str) -> ApiKey | None:
        """The active API key ``key`` is, or None (constant-time comparison against every hash)."""
        digest = token_hash(key)
        rows = self._db.execute(
            "SELECT name, owner, project, key_hash FROM api_keys WHERE revoked = 0"
        ).fetchall()
        found: ApiKey | None = None
        for name, owner, project, stored in rows:
            if hmac.compare_digest(stored, digest):
                found = ApiKey(name, owner, project, key_id_of(stored))
        return found

    def active_key_ids(self) -> set[str]:
        """The ids of every active (not revoked) API key."""
        rows = self._db.execute("SELECT key_hash FROM api_keys WHERE revoked = 0")
        return {key_id_of(stored) for (stored,) in rows}

    def active_key_id(self, name: str) -> str | None:
        """The id of the active API key named ``name``, or None."""
        row = self._db.execute(
            "SELECT key_hash FROM api_keys WHERE name = ? AND revoked = 0", (name,)
        ).fetchone()
        return key_id_of(row[0]) if row is not None else None

    # -- usage -------------------------------------------------------------------------

    def add_usage(self, record: UsageRow, at: float) -> None:
        """An ended turn (``at``: when, Unix time): its row, and its key's hourly totals."""
        model = record.model_label
        prompt, completion = record.prompt_tokens or 0, record.completion_tokens or 0
        error = int(record.outcome in ERROR_OUTCOMES)
        with self._db:
            self._db.execute(
                "INSERT INTO usage_turns (at, key_id, key_name, session, runner_id, job_id, model,"
                " api, stream, prompt_tokens, completion_tokens, ttft, duration, outcome)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    at,
                    record.key_id,
                    record.key_name,
                    record.session,
                    record.runner_id,
                    record.job_id,
                    model,
                    record.api,
                    int(record.stream),
                    record.prompt_tokens,
                    record.completion_tokens,
                    record.ttft,
                    record.duration,
                    record.outcome or "",
                ),
            )
            self._db.execute(
                "INSERT INTO usage_hourly (hour, key_id, key_name, model, turns, prompt_tokens,"
                " completion_tokens, errors) VALUES (?, ?, ?, ?, 1, ?, ?, ?)"
                " ON CONFLICT(hour, key_id, model) DO UPDATE SET turns = turns + 1,"
                " prompt_tokens = prompt_tokens + excluded.prompt_tokens,"
                " completion_tokens = completion_tokens + excluded.completion_tokens,"
                " errors = errors + excluded.errors, key_name = excluded.key_name",
                (
                    int(at) // HOUR * HOUR,
                    record.key_id,
                    record.key_name,
                    model,
                    prompt,
                    completion,
                    error,
                ),
            )

    def prune_usage(self, before: float, limit: int) -> int:
        """Delete up to ``limit`` turn rows older than ``before`` (the oldest first; the hourly
        totals stay); returns how many. Rows are complete from ``usage_turns_from`` on."""
        with self._db:
            rows = self._db.execute(
                "SELECT id, at FROM usage_turns WHERE at < ? ORDER BY at LIMIT ?", (before, limit)
            ).fetchall()
            if rows:
                self._db.executemany(
                    "DELETE FROM usage_turns WHERE id = ?", [(r[0],) for r in rows]
                )
            kept_from = before if len(rows) < limit else rows[-1][1]
            self._db.execute(
                "INSERT INTO usage_meta (name, value) VALUES ('turns_from', ?)"
                " ON CONFLICT(name) DO UPDATE SET value = MAX(value, excluded.value)",
                (kept_from,),
            )
        return len(rows)

    def usage_turns_from(self) -> float:
        """The Unix time from which every turn's row is kept (-inf: none was ever pruned)."""
        row = self._db.execute("SELECT value FROM usage_meta WHERE name = 'turns_from'").fetchone()
        return float(row[0]) if row is not None else -float("inf")

    def usage_rows(self, since: float = 0.0, key_name: str | None = None) -> list[dict[str, Any]]:
        """The kept turn rows ended at or after ``since``, oldest first."""
        query = (
            "SELECT at, key_id, key_name, session, runner_id, job_id, model, api, stream,"
            " prompt_tokens, completion_tokens, ttft, duration, outcome FROM usage_turns"
            " WHERE at >= ?"
        )
        args: tuple[Any, ...] = (since,)
        if key_name is not None:
            query += " AND key_name = ?"
            args = (*args, key_name)
        names = (
            "at key_id key_name session runner_id job_id model api stream prompt_tokens"
            " completion_tokens ttft duration outcome"
        ).split()
        rows = self._db.execute(query + " ORDER BY at, id", args).fetchall()
        found = [dict(zip(names, row, strict=True)) for row in rows]
        for row in found:
            row["stream"] = bool(row["stream"])
        return found

    def hourly_usage(self, since: float, key_name: str | None = None) -> list[HourlyUsage]:
        """Hourly totals per key name and model from the hour ``since`` falls in on, oldest
        first."""
        query = (
            "SELECT hour, key_name, model, SUM(turns), SUM(prompt_tokens), SUM(completion_tokens),"
            " SUM(errors) FROM usage_hourly WHERE hour >= ?"
        )
        args: tuple[Any, ...] = (int(since) // HOUR * HOUR if since > 0 else 0,)
        if key_name is not None:
            query += " AND key_name = ?"
            args = (*args, key_name)
        query += " GROUP BY hour, key_name, model ORDER BY hour, key_name, model"
        return [
            HourlyUsage(r[0], r[1], r[2] or None, r[3], r[4], r[5], r[6])
            for r in self._db.execute(query, args)
        ]

    def usage_totals(
        self, since: float, key_name: str | None = None
    ) -> tuple[list[UsageTotal], bool]:
        """Per key name and model, the use since ``since`` (Unix time); and whether that is
        exact (from the turn rows, all kept since then) or from the hourly totals (the hour
        ``since`` falls in counted whole)."""
        exact = since >= self.usage_turns_from()
        if exact:
            query = (
                "SELECT key_name, model, COUNT(*), SUM(COALESCE(prompt_tokens, 0)),"
                " SUM(COALESCE(completion_tokens, 0)),"
                f" SUM(outcome IN ({', '.join('?' * len(ERROR_OUTCOMES))}))"
                " FROM usage_turns WHERE at >= ?"
            )
            args: tuple[Any, ...] = (*ERROR_OUTCOMES, since)
        else:
            query = (
                "SELECT key_name, model, SUM(turns), SUM(prompt_tokens), SUM(completion_tokens),"
                " SUM(errors) FROM usage_hourly WHERE hour >= ?"
            )
            args = (int(since) // HOUR * HOUR if since > 0 else 0,)
        if key_name is not None:
            query += " AND key_name = ?"
            args = (*args, key_name)
        query += " GROUP BY key_name, model ORDER BY key_name, model"
        return [UsageTotal(*row) for row in self._db.execute(query, args)], exact

    def tokens_since(self, key_id: str, hour: int) -> int:
        """The key's prompt and completion tokens from ``hour`` (an hour's start) on."""
        row = self._db.execute(
            "SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM usage_hourly"
            " WHERE key_id = ? AND hour >= ?",
            (key_id, hour),
        ).fetchone()
        return int(row[0])


def _limit_values(limits: KeyLimits | None) -> tuple[int | None, ...]:
    """A key's limits as its columns (0 or None: no limit, NULL)."""
    limits = limits or KeyLimits()
    return tuple(getattr(limits, name) or None for name in LIMIT_NAMES)


def ensure_private_dir(path: pathlib.Path) -> None:
    """Create ``path`` (and parents) if needed and make it owner-only (0700)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def load_or_create_admin_token(data_dir: pathlib.Path) -> tuple[str, bool]:
    """The admin token stored in ``data_dir/admin-token`` (0600), creating it at first start.

    Returns ``(token, created)``.
    """
    ensure_private_dir(data_dir)
    path = data_dir / "admin-token"
    try:
        token = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        token = ""
    if token:
        return token, False
    token = new_token(ADMIN_TOKEN_PREFIX)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # an empty leftover file
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(token + "\n")
    os.chmod(path, 0o600)
    return token, True
