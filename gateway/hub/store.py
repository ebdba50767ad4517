"""SQLite persistence of the hub's registered runners and API keys (only token hashes are stored)."""

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
from dataclasses import dataclass

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
    revoked INTEGER NOT NULL DEFAULT 0
);
"""


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


def split_project(project: str) -> tuple[str, str]:
    """``"owner/project"`` -> ``("owner", "project")``; ValueError when malformed."""
    owner, sep, name = project.partition("/")
    if not sep or not owner or not name or "/" in name:
        raise ValueError(f"project must look like OWNER/PROJECT, not {project!r}")
    return owner, name


@dataclass(frozen=True, slots=True)
class Runner:
    """A registered runner (the token itself is never kept, only its hash)."""

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
        self._db.executescript(_SCHEMA)
        self._db.commit()

    def close(self) -> None:
        self._db.close()

    # -- runners ---------------------------------------------------------

    def add_runner(
        self, owner: str, project: str, name: str, labels: list[str]
    ) -> tuple[Runner, str]:
        """Register a runner; returns it and its token (shown once, stored hashed)."""
        token = new_token(RUNNER_TOKEN_PREFIX)
        runner = Runner(
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
    def _runner(row: tuple[str, str, str, str, str, str, str]) -> Runner:
        return Runner(row[0], row[1], row[2], row[3], tuple(json.loads(row[4])), row[5], row[6])

    def runner_by_token(self, token: str) -> Runner | None:
        """The runner whose token this is (constant-time comparison against every hash)."""
        digest = token_hash(token)
        found: str | None = None
        for runner_id, stored in self._db.execute("SELECT id, token_hash FROM runners"):
            if hmac.compare_digest(stored, digest):
                found = runner_id
        return self.runner(found) if found is not None else None

    def runner(self, runner_id: str) -> Runner | None:
        """The registered runner with this id, or None."""
        row = self._db.execute(
            f"SELECT {self._RUNNER_COLUMNS} FROM runners WHERE id = ?", (runner_id,)
        ).fetchone()
        return self._runner(row) if row is not None else None

    def list_runners(self) -> list[Runner]:
        rows = self._db.execute(
            f"SELECT {self._RUNNER_COLUMNS} FROM runners ORDER BY registered_at, id"
        ).fetchall()
        return [self._runner(row) for row in rows]

    # -- API keys --------------------------------------------------------

    def create_api_key(self, name: str, project: str = DEFAULT_KEY_PROJECT) -> str:
        """Create an API key for ``project`` ("owner/project"); returns the key (shown once).

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
                "INSERT OR REPLACE INTO api_keys (name, owner, project, key_hash, created_at, revoked)"
                " VALUES (?, ?, ?, ?, ?, 0)",
                (name, owner, proj, token_hash(key), utc_now()),
            )
        return key

    def list_api_keys(self) -> list[dict[str, object]]:
        rows = self._db.execute(
            "SELECT name, owner, project, created_at, revoked FROM api_keys ORDER BY created_at, name"
        ).fetchall()
        return [
            {
                "name": r[0],
                "owner": r[1],
                "project": r[2],
                "createdAt": r[3],
                "revoked": bool(r[4]),
            }
            for r in rows
        ]

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
                found = ApiKey(name, owner, project)
        return found


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
