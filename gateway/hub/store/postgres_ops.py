"""PostgreSQL's own operations of the hub's store, sans-IO (as ``sql``'s): whether a database
holds a hub store, its migrations (under an advisory lock, so that replicas starting together
apply them once) and the admin credential every hub on it shares. The operations both databases
run are ``ops``, ``trust_ops`` and ``usage_ops``; ``postgres_io`` runs them on a connection."""

from __future__ import annotations

from gateway.hub.store.records import utc_now
from gateway.hub.store.schema import (
    LATEST,
    MIGRATIONS,
    VERSION_TABLE,
    SchemaTooNew,
    for_postgres,
    too_new,
)
from gateway.hub.store.sql import BEGIN as _BEGIN
from gateway.hub.store.sql import COMMIT, POSTGRES, Op, Query, Row, T

__all__ = ["BEGIN", "COMMIT", "ROLLBACK", "Op", "Query", "Row", "T"]  # as before: the replicas'

BEGIN = Query(_BEGIN[POSTGRES])
ROLLBACK = Query("ROLLBACK")
MIGRATION_LOCK = 0x616C_7067_6875_6221  # pg_advisory_xact_lock's key: the hub's migrations
ADMIN = "admin"  # the admin credential's row in ``credentials``


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
