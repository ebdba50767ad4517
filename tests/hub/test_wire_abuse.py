"""The server core against a hostile peer, over raw loopback sockets to an in-process hub (issue 30
rows 1, 3 and 12; issue 31 point 11), on trio's autojump clock.

- a runner that sends 300,000 pings on a channel it never reads: at most one pong waits for it
  (a newer ping's replaces it), no task per pong, and the channel is failed with 1008; the hub's
  RSS comes back to within 10 % of its level before the flood;
- a runner that opens a fragmented message and sends millions of empty continuation frames: the
  message's fragments are counted, the channel is failed with 1009 at the bound; RSS as above;
- an absolute-form request line (``GET http://host/healthz HTTP/1.1``) is routed by its path
  (RFC 9112 §3.2.2), and a HEAD is answered wherever a GET is, without the body;
- every status line the server core writes carries its reason phrase (``HTTP/1.1 200 OK``).
"""

from __future__ import annotations

import gc
import json
import os
import socket
import urllib.parse
from typing import Any

import pytest
import trio
import trio.testing
from helpers import ADMIN, CHAT_DEFINITION, OWNER, PROJECT, register_runner
from rawclient import CONT, PING, TEXT, RawConn, bearer, head, request, upgrade_head, ws_frame

from gateway.hub import Hub, open_hub
from gateway.wire.wsframes import MAX_FRAGMENTS

BASE = f"/api/owners/{OWNER}/projects/{PROJECT}"
CHANNEL = "/api/lives/chat/channel/ws"
RSS_SLACK = 1.10  # issue 30 point 2: within 10 % of the level before the flood


def _hub() -> Hub:
    # keepalive pings off: the clock jumps, and no ping's answer is judged against it; nor is a
    # runner busy flooding its channel taken for offline while the clock jumps
    return Hub(admin_token=ADMIN, ping_interval=0.0, offline_after=1e9)


def rss() -> int:
    """This process's resident set, in bytes (the hub runs in it), after a full collection."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def exchange(url: str, data: bytes) -> Any:
    conn = await RawConn.open(url)
    try:
        await conn.send(data)
        resp = await conn.response()
    finally:
        await conn.aclose()
    assert resp is not None, "no answer"
    return resp


async def open_channel(hub: Hub, url: str, rcvbuf: int = 0) -> tuple[str, RawConn]:
    """A claimed job's Chat Channel, dialled with a raw handshake: (job id, connection);
    ``rcvbuf``: the runner's receive buffer, set before it connects (its window)."""
    runner = await register_runner(hub, OWNER, PROJECT, "box", ["chat-llm:v1"])
    job = await hub.board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], dict(CHAT_DEFINITION))
    claim = request(
        "POST",
        f"{BASE}/runners/generate-jitconfig",
        [bearer(runner["token"])],
        {"jobId": job.id, "name": "box"},
    )
    assert (await exchange(url, claim)).status == 200
    parts = urllib.parse.urlsplit(url)
    sock = trio.socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect((parts.hostname, parts.port))
    conn = RawConn(trio.SocketStream(sock))
    await conn.send(upgrade_head(f"{CHANNEL}?jobId={job.id}&token={runner['token']}"))
    resp = await conn.head()
    assert resp is not None and resp.status == 101, resp
    assert resp.reason == b"Switching Protocols"
    assert await hub.channels.wait(job.id, 10) is not None
    return job.id, conn


async def flood(conn: RawConn, batch: bytes, batches: int) -> int:
    """Send ``batch`` up to ``batches`` times, reading nothing; how many went before the hub
    closed the connection."""
    for n in range(batches):
        if not await conn.send(batch):
            return n
    return batches


async def channel_end(ch: Any) -> int | None:
    """The close code the channel ended with, once it is gone."""
    await ch.closed.wait()
    await trio.testing.wait_all_tasks_blocked()
    return ch.end_code


# -- row 1: pings on a channel that is never read ---------------------------------------------------


async def test_300000_pings_never_read_keep_one_pong_and_fail_the_channel_with_1008(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Before: every pong appended to an unbounded send buffer and, once the socket was full,
    a flush task each (930 MB for 300,000 pings, kept). Now: one pong waits at most, the channel
    is failed with 1008 once the runner pings on while it waits, and the hub's RSS comes back."""
    async with open_hub(_hub()) as (hub, url):
        with trio.fail_after(120):
            # the hub answers the pings of one read with one pong (the latest's): a runner that
            # never reads fills a small window (and the hub's send buffer behind it) within the
            # 300,000; with a large one it takes more pings, with the same outcome
            job_id, conn = await open_channel(hub, url, rcvbuf=4096)
            ch = hub.channels.get(job_id)
            before = rss()
            batch = ws_frame(PING, b"p" * 125) * 1000  # 131 KB
            sent = await flood(conn, batch, 300)
            code = await channel_end(ch)
            errors = hub.counters.ws_protocol_errors
            await conn.aclose()
        after = rss()
    print(f"\n{sent * 1000} pings sent; RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    assert code == 1008 and errors == 1
    assert sent < 300, "the hub read every ping: it never failed the channel"
    assert after <= before * RSS_SLACK


# -- row 3: a fragmented message of millions of empty frames ---------------------------------------


async def test_millions_of_empty_continuation_frames_fail_the_channel_with_1009(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Before: each empty continuation was kept (RSS +63-84 MB and growing, never closed): the
    bound counted payload bytes only. Now the message's frames are counted too: past
    ``MAX_FRAGMENTS`` the channel is failed with 1009, and the hub's RSS comes back."""
    async with open_hub(_hub()) as (hub, url):
        with trio.fail_after(120):
            job_id, conn = await open_channel(hub, url)
            ch = hub.channels.get(job_id)
            before = rss()
            await conn.send(ws_frame(TEXT, b'{"type":', fin=False))
            batch = ws_frame(CONT, b"", fin=False) * 10_000  # 60 KB
            sent = await flood(conn, batch, 300)  # 3,000,000 frames
            close_code = await conn.close_frame()
            code = await channel_end(ch)
            await conn.aclose()
        after = rss()
    print(f"\n{sent * 10_000} empty frames sent; RSS {before / 2**20:.1f} -> {after / 2**20:.1f}")
    assert close_code == code == 1009
    assert sent * 10_000 < 100 * MAX_FRAGMENTS
    assert after <= before * RSS_SLACK


# -- row 12: absolute-form request lines, HEAD --------------------------------------------------------


async def test_an_absolute_form_request_line_is_routed_by_its_path(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """RFC 9112 §3.2.2: a server must accept the absolute form (before: 404)."""
    async with open_hub(_hub()) as (hub, url):
        origin = await exchange(url, head("GET", "/healthz"))
        absolute = await exchange(url, head("GET", "http://hub.example:8080/healthz"))
        secure = await exchange(url, head("GET", "HTTPS://Hub.Example/healthz?x=1"))
        key = await hub.keys.create("k")
        models = await exchange(url, head("GET", "http://hub/v1/models", [bearer(key)]))
        nowhere = await exchange(url, head("GET", "http://hub/nowhere"))
    assert origin.status == absolute.status == secure.status == 503  # no runner yet
    assert json.loads(absolute.body)["status"] == json.loads(origin.body)["status"] == "unavailable"
    assert models.status != 404 and nowhere.status == 404


@pytest.mark.parametrize("target", ["/healthz", "http://hub/healthz"])
async def test_head_is_answered_where_get_is_without_a_body(
    autojump_clock: trio.testing.MockClock, target: str
) -> None:
    """HEAD on a GET route (before: 405): the GET's status and headers, no body; the connection
    stays usable (a GET pipelined behind it gets its whole answer)."""
    async with open_hub(_hub()) as (_hub_, url):
        conn = await RawConn.open(url)
        try:
            await conn.send(head("HEAD", target) + head("GET", target))
            to_head = await conn.head()
            to_get = await conn.response()
        finally:
            await conn.aclose()
    assert to_head is not None and to_get is not None
    assert to_head.status == to_get.status == 503
    assert to_head.headers[b"content-length"] == b"%d" % len(to_get.body) != b"0"
    assert to_head.headers[b"content-type"] == to_get.headers[b"content-type"]
    assert json.loads(to_get.body)["status"] == "unavailable"  # nothing of HEAD's in between


async def test_head_on_a_route_without_get_is_405_without_a_body(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(_hub()) as (_hub_, url):
        conn = await RawConn.open(url)
        try:
            await conn.send(head("HEAD", f"{BASE}/runners/jobs") + head("GET", "/healthz"))
            to_head = await conn.head()
            after = await conn.response()
        finally:
            await conn.aclose()
    assert to_head is not None and to_head.status == 405 and to_head.reason == b"Method Not Allowed"
    assert after is not None and after.status == 503


# -- issue 31 point 11: reason phrases ----------------------------------------------------------------


async def test_every_status_line_carries_its_reason_phrase(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Handler answers (whole and streamed) and the core's own refusals: ``HTTP/1.1 200 OK``,
    not ``HTTP/1.1 200 ``."""
    async with open_hub(_hub()) as (hub, url):
        seen: dict[int, bytes] = {}

        async def status_of(data: bytes) -> None:
            resp = await exchange(url, data)
            seen[resp.status] = resp.reason

        key = await hub.keys.create("k")
        runner = await register_runner(hub, OWNER, PROJECT, "box", ["chat-llm:v1"])
        await status_of(head("GET", "/api/hub/counters", [bearer(ADMIN)]))  # 200
        await status_of(head("GET", "/v1/models", [bearer(key)]))  # 200, or 503 without a runner
        await status_of(head("GET", "/nowhere"))  # 404
        await status_of(head("GET", "/v1/models"))  # 401
        await status_of(request("POST", f"{BASE}/runners/jobs", [bearer(runner["token"])]))  # 204
        await status_of(
            head("GET", "/x", [("Transfer-Encoding", "chunked"), ("Content-Length", "1")])
        )
        await status_of(head("GET", "/x", [("X-Big", "a" * 70_000)]))  # 431 from the core
        await status_of(b"GET / HTTP/1.1\r\n\r\n" + b"\x00bad\r\n\r\n")  # 400 from h11's check
        conn = await RawConn.open(url)
        await conn.send(b"GET /healthz HTTP/1.1\r\nHost: hub\r\n")  # never ends
        late = await conn.response()
        await conn.aclose()
        assert late is not None
        seen[late.status] = late.reason  # 408
    expected = {
        200: b"OK",
        204: b"No Content",
        400: b"Bad Request",
        401: b"Unauthorized",
        404: b"Not Found",
        408: b"Request Timeout",
        431: b"Request Header Fields Too Large",
        503: b"Service Unavailable",
    }
    assert seen and all(seen[s] == expected[s] for s in seen), seen
    assert {200, 400, 401, 404, 408, 431} <= set(seen)
