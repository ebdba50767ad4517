"""PostgreSQL connections of the hub's store on libpq (psycopg's ``pq`` layer): an operation of
``postgres_ops`` run non-blocking from trio (``TrioConnection``, the hub's way), or blocking
(``BlockingConnection``: at open; in a worker thread, ``ThreadConnection``, measured against it).

From trio: libpq's asynchronous calls (``send_query_params``, ``flush``, ``consume_input``,
``is_busy``, ``get_result``) with ``trio.lowlevel.wait_readable``/``wait_writable`` on the
connection's socket, so a statement's round trip costs the trio thread no thread hop and other
tasks run while the server works. Parameters go as text (types left to the server, or cast in
the statement); results come as text and are read by column type (``LOADERS``). A failure is a
``PgFailure`` whose ``kind`` says what the store does with it: ``down`` (the connection or the
server is gone), ``retry`` (this statement lost a race or was cancelled: try later) or
``error``. Every message is one line with the URL's password scrubbed (``dburl.scrub``)."""

from __future__ import annotations

import contextlib
import ipaddress
import select
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
import trio
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from gateway.hub.store import dburl
from gateway.hub.store.sql import Op, Query, Row

T = TypeVar("T")

DOWN, RETRY, ERROR = "down", "retry", "error"
APPLICATION = "alp-gateway hub"  # application_name, unless the URL names one
CONNECT_TIMEOUT = 5  # s, libpq's connect_timeout for blocking connects (unless the URL says)

# SQLSTATE classes and codes that mean the server or the connection is gone, or this
# statement may work if tried again later
_DOWN_CLASSES = ("08", "53", "57P")  # connection exception, insufficient resources, shutdown
_RETRY_CODES = ("40001", "40P01", "55P03", "57014")  # serialization, deadlock, lock, cancelled

FRESH_READS = 8  # reads of what the server sent an idle connection, at most, before it is lent
PREPARED_MAX = 128  # statements kept prepared per connection
_PREPARED = ("SELECT", "INSERT", "UPDATE", "DELETE", "WITH")  # what may be prepared

LOADERS: dict[int, Callable[[bytes], Any]] = {
    16: lambda v: v == b"t",  # bool
    20: int,  # int8
    21: int,  # int2
    23: int,  # int4
    700: float,  # float4
    701: float,  # float8
    25: bytes.decode,  # text (client_encoding is UTF8)
    1043: bytes.decode,  # varchar
    19: bytes.decode,  # name
}


class PgFailure(Exception):
    """A statement or a connection failed; ``detail`` is one line (no password)."""

    def __init__(self, detail: str, kind: str) -> None:
        super().__init__(detail)
        self.detail = detail
        self.kind = kind


def conninfo(url: str) -> dict[str, str]:
    """libpq's parameters of ``url``, with ours where it does not say (an application name,
    UTF-8); ValueError (one line, no password) when libpq cannot read it."""
    try:
        params = {k: str(v) for k, v in conninfo_to_dict(url).items()}
    except psycopg.Error as exc:
        raise ValueError(f"not a PostgreSQL URL libpq reads: {_line(str(exc), url)}") from None
    params.setdefault("application_name", APPLICATION)
    params["client_encoding"] = "UTF8"
    return params


def _line(message: str, url: str) -> str:
    """libpq's message as one line, the URL's password scrubbed."""
    text = "; ".join(part.strip() for part in message.strip().splitlines() if part.strip())
    return dburl.scrub(text or "no message", url)


def _sqlstate_kind(code: str) -> str:
    if code in _RETRY_CODES:
        return RETRY
    if code.startswith(_DOWN_CLASSES):
        return DOWN
    return ERROR


def _param(value: Any) -> bytes | None:
    """A parameter in PostgreSQL's text format (a list as an array literal)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list):
        return ("{" + ",".join(_element(v) for v in value) + "}").encode()
    return _scalar(value).encode()


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "NaN"
        if value in (float("inf"), float("-inf")):
            return "Infinity" if value > 0 else "-Infinity"
        return repr(value)
    raise TypeError(f"no PostgreSQL text for a {type(value).__name__}")


def _element(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return _scalar(value)


def _rows(res: pq.abc.PGresult) -> list[Row]:
    width = res.nfields
    if not width:
        return []
    loaders = []
    for column in range(width):
        oid = res.ftype(column)
        if oid not in LOADERS:
            raise PgFailure(f"a column of type oid {oid}, which the store does not read", ERROR)
        loaders.append(LOADERS[oid])
    get = res.get_value
    return [
        tuple(
            None if (value := get(row, column)) is None else loaders[column](value)
            for column in range(width)
        )
        for row in range(res.ntuples)
    ]


class _Connection:
    """What both ways share: the libpq connection, its answers read, its end."""

    def __init__(self, pgconn: pq.abc.PGconn, url: str) -> None:
        self.pgconn = pgconn
        self.url = url
        self.prepared: dict[str, bytes] = {}  # statement -> its name on this connection

    def _statement(self, sql: str) -> tuple[bytes | None, bytes]:
        """The name of ``sql`` prepared on this connection, or None when it is still to be
        (then the name it is to get); None, b"" for a statement never prepared."""
        name = self.prepared.get(sql)
        if name is not None:
            return None, name
        if not sql.startswith(_PREPARED) or len(self.prepared) >= PREPARED_MAX:
            return None, b""
        return f"s{len(self.prepared)}".encode(), b""

    def _answer(self, res: pq.abc.PGresult) -> list[Row]:
        status = res.status
        if status == pq.ExecStatus.TUPLES_OK:
            return _rows(res)
        if status == pq.ExecStatus.COMMAND_OK:
            return []
        code = (res.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode()
        message = res.get_error_message() or f"the statement ended with status {status}"
        kind = _sqlstate_kind(code) if code else DOWN if self.broken else ERROR
        return self._fail(message, kind)

    def _fail(self, message: str, kind: str) -> Any:
        if self.broken:
            kind = DOWN
        raise PgFailure(_line(message, self.url), kind)

    @property
    def broken(self) -> bool:
        return self.pgconn.status != pq.ConnStatus.OK

    def reusable(self) -> bool:
        """Whether it can serve another operation: open, no transaction or statement left."""
        pgconn = self.pgconn
        return (
            pgconn.status == pq.ConnStatus.OK
            and pgconn.transaction_status == pq.TransactionStatus.IDLE
        )

    def fresh(self) -> bool:
        """Whether an idle connection is still open: what the server sent meanwhile read without
        waiting, for as long as there is some (a stopped server's last words, then its end)."""
        pgconn = self.pgconn
        try:
            readable = select.poll()
            readable.register(pgconn.socket, select.POLLIN)
            for _ in range(FRESH_READS):
                if not readable.poll(0):
                    break
                pgconn.consume_input()
            else:
                return False  # the server keeps talking to an idle connection: not ours to trust
        except psycopg.OperationalError:
            return False
        return self.reusable() and not pgconn.is_busy()

    def close(self) -> None:
        self.pgconn.finish()


class BlockingConnection(_Connection):
    """A connection whose statements block the calling thread (libpq's ``PQexecParams``)."""

    @classmethod
    def connect(cls, params: dict[str, str], url: str) -> BlockingConnection:
        params = {"connect_timeout": str(CONNECT_TIMEOUT), **params}
        pgconn = pq.PGconn.connect(make_conninfo("", **params).encode())
        if pgconn.status != pq.ConnStatus.OK:
            message = pgconn.get_error_message()
            pgconn.finish()
            raise PgFailure(_line(message, url), DOWN)
        return cls(pgconn, url)

    def run(self, op: Op[T]) -> T:
        """The operation, to its end (a transaction left open by a failure is rolled back)."""
        try:
            query = next(op)
            while True:
                query = op.send(self._execute(query))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        finally:
            op.close()
            if self.pgconn.status == pq.ConnStatus.OK and (
                self.pgconn.transaction_status != pq.TransactionStatus.IDLE
            ):
                with contextlib.suppress(psycopg.OperationalError):  # then the connection ends it
                    self.pgconn.exec_(b"ROLLBACK")

    def _execute(self, query: Query) -> list[Row]:
        pgconn = self.pgconn
        params = [_param(p) for p in query.params]
        try:
            new, name = self._statement(query.sql)
            if new is not None:
                self._answer(pgconn.prepare(new, query.sql.encode()))
                self.prepared[query.sql] = name = new
            if name:
                res = pgconn.exec_prepared(name, params)  # type: ignore[arg-type]  # None: NULL
            else:
                res = pgconn.exec_params(query.sql.encode(), params)
        except psycopg.OperationalError as exc:
            return self._fail(str(exc), DOWN)  # type: ignore[no-any-return]
        return self._answer(res)


class TrioConnection(_Connection):
    """A non-blocking connection driven from trio: the hub's way."""

    @classmethod
    async def connect(cls, params: dict[str, str], url: str) -> TrioConnection:
        params = await _resolved(params)
        pgconn = pq.PGconn.connect_start(make_conninfo("", **params).encode())
        try:
            while True:
                if pgconn.status == pq.ConnStatus.BAD:
                    raise PgFailure(_line(pgconn.get_error_message(), url), DOWN)
                state = pgconn.connect_poll()
                if state == pq.PollingStatus.OK:
                    break
                if state == pq.PollingStatus.READING:
                    await trio.lowlevel.wait_readable(pgconn.socket)
                elif state == pq.PollingStatus.WRITING:
                    await trio.lowlevel.wait_writable(pgconn.socket)
                else:
                    raise PgFailure(_line(pgconn.get_error_message(), url), DOWN)
            pgconn.nonblocking = 1
        except BaseException:
            _finish(pgconn)
            raise
        return cls(pgconn, url)

    async def run(self, op: Op[T]) -> T:
        """The operation, to its end. Cancelled or failed mid-way, the connection is left as
        it is: not ``reusable`` (the store closes it, which ends what it had begun)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            query = next(op)
            while True:
                query = op.send(await self._execute(query))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        finally:
            op.close()

    async def _execute(self, query: Query) -> list[Row]:
        pgconn = self.pgconn
        params = [_param(p) for p in query.params]
        try:
            new, name = self._statement(query.sql)
            if new is not None:  # prepared first, in a round trip of its own (once)
                pgconn.send_prepare(new, query.sql.encode())
                await self._answers()
                self.prepared[query.sql] = name = new
            if name:
                pgconn.send_query_prepared(name, params)
            else:
                pgconn.send_query_params(query.sql.encode(), params)
            return await self._answers()
        except psycopg.OperationalError as exc:
            return self._fail(str(exc), DOWN)  # type: ignore[no-any-return]

    async def _answers(self) -> list[Row]:
        """What was sent flushed, then its results read (the first one's rows or failure)."""
        pgconn = self.pgconn
        fd = pgconn.socket
        answer: list[Row] | None = None
        failure: PgFailure | None = None
        while pgconn.flush():
            await trio.lowlevel.wait_writable(fd)
        while True:
            while pgconn.is_busy():
                await trio.lowlevel.wait_readable(fd)
                pgconn.consume_input()
            res = pgconn.get_result()
            if res is None:
                break
            if answer is None and failure is None:
                try:
                    answer = self._answer(res)
                except PgFailure as exc:
                    failure = exc
        if failure is not None:
            raise failure
        return answer or []

    def close(self) -> None:
        _finish(self.pgconn)


class ThreadConnection:
    """A ``BlockingConnection`` whose operations run in a worker thread (one hop each):
    measured against ``TrioConnection`` (``bench/store_calls.py``), not the hub's way."""

    def __init__(self, conn: BlockingConnection) -> None:
        self.conn = conn

    @classmethod
    async def connect(cls, params: dict[str, str], url: str) -> ThreadConnection:
        conn = await trio.to_thread.run_sync(BlockingConnection.connect, params, url)
        return cls(conn)

    async def run(self, op: Op[T]) -> T:
        return await trio.to_thread.run_sync(self.conn.run, op)

    def reusable(self) -> bool:
        return self.conn.reusable()

    def fresh(self) -> bool:
        return self.conn.fresh()

    def close(self) -> None:
        self.conn.close()


def _finish(pgconn: pq.abc.PGconn) -> None:
    """Close a connection trio may have waited on (trio told first, as it asks)."""
    try:
        fd = pgconn.socket
    except psycopg.OperationalError:  # no socket left
        fd = -1
    if fd >= 0:
        try:
            trio.lowlevel.notify_closing(fd)
        except RuntimeError:  # outside trio: nothing waits on it
            pass
    pgconn.finish()


async def _resolved(params: dict[str, str]) -> dict[str, str]:
    """``params`` with the address of a single host name looked up by trio (libpq would block
    the thread on it); several hosts, a socket directory or an address are left to libpq."""
    host = params.get("host", "")
    if not host or "hostaddr" in params or "," in host or host.startswith("/"):
        return params
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return params
    port = int(params.get("port") or 5432)
    try:
        found = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return params  # libpq says why in its own words
    return {**params, "hostaddr": str(found[0][4][0])}
