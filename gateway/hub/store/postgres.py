"""The hub's store on PostgreSQL, for a team's hub (several replicas may share it): a bounded
pool of connections driven from trio, migrated when opened, and its own recovery when the
database goes away and comes back.

Why from trio and not in a worker thread: ``bench/store_calls.py`` measures the per-turn calls
both ways on this machine (the figures are in ``bench/README.md``); a hop to a worker thread and
back costs more wall and CPU time than the non-blocking round trip (see ``postgres_io``).

The pool: at most ``pool_size`` connections, opened when first needed and kept; a call waits for
one when all are busy. An idle connection is checked before it is lent (what the server sent
meanwhile read without waiting: a restarted server's end is found there, not by a failed call).
A connection left mid-statement (a call cancelled, a failure) is closed, never lent again.

A database that goes away: the call that finds it so fails with ``StoreUnavailable`` (the hub
answers 503 ``store_unavailable``), said once in the log (``Store._unavailable``); while it is
away, calls fail at once but for one try to connect every ``RETRY_AFTER`` s; the first call that
succeeds says it is back. A call that gets no answer within ``CALL_TIMEOUT`` s counts as the
database gone (its connection is closed)."""

from __future__ import annotations

import math
import pathlib
import time
from typing import Any, Protocol, TypeVar

import trio

from gateway.hub.store import dburl, postgres_usage
from gateway.hub.store import postgres_ops as pg_ops
from gateway.hub.store.base import (
    BATCH_INTERVAL,
    BATCH_ROWS,
    POOL_SIZE,
    StoreError,
    StoreMissing,
    StoreUnavailable,
    UsageRow,
)
from gateway.hub.store.credentials import (
    ADMIN_TOKEN_PREFIX,
    new_token,
    read_admin_token,
    token_hash,
    write_admin_token,
)
from gateway.hub.store.postgres_io import (
    DOWN,
    RETRY,
    BlockingConnection,
    PgFailure,
    ThreadConnection,
    TrioConnection,
    conninfo,
)
from gateway.hub.store.records import AdminCredential
from gateway.hub.store.schema import SchemaTooNew
from gateway.hub.store.sql import POSTGRES, Op
from gateway.hub.store.sqlstore import SqlStore

CONNECT_TIMEOUT = 5.0  # s to open a connection
CALL_TIMEOUT = 15.0  # s a call may wait for its answers
RETRY_AFTER = 1.0  # s between tries to connect to a database that went away

T = TypeVar("T")


class _Conn(Protocol):
    async def run(self, op: Op[T]) -> T: ...
    def reusable(self) -> bool: ...
    def fresh(self) -> bool: ...
    def close(self) -> None: ...


class PostgresStore(SqlStore):
    """The hub's store in the PostgreSQL database ``url`` names (``postgresql://...``). Opened
    and migrated here, blocking (StoreError, one line, when it cannot be); with
    ``create=False`` a database without a hub store in it is refused rather than made one."""

    dialect = POSTGRES

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = POOL_SIZE,
        usage_retention: float = math.inf,
        batch_interval: float = BATCH_INTERVAL,
        batch_rows: int = BATCH_ROWS,
        create: bool = True,
        in_thread: bool = False,
    ) -> None:
        super().__init__(
            usage_retention=usage_retention, batch_interval=batch_interval, batch_rows=batch_rows
        )
        if pool_size < 1:
            raise ValueError(f"the store's pool needs at least 1 connection, not {pool_size}")
        self.where = dburl.redact(url)
        self._url = url
        try:
            self._params = conninfo(url)
        except ValueError as exc:
            raise StoreError(f"the hub store {self.where}: {exc}") from None
        self.pool_size = pool_size
        self._slots = trio.Semaphore(pool_size)  # connections lent at most
        self._idle: list[_Conn] = []
        # lent now; and those lent when a call's connection was lost: a call that succeeds on
        # one proves nothing (a server shutting down ends its connections one by one), so each
        # is closed when given back, and the next call connects anew (at once)
        self._lent: set[_Conn] = set()
        self._stale: set[_Conn] = set()
        self.connections = 0  # open now, lent or idle (never more than pool_size)
        self._connect: Any = ThreadConnection.connect if in_thread else TrioConnection.connect
        self._retry_at = -math.inf  # trio clock: while unavailable, no connect before this
        self._detail = ""  # why it is unavailable
        self.shareable = True  # several hubs may share it (their replicas' statements run here)
        self._open(create)

    # -- blocking: opening, the admin credential -------------------------------------------------

    def _blocking(self, op: Op[T]) -> T:
        """``op`` on a connection of its own, blocking (at open, before serving)."""
        try:
            conn = BlockingConnection.connect(self._params, self._url)
            try:
                return conn.run(op)
            finally:
                conn.close()
        except PgFailure as exc:
            kind = StoreUnavailable if exc.kind in (DOWN, RETRY) else StoreError
            raise kind(f"the hub store {self.where}: {exc.detail}") from None

    def _open(self, create: bool) -> None:
        def opening() -> Op[int]:
            if not create and not (yield from pg_ops.has_schema()):
                raise StoreMissing(f"no hub in {self.where} (no hub store in that database)")
            return (yield from pg_ops.migrate(self.where))

        try:
            self._blocking(opening())
        except SchemaTooNew as exc:
            raise StoreError(str(exc)) from None

    def admin_credential(self, data_dir: pathlib.Path | None) -> AdminCredential:
        """The admin credential every hub on this database shares: its hash is kept in the
        store. The first hub to start makes it (from ``data_dir/admin-token`` when that holds
        one, else a new token, then kept there) and shows it once; a later one reads the hash
        and knows the token only if its own ``admin-token`` file holds it."""
        known = read_admin_token(data_dir) if data_dir is not None else None
        token = known or new_token(ADMIN_TOKEN_PREFIX)
        stored, claimed = self._blocking(pg_ops.claim_admin(token_hash(token)))
        if stored != token_hash(token):
            return AdminCredential(None, stored)
        made = claimed and known is None
        if made and data_dir is not None:
            write_admin_token(data_dir, token)
        return AdminCredential(token, stored, made)

    # -- the pool ---------------------------------------------------------------------------------

    async def _run(self, op: Op[T]) -> T:
        """``op`` on a connection of the pool (waiting for one when all are lent)."""
        if self._closed:
            op.close()
            raise StoreUnavailable(f"the hub store {self.where} is closed")
        started = time.monotonic()
        async with self._slots:
            conn = await self._borrow(op)
            self._lent.add(conn)
            try:
                with trio.fail_after(CALL_TIMEOUT):
                    result = await conn.run(op)
            except trio.TooSlowError:
                self._drop(conn)
                raise self._gone(f"no answer within {CALL_TIMEOUT:g} s", retry_now=True) from None
            except PgFailure as exc:
                self._give_back(conn)
                if exc.kind == DOWN:  # the lent ones may be ending too: not trusted after
                    self._stale |= self._lent
                    raise self._gone(exc.detail, retry_now=True) from None
                if exc.kind == RETRY:
                    raise StoreUnavailable(f"the hub store {self.where}: {exc.detail}") from None
                raise StoreError(f"the hub store {self.where}: {exc.detail}") from None
            except BaseException:
                self._give_back(conn)
                raise
            proof = conn not in self._stale  # (a stale one's success proves nothing)
            self._give_back(conn)
        if not self.available and proof:
            self._available(started)
        return result

    async def _borrow(self, op: Op[Any]) -> _Conn:
        """An idle connection still open, else a new one (while the database is away: one try
        every ``RETRY_AFTER`` s, the other calls refused at once)."""
        while self._idle:
            idle = self._idle.pop()
            if idle.fresh():
                return idle
            self._drop(idle)
        now = trio.current_time()
        if not self.available and now < self._retry_at:
            op.close()
            await trio.lowlevel.checkpoint()
            raise StoreUnavailable(f"the hub store {self.where}: {self._detail}")
        self._retry_at = now + RETRY_AFTER
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                conn: _Conn = await self._connect(self._params, self._url)
        except trio.TooSlowError:
            op.close()
            raise self._gone(f"no connection within {CONNECT_TIMEOUT:g} s") from None
        except PgFailure as exc:
            op.close()
            raise self._gone(exc.detail) from None
        self.connections += 1
        return conn

    def _give_back(self, conn: _Conn) -> None:
        self._lent.discard(conn)
        if conn.reusable() and not self._closed and conn not in self._stale:
            self._idle.append(conn)
        else:
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        self._lent.discard(conn)
        self._stale.discard(conn)
        self.connections -= 1
        conn.close()

    def _gone(self, detail: str, *, retry_now: bool = False) -> StoreUnavailable:
        """The database (or a connection to it) is gone: the idle connections go too; the next
        try to connect is at once after a call's failure (it may have been that connection's
        alone), ``RETRY_AFTER`` s after a failed connect."""
        self._detail = detail
        if retry_now:
            self._retry_at = -math.inf
        while self._idle:
            self._drop(self._idle.pop())
        return self._unavailable(detail)

    async def _close(self) -> None:
        self._closed = True
        while self._idle:
            self._drop(self._idle.pop())

    async def _write_usage(self, rows: list[UsageRow], mark: tuple[str, int] | None) -> None:
        await self._run(postgres_usage.write_usage(rows, mark))

    async def people(self, op: Op[T]) -> T:
        await self.flush_usage()
        return await self._run(op)
