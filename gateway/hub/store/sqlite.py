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
from typing import Any, Concatenate, ParamSpec, TypeVar

import trio

from gateway.hub.money import KeyBudget, Price
from gateway.hub.store import ops, people_ops, sqlite_ops, trust_ops, usage_ops
from gateway.hub.store.backup import lock_shared
from gateway.hub.store.base import (
    BATCH_INTERVAL,
    BATCH_ROWS,
    Store,
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
from gateway.hub.store.records import (
    DEFAULT_KEY_PROJECT,
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
    UsageTotal,
)
from gateway.hub.store.schema import SchemaTooNew
from gateway.hub.store.sql import SQLITE, Op

FILENAME = "hub.sqlite3"
BUSY_TIMEOUT = 10.0  # s a statement waits for another process's write lock before it fails

P = ParamSpec("P")
T = TypeVar("T")


class SqliteStore(Store):
    """The hub's SQLite database: ``data_dir/hub.sqlite3``, or in memory when ``data_dir`` is
    None. Opened and migrated here (StoreError, one line, when it cannot be)."""

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

    async def journal_mark(self, name: str) -> int:
        return await self._run(usage_ops.journal_mark(SQLITE, name))

    # -- jobs --------------------------------------------------------------------------------

    async def save_job(self, job: StoredJob) -> None:
        await self._run(ops.save_job(SQLITE, job))

    async def delete_job(self, job_id: str) -> None:
        await self._run(ops.delete_job(SQLITE, job_id))

    async def add_job_report(self, job_id: str, body: dict[str, Any]) -> None:
        await self._run(ops.add_job_report(SQLITE, job_id, body))

    async def load_jobs(self, *, live_only: bool = False) -> list[StoredJob]:
        return await self._run(ops.load_jobs(SQLITE, live_only))

    async def load_job(self, job_id: str) -> StoredJob | None:
        return await self._run(ops.load_job(SQLITE, job_id))

    async def job_ids(self) -> list[str]:
        return await self._run(ops.job_ids(SQLITE))

    async def count_jobs(self) -> int:
        return await self._run(ops.count_jobs(SQLITE))

    # -- sessions and model lists --------------------------------------------------------------

    async def save_session(self, session: StoredSession) -> None:
        await self._run(ops.save_session(SQLITE, session))

    async def delete_session(
        self, key_name: str, session_id: str, job_id: str | None = None
    ) -> None:
        await self._run(ops.delete_session(SQLITE, key_name, session_id, job_id))

    async def load_sessions(self) -> list[StoredSession]:
        return await self._run(ops.load_sessions(SQLITE))

    async def save_models(self, models: ModelList) -> None:
        await self._run(ops.save_models(SQLITE, models))

    async def load_models(self, owner: str, project: str) -> list[ModelList]:
        return await self._run(ops.load_models(SQLITE, owner, project))

    # -- registrations and API keys -------------------------------------------------------------

    async def add_registration(
        self,
        owner: str,
        project: str,
        name: str,
        labels: list[str],
        enrollment: str | None = None,
    ) -> tuple[Registration, str]:
        return await self._run(
            ops.add_registration(SQLITE, owner, project, name, labels, enrollment)
        )

    async def registration_by_token(self, token: str) -> Registration | None:
        return await self._run(ops.registration_by_token(SQLITE, token))

    async def registration(self, runner_id: str) -> Registration | None:
        return await self._run(ops.registration(SQLITE, runner_id))

    async def list_runners(self) -> list[RunnerRecord]:
        return await self._run(trust_ops.list_runners(SQLITE))

    async def revoke_runner(self, runner_id: str) -> bool:
        return await self._run(trust_ops.revoke_runner(SQLITE, runner_id))

    async def revoked_runners(self) -> set[str]:
        return await self._run(trust_ops.revoked_runners(SQLITE))

    async def runners_seen(self, runner_ids: list[str], at: float) -> None:
        await self._run(trust_ops.runners_seen(SQLITE, runner_ids, at))

    async def create_enrollment(
        self, project: str, expires_at: float | None, uses: int | None
    ) -> tuple[Enrollment, str]:
        return await self._run(trust_ops.create_enrollment(SQLITE, project, expires_at, uses))

    async def list_enrollments(self) -> list[Enrollment]:
        return await self._run(trust_ops.list_enrollments(SQLITE))

    async def enrollment_by_token(self, token: str) -> Enrollment | None:
        return await self._run(trust_ops.enrollment_by_token(SQLITE, token))

    async def use_enrollment(self, enrollment_id: str, now: float) -> bool:
        return await self._run(trust_ops.use_enrollment(SQLITE, enrollment_id, now))

    async def revoke_enrollment(self, enrollment_id: str) -> bool:
        return await self._run(trust_ops.revoke_enrollment(SQLITE, enrollment_id))

    async def create_api_key(
        self, name: str, project: str = DEFAULT_KEY_PROJECT, limits: KeyLimits | None = None
    ) -> str:
        return await self._run(ops.create_api_key(SQLITE, name, project, limits))

    async def list_api_keys(self) -> list[dict[str, object]]:
        return await self._run(ops.list_api_keys(SQLITE))

    async def key_limits(self, name: str) -> tuple[str, KeyLimits] | None:
        return await self._run(ops.key_limits(SQLITE, name))

    async def set_key_limits(self, name: str, limits: KeyLimits) -> bool:
        return await self._run(ops.set_key_limits(SQLITE, name, limits))

    async def revoke_api_key(self, name: str) -> bool:
        return await self._run(ops.revoke_api_key(SQLITE, name))

    async def check_api_key(self, key: str) -> ApiKey | None:
        return await self._run(ops.check_api_key(SQLITE, key))

    async def active_key_ids(self) -> set[str]:
        return await self._run(ops.active_key_ids(SQLITE))

    async def active_key_id(self, name: str) -> str | None:
        return await self._run(ops.active_key_id(SQLITE, name))

    # -- usage (the queued rows written first) ---------------------------------------------------

    async def prune_usage(self, before: float, limit: int) -> int:
        await self.flush_usage()
        return await self._run(usage_ops.prune_usage(SQLITE, before, limit))

    async def usage_turns_from(self) -> float:
        await self.flush_usage()
        return await self._run(usage_ops.usage_turns_from(SQLITE))

    async def usage_rows(
        self, since: float = 0.0, key_name: str | None = None
    ) -> list[dict[str, Any]]:
        await self.flush_usage()
        return await self._run(usage_ops.usage_rows(SQLITE, since, key_name))

    async def hourly_usage(self, since: float, key_name: str | None = None) -> list[HourlyUsage]:
        await self.flush_usage()
        return await self._run(usage_ops.hourly_usage(SQLITE, since, key_name))

    async def usage_totals(
        self, since: float, key_name: str | None = None
    ) -> tuple[list[UsageTotal], bool]:
        await self.flush_usage()
        return await self._run(usage_ops.usage_totals(SQLITE, since, key_name))

    async def tokens_since(self, key_id: str, hour: int) -> int:
        await self.flush_usage()
        return await self._run(usage_ops.tokens_since(SQLITE, key_id, hour))

    async def people(self, op: Op[T]) -> T:
        await self.flush_usage()
        return await self._call(people_ops.run_sqlite, op)

    async def cost_since(self, key_id: str, hour: int) -> float:
        await self.flush_usage()
        return await self._run(usage_ops.cost_since(SQLITE, key_id, hour))

    async def throughput(self, model: str, since: float) -> tuple[float, float]:
        await self.flush_usage()
        return await self._run(usage_ops.throughput(SQLITE, model, since))

    # -- prices and budgets ----------------------------------------------------------------------

    async def set_price(self, price: Price) -> None:
        await self._run(usage_ops.set_price(SQLITE, price))

    async def delete_price(self, model: str) -> bool:
        return await self._run(usage_ops.delete_price(SQLITE, model))

    async def list_prices(self) -> list[Price]:
        return await self._run(usage_ops.list_prices(SQLITE))

    async def key_budgets(self) -> dict[str, KeyBudget]:
        return await self._run(usage_ops.key_budgets(SQLITE))

    async def set_key_budget(self, name: str, budget: KeyBudget) -> bool:
        return await self._run(usage_ops.set_key_budget(SQLITE, name, budget))


def _error(where: str, exc: sqlite3.Error) -> StoreError:
    """One line for a failed statement: StoreUnavailable when the database cannot be used now
    (locked, unreadable, full), StoreError otherwise."""
    kind = StoreUnavailable if isinstance(exc, sqlite3.OperationalError) else StoreError
    return kind(f"the hub store {where}: {exc}")
