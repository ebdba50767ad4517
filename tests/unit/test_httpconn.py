"""The server core's HTTP/1.1 connection on its own (``gateway.wire.httpconn``), over a real socket
pair, the client's bytes the test's own: what a client may do that the hub's own tests do not
(``tests/hub/test_hostile_wire.py`` has the hostile ones): ``Expect: 100-continue``,
requests pipelined with bodies (chunked among them), HTTP/1.0, ``Connection: close``, the
``Host`` header, a chunked body over the limit, and a response header that would inject a line.
"""

from __future__ import annotations

import gc
import socket
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing
from rawclient import RawConn

from gateway.wire.errors import HTTPError
from gateway.wire.http import Request, header
from gateway.wire.httpconn import serve_connection
from gateway.wire.httpparse import RequestParser
from gateway.wire.server import Server
from gateway.wire.sweeper import GRAIN


class Echo:
    """Answers each request with its method, path and body (read unless ``X-Refuse`` is sent:
    then 401 at once, as the hub's routes refuse a request before its body)."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    async def http(self, req: Request) -> None:
        if header(req.scope, b"x-refuse") is not None:
            await req.resp.error(HTTPError(401, "no", "no"))
            return
        try:
            body = await req.body(100)
        except HTTPError as err:
            await req.resp.error(err)
            return
        self.seen.append(body)
        answer = b"%s %s %s" % (req.scope["method"].encode(), req.scope["path"].encode(), body)
        if header(req.scope, b"x-stream") is not None:  # no length: chunked, or to the close
            await req.resp.start(200, [(b"content-type", b"text/plain")])
            await req.resp.body(answer, more=False)
        else:
            await req.resp.whole(200, answer, [(b"content-type", b"text/plain")])


@asynccontextmanager
async def connected(
    handler: Any, fails: list[BaseException] | None = None
) -> AsyncIterator[RawConn]:
    """A connection served by the core with ``handler``, its client's end; what serving it
    raised goes to ``fails`` (the listener logs it and closes the connection)."""
    near, far = socket.socketpair()

    server = Server(handler)

    async def serve() -> None:
        try:
            await serve_connection(server, near, ("127.0.0.1", 1), None)
        except Exception as exc:
            if fails is None:
                raise
            fails.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.sweeper.run)  # the head deadlines (the listener runs it)
        nursery.start_soon(serve)
        conn = RawConn(trio.SocketStream(trio.socket.from_stdlib_socket(far)))
        try:
            yield conn
        finally:
            await conn.aclose()
            nursery.cancel_scope.cancel()


async def test_expect_100_continue_gets_its_100_once_the_body_is_asked_for() -> None:
    async with connected(Echo()) as conn:
        await conn.send(
            b"POST /up HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
        )
        interim = await conn.head()
        assert interim is not None and (interim.status, interim.reason) == (100, b"Continue")
        await conn.send(b"hello")
        resp = await conn.response()
        assert resp is not None and resp.status == 200 and resp.body == b"POST /up hello"
        # refused before its body: no 100, and the connection closes after the answer
        await conn.send(
            b"POST /up HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nX-Refuse: 1\r\n"
            b"Content-Length: 5\r\n\r\n"
        )
        refused = await conn.response()
        assert refused is not None and refused.status == 401
        assert refused.headers[b"connection"] == b"close"
        assert await conn.closed() == b""


async def test_requests_pipelined_with_bodies_are_answered_in_order() -> None:
    echo = Echo()
    async with connected(echo) as conn:
        await conn.send(
            b"POST /a HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\none"
            b"POST /b HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2\r\ntw\r\n1;ext=1\r\no\r\n0\r\n\r\n"
            b"HEAD /c HTTP/1.1\r\nHost: h\r\n\r\n"
            b"GET /d%20e HTTP/1.1\r\nHost: h\r\nX-Stream: 1\r\n\r\n"
        )
        a, b = await conn.response(), await conn.response()
        c = await conn.head()
        d = await conn.response()
    assert a is not None and b is not None and c is not None and d is not None
    assert (a.status, a.body) == (200, b"POST /a one")
    assert (b.status, b.body) == (200, b"POST /b two")
    assert c.status == 200 and c.headers[b"content-length"] == b"%d" % len(b"GET /c ")
    assert d.status == 200 and d.headers[b"transfer-encoding"] == b"chunked"
    assert d.body == b"GET /d e "  # the path percent-decoded
    assert echo.seen == [b"one", b"two", b"", b""]


async def test_http10_is_answered_without_chunks_and_closed() -> None:
    async with connected(Echo()) as conn:
        await conn.send(b"GET /old HTTP/1.0\r\nX-Stream: 1\r\n\r\nGET /never HTTP/1.0\r\n\r\n")
        resp = await conn.response()  # no length: read to the close
    assert resp is not None and resp.status == 200
    assert b"transfer-encoding" not in resp.headers
    assert resp.headers[b"connection"] == b"close"
    assert resp.body == b"GET /old "


async def test_connection_close_is_the_last_request_answered() -> None:
    echo = Echo()
    async with connected(echo) as conn:
        await conn.send(
            b"GET /last HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
            b"GET /never HTTP/1.1\r\nHost: h\r\n\r\n"
        )
        resp = await conn.response()
        rest = await conn.closed()
    assert resp is not None and resp.status == 200 and resp.headers[b"connection"] == b"close"
    assert rest == b"" and len(echo.seen) == 1


async def test_http11_needs_exactly_one_host() -> None:
    for head in (
        b"GET / HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    ):
        echo = Echo()
        async with connected(echo) as conn:
            await conn.send(head)
            resp = await conn.response()
            rest = await conn.closed()
        assert resp is not None and resp.status == 400 and b"Host" in resp.body, head
        assert rest == b"" and echo.seen == []


async def test_a_chunked_body_over_the_limit_is_413() -> None:
    async with connected(Echo()) as conn:
        await conn.send(b"POST /big HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n")
        await conn.send(b"40\r\n" + b"x" * 64 + b"\r\n" + b"40\r\n" + b"y" * 64 + b"\r\n")
        resp = await conn.response()
        assert resp is not None and resp.status == 413
        assert resp.headers[b"connection"] == b"close"


class Injecting:
    """A handler that puts a client's text into a header, CR LF and all."""

    async def http(self, req: Request) -> None:
        await req.resp.whole(200, b"{}", [(b"x-echo", b"a\r\nset-cookie: evil=1")])


async def test_a_header_value_with_a_line_break_is_never_written() -> None:
    fails: list[BaseException] = []
    async with connected(Injecting(), fails) as conn:
        await conn.send(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        rest = await conn.closed()
    assert rest == b""  # nothing written: the connection closed
    assert len(fails) == 1 and isinstance(fails[0], ValueError)


async def test_an_upgrade_not_taken_is_answered_and_the_connection_closed() -> None:
    """llhttp stops at an upgrade (here to h2c, which is not served): the request is answered
    as it is, with ``connection: close``, and what follows it is never read as HTTP."""
    echo = Echo()
    async with connected(echo) as conn:
        await conn.send(
            b"GET /up HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        )
        resp = await conn.response()
        rest = await conn.closed()
    assert resp is not None and resp.status == 200 and resp.body == b"GET /up "
    assert resp.headers[b"connection"] == b"close"
    assert rest == b"" and echo.seen == [b""]


async def test_a_head_that_comes_as_its_deadline_passes_is_served(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The connection's requests share one cancel scope whose deadline is set while a head is
    awaited: a head read in the same turn of the run loop as that deadline passes is served
    whole (as a head a moment earlier is), not cancelled under its handler."""
    near, far = socket.socketpair()
    echo = Echo()
    server = Server(echo)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.sweeper.run)
        nursery.start_soon(serve_connection, server, near, ("127.0.0.1", 1), None)
        await trio.testing.wait_all_tasks_blocked()  # it waits for the first head
        far.sendall(b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\nhi")
        mock_clock.jump(10.0 + GRAIN)  # head_timeout (10 s) passes as the head is there
        conn = RawConn(trio.SocketStream(trio.socket.from_stdlib_socket(far)))
        resp = await conn.response()
        assert resp is not None and resp.status == 200, resp
        assert resp.body == b"POST /x hi"
        assert echo.seen == [b"hi"]
        await conn.send(b"GET /y HTTP/1.1\r\nHost: h\r\n\r\n")  # kept alive, still served
        resp = await conn.response()
        assert resp is not None and resp.status == 200 and resp.body == b"GET /y ", resp
        await conn.aclose()
        nursery.cancel_scope.cancel()


def test_a_closed_request_parser_is_freed_at_once_not_by_the_cyclic_collector() -> None:
    """llhttp's parser and ours hold each other; ``close`` (a connection's end) breaks the pair,
    so a refused body's first piece goes with the connection, not at the next full collection."""
    parser = RequestParser()
    parser.feed(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n" + b"x" * 60_000)
    assert len(parser.heads) == 1 and sum(map(len, parser.body)) == 60_000
    gone = weakref.ref(parser)
    enabled = gc.isenabled()
    gc.disable()
    try:
        parser.close()
        del parser
        assert gone() is None
    finally:
        if enabled:
            gc.enable()
