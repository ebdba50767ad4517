"""The hub's store: keys and their limits, usage, jobs and reports, sessions, runner registrations
and model lists, behind one async interface (``Store``); SQLite in the data directory is the
embedded default (``open_store``). Nothing outside this package speaks SQL or imports a driver."""

from __future__ import annotations

import math
import pathlib

from gateway.hub.store.base import (
    BATCH_INTERVAL,
    BATCH_ROWS,
    PRUNE_BATCH,
    PRUNE_EVERY,
    Store,
    StoreError,
    StoreUnavailable,
)
from gateway.hub.store.credentials import (
    ADMIN_TOKEN_PREFIX,
    API_KEY_PREFIX,
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
    ApiKey,
    HourlyUsage,
    KeyLimits,
    ModelList,
    Registration,
    StoredJob,
    StoredSession,
    UsageRecord,
    UsageTotal,
    limits_of,
)
from gateway.hub.store.schema import LATEST as SCHEMA_VERSION
from gateway.hub.store.sqlite import SqliteStore


def open_store(
    data_dir: pathlib.Path | None = None,
    *,
    usage_retention: float = math.inf,
    batch_interval: float = BATCH_INTERVAL,
    batch_rows: int = BATCH_ROWS,
) -> Store:
    """The hub's store in ``data_dir`` (SQLite, migrated; in memory when None); StoreError (one
    line) when it cannot be opened, OSError when the directory cannot be made."""
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
    "ERROR_OUTCOMES",
    "HOUR",
    "LIMIT_NAMES",
    "PRUNE_BATCH",
    "PRUNE_EVERY",
    "RUNNER_TOKEN_PREFIX",
    "SCHEMA_VERSION",
    "ApiKey",
    "HourlyUsage",
    "KeyLimits",
    "ModelList",
    "Registration",
    "SqliteStore",
    "Store",
    "StoreError",
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
