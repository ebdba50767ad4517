"""A hub that holds under abuse (issue 18, point 5): every probe is a test over a raw loopback
socket to an in-process hub, on trio's autojump clock (deadlines of seconds pass at once).

No credential pins memory or a descriptor: credentials before any body, a head and a body each
have a deadline, connections are capped. One protocol violation on a Chat Channel fails that
connection (RFC 6455 §7.1.7) instead of hanging it. Smuggling-shaped or malformed framing
closes the connection (RFC 9112 §6.1). A client's bad input or early exit is not an ERROR, and
what a client sends is escaped and capped in log lines.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import trio
import trio.testing
from helpers import ADMIN, CHAT_DEFINITION, OWNER, PROJECT, register_runner
from rawclient import (
    BINARY,
    CLOSE,
    CONT,
    PING,
    TEXT,
    RawConn,
    bearer,
    close_payload,
    head,
    request,
    upgrade_head,
    ws_frame,
)

from gateway.hub import Hub, open_hub
from gateway.hub.runnerapi import ENROLL_NEEDED

BASE = f"/api/owners/{OWNER}/projects/{PROJECT}"
CHANNEL = "/api/lives/chat/channel/ws"
CHAT = "/v1/chat/completions"
COUNTERS = "/api/hub/counters"
SOON = 1.0  # s (virtual): "at once" — well inside every timeout a hub waits on


class Records(logging.Handler):
    """Every log record, as it was emitted."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def bad(self, since: int = 0) -> list[str]:
        """Records at ERROR or above, or with a traceback, from ``since`` on."""
        return [
            f"{r.levelname} {r.name}: {r.getMessage()}"
            for r in self.records[since:]
            if r.levelno >= logging.ERROR or r.exc_info is not None
        ]

    def warnings(self, since: int = 0) -> list[logging.LogRecord]:
        """WARNING records of the hub's loggers (and its server core's) from ``since`` on."""
        return [
            r
            for r in self.records[since:]
            if r.levelno == logging.WARNING and r.name.startswith(("gateway.hub", "gateway.wire"))
        ]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    root = logging.getLogger()
    saved = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(saved)


def _hub(**settings: Any) -> Hub:
    # keepalive pings off: the clock jumps, and no ping's answer is judged against it
    settings.setdefault("ping_interval", 0.0)
    return Hub(admin_token=ADMIN, **settings)


async def exchange(url: str, data: bytes) -> Any:
    """One request on a new connection: the response (asserted present)."""
    conn = await RawConn.open(url)
    try:
        await conn.send(data)
        resp = await conn.response()
    finally:
        await conn.aclose()
    assert resp is not None, "no answer"
    return resp


async def claimed(hub: Hub, url: str) -> tuple[str, str]:
    """(job id, runner token): a Kind B job claimed through the runner API by a runner
    registered for it."""
    runner = await register_runner(hub, OWNER, PROJECT, "box", ["chat-llm:v1"])
    job = await hub.board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], dict(CHAT_DEFINITION))
    body = {"jobId": job.id, "name": "box"}
    resp = await exchange(
        url, request("POST", f"{BASE}/runners/generate-jitconfig", [bearer(runner["token"])], body)
    )
    assert resp.status == 200, resp.body
    return job.id, runner["token"]


def _channel_target(job_id: str, token: str) -> str:
    return f"{CHANNEL}?jobId={job_id}&token={token}"


async def _credential(hub: Hub, route: str) -> str:
    """A valid credential for ``route``: a runner token, or an API key for the chat route."""
    if route == "chat":
        return await hub.keys.create("k")
    return (await register_runner(hub, OWNER, PROJECT, "box", ["chat-llm:v1"]))["token"]


def _target(route: str) -> tuple[str, str]:
    return {"poll": ("POST", f"{BASE}/runners/jobs"), "chat": ("POST", CHAT)}[route]


# -- 1. credentials before any body --------------------------------------------------------------

UNAUTHENTICATED = {
    # route: (method, path, message without a credential, message with a wrong one)
    "register": (
        "POST",
        f"{BASE}/runners",
        ENROLL_NEEDED,
        "unknown credential",
    ),
    "poll": ("POST", f"{BASE}/runners/jobs", "a runner token is required", "unknown runner token"),
    "claim": (
        "POST",
        f"{BASE}/runners/generate-jitconfig",
        "a runner token is required",
        "unknown runner token",
    ),
    "status": (
        "PATCH",
        f"{BASE}/runs/r1/jobs/j1",
        "a runner token is required",
        "unknown runner token",
    ),
    "progress": (
        "POST",
        f"{BASE}/runs/r1/jobs/j1/progress",
        "a runner token is required",
        "unknown runner token",
    ),
    "chat": ("POST", CHAT, "You didn't provide an API key.", "Incorrect API key provided."),
}


@pytest.mark.parametrize("credential", ["missing", "wrong"])
@pytest.mark.parametrize("route", list(UNAUTHENTICATED))
async def test_no_credential_is_refused_before_the_body_is_read(
    autojump_clock: trio.testing.MockClock, route: str, credential: str
) -> None:
    """Only the head is sent, declaring 16 MB: the 401 comes at once (the hub waits for no
    body), and the hub closes the connection (the body was never consumed)."""
    method, path, missing, wrong = UNAUTHENTICATED[route]
    headers = [("Content-Type", "application/json"), ("Content-Length", "16000000")]
    if credential == "wrong":
        headers.append(bearer("alpr_not_a_token_of_this_hub"))
    async with open_hub(_hub()) as (_hub_, url):
        with trio.fail_after(120):
            conn = await RawConn.open(url)
            start = trio.current_time()
            await conn.send(head(method, path, headers))
            resp = await conn.response()
            answered = trio.current_time() - start
            assert resp is not None and resp.status == 401, resp
            rest = await conn.closed()
    assert answered < SOON
    assert resp.headers.get(b"www-authenticate") == b"Bearer"
    message = resp.json()["error"]["message"]
    assert message.startswith(missing if credential == "missing" else wrong)
    assert rest == b""  # closed, nothing more


# -- 2. the head's deadline and size -------------------------------------------------------------


@pytest.mark.parametrize("how", ["trickled", "partial"])
@pytest.mark.parametrize("head_timeout", [None, 3.0])
async def test_a_head_not_complete_within_head_timeout_is_closed(
    autojump_clock: trio.testing.MockClock, head_timeout: float | None, how: str
) -> None:
    """A head trickled a byte a second, or half a head and silence: closed at head_timeout
    (default 10 s) after the connection opened, not long before, not long after (a 408 first,
    or nothing)."""
    deadline = 10.0 if head_timeout is None else head_timeout
    settings = {} if head_timeout is None else {"head_timeout": head_timeout}
    partial = b"GET /v1/models HTTP/1.1\r\nHost: hub\r\nX-Slow: "
    async with open_hub(_hub(**settings)) as (_hub_, url):
        with trio.fail_after(deadline + 60):
            conn = await RawConn.open(url)
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                if how == "trickled":
                    nursery.start_soon(conn.trickle, partial + b"a" * 1000, 1.0)
                else:
                    assert await conn.send(partial)
                rest = await conn.closed()
                closed_after = trio.current_time() - start
                nursery.cancel_scope.cancel()
    assert deadline - 0.01 <= closed_after <= deadline + 1.5, closed_after
    assert rest == b"" or rest.startswith(b"HTTP/1.1 408 "), rest[:100]


@pytest.mark.parametrize("ended", [True, False])
async def test_a_head_over_64_kib_is_refused_431_and_closed(
    autojump_clock: trio.testing.MockClock, ended: bool
) -> None:
    """Over the bound, whether the head ends just past it or never ends: 431, then closed
    (before anything else about the request is looked at: no 401 for the missing key)."""
    big = b"GET /v1/models HTTP/1.1\r\nHost: hub\r\nX-Big: " + b"a" * (65 * 1024)
    if ended:
        big += b"\r\n\r\n"
    async with open_hub(_hub()) as (_hub_, url):
        with trio.fail_after(30):
            conn = await RawConn.open(url)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(conn.send, big)  # the hub may stop reading part-way
                resp = await conn.response()
                assert resp is not None and resp.status == 431, resp
                rest = await conn.closed()
    assert rest == b""


# -- 3. the body's deadline and size -------------------------------------------------------------


@pytest.mark.parametrize("route", ["poll", "chat"])
@pytest.mark.parametrize("body_timeout", [None, 5.0])
async def test_a_body_not_complete_within_body_timeout_gets_408_and_is_closed(
    autojump_clock: trio.testing.MockClock, body_timeout: float | None, route: str
) -> None:
    """Valid credentials, a 100-byte body trickled a byte a second: 408 at body_timeout
    (default 60 s) from the end of the head, then the connection is closed."""
    deadline = 60.0 if body_timeout is None else body_timeout
    settings = {} if body_timeout is None else {"body_timeout": body_timeout}
    method, path = _target(route)
    async with open_hub(_hub(**settings)) as (hub, url):
        token = await _credential(hub, route)
        body = b'{"capabilities": ["chat-llm:v1"], "model": "m", "messages": []}'.ljust(100)
        headers = [bearer(token), ("Content-Type", "application/json"), ("Content-Length", "100")]
        with trio.fail_after(200):
            conn = await RawConn.open(url)
            async with trio.open_nursery() as nursery:
                assert await conn.send(head(method, path, headers))
                start = trio.current_time()
                nursery.start_soon(conn.trickle, body, 1.0)
                resp = await conn.response()
                answered = trio.current_time() - start
                assert resp is not None and resp.status == 408, resp
                rest = await conn.closed()
                nursery.cancel_scope.cancel()
    assert deadline - 0.01 <= answered <= deadline + 1.5, answered
    assert rest == b""


@pytest.mark.parametrize("route", ["poll", "chat"])
async def test_a_declared_body_over_max_body_gets_413_at_once_and_is_closed(
    autojump_clock: trio.testing.MockClock, route: str
) -> None:
    method, path = _target(route)
    async with open_hub(_hub(max_body=1000)) as (hub, url):
        headers = [bearer(await _credential(hub, route)), ("Content-Length", "2000")]
        with trio.fail_after(120):
            conn = await RawConn.open(url)
            start = trio.current_time()
            await conn.send(head(method, path, headers))  # the head only
            resp = await conn.response()
            answered = trio.current_time() - start
            assert resp is not None and resp.status == 413, resp
            rest = await conn.closed()
    assert answered < SOON
    assert rest == b""


# -- 4. the WebSocket handshake ------------------------------------------------------------------


@pytest.mark.parametrize("valid", [False, True])
async def test_an_upgrade_with_a_body_is_refused_400_at_once_and_closed(
    autojump_clock: trio.testing.MockClock, valid: bool
) -> None:
    async with open_hub(_hub()) as (hub, url):
        with trio.fail_after(120):
            job_id, token = await claimed(hub, url) if valid else ("nojob", "alpr_wrong")
            conn = await RawConn.open(url)
            start = trio.current_time()
            target = _channel_target(job_id, token)
            await conn.send(upgrade_head(target, [("Content-Length", "1000")]))  # and no body
            resp = await conn.response()
            answered = trio.current_time() - start
            assert resp is not None and resp.status == 400, resp
            rest = await conn.closed()
    assert answered < SOON
    assert rest == b""
    assert hub.channels.get(job_id) is None


@pytest.mark.parametrize("head_timeout", [None, 2.0])
async def test_an_upgrade_head_that_never_completes_is_closed_at_head_timeout(
    autojump_clock: trio.testing.MockClock, head_timeout: float | None
) -> None:
    deadline = 10.0 if head_timeout is None else head_timeout
    settings = {} if head_timeout is None else {"head_timeout": head_timeout}
    async with open_hub(_hub(**settings)) as (hub, url):
        with trio.fail_after(deadline + 60):
            job_id, token = await claimed(hub, url)
            conn = await RawConn.open(url)
            start = trio.current_time()
            whole = upgrade_head(_channel_target(job_id, token))
            assert await conn.send(whole[: whole.index(b"Sec-WebSocket-Key")])
            rest = await conn.closed()
            closed_after = trio.current_time() - start
    assert deadline - 0.01 <= closed_after <= deadline + 1.5, closed_after
    assert rest == b"" or rest.startswith(b"HTTP/1.1 408 "), rest[:100]
    assert hub.channels.get(job_id) is None


# -- 5. a cap on connections ---------------------------------------------------------------------


def _admin_get() -> bytes:
    """A request any hub serves with a 200 (the counters, with the admin credential)."""
    return head("GET", COUNTERS, [bearer(ADMIN)])


async def _refused(url: str) -> None:
    """A connection over the cap: 503 with a short body and Connection: close, then closed."""
    conn = await RawConn.open(url)
    await conn.send(_admin_get())
    resp = await conn.response()
    assert resp is not None and resp.status == 503, resp
    assert resp.headers.get(b"connection", b"").lower() == b"close"
    assert len(resp.body) < 200
    assert await conn.closed() == b""
    await conn.aclose()


async def test_max_connections_refuses_one_more_with_503_and_serves_after_one_closes(
    autojump_clock: trio.testing.MockClock, records: Records
) -> None:
    async with open_hub(_hub(max_connections=4, head_timeout=1000.0)) as (_hub_, url):
        with trio.fail_after(120):
            held = []
            for _ in range(4):  # four open idle connections (each served once: surely counted)
                conn = await RawConn.open(url)
                await conn.send(_admin_get())
                resp = await conn.response()
                assert resp is not None and resp.status == 200, resp
                held.append(conn)
            await _refused(url)
            await held.pop().aclose()
            await trio.testing.wait_all_tasks_blocked()  # the hub has seen it go
            resp = await exchange(url, _admin_get())
            assert resp.status == 200, resp
            for conn in held:  # the others are still open, and served
                await conn.send(_admin_get())
                again = await conn.response()
                assert again is not None and again.status == 200, again
    assert len(records.warnings()) == 1


async def test_refusals_warn_at_most_once_a_minute(
    autojump_clock: trio.testing.MockClock, records: Records
) -> None:
    """Twenty connections refused at once: one WARNING; a minute later, twenty more: one more.
    (The four held connections are event streams: busy, never idle-closed.)"""
    hub = _hub(max_connections=4, offline_after=1e6, keepalive_interval=1e6)
    async with open_hub(hub) as (hub, url):
        token = (await register_runner(hub, OWNER, PROJECT, "box", ["chat-llm:v1"]))["token"]
        with trio.fail_after(300):
            held = []
            for _ in range(4):
                conn = await RawConn.open(url)
                await conn.send(head("GET", f"{BASE}/runners/events", [bearer(token)]))
                resp = await conn.head()
                assert resp is not None and resp.status == 200, resp
                held.append(conn)
            for _ in range(20):
                await _refused(url)
            first = len(records.warnings())
            autojump_clock.jump(61)
            for _ in range(20):
                await _refused(url)
            second = len(records.warnings())
            for conn in held:
                await conn.aclose()
    assert first == 1
    assert second == 2


# -- 6. framing: smuggling shapes, malformed chunks, deep JSON --------------------------------------


async def test_content_length_with_chunked_is_400_and_the_connection_closed(
    autojump_clock: trio.testing.MockClock, records: Records
) -> None:
    """RFC 9112 §6.1: the framing is ambiguous, so the connection closes after the 400; the
    request pipelined behind it is never answered."""
    async with open_hub(_hub()) as (hub, url):
        key = await hub.keys.create("k")
        smuggled = head(
            "POST",
            CHAT,
            [bearer(key), ("Content-Length", "5"), ("Transfer-Encoding", "chunked")],
        )
        with trio.fail_after(120):
            conn = await RawConn.open(url)
            await conn.send(smuggled + b"0\r\n\r\n" + _admin_get())
            resp = await conn.response()
            assert resp is not None and resp.status == 400, resp
            rest = await conn.closed()
    assert rest == b""
    assert records.bad() == []


@pytest.mark.parametrize(
    "codings",
    [
        [("Transfer-Encoding", "identity"), ("Transfer-Encoding", "chunked")],
        [("Transfer-Encoding", "chunked"), ("Transfer-Encoding", "chunked")],
        [("Transfer-Encoding", "identity, chunked")],
        [("Transfer-Encoding", "gzip, chunked")],
    ],
)
async def test_a_transfer_coding_repeated_or_unknown_is_refused_and_the_connection_closed(
    autojump_clock: trio.testing.MockClock, records: Records, codings: list[tuple[str, str]]
) -> None:
    """Issue 36 point 7: llhttp reads only the last coding, so ``identity`` then ``chunked``
    would be read as chunked where another server reads it otherwise; refused (501, as h11
    did) and the connection closed: the request pipelined behind it is never answered."""
    async with open_hub(_hub()) as (hub, url):
        key = await hub.keys.create("k")
        framed = head("POST", CHAT, [bearer(key), *codings])
        with trio.fail_after(120):
            conn = await RawConn.open(url)
            await conn.send(framed + b"2\r\n{}\r\n0\r\n\r\n" + _admin_get())
            resp = await conn.response()
            assert resp is not None and resp.status in (400, 501), resp  # llhttp's 400, or ours
            assert resp.json()["error"]["code"] == "invalid_request"
            rest = await conn.closed()
    assert rest == b""
    assert records.bad() == []


async def test_a_chunk_extension_of_16_mib_is_refused_400_long_before_its_end(
    autojump_clock: trio.testing.MockClock, records: Records
) -> None:
    """Issue 36 point 7: llhttp skips a chunk extension however long it is; the hub stops
    reading a chunk's size line past 16 KiB and answers 400 while the client is still sending."""
    total = 16 << 20
    sent = 0
    async with open_hub(_hub()) as (hub, url):
        key = await hub.keys.create("k")
        chunked = head("POST", CHAT, [bearer(key), ("Transfer-Encoding", "chunked")])
        with trio.fail_after(120):
            conn = await RawConn.open(url)
            assert await conn.send(chunked + b"2;ext=")

            async def extension() -> None:
                nonlocal sent
                piece = b"a" * 65536
                while sent < total and await conn.send(piece):
                    sent += len(piece)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(extension)
                resp = await conn.response()
                nursery.cancel_scope.cancel()
            assert resp is not None and resp.status == 400, resp
            assert "chunk" in resp.json()["error"]["message"]
            await conn.aclose()
    assert sent < total, sent
    assert records.bad() == []


# int(x, 16) takes the last three
@pytest.mark.parametrize("size_line", [b"zz", b"-1", b"1 1", b"0x5", b"1_0", b" 5"])
async def test_a_malformed_chunk_size_is_400_and_closed_without_an_error_log(
    autojump_clock: trio.testing.MockClock, records: Records, size_line: bytes
) -> None:
    async with open_hub(_hub()) as (hub, url):
        key = await hub.keys.create("k")
        chunked = head("POST", CHAT, [bearer(key), ("Transfer-Encoding", "chunked")])
        with trio.fail_after(120):
            conn = await RawConn.open(url)
            await conn.send(chunked + size_line + b"\r\n{}\r\n0\r\n\r\n")
            resp = await conn.response()
            assert resp is not None and resp.status == 400, resp
            rest = await conn.closed()
    assert rest == b""
    assert records.bad() == []


@pytest.mark.parametrize("route", ["chat", "poll"])
async def test_json_nested_100000_deep_is_invalid_json_not_a_500(
    autojump_clock: trio.testing.MockClock, records: Records, route: str
) -> None:
    depth = 100_000
    body = b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    method, path = _target(route)
    async with open_hub(_hub()) as (hub, url):
        credential = await _credential(hub, route)
        with trio.fail_after(120):
            resp = await exchange(url, request(method, path, [bearer(credential)], body))
    assert resp.status == 400, resp
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error"
    assert error["param"] is None and isinstance(error["message"], str)
    assert records.bad() == []


# -- 7. a client that leaves mid-upload ------------------------------------------------------------


@pytest.mark.parametrize("route", ["poll", "chat"])
async def test_a_client_leaving_mid_upload_is_one_debug_line_at_most(
    autojump_clock: trio.testing.MockClock, records: Records, route: str
) -> None:
    method, path = _target(route)
    async with open_hub(_hub()) as (hub, url):
        headers = [bearer(await _credential(hub, route)), ("Content-Length", "1000")]
        with trio.fail_after(120):
            since = len(records.records)
            conn = await RawConn.open(url)
            await conn.send(head(method, path, headers) + b'{"capabil')  # 10 of 1000 bytes
            await conn.aclose()
            await trio.testing.wait_all_tasks_blocked()  # the hub has seen it go
            about_it = records.records[since:]
            resp = await exchange(url, _admin_get())  # and it goes on serving
    assert resp.status == 200, resp
    assert len(about_it) <= 1, [r.getMessage() for r in about_it]
    assert all(r.levelno == logging.DEBUG and r.exc_info is None for r in about_it), [
        f"{r.levelname}: {r.getMessage()}" for r in about_it
    ]
    assert records.bad() == []


# -- 8. WebSocket protocol violations on an accepted Chat Channel --------------------------------

VIOLATIONS = {
    # name: (the frame(s) the runner sends, the close code the hub must send)
    "invalid UTF-8 in a text frame": (ws_frame(TEXT, b'{"type": "\xff\xfe"}'), 1007),
    "reserved opcode 0x3": (ws_frame(0x3, b"x"), 1002),
    "RSV1 without an extension": (ws_frame(TEXT, b"{}", rsv1=True), 1002),
    "an unmasked frame": (ws_frame(TEXT, b"{}", masked=False), 1002),
    "a ping of 126 bytes": (ws_frame(PING, b"p" * 126), 1002),
    "a fragmented ping": (ws_frame(PING, b"p", fin=False), 1002),
    "a continuation with no message": (ws_frame(CONT, b"x"), 1002),
    "close code 999": (ws_frame(CLOSE, close_payload(999)), 1002),
}


async def _open_channel(hub: Hub, url: str) -> tuple[str, RawConn]:
    """A claimed job's Chat Channel, dialled with a raw handshake: (job id, connection)."""
    job_id, token = await claimed(hub, url)
    conn = await RawConn.open(url)
    await conn.send(upgrade_head(_channel_target(job_id, token)))
    resp = await conn.head()
    assert resp is not None and resp.status == 101, resp
    assert await hub.channels.wait(job_id, 10) is not None
    return job_id, conn


@pytest.mark.parametrize("violation", list(VIOLATIONS))
async def test_a_protocol_violation_fails_the_channel(
    autojump_clock: trio.testing.MockClock, records: Records, violation: str
) -> None:
    """RFC 6455 §7.1.7: the hub sends its close frame (1007 for invalid UTF-8, 1002 for the
    rest), closes the TCP connection, and the channel is gone (no turn waits on it forever)."""
    frame, code = VIOLATIONS[violation]
    async with open_hub(_hub()) as (hub, url):
        with trio.fail_after(30):
            job_id, conn = await _open_channel(hub, url)
            await conn.send(frame)
            close_code = await conn.close_frame()
            rest = await conn.closed()
            await trio.testing.wait_all_tasks_blocked()
            gone = hub.channels.get(job_id) is None
    assert close_code == code
    assert rest == b""  # and the TCP connection closed after it
    assert gone
    assert records.bad() == []


@pytest.mark.parametrize("when", ["with the close frame", "after the hub's close frame"])
async def test_data_after_the_runners_close_frame_is_no_error(
    autojump_clock: trio.testing.MockClock, records: Records, when: str
) -> None:
    """Frames and junk behind the runner's close frame, in the same segment or once the hub
    answered the close: ignored (no ERROR), the connection closed, the channel gone."""
    late = ws_frame(TEXT, b'{"type": "late"}') + ws_frame(BINARY, b"\x00" * 10) + b"junk"
    bye = ws_frame(CLOSE, close_payload(1000, "bye"))
    async with open_hub(_hub()) as (hub, url):
        with trio.fail_after(30):
            job_id, conn = await _open_channel(hub, url)
            if when == "with the close frame":
                await conn.send(bye + late)
            else:
                await conn.send(bye)
                assert await conn.close_frame() is not None
                await conn.send(late)  # False if the hub closed already: nothing to prove then
            while await conn.frame() is not None:  # to the end of the connection
                pass
            await trio.testing.wait_all_tasks_blocked()
            gone = hub.channels.get(job_id) is None
    assert conn.eof and gone
    assert records.bad() == []


# -- 9. log lines escape and cap what clients send -------------------------------------------------


@pytest.fixture
def hub_log() -> Iterator[Records]:
    """Records as the hub command's log handler passes them on (``configure_logging``: the
    logsafe filter on every root handler), formatted the moment they are emitted."""
    from gateway.hub.cli import configure_logging

    handler = Records()
    root = logging.getLogger()
    server = logging.getLogger("gateway.wire.server")
    saved = (root.level, server.level)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    configure_logging()
    yield handler
    root.removeHandler(handler)
    root.setLevel(saved[0])
    server.setLevel(saved[1])


async def _chat_with_session(session: bytes) -> int:
    """One chat turn on a fake runner with ``X-Chat-Session: <session>`` (raw bytes in the
    head): its status. Real clock: nothing here is a deadline."""
    from fake_runner import CONTENT_MODEL, FakeRunner

    async with open_hub(_hub()) as (hub, url):
        key = await hub.keys.create("k")
        runner = FakeRunner(url, ADMIN)
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            body = {"model": CONTENT_MODEL, "messages": [{"role": "user", "content": "hi"}]}
            headers = [bearer(key), (b"X-Chat-Session", session)]
            with trio.fail_after(30):  # a hang guard only
                resp = await exchange(url, request("POST", CHAT, headers, body))
            nursery.cancel_scope.cancel()
    return resp.status


def _messages(log: Records) -> list[str]:
    return [log.format(r) for r in log.records]


@pytest.mark.parametrize(
    ("session", "shown"),
    [
        (b"a\x85c\x9bd", "a\\x85c\\x9bd"),  # NEL and CSI: obs-text bytes, a valid header value
        (b"a\x1bb\x85c", "a\\x1bb\\x85c"),  # ESC: a control, which a server may also refuse
    ],
)
async def test_a_session_id_with_control_bytes_is_escaped_in_log_lines(
    hub_log: Records, session: bytes, shown: str
) -> None:
    status = await _chat_with_session(session)
    lines = _messages(hub_log)
    if b"\x1b" not in session or status == 200:  # ESC: served, or refused with a 400
        assert status == 200
        assert any(shown in line for line in lines), lines
    else:
        assert status == 400
    for record, line in zip(hub_log.records, lines, strict=True):
        assert not any(c in line for c in "\x1b\x85\x9b"), line
        if record.exc_info is None:
            assert "\n" not in line and "\r" not in line, line


async def test_a_session_id_over_200_characters_is_refused_and_never_logged_whole(
    hub_log: Records,
) -> None:
    assert await _chat_with_session(b"s" * 200) == 200  # the longest a session id may be
    assert await _chat_with_session(b"s" * 10_000) == 400  # the caller's shape: a chat error
    lines = _messages(hub_log)
    assert lines and max(len(line) for line in lines) < 1000 and "s" * 300 not in "".join(lines)
