"""The hub's store: keys and their limits, usage, jobs and reports, sessions, runner registrations
and model lists, behind one async interface (``Store``); SQLite in the data directory is the
embedded default, PostgreSQL (a ``postgresql://`` URL) the store several hubs can share
(``open_store``). Nothing outside this package speaks SQL or imports a driver."""

from __future__ import annotations

import math
import pathlib

from gateway.hub.store import dburl
from gateway.hub.store.base import (
    BATCH_INTERVAL,
    BATCH_ROWS,
    POOL_SIZE,
    PRUNE_BATCH,
    PRUNE_EVERY,
    Store,
    StoreError,
    StoreMissing,
    StoreUnavailable,
)
from gateway.hub.store.credentials import (
    ADMIN_TOKEN_PREFIX,
    API_KEY_PREFIX,
    ENROLLMENT_TOKEN_PREFIX,
    RUNNER_TOKEN_PREFIX,
    ensure_private_dir,
    key_id_of,
    load_or_create_admin_token,
    new_token,
    token_hash,
)
from gateway.hub.store.records import (
    DEFAULT_KEY_PROJECT,
    ERROR_OUTCOMES,
    HOUR,
    LIMIT_NAMES,
    AdminCredential,
    ApiKey,
    Enrollment,
    HourlyUsage,
    KeyLimits,
    ModelList,
    Registration,
    RunnerRecord,
    StoredJob,
    StoredSession,
    UsageRecord,
    UsageTotal,
    limits_of,
)
from gateway.hub.store.schema import LATEST as SCHEMA_VERSION
from gateway.hub.store.sqlite import FILENAME, SqliteStore


def open_store(
    place: pathlib.Path | str | None = None,
    *,
    create: bool = True,
    pool_size: int = POOL_SIZE,
    usage_retention: float = math.inf,
    batch_interval: float = BATCH_INTERVAL,
    batch_rows: int = BATCH_ROWS,
) -> Store:
    """The hub's store at ``place``, migrated: a ``postgresql://`` URL (a pool of at most
    ``pool_size`` connections), else a data directory (SQLite, in memory when None).
    ``create=False``: StoreMissing when there is no hub store there yet (rather than making
    one). StoreError (one line, never a password) when it cannot be opened, OSError when the
    directory cannot be made."""
    if isinstance(place, str) and dburl.is_url(place):
        try:  # psycopg only when it is used; it loads the system's libpq then
            from gateway.hub.store.postgres import PostgresStore
        except ImportError as exc:  # psycopg without a libpq to load: one line, how to get one
            raise StoreError(
                f"a store on PostgreSQL needs libpq, which was not found ({exc}): install the "
                "system's (Debian/Ubuntu: apt-get install libpq5) or psycopg's own "
                "(pip install 'alp-gateway[postgresql-binary]')"
            ) from None

        return PostgresStore(
            place,
            pool_size=pool_size,
            create=create,
            usage_retention=usage_retention,
            batch_interval=batch_interval,
            batch_rows=batch_rows,
        )
    data_dir = None if place is None else pathlib.Path(place)
    if not create and data_dir is not None and not (data_dir / FILENAME).exists():
        raise StoreMissing(f"no hub in {data_dir} (no {FILENAME})")
    return SqliteStore(
        data_dir,
        usage_retention=usage_retention,
        batch_interval=batch_interval,
        batch_rows=batch_rows,
    )


__all__ = [
    "ADMIN_TOKEN_PREFIX",
    "API_KEY_PREFIX",
    "BATCH_INTERVAL",
    "BATCH_ROWS",
    "DEFAULT_KEY_PROJECT",
    "ENROLLMENT_TOKEN_PREFIX",
    "ERROR_OUTCOMES",
    "HOUR",
    "LIMIT_NAMES",
    "PRUNE_BATCH",
    "POOL_SIZE",
    "PRUNE_EVERY",
    "RUNNER_TOKEN_PREFIX",
    "SCHEMA_VERSION",
    "AdminCredential",
    "ApiKey",
    "Enrollment",
    "HourlyUsage",
    "KeyLimits",
    "ModelList",
    "Registration",
    "RunnerRecord",
    "SqliteStore",
    "Store",
    "StoreError",
    "StoreMissing",
    "StoreUnavailable",
    "StoredJob",
    "StoredSession",
    "UsageRecord",
    "UsageTotal",
    "ensure_private_dir",
    "key_id_of",
    "limits_of",
    "load_or_create_admin_token",
    "new_token",
    "open_store",
    "token_hash",
]
