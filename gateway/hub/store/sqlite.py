"""The hub's store on SQLite, the embedded default: ``DATA/hub.sqlite3`` (in memory without a data
directory), one connection, migrated when opened, its statements run on the calling thread.

Why on the trio thread and not in a worker thread (``trio.to_thread.run_sync``): each call is a
few µs to a few tens of µs of local work (WAL, ``synchronous=NORMAL``: a commit does not wait for
the disk, only the occasional checkpoint does), while a hop to a worker thread and back costs
more than the call itself (``bench/store_calls.py`` measures both on this machine); and a call
that never yields keeps the callers' steps atomic as they were. The per-turn usage rows are not
written on the turn's path at all (``Store.queue_usage``). What still waits on this thread is
another process holding the write lock (``hub keys`` from the command line: a few ms); bounded
by ``BUSY_TIMEOUT``. ``in_thread=True`` runs every call in one worker thread instead (measured,
not used)."""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import sqlite3
from collections.abc import Callable
from functools import partial
from typing import Concatenate, ParamSpec, TypeVar

import trio

from gateway.hub.store import people_ops, sqlite_ops
from gateway.hub.store.backup import lock_shared
from gateway.hub.store.base import (
    BATCH_INTERVAL,
    BATCH_ROWS,
    StoreError,
    StoreUnavailable,
    UsageRow,
)
from gateway.hub.store.credentials import (
    ADMIN_TOKEN_PREFIX,
    ensure_private_dir,
    load_or_create_admin_token,
    new_token,
    token_hash,
)
from gateway.hub.store.records import AdminCredential
from gateway.hub.store.schema import SchemaTooNew
from gateway.hub.store.sql import SQLITE, Op
from gateway.hub.store.sqlstore import SqlStore

FILENAME = "hub.sqlite3"
BUSY_TIMEOUT = 10.0  # s a statement waits for another process's write lock before it fails

P = ParamSpec("P")
T = TypeVar("T")


class SqliteStore(SqlStore):
    """The hub's SQLite database: ``data_dir/hub.sqlite3``, or in memory when ``data_dir`` is
    None. Opened and migrated here (StoreError, one line, when it cannot be)."""

    dialect = SQLITE

    def __init__(
        self,
        data_dir: pathlib.Path | None = None,
        *,
        usage_retention: float = math.inf,
        batch_interval: float = BATCH_INTERVAL,
        batch_rows: int = BATCH_ROWS,
        in_thread: bool = False,
    ) -> None:
        super().__init__(
            usage_retention=usage_retention, batch_interval=batch_interval, batch_rows=batch_rows
        )
        self.path = None if data_dir is None else data_dir / FILENAME
        self.where = "(memory)" if self.path is None else str(self.path)
        self._limiter = trio.CapacityLimiter(1) if in_thread else None
        self._lock_fd = -1  # a shared lock on the data directory's store: no restore under it
        try:
            self._db: sqlite3.Connection | None = self._connect(data_dir)
        except sqlite3.Error as exc:
            self._unlock()
            raise _error(self.where, exc) from None
        except SchemaTooNew as exc:
            self._unlock()
            raise StoreError(str(exc)) from None
        except BaseException:
            self._unlock()
            raise

    def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)

    def _connect(self, data_dir: pathlib.Path | None) -> sqlite3.Connection:
        if data_dir is None:
            db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        else:
            ensure_private_dir(data_dir)
            self._lock_fd = lock_shared(data_dir)  # `hub restore` refuses while it is held
            db = sqlite3.connect(
                self.where, timeout=BUSY_TIMEOUT, check_same_thread=False, isolation_level=None
            )
            with contextlib.suppress(OSError):
                os.chmod(self.where, 0o600)
            # in WAL mode with synchronous=NORMAL a commit does not wait for the disk (only the
            # occasional checkpoint does); the -wal and -shm files sit in the owner-only
            # data directory
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
        try:
            sqlite_ops.migrate(db, self.where)
        except BaseException:
            db.close()
            raise
        return db

    async def _run(self, op: Op[T]) -> T:
        """The operation ``op`` (``ops``, ``trust_ops``, ``usage_ops``) on the connection."""
        return await self._call(sqlite_ops.run, op)

    async def _call(
        self, fn: Callable[Concatenate[sqlite3.Connection, P], T], *args: P.args, **kw: P.kwargs
    ) -> T:
        """``fn`` on the connection: here, or in the worker thread with ``in_thread``."""
        db = self._db
        if db is None:
            raise StoreUnavailable(f"the hub store {self.where} is closed")
        try:
            if self._limiter is None:
                result = fn(db, *args, **kw)
            else:
                result = await trio.to_thread.run_sync(
                    partial(fn, db, *args, **kw), limiter=self._limiter
                )
        except sqlite3.OperationalError as exc:  # locked, unreadable, full: said once
            raise self._unavailable(str(exc)) from None
        except sqlite3.Error as exc:
            raise _error(self.where, exc) from None
        if not self.available:
            self._available()
        return result

    async def _close(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            db.close()
        self._unlock()

    def admin_credential(self, data_dir: pathlib.Path | None) -> AdminCredential:
        """The token in ``data_dir/admin-token`` (made there at first start), as before the
        store kept credentials: a homelab's hub reads it back from that file. Without a data
        directory, a new one each time."""
        if data_dir is None:
            token, created = new_token(ADMIN_TOKEN_PREFIX), True
        else:
            token, created = load_or_create_admin_token(data_dir)
        return AdminCredential(token, token_hash(token), created)

    async def _write_usage(self, rows: list[UsageRow], mark: tuple[str, int] | None) -> None:
        await self._call(sqlite_ops.write_usage, rows, mark)

    async def people(self, op: Op[T]) -> T:
        await self.flush_usage()
        return await self._call(people_ops.run_sqlite, op)


def _error(where: str, exc: sqlite3.Error) -> StoreError:
    """One line for a failed statement: StoreUnavailable when the database cannot be used now
    (locked, unreadable, full), StoreError otherwise."""
    kind = StoreUnavailable if isinstance(exc, sqlite3.OperationalError) else StoreError
    return kind(f"the hub store {where}: {exc}")
