"""The hub store's schema as versioned migrations, applied in order at start: one list for every
backend, written in SQLite's dialect, with PostgreSQL's differences said once here.

Pure data: each backend applies them in one transaction and records each version applied in
its ``schema_version`` table; a store whose version is newer than ``LATEST`` is refused.
Migration 1 is the schema of every store made before migrations, exactly: it creates what is
missing and adds the columns older stores lack, so an existing data directory opens unchanged.
A change to the schema is a new migration at the end, never an edit of one that shipped.

PostgreSQL runs the same statements through ``for_postgres``: SQLite's INTEGER is 64 bits and
its REAL 8 bytes, so they become BIGINT and DOUBLE PRECISION, and an AUTOINCREMENT key an
identity column; what cannot be said in both dialects is a migration's ``postgres`` statements
(run after its own there), such as the ordering column SQLite has as ``rowid``."""

from __future__ import annotations

import re
from dataclasses import dataclass

# the replicas' tables on PostgreSQL (their migrations below): the SQL is the replicas' own
from gateway.hub.store.replica_schema import BUDGET_STATEMENTS
from gateway.hub.store.replica_schema import RECORDED as TEAM_RECORDED
from gateway.hub.store.replica_schema import STATEMENTS as TEAM_STATEMENTS
from gateway.hub.store.replica_schema import STOPPED as TEAM_STOPPED


@dataclass(frozen=True)
class Migration:
    """One step of the schema: statements run in order, then the columns a store made before
    them may lack, added when missing (``(table, column, declaration)``)."""

    version: int
    what: str
    statements: tuple[str, ...]
    columns: tuple[tuple[str, str, str], ...] = ()
    postgres: tuple[str, ...] = ()  # PostgreSQL only, after the statements and columns


class SchemaTooNew(Exception):
    """The database's schema is newer than this code knows (the message says so in one line)."""


VERSION_TABLE = (
    "CREATE TABLE IF NOT EXISTS schema_version ("
    "version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL)"
)

_V1 = (
    """CREATE TABLE IF NOT EXISTS runners (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    owner TEXT NOT NULL,
    project TEXT NOT NULL,
    labels TEXT NOT NULL,
    token_hash TEXT NOT NULL,
    registered_at TEXT NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS api_keys (
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
)""",
    """CREATE TABLE IF NOT EXISTS jobs (
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
)""",
    """CREATE TABLE IF NOT EXISTS job_reports (
    job_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    body TEXT NOT NULL,
    received_at TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
)""",
    """CREATE TABLE IF NOT EXISTS runner_models (
    runner_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    project TEXT NOT NULL,
    models TEXT NOT NULL,
    answered_at REAL NOT NULL
)""",
    """CREATE TABLE IF NOT EXISTS sessions (
    key_name TEXT NOT NULL,
    session_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    project TEXT NOT NULL,
    job_id TEXT NOT NULL,
    key_id TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (key_name, session_id)
)""",
    """CREATE TABLE IF NOT EXISTS usage_turns (
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
)""",
    "CREATE INDEX IF NOT EXISTS usage_turns_at ON usage_turns (at)",
    """CREATE TABLE IF NOT EXISTS usage_hourly (
    hour INTEGER NOT NULL,
    key_id TEXT NOT NULL,
    key_name TEXT NOT NULL,
    model TEXT NOT NULL,
    turns INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    errors INTEGER NOT NULL,
    PRIMARY KEY (hour, key_id, model)
)""",
    """CREATE TABLE IF NOT EXISTS usage_meta (
    name TEXT PRIMARY KEY,
    value REAL NOT NULL
)""",
)

_V7 = (  # people (issue 34): gateway/hub/store/people_ops.py reads and writes them
    """CREATE TABLE IF NOT EXISTS people (
    sub TEXT PRIMARY KEY,
    email TEXT,
    name TEXT,
    role TEXT NOT NULL,
    first_seen TEXT NOT NULL,
    last_seen TEXT NOT NULL,
    projects TEXT
)""",
    """CREATE TABLE IF NOT EXISTS key_owners (
    key_hash TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    key_name TEXT NOT NULL,
    sub TEXT NOT NULL,
    email TEXT,
    created_at TEXT NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS key_owners_key_id ON key_owners (key_id)",
    "CREATE INDEX IF NOT EXISTS key_owners_sub ON key_owners (sub)",
    """CREATE TABLE IF NOT EXISTS page_sessions (
    id_hash TEXT PRIMARY KEY,
    sub TEXT NOT NULL,
    email TEXT,
    name TEXT,
    role TEXT NOT NULL,
    created REAL NOT NULL,
    expires REAL NOT NULL
)""",
)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "the tables of every store made before migrations",
        _V1,
        columns=(
            # a store from before sessions were keyed by the key's id
            ("sessions", "key_id", "TEXT NOT NULL DEFAULT ''"),
            # a store from before keys had limits
            ("api_keys", "rpm", "INTEGER"),
            ("api_keys", "tpm", "INTEGER"),
            ("api_keys", "tokens_per_day", "INTEGER"),
            ("api_keys", "max_streams", "INTEGER"),
        ),
        # the order jobs were made in, which SQLite keeps as every row's ``rowid``
        postgres=(
            "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS seq BIGINT GENERATED ALWAYS AS IDENTITY",
        ),
    ),
    Migration(
        2,
        "usage marked estimated: a turn that ended before its backend said its tokens",
        (),
        columns=(
            ("usage_turns", "estimated", "INTEGER NOT NULL DEFAULT 0"),
            ("usage_hourly", "estimated", "INTEGER NOT NULL DEFAULT 0"),
        ),
    ),
    Migration(
        3,
        "the hub's own credentials by hash: the admin credential every replica shares",
        (
            """CREATE TABLE IF NOT EXISTS credentials (
    name TEXT PRIMARY KEY,
    hash TEXT NOT NULL,
    created_at TEXT NOT NULL
)""",
        ),
    ),
    Migration(
        4,
        "usage marked continued: a turn whose answer another runner or backend finished",
        (),
        columns=(("usage_turns", "continued", "INTEGER NOT NULL DEFAULT 0"),),
    ),
    Migration(
        5,
        "a team of hubs on PostgreSQL: replicas, channels, runners' presence, limits shared",
        (),
        postgres=TEAM_STATEMENTS,  # SQLite's single hub has no team
    ),
    Migration(
        6,
        "runners enrolled by a project's enrollment token, revoked, and when each was last seen",
        (
            """CREATE TABLE IF NOT EXISTS enrollment_tokens (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    project TEXT NOT NULL,
    token_hash TEXT NOT NULL,
    created_at TEXT NOT NULL,
    expires_at REAL,
    uses_left INTEGER,
    used INTEGER NOT NULL DEFAULT 0,
    revoked INTEGER NOT NULL DEFAULT 0
)""",
        ),
        columns=(
            ("runners", "revoked_at", "TEXT"),
            ("runners", "enrollment_id", "TEXT"),
            ("runners", "last_seen", "REAL"),
        ),
    ),
    Migration(
        7,
        "people who sign in (OpenID Connect), the keys they own, their page sessions",
        _V7,
    ),
    Migration(
        8,
        "money and priority: model prices, each turn's cost, keys' budgets and priority class",
        (
            """CREATE TABLE IF NOT EXISTS prices (
    model TEXT PRIMARY KEY,
    input REAL NOT NULL,
    output REAL NOT NULL,
    reference TEXT,
    ref_input REAL,
    ref_output REAL,
    watts REAL,
    kwh_price REAL,
    updated_at TEXT NOT NULL
)""",
        ),
        columns=(
            ("api_keys", "budget_daily", "REAL"),
            ("api_keys", "budget_monthly", "REAL"),
            ("api_keys", "priority", "TEXT NOT NULL DEFAULT 'standard'"),
            ("usage_turns", "cost", "REAL"),
            ("usage_turns", "ref_cost", "REAL"),
            ("usage_hourly", "cost", "REAL NOT NULL DEFAULT 0"),
            ("usage_hourly", "ref_cost", "REAL NOT NULL DEFAULT 0"),
            ("usage_hourly", "unpriced", "INTEGER NOT NULL DEFAULT 0"),
        ),
        postgres=BUDGET_STATEMENTS,  # a team's budgets: admitted in the store (SQLite: in memory)
    ),
    Migration(
        9,
        "a team's turns keep their usage row from admission: a replica lost for good loses none",
        (),
        postgres=TEAM_RECORDED,
    ),
    Migration(
        10,
        "a runner's clean stop is in its presence: every replica counts it down at once",
        (),
        postgres=TEAM_STOPPED,
    ),
)
LATEST = MIGRATIONS[-1].version


def too_new(where: str, version: int) -> str:
    """The one line that refuses a store whose schema is newer than this code knows."""
    return (
        f"the hub store {where} has schema version {version}, newer than this alp-gateway "
        f"knows (up to {LATEST}): run the alp-gateway that made it, or a newer one"
    )


_POSTGRES_TYPES = (
    (
        re.compile(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b"),
        "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
    ),
    (re.compile(r"\bINTEGER\b"), "BIGINT"),  # SQLite's integers are 64 bits
    (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),  # SQLite's REAL is an 8-byte float
)


def for_postgres(statement: str) -> str:
    """A statement (or a column's declaration) of SQLite's dialect in PostgreSQL's."""
    for pattern, replacement in _POSTGRES_TYPES:
        statement = pattern.sub(replacement, statement)
    return statement
